"""DeepCompile's shared graph edits (``dsrun/compile/fx.py``), DeepSpeed's ``dc`` ops over dsrun's handle, and AutoSP
(``dsrun/compile/autosp.py``): its edits of a dynamo graph on one rank, and on two ranks a model trained with the
sequence split by the graph with the losses of the unsplit model."""
from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from torch.fx import Graph, GraphModule

import dsrun
from dsrun.compile import autosp, sp_mesh
from dsrun.compile.fx import add_end_backward, get_output_node, replace_reduce_outputs_with_none
from dsrun.compile.handle import get_deepcompile_handle
from dsrun.compile.ops import END_BACKWARD, REDUCE
from dsrun.compile.util import get_deepcompile_handle as deepspeed_handle
from tests.helpers import run_ranks

VOCAB, HEADS, HEAD_DIM, SEQ = 32, 4, 4, 8


class _TinyAttention(torch.nn.Module):
    """Token and position embeddings, one SDPA layer, a vocabulary head and the mean cross-entropy: every loss term
    is one token's, so the mean over ranks of the mean over each rank's tokens is the whole sequence's."""

    def __init__(self) -> None:
        super().__init__()
        width = HEADS * HEAD_DIM
        self.tokens, self.positions = torch.nn.Embedding(VOCAB, width), torch.nn.Embedding(SEQ, width)
        self.qkv, self.out, self.head = (torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width),
                                         torch.nn.Linear(width, VOCAB))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(input_ids) + self.positions(position_ids)
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)  # each [B, N, S, H]
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(b, s, HEADS * HEAD_DIM))
        return F.cross_entropy(self.head(x).view(-1, VOCAB), labels.reshape(-1))


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    return ids, torch.randint(0, VOCAB, (2, SEQ), generator=g), torch.arange(SEQ).expand(2, SEQ).clone()


def _reduce_graph(reduce: object) -> tuple[Graph, list]:
    graph = Graph()
    grad = graph.placeholder("grad")
    reduces = [graph.call_function(reduce, (grad, 7, 11) if "dc." in str(reduce) else (grad, 11)) for _ in range(2)]
    graph.output((grad, reduces[0]))
    return graph, reduces


def test_end_backward_follows_every_reduction_and_launches_the_buckets() -> None:
    handle = get_deepcompile_handle()
    handle.cleanup()
    launched: list[int] = []
    reduced: list[torch.Tensor] = []
    param = torch.nn.Parameter(torch.zeros(1))
    param.ds_id = 11
    handle.register_z3_param(param)
    handle.init(lambda p, g: reduced.append(g), lambda: launched.append(1))
    # dsrun's ops: the end reads both reductions (so comes after them) and releases the buckets when run
    graph, reduces = _reduce_graph(REDUCE)
    end = add_end_backward(graph, 3, release_reduce_buckets=True)
    assert end.target is END_BACKWARD and end.args == (reduces, 3, True) and end.next is get_output_node(graph)
    replace_reduce_outputs_with_none(graph)
    assert get_output_node(graph).args == ((graph.find_nodes(op="placeholder")[0], None),)
    graph.eliminate_dead_code()  # a side effect: kept though nothing reads it
    assert END_BACKWARD in [n.target for n in graph.nodes]
    torch.ops.dsrun_dc.end_backward([None, None], 3, False)
    torch.ops.dsrun_dc.end_backward([None, None], 3, True)
    assert launched == [1] and handle.stats.backward_ends == 2
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # what tracing and inductor's compile run: the fake form, never the launch
        torch.ops.dsrun_dc.end_backward([None, None], 3, True)
    assert launched == [1] and handle.stats.backward_ends == 2
    # no reduction, no end; DeepSpeed's dc ops once its handle was asked for, each end in its own library
    assert add_end_backward(Graph(), 0) is None
    deepspeed_handle()
    graph, reduces = _reduce_graph(torch.ops.dc.reduce_grad.default)
    assert add_end_backward(graph, 7).target is torch.ops.dc.end_backward.default
    torch.ops.dc.end_backward([torch.ops.dc.reduce_grad(torch.full((1,), 2.0), 7, 11)], 7, True)
    assert launched == [1, 1] and [g.item() for g in reduced] == [2.0]
    handle.cleanup()


