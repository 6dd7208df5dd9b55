"""dsrun's GPT as a PipelineModule (``model.pipeline_stages``): the same computation as the GPT, its options
checked against the ``pipeline`` section, the ``gpt_pipe`` recipe's checks, and the estimator's walk of a
schedule (micro-batches in flight per stage)."""
from __future__ import annotations

import pytest
import torch

from dsrun.compose import compose_runspec
from dsrun.config import load_ds_config
from dsrun.models.config import GPTConfig
from dsrun.models.gpt import GPT
from dsrun.runspec import resolve_run
from dsrun.workloads.pipeline_memory import blocks_in_flight
from dsrun.workloads.pipeline import gpt_pipeline
from dsrun.pipe.schedule import TrainSchedule
from dsrun.pipe.timed import GPipeSchedule
from dsrun.utils.errors import ConfigError

pytestmark = pytest.mark.usefixtures("world_of_one")

SHAPE = dict(vocab_size=40, block_size=12, n_layer=3, n_head=2, n_embd=16)


def ds(**pipeline) -> object:
    return load_ds_config({"train_micro_batch_size_per_gpu": 2, "pipeline": pipeline}, world_size=1)


def pipeline_names(n_layer: int, tied: bool) -> dict[str, str]:
    """GPT parameter name -> PipelineModule parameter name (layers: embedding, positions, blocks, norm, head)."""
    names = {"transformer.wte.weight": "tied_modules.embed.weight" if tied else "0.weight",
             "transformer.wpe.weight": "1.wpe.weight", "transformer.ln_f.weight": f"{n_layer + 2}.weight",
             "transformer.ln_f.bias": f"{n_layer + 2}.bias"}
    if not tied:
        names["lm_head.weight"] = f"{n_layer + 3}.weight"
    return names


@pytest.mark.parametrize("tied", [True, False])
def test_the_pipelined_gpt_computes_what_the_gpt_computes(tied: bool) -> None:
    """The same weights give the same logits and loss: the layers run the GPT's own operations in its order,
    so the results are bitwise equal (no reordered sum anywhere)."""
    config = GPTConfig(**SHAPE, tie_embeddings=tied)
    torch.manual_seed(0)
    gpt = GPT(**SHAPE, tie_embeddings=tied)
    module = gpt_pipeline(config, ds())
    names = pipeline_names(config.n_layer, tied)
    mine = dict(module.named_parameters())
    with torch.no_grad():
        for name, param in gpt.named_parameters():
            target = names.get(name) or f"{int(name.split('.')[2]) + 2}.{'.'.join(name.split('.')[3:])}"
            mine[target].copy_(param)
    tokens = torch.randint(0, SHAPE["vocab_size"], (3, 10), generator=torch.Generator().manual_seed(1))
    targets = torch.roll(tokens, -1, dims=1)
    logits = module(tokens)
    torch.testing.assert_close(logits, gpt(tokens), rtol=0, atol=0)
    torch.testing.assert_close(module.loss_fn(logits, targets), gpt(tokens, targets), rtol=0, atol=0)
    assert sum(p.numel() for p in module.parameters()) == config.num_parameters()


def test_activation_checkpointing_modes_of_a_pipelined_gpt() -> None:
    full = gpt_pipeline(GPTConfig(**SHAPE, activation_checkpointing="full"), ds())
    assert full.activation_checkpoint_interval == 1
    assert gpt_pipeline(GPTConfig(**SHAPE), ds(activation_checkpoint_interval=2)).activation_checkpoint_interval == 2
    for mode in ("every_2", "selective"):
        with pytest.raises(ConfigError, match="model.activation_checkpointing"):
            gpt_pipeline(GPTConfig(**SHAPE, activation_checkpointing=mode), ds())
    with pytest.raises(ConfigError, match="disagrees"):
        gpt_pipeline(GPTConfig(**SHAPE, activation_checkpointing="full"), ds(activation_checkpoint_interval=2))


def test_more_stages_than_pipeline_layers_is_a_config_error_of_the_model() -> None:
    """Found by the GPT's config (so before launch, on the meta device), not by the ranks of an empty stage."""
    from dsrun.models.gpt_pipe import pipeline_layers

    config = GPTConfig(**SHAPE, pipeline_stages=7)  # 3 blocks: 7 layers, one per stage
    assert len(pipeline_layers(config)) == config.pipeline_layers == 7
    with pytest.raises(ConfigError, match=r"model.pipeline_stages: 8 stages but a GPT of n_layer=3 is 7 pipeline "
                                          r"layers .* \(use at most 7 stages, or raise model.n_layer\)"):
        GPTConfig(**SHAPE, pipeline_stages=8)


def test_the_recipe_counts_data_parallel_ranks_and_refuses_what_a_pipeline_cannot_run() -> None:
    run = resolve_run(compose_runspec(["+recipe=gpt_pipe", "launcher.num_procs=4"]))
    assert run.ds.train_batch_size == 8 * 4 * 2  # micro batch x micro-batches x 2 data-parallel ranks
    with pytest.raises(ConfigError) as info:
        resolve_run(compose_runspec(["+recipe=gpt_pipe", "launcher.num_procs=3", "train.teacher=/some/run",
                                     "+ds.pipeline.stages=4"]))
    keys = {p.path for p in info.value.problems}
    assert {"model.pipeline_stages", "train.teacher", "ds.pipeline.stages"} <= keys


@pytest.mark.parametrize("stages,micro_batches", [(2, 8), (4, 8), (4, 3)])
def test_micro_batches_in_flight_are_walked_from_the_schedule(stages: int, micro_batches: int) -> None:
    """1F1B keeps at most ``stages - s`` micro-batches alive on stage ``s`` (never more than exist); GPipe
    runs every forward before any backward, so it keeps all of them."""
    for s in range(stages):
        assert blocks_in_flight(TrainSchedule(micro_batches, stages, s), [3]) == 3 * min(micro_batches, stages - s)
        assert blocks_in_flight(GPipeSchedule(micro_batches, stages, s), [3]) == 3 * micro_batches


@pytest.mark.parametrize("tied,bias", [(True, True), (False, False)])
def test_universal_names_of_the_pipelined_gpt_are_the_gpts(tied: bool, bias: bool) -> None:
    """``module.dense_names`` (dsrun.models.gpt_pipe.dense_names) through the one NameMap universal checkpoints
    use: every pipeline parameter gets the GPT's name, and copying by those names computes the GPT's logits."""
    from dsrun.checkpoint.pipeline_state import NameMap, first_layers
    from dsrun.pipe.checkpoint import _tied_layers

    config = GPTConfig(**SHAPE, tie_embeddings=tied, bias=bias)
    torch.manual_seed(0)
    gpt = GPT(**SHAPE, tie_embeddings=tied, bias=bias)
    module = gpt_pipeline(config, ds())
    names = NameMap(first_layers(_tied_layers(module)), module.dense_names)
    mine, dense = dict(module.named_parameters()), dict(gpt.named_parameters())
    assert {names.universal(n) for n in mine} == set(dense)
    with torch.no_grad():
        for name, param in mine.items():
            assert names.pipeline(names.universal(name)) == name
            param.copy_(dense[names.universal(name)])
    tokens = torch.randint(0, SHAPE["vocab_size"], (3, 10), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(module(tokens), gpt(tokens), rtol=0, atol=0)
