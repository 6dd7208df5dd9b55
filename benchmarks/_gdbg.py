import sys, traceback, torch
sys.path.insert(0, ".")
from dsrun.models import GPT
for dev in ["cpu", "cuda"]:
    for mode in ["full", "every_2", "selective"]:
        for fn_name in ["default", "reentrant"]:
            try:
                torch.manual_seed(0)
                m = GPT(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=32, dropout=0.1, activation_checkpointing=mode).to(dev)
                if fn_name == "reentrant":
                    import dsrun.checkpointing as c; m.enable_activation_checkpointing(True, c.checkpoint)
                idx = torch.randint(0, 256, (2, 64)).to(dev)
                m(idx, idx).backward()
                print(dev, mode, fn_name, "ok")
            except Exception as e:
                print(dev, mode, fn_name, "FAIL", repr(e)[:100])
                if dev == "cuda" and mode == "full": traceback.print_exc(limit=-8)