def _traced(seq_len: int) -> tuple[GraphModule, tuple]:
    """Dynamo's graph of the tiny model on tagged inputs, the sequence dynamic (what the AutoSP backend gets)."""
    captured: list[GraphModule] = []

    def capture(gm: GraphModule, example_inputs: list) -> GraphModule:
        captured.append(gm)
        return gm

    torch._dynamo.reset()
    ids, labels, positions = autosp.prepare_autosp_inputs(*_batch(0))[:3]
    torch.compile(_TinyAttention(), backend=capture, dynamic=True)(ids, labels, positions)
    return captured[0], (ids, labels, positions)


def test_autosp_finds_the_tagged_inputs_and_slices_the_sequence(monkeypatch) -> None:
    gm, (ids, _, _) = _traced(SEQ)
    assert ids.tag == autosp.AUTOSP_INPUT_ID_KEY
    assert [n.target for n in autosp.get_sdpa_nodes(gm)] == [F.scaled_dot_product_attention]
    nodes = [autosp.get_input_id_node(gm), autosp.get_label_id_node(gm), autosp.get_position_id_node(gm)]
    assert [n.meta["tensor_dict"]["tag"] for n in nodes] == ["input_id", "label_id", "position_id"]
    with pytest.raises(ValueError, match="seq_dim 2"):
        autosp.prepare_autosp_inputs(ids, ids, seq_dim=2)
    # rank 3 of a world of groups of 2 is rank 1 of its group: it keeps [s // 2, 2 * (s // 2)) of the sequence
    monkeypatch.setitem(sp_mesh.GROUP_REGISTRY, "SP_SIZE", 2)
    monkeypatch.setattr(autosp.comm, "get_rank", lambda *a: 3)
    input_ids = nodes[0]
    readers = set(input_ids.users)
    sliced = autosp.shard_tensor_node(gm, input_ids)
    gm.graph.lint()
    assert set(input_ids.users) == {sliced} and all(sliced in r.all_input_nodes for r in readers)
    _, (everything, part) = sliced.args
    assert everything.args == (None, None, None) and part.target is slice
    start, end, _ = part.args
    chunk = start.args[1]
    assert (start.target, start.args[0], chunk.target, chunk.args[1]) == (operator.mul, 1, operator.floordiv, 2)
    assert end.target is operator.add and end.args == (start, chunk)


def _autosp_run(rank: int, world_size: int) -> list[float]:
    torch.manual_seed(0)
    model = _TinyAttention()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "gradient_clipping": 0.0,
              "sequence_parallel_size": 2,
              "compile": {"deepcompile": True, "passes": ["autosp"]}}
    engine, *_ = dsrun.initialize(model=model, model_parameters=model.parameters(), config=config)
    engine.compile(backend="eager", compile_kwargs={"dynamic": True})
    losses = []
    for step in range(3):
        ids, labels, positions = autosp.prepare_autosp_inputs(*_batch(step))[:3]
        loss = engine(ids, labels, positions)  # this rank's half of the sequence
        engine.backward(loss)
        engine.step()
        whole = loss.detach().clone()
        dsrun.comm.all_reduce(whole, group=sp_mesh.my_group())
        losses.append(whole.item() / 2)
    engine.destroy()
    return losses


def test_autosp_trains_with_the_losses_of_the_unsplit_model() -> None:
    torch.manual_seed(0)
    model = _TinyAttention()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    expected = []
    for step in range(3):
        loss = model(*_batch(step))
        expected.append(loss.item())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    for losses in run_ranks(_autosp_run, 2):  # each rank attends over the whole sequence through the exchanges
        # fp32 sums of 16 and of 8 + 8 terms of order 1 (log 32 = 3.5): a few ulps of 3.5 apart at most
        assert losses == pytest.approx(expected, rel=1e-5)
