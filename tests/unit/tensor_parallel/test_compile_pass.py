"""The AutoTP compile pass (``compile.passes: ["autotp"]``, :mod:`dsrun.tensor_parallel.compile_pass`): in-process on
a one-rank group (the graph's shape, the all-or-nothing switch, the engine's and the config's answers); its
collectives over two ranks are checked in ``test_deepspeed_layers.py``'s two-rank run."""
from __future__ import annotations

import copy

import pytest
import torch

import dsrun
from dsrun import comm
from dsrun.tensor_parallel import compile_pass
from dsrun.tensor_parallel.deepspeed_layers import LinearAllreduce, LinearLayer, LmHeadLinearAllreduce
from dsrun.tensor_parallel.graph_collectives import COLUMN_PARALLEL_OP, GATHER_OUTPUT_OP, ROW_PARALLEL_OP
from dsrun.utils.errors import ConfigError


class TPBlock(torch.nn.Module):
    """A residual column/row pair and a column head that gathers its output: what the pass rewrites."""

    def __init__(self, up: torch.nn.Module, down: torch.nn.Module, head: torch.nn.Module) -> None:
        super().__init__()
        self.up, self.down, self.head = up, down, head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + self.down(torch.relu(self.up(x))))


def split_block(group: object, seed: int = 1) -> tuple[torch.nn.Module, TPBlock]:
    """The whole block and the same block split over ``group`` (DeepSpeed's layers)."""
    torch.manual_seed(seed)
    whole = TPBlock(torch.nn.Linear(8, 6), torch.nn.Linear(6, 8), torch.nn.Linear(8, 5))
    split = TPBlock(LinearLayer(copy.deepcopy(whole.up), group), LinearAllreduce(copy.deepcopy(whole.down), group),
                    LinearLayer(copy.deepcopy(whole.head), group, gather_output=True))
    return whole, split


def compile_with_pass(model: torch.nn.Module) -> tuple[torch.nn.Module, list[torch.fx.GraphModule]]:
    """``model`` compiled as one graph through the AutoTP backend (eager), and the graphs it was given."""
    backend = compile_pass.init_autotp(model, backend="eager")
    graphs: list[torch.fx.GraphModule] = []

    def keep(gm: torch.fx.GraphModule, inputs: list) -> object:
        graphs.append(gm)
        return backend(gm, inputs)

    torch._dynamo.reset()
    return torch.compile(model, backend=keep, fullgraph=True), graphs


def test_the_autotp_pass_puts_the_collectives_in_the_graph(world_of_one, monkeypatch) -> None:
    from dsrun.zero.linear import zero3_linear_wrap

    # as after any ZeRO-3 run in the process: F.linear is ZeRO-3's memory-efficient linear (an autograd function)
    monkeypatch.setattr(torch.nn.functional, "linear", zero3_linear_wrap)
    group = comm.new_group([0])
    _, reference = split_block(group)
    _, model = split_block(group)
    compiled, graphs = compile_with_pass(model)
    x = torch.randn(3, 8, requires_grad=True)
    xc = x.detach().clone().requires_grad_()
    out, expected = compiled(xc), reference(x)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(xc.grad, x.grad)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert all(m.defer_collectives_to_compiler for m in (model.up, model.down, model.head))
    (gm,) = graphs  # one graph: the layers' own autograd functions are gone from the forward
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(COLUMN_PARALLEL_OP) == 2 and targets.count(ROW_PARALLEL_OP) == 1
    assert GATHER_OUTPUT_OP not in targets  # one rank's slice is the whole width (two ranks: the two-rank run)
    reduce_node = next(n for n in gm.graph.nodes if n.target is ROW_PARALLEL_OP)
    assert reduce_node.args[0].target in compile_pass._MATMUL_TARGETS  # the partial sums, before the bias
    # a split layer whose matmul the pass does not recognise is refused, not left without its collective
    monkeypatch.setattr(compile_pass, "_MATMUL_TARGETS", set())
    with pytest.raises(RuntimeError, match="found no matmul of the split layer"):
        compile_pass.pass_insert_tp_collectives(gm, [])


def test_a_layer_the_pass_cannot_rewrite_leaves_every_layer_alone(world_of_one) -> None:
    group = comm.new_group([0])
    model = torch.nn.Module()
    model.column = LinearLayer(torch.nn.Linear(4, 4), group)
    model.row = LinearAllreduce(torch.nn.Linear(4, 4), group)
    model.head = LmHeadLinearAllreduce(torch.nn.Linear(4, 4), group)
    with pytest.raises(NotImplementedError, match="cannot rewrite 'head'"):
        compile_pass.defer_collectives_to_compiler(model)
    assert not model.column.defer_collectives_to_compiler and not model.row.defer_collectives_to_compiler


def test_the_engine_and_the_config_answer_for_the_pass(world_of_one, monkeypatch) -> None:
    config = {"train_batch_size": 1, "compile": {"deepcompile": True, "passes": ["autotp"]}}
    engine, *_ = dsrun.initialize(model=torch.nn.Linear(4, 4), config=config)
    engine.compile(backend="eager")  # no tensor parallelism: the torch compiler, as DeepSpeed falls back
    assert engine.is_compiled and not engine.is_deepcompile_active()
    engine.destroy()
    with pytest.raises(ConfigError, match="compile.passes.*'z1'.*only to refuse it"):
        dsrun.initialize(model=torch.nn.Linear(4, 4), config={**config, "compile": {"deepcompile": True, "passes": ["autotp", "z1"]}})
    # transformers releases whose batched_mm experts cannot be captured in a full graph are named
    transformers = pytest.importorskip("transformers")
    experts = torch.nn.Module()
    experts._apply_gate, experts.is_concatenated = (lambda x: x), True
    experts.config = type("Config", (), {"_experts_implementation": "batched_mm"})()
    model = torch.nn.Module()
    model.experts = experts
    monkeypatch.setattr(transformers, "__version__", compile_pass.BROKEN_TRANSFORMERS_MOE_VERSIONS[0])
    with pytest.raises(RuntimeError, match="45634"):
        compile_pass._check_broken_transformers_moe(model)
    monkeypatch.setattr(transformers, "__version__", compile_pass.BROKEN_TRANSFORMERS_MOE_VERSIONS[1])
    compile_pass._check_broken_transformers_moe(model)
