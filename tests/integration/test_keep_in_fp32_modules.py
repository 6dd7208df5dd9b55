"""``data_types.keep_in_fp32_modules`` over two gloo ranks: the kept parameters stay fp32 through every ZeRO
stage's copies (flat groups, shards) and train there, the rest is bf16/fp16; one process runs every case.

* a plain torch model listing ``["mid"]`` under bf16 at ZeRO 0-3 (and stage 3 with its optimizer in host memory):
  the listed module computes in fp32 (it asserts its input's dtype), its weights' updates keep fp32 digits bf16
  cannot hold, the model's bytes are the kept elements at 4 bytes plus the rest at 2 (stage 3: this rank's
  shards), the loss falls, and stages 1-3 give stage 0's losses bit for bit (the kept gradients are reduced in
  fp32 at every stage, the rest in bf16, with the same elementwise arithmetic);
* Hugging Face's T5 built from its config under fp16 with "auto" (its own ``_keep_in_fp32_modules = ["wo"]``) at
  ZeRO 0 and 3: its ``wo`` weights fp32, everything else fp16, and it trains.
"""
from __future__ import annotations

import torch

from tests.helpers import run_ranks

STEPS = 3
CASES = ("0", "1", "2", "3", "3 offload")  # ZeRO stage, and stage 3 with its optimizer in host memory


class Mid(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)
        self.register_buffer("scale", torch.full((16,), 1.0 + 2.0 ** -12))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        assert h.dtype == torch.float32, h.dtype  # the island's forward receives fp32
        return self.proj(h) * self.scale


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.mid, self.last = torch.nn.Linear(8, 16), Mid(), torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.relu(self.mid(torch.relu(self.first(x))))).float().pow(2).mean()


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    return T5ForConditionalGeneration(T5Config(vocab_size=32, d_model=16, d_kv=8, d_ff=32, num_layers=1,
                                               num_heads=2, decoder_start_token_id=0, dropout_rate=0.0))


def _bytes(engine, stage: int) -> dict[str, int]:
    """Bytes of the model's parameters this rank holds, kept and not (stage 3: its shards)."""
    out = {"kept": 0, "rest": 0}
    for p in engine.module.parameters():
        held = p.ds_tensor if stage == 3 else p
        out["kept" if getattr(p, "ds_keep_fp32", False) else "rest"] += held.numel() * held.element_size()
    return out


def train(rank: int, world: int) -> dict:
    import dsrun
    from dsrun import comm

    comm.init_distributed(dist_backend="gloo")
    out = {}
    try:
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(4, 8, generator=gen)
        for case in CASES:
            stage = int(case[0])
            net = Net()
            zero = {"stage": stage, **({"offload_optimizer": {"device": "cpu"}} if "offload" in case else {})}
            config = {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True},
                      "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, "zero_optimization": zero,
                      "data_types": {"keep_in_fp32_modules": ["mid"]}}
            engine = dsrun.initialize(model=net, config=config)[0]
            losses = []
            for _ in range(STEPS):
                loss = engine(x.bfloat16())
                engine.backward(loss)
                engine.step()
                losses.append(float(loss))
            weight = net.mid.proj.weight if stage != 3 else net.mid.proj.weight.ds_tensor
            out[case] = {
                "losses": losses, "bytes": _bytes(engine, stage),
                "dtypes": {n: str(p.dtype if stage != 3 else p.ds_tensor.dtype) for n, p in net.named_parameters()},
                "scale": str(net.mid.scale.dtype),
                # an Adam step of lr 1e-2 moves each weight by about 1e-2: the result holds digits bf16 drops
                "fp32_digits": bool((weight.detach() != weight.detach().bfloat16().float()).any()),
                "numel": {"kept": net.mid.proj.weight.ds_numel + net.mid.proj.bias.ds_numel if stage == 3 else
                          sum(p.numel() for p in net.mid.parameters())}}
            engine.destroy()
        ids = torch.randint(1, 32, (2, 6), generator=torch.Generator().manual_seed(rank))
        for stage in (0, 3):
            t5 = _t5()
            config = {"train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": True, "initial_scale_power": 8},
                      "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": stage}}
            engine = dsrun.initialize(model=t5, config=config)[0]
            losses = []
            for _ in range(STEPS):
                loss = engine(input_ids=ids, labels=ids).loss
                engine.backward(loss)
                engine.step()
                losses.append(float(loss))
            held = {n: (p.ds_tensor if stage == 3 else p).dtype for n, p in t5.named_parameters()}
            out[f"t5_{stage}"] = {"losses": losses, "kept": sorted(n for n, d in held.items() if d == torch.float32),
                                  "others": sorted({str(d) for d in held.values() if d != torch.float32}),
                                  "skipped": engine.skipped_steps}
            engine.destroy()
        return out
    finally:
        comm.destroy_process_group()


def test_kept_modules_train_fp32_at_zero_stages():
    ranks = run_ranks(train, 2, timeout=400)
    for got in ranks:
        for name in CASES:
            case, stage = got[name], int(name[0])
            kept = {n for n, d in case["dtypes"].items() if d == "torch.float32"}
            assert kept == {"mid.proj.weight", "mid.proj.bias"}, (stage, case["dtypes"])
            assert set(case["dtypes"].values()) == {"torch.float32", "torch.bfloat16"}
            assert case["scale"] == "torch.float32" and case["fp32_digits"], stage
            kept_numel = case["numel"]["kept"]  # 16 * 16 + 16
            rest_numel = 8 * 16 + 16 + 16 * 4 + 4
            if stage == 3:  # each rank's shards: half of each parameter, rounded up
                assert case["bytes"]["kept"] == 4 * (kept_numel // 2)
                assert case["bytes"]["rest"] == 2 * sum((n + 1) // 2 for n in (8 * 16, 16, 16 * 4, 4))
            else:
                assert case["bytes"] == {"kept": 4 * kept_numel, "rest": 2 * rest_numel}, stage
            assert case["losses"][-1] < case["losses"][0], (stage, case["losses"])
            if name in ("1", "2", "3"):  # the same elementwise arithmetic as stage 0 (kept gradients summed in
                assert case["losses"] == got["0"]["losses"], name  # fp32, the rest in bf16; torch's Adam): bitwise
        for stage in (0, 3):
            case = got[f"t5_{stage}"]
            assert case["kept"] == ["decoder.block.0.layer.2.DenseReluDense.wo.weight",
                                    "encoder.block.0.layer.1.DenseReluDense.wo.weight"], case
            assert case["others"] == ["torch.float16"]
            assert case["skipped"] == 0 and case["losses"][-1] < case["losses"][0], case
