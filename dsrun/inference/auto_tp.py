"""Automatic tensor parallelism: find each Transformer block's linear pairs and split them over ranks.

How a model is read, with no per-architecture code:

1. **Blocks** are the items of an ``nn.ModuleList`` that hold two or more linears (the outermost such; a
   T5 block's inner ``layer`` list belongs to its block).
2. In each block, the linears (``nn.Linear`` or GPT-2's ``Conv1D``), in registration order, are
   **row-parallel** when they write back into the residual stream, else **column-parallel**. A linear
   writes back when its attribute name is an output projection (``o_proj out_proj c_proj down_proj fc2
   wo o dense_4h_to_h``) or when a normalisation is the next module of its parent (the post-norm layout
   of BERT's ``SelfOutput``/``Output``). A user's ``injection_policy`` ``{BlockClass: ("attn.o", ...)}``
   names the row-parallel linears of that block class instead, as in DeepSpeed.
3. The linears then form **pairs**: each run of column-parallel linears ends at one row-parallel linear.
   A column linear whose output is k times its partner's input (GPT-2's fused ``c_attn`` = q|k|v, a fused
   gate|up) is split part by part. Splits fall on whole heads: the block's attention modules must have
   heads (and key/value heads) divisible by the tensor-parallel size, and their head counts
   (``num_heads``, ``n_head``, ``num_attention_heads``...) and widths (``split_size``, ``all_head_size``,
   ``inner_dim``) are divided by it; a per-head table (T5's relative position bias) is split by heads.
4. Everything outside the pairs (embeddings, norms, the LM head) stays whole on every rank.

:func:`plan_model` returns the plan (for a dry look, and for tests); :func:`shard_model` applies it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import torch
from torch import nn

from dsrun.utils.errors import ConfigError, Problem

from .groups import TPGroup
from .layers import ColumnParallelLinear, RowParallelLinear, is_linear, linear_parts, out_in

OUTPUT_PROJECTIONS = frozenset({"o_proj", "out_proj", "c_proj", "down_proj", "fc2", "wo", "o", "dense_4h_to_h"})
HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_heads", "n_head")
KV_HEAD_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")
WIDTH_ATTRS = ("all_head_size", "inner_dim", "split_size")
HEAD_DIM_ATTRS = ("head_dim", "head_size", "attention_head_size", "key_value_proj_dim")


@dataclass
class LinearSlot:
    """One linear of a block: its name inside the block, where it hangs, and its role."""

    name: str
    parent: nn.Module
    attr: str
    module: nn.Module
    row: bool
    parts: int = 1

    @property
    def shape(self) -> tuple[int, int]:
        return out_in(self.module)


@dataclass
class Pair:
    columns: list[LinearSlot]
    row: LinearSlot

    @property
    def attention(self) -> bool:
        """Whether the column linears sit in an attention module (one with heads)."""
        return any(_head_dim(c.parent, self.row) is not None for c in self.columns)


@dataclass
class BlockPlan:
    name: str
    block: nn.Module
    pairs: list[Pair] = field(default_factory=list)

    def describe(self) -> str:
        pairs = "; ".join(f"{'+'.join(c.name + (f'[x{c.parts}]' if c.parts > 1 else '') for c in p.columns)}"
                          f" -> {p.row.name}" for p in self.pairs)
        return f"{self.name} ({type(self.block).__name__}): {pairs}"


# ------------------------------------------------------------------------------------------------- reading
def _count_linears(module: nn.Module) -> int:
    return sum(1 for m in module.modules() if is_linear(m))


def find_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost ModuleList items holding two or more linears, with their qualified names."""
    found: list[tuple[str, nn.Module]] = []

    def walk(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            qualified = f"{prefix}.{name}" if prefix else name
            if isinstance(module, nn.ModuleList) and _count_linears(child) >= 2:
                found.append((qualified, child))
            else:
                walk(child, qualified)

    walk(model, "")
    return found


def block_linears(block: nn.Module) -> Iterator[tuple[str, nn.Module, str, nn.Module]]:
    """(name in block, parent, attribute, linear) in registration order; a linear is not entered."""
    def walk(module: nn.Module, prefix: str) -> Iterator[tuple[str, nn.Module, str, nn.Module]]:
        for attr, child in module.named_children():
            name = f"{prefix}.{attr}" if prefix else attr
            if is_linear(child):
                yield name, module, attr, child
            else:
                yield from walk(child, name)

    yield from walk(block, "")


def _followed_by_norm(parent: nn.Module, attr: str) -> bool:
    names = list(parent._modules)
    index = names.index(attr)
    following = parent._modules[names[index + 1]] if index + 1 < len(names) else None
    return following is not None and "norm" in type(following).__name__.lower()


def _policy_rows(block: nn.Module, policy: Mapping[Any, Any] | None) -> tuple[str, ...] | None:
    if not policy:
        return None
    for key, names in policy.items():
        matches = key is type(block) or (isinstance(key, str) and key == type(block).__name__)
        if matches:
            if isinstance(names, str):
                names = (names,)
            if not isinstance(names, (tuple, list)) or not all(isinstance(n, str) for n in names):
                raise ConfigError(Problem("init_inference.injection_policy", f"the value for {type(block).__name__} "
                                          "must name its row-parallel linears, e.g. ('attn.o_proj', 'mlp.down')",
                                          "kernel-injection policy classes are not supported"))
            return tuple(names)
    return None


def _is_row(name: str, parent: nn.Module, attr: str, rows: tuple[str, ...] | None) -> bool:
    if rows is not None:
        return any(name == r or name.endswith("." + r) for r in rows)
    return attr in OUTPUT_PROJECTIONS or _followed_by_norm(parent, attr)


def plan_block(name: str, block: nn.Module, policy: Mapping[Any, Any] | None = None) -> BlockPlan:
    rows = _policy_rows(block, policy)
    plan = BlockPlan(name, block)
    pending: list[LinearSlot] = []
    hint = f"pass injection_policy={{{type(block).__name__}: (<the row-parallel linears>,)}}"
    for lname, parent, attr, module in block_linears(block):
        slot = LinearSlot(lname, parent, attr, module, _is_row(lname, parent, attr, rows))
        if not slot.row:
            pending.append(slot)
            continue
        if not pending:
            raise ConfigError(Problem(f"{name}.{lname}", "is an output projection with no input projection before "
                                      "it in its block, so the block cannot be split automatically", hint))
        for column in pending:
            out_features, _ = column.shape
            ratio, rest = divmod(out_features, slot.shape[1])
            column.parts = ratio if ratio > 1 and rest == 0 else 1
        plan.pairs.append(Pair(pending, slot))
        pending = []
    if pending:
        raise ConfigError(Problem(f"{name}.{pending[0].name}", "no output projection follows this linear in its "
                                  "block, so the block cannot be split automatically", hint))
    return plan


def plan_model(model: nn.Module, policy: Mapping[Any, Any] | None = None) -> list[BlockPlan]:
    """How :func:`shard_model` would split ``model``; raises ConfigError if a block cannot be split."""
    blocks = find_blocks(model)
    if not blocks:
        raise ConfigError(Problem("init_inference.tensor_parallel", f"found no Transformer blocks in "
                                  f"{type(model).__name__} (an nn.ModuleList of layers holding linears)",
                                  "pass injection_policy, or run it with tp_size=1"))
    return [plan_block(name, block, policy) for name, block in blocks]


# ----------------------------------------------------------------------------------------------- splitting
def _head_dim(module: nn.Module, row: LinearSlot) -> int | None:
    for attr in HEAD_DIM_ATTRS:
        value = getattr(module, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    for attr in HEAD_ATTRS:
        value = getattr(module, attr, None)
        if isinstance(value, int) and value > 0:
            return row.shape[1] // value
    return None


def _check_divisible(plan: BlockPlan, size: int) -> list[Problem]:
    problems = []
    for pair in plan.pairs:
        if pair.row.shape[1] % size:
            problems.append(Problem(f"{plan.name}.{pair.row.name}", f"its {pair.row.shape[1]} input features do "
                                    f"not split over tp_size={size}"))
        for column in pair.columns:
            piece, rest = divmod(column.shape[0] // column.parts, size)
            head_dim = _head_dim(column.parent, pair.row)
            if rest or (head_dim and piece % head_dim):
                what = f"{column.shape[0] // column.parts // head_dim} heads" if head_dim else \
                    f"{column.shape[0] // column.parts} features"
                problems.append(Problem(f"{plan.name}.{column.name}", f"its {what} do not split over "
                                        f"tp_size={size}", "pick a tp_size that divides the head counts"))
    return problems


def _slice_rows(tensor: torch.Tensor | None, parts: int, rank: int, size: int) -> torch.Tensor | None:
    """Rank ``rank``'s slice of each of ``parts`` equal row blocks of ``tensor`` (dim 0), concatenated."""
    if tensor is None:
        return None
    blocks = tensor.reshape(parts, tensor.shape[0] // parts, *tensor.shape[1:])
    piece = blocks.shape[1] // size
    return blocks[:, rank * piece:(rank + 1) * piece].reshape(-1, *tensor.shape[1:]).clone()


def split_head_attrs(module: nn.Module, tp: TPGroup, where: str,
                     share: tuple[int, int, int] | None = None) -> None:
    """Divide a module's head counts and head widths by the group size; split per-head tables by heads.
    ``share = (start, count, total)``: this rank holds ``count`` of ``total`` key/value groups from group
    ``start`` (AutoTP's uneven cut on whole heads), so each count is scaled by ``count / total``; the default is
    the even cut, ``(rank, 1, size)``."""
    start, count, total = share if share is not None else (tp.rank, 1, tp.size)
    heads = {attr: getattr(module, attr) for attr in HEAD_ATTRS + KV_HEAD_ATTRS + WIDTH_ATTRS
             if isinstance(getattr(module, attr, None), int) and not isinstance(getattr(module, attr), bool)}
    for attr, value in heads.items():
        if value % total:
            raise ConfigError(Problem(f"{where}.{attr}", f"{value} does not split over tp_size={tp.size}"))
    head_counts = {heads[a] for a in HEAD_ATTRS if a in heads}
    for attr, child in list(module.named_children()):
        if isinstance(child, nn.Embedding) and child.embedding_dim in head_counts:
            unit = child.embedding_dim // total
            table = child.weight.detach()[:, start * unit:(start + count) * unit].clone()
            setattr(module, attr, nn.Embedding.from_pretrained(table, freeze=True))
    for attr, value in heads.items():
        setattr(module, attr, value // total * count)


def check_split(model: nn.Module, tp_size: int, policy: Mapping[Any, Any] | None = None) -> list[BlockPlan]:
    """The plan of ``model`` (which may live on the meta device), if it splits over ``tp_size`` ranks; a
    ConfigError otherwise, one line per distinct problem (blocks alike are reported once, as ``h.*``)."""
    plans = plan_model(model, policy)
    problems: dict[tuple[str, str], Problem] = {}
    for plan in plans:
        for problem in _check_divisible(plan, tp_size):
            leaf = problem.path[len(plan.name) + 1:]
            key = (leaf, problem.message)
            if key in problems:
                generic = plan.name.rsplit(".", 1)[0] + ".*." + leaf
                problems[key] = Problem(generic, problem.message, problem.hint)
            else:
                problems[key] = problem
    if problems:
        raise ConfigError(list(problems.values()))
    return plans


def parallel_linears(pair: Pair, tp: TPGroup) -> list[tuple[LinearSlot, nn.Module]]:
    """This rank's column- and row-parallel slices of ``pair``'s linears (copies; the pair's modules, read whole,
    are left as they are), each with the slot it replaces."""
    out: list[tuple[LinearSlot, nn.Module]] = []
    for column in pair.columns:
        weight, bias = linear_parts(column.module)
        out.append((column, ColumnParallelLinear(
            _slice_rows(weight.detach(), column.parts, tp.rank, tp.size),
            _slice_rows(None if bias is None else bias.detach(), column.parts, tp.rank, tp.size))))
    weight, bias = linear_parts(pair.row.module)
    piece = weight.shape[1] // tp.size
    row_weight = weight.detach()[:, tp.rank * piece:(tp.rank + 1) * piece].clone()
    out.append((pair.row, RowParallelLinear(row_weight, None if bias is None else bias.detach().clone(), tp.group,
                                            tp.size)))
    return out


def attention_modules(plan: BlockPlan) -> list[tuple[nn.Module, str]]:
    """The modules whose head counts a split divides (the parents of attention pairs' column linears), with
    their qualified names."""
    found: dict[int, tuple[nn.Module, str]] = {}
    for pair in plan.pairs:
        if pair.attention:
            for column in pair.columns:
                found[id(column.parent)] = (column.parent, f"{plan.name}.{column.name}".rsplit(".", 1)[0])
    return list(found.values())


def shard_model(model: nn.Module, tp: TPGroup, policy: Mapping[Any, Any] | None = None) -> list[BlockPlan]:
    """Replace each pair's linears by this rank's column- and row-parallel slices (in place); returns the
    plan. With ``tp.size == 1`` the linears are replaced by whole ones (so they can be quantized)."""
    plans = check_split(model, tp.size, policy)
    for plan in plans:
        attention = attention_modules(plan)
        for pair in plan.pairs:
            for slot, new in parallel_linears(pair, tp):
                setattr(slot.parent, slot.attr, new)
                slot.module = new  # the plan must not keep the whole weight alive
        if tp.size > 1:
            for module, where in attention:
                split_head_attrs(module, tp, where)
    return plans


def quantize_blocks(plans: list[BlockPlan], q_groups: int, qkv: bool) -> int:
    """Weight-only INT8 for every linear of the blocks (``qkv=False`` keeps attention's input projections
    in float); returns the number of linears quantized."""
    count = 0
    for plan in plans:
        for pair in plan.pairs:
            slots = pair.columns + [pair.row]
            for slot in slots:
                if not qkv and pair.attention and not slot.row:
                    continue
                module = getattr(slot.parent, slot.attr)
                try:
                    module.quantize_(q_groups)
                except ValueError as err:
                    raise ConfigError(Problem("init_inference.quant.weight.q_groups", str(err),
                                              "pick a divisor of every layer's output width")) from None
                count += 1
    return count
