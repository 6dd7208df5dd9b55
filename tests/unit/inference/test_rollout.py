"""DeepSpeed's rollout interface (``deepspeed.runtime.rollout``): its checks, and the hybrid-engine rollout
generating with a training engine's own module."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import dsrun
from dsrun.inference.rollout import (HybridEngineRollout, RolloutBatch, RolloutConfig, RolloutRequest, SamplingConfig,
                                     build_rollout)
from dsrun.utils.errors import ConfigError


def test_requests_and_batches_check_their_shapes():
    with pytest.raises(ValueError, match="must be 2-D"):
        RolloutRequest(prompt_ids=torch.zeros(4), prompt_attention_mask=torch.ones(4))
    with pytest.raises(ValueError, match="does not match"):
        RolloutBatch(torch.zeros(2, 4), torch.ones(2, 5), torch.tensor([4, 4]))
    with pytest.raises(ValueError, match="1-D of length 2"):
        RolloutBatch(torch.zeros(2, 4), torch.ones(2, 4), torch.tensor([4]))
    with pytest.raises(ValueError, match="Unknown rollout engine"):
        build_rollout(RolloutConfig(engine="vllm"))
    with pytest.raises(ValueError, match="needs both"):
        build_rollout(RolloutConfig())
    with pytest.raises(ConfigError, match="use_graph_capture"):
        HybridEngineRollout(object(), object(), RolloutConfig(use_graph_capture=True))


@pytest.mark.usefixtures("world_of_one")
def test_hybrid_engine_rollout_generates_with_the_training_weights():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=40, n_positions=32, n_embd=16, n_layer=1,
                                                                 n_head=2, eos_token_id=39, bos_token_id=39)).eval()
    engine = dsrun.initialize(model=model, config={"train_batch_size": 1, "optimizer": {"type": "SGD",
                                                                                        "params": {"lr": 0.1}}})[0]
    rollout = build_rollout(RolloutConfig(), student_engine=engine, tokenizer=SimpleNamespace(pad_token_id=0,
                                                                                              eos_token_id=39))
    prompts = torch.tensor([[5, 6, 7], [0, 8, 9]])  # the second left-padded
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    batch = rollout.generate(RolloutRequest(prompts, mask), SamplingConfig(max_new_tokens=4, temperature=0.0,
                                                                           n_samples_per_prompt=2))
    expected = model.generate(prompts.repeat_interleave(2, 0), attention_mask=mask.repeat_interleave(2, 0),
                              max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(batch.input_ids, expected) and batch.batch_size == 4 and batch.seq_len == 7
    assert batch.response_start_idx.tolist() == [3] * 4
    assert batch.attention_mask[:, :3].tolist() == [[1, 1, 1]] * 2 + [[0, 1, 1]] * 2
    assert torch.equal(batch.attention_mask[:, 3:], (expected[:, 3:] != 0).long())
    # after a step the next rollout reads the new weights: nothing to sync
    before = model.lm_head.weight.detach().clone()
    engine.backward(engine(input_ids=prompts[:1], labels=prompts[:1]).loss)
    engine.step()
    rollout.sync_weights(1)
    assert not torch.equal(before, model.lm_head.weight)
    again = rollout.generate(RolloutRequest(prompts, mask), SamplingConfig(max_new_tokens=4, temperature=0.0))
    assert torch.equal(again.input_ids, model.generate(prompts, attention_mask=mask, max_new_tokens=4,
                                                       do_sample=False, pad_token_id=0))


def test_nucleus_sampling_keeps_the_smallest_set_reaching_top_p():
    torch.manual_seed(0)
    logits = torch.tensor([0.5, 0.3, 0.2]).log().expand(400, 3)
    tokens = HybridEngineRollout._sample_top_p(logits, top_p=0.6)  # 0.5 < 0.6 <= 0.8: the first two tokens
    assert tokens.shape == (400, 1) and set(tokens.flatten().tolist()) == {0, 1}
    assert set(HybridEngineRollout._sample_top_p(logits).flatten().tolist()) == {0, 1, 2}
    assert HybridEngineRollout._sample_top_p(torch.tensor([[1.0, 10.0, 2.0]]), temperature=1e-10).item() == 1
