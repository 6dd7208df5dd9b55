"""The real inputs of a compiled backward, captured for DeepCompile's passes (DeepSpeed's
``deepspeed.compile.patch_compiled_func``).

A pass gets ``create_inputs_fn``: the graph's real inputs, to run the graph it is rewriting. For a backward graph
these exist only when the backward runs. AOT autograd compiles a backward lazily, on its first call, inside
``CompiledFunction._backward_impl(ctx, all_args)``; while :func:`patch_compiled_func` is in force,
``torch.autograd.Function`` is a subclass whose metaclass wraps that method of each ``CompiledFunction`` class AOT
autograd defines, so its ``all_args`` are recorded under the DeepCompile frame registered for that class
(:func:`register_backward_frame`, in the order the classes are made) before the backward compiler runs, which
takes them with :func:`pop_backward_input`; later backwards of a frame whose inputs were taken are not recorded
(torch compiles a backward once: holding their activations would only cost memory). A frame is ``(owner, frame_id)``: two engines compiling the same frame
id never see each other's inputs. :func:`unpatch_compiled_func` puts torch's class back and drops what is held.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Hashable, Iterable

import torch

backward_inputs: dict[Hashable, list[Any]] = {}  # frame -> captured all_args, oldest first
backward_frame_keys: deque = deque()  # frames waiting for their CompiledFunction class, in order
_taken: set = set()  # frames whose backward compiler took its inputs

enabled_patched_func = False
original_grad_fn: type | None = None
_base_meta = type(torch.autograd.Function)


def _unwrap_staticmethod(method: object) -> Any:
    # a staticmethod descriptor is not callable before Python 3.10
    return method.__func__ if isinstance(method, staticmethod) else method


class FunctionMeta(_base_meta):
    """Wraps ``_backward_impl`` of each class named ``CompiledFunction`` (AOT autograd's, torch >= 2.7)."""

    def __new__(mcs, name: str, bases: tuple, namespace: dict) -> type:
        if name != "CompiledFunction" or "_backward_impl" not in namespace:
            return super().__new__(mcs, name, bases, namespace)
        original = _unwrap_staticmethod(namespace["_backward_impl"])
        frame_key = backward_frame_keys.popleft() if backward_frame_keys else None

        def _backward_impl(ctx: object, all_args: list) -> Any:
            if enabled_patched_func and frame_key is not None and frame_key not in _taken:
                backward_inputs.setdefault(frame_key, []).append(all_args)
            return original(ctx, all_args)

        namespace["_backward_impl"] = staticmethod(_backward_impl)
        return super().__new__(mcs, name, bases, namespace)


def patch_compiled_func() -> dict[Hashable, list[Any]]:
    """Capture compiled backwards' inputs from now on; returns the dict they are kept in."""
    global enabled_patched_func, original_grad_fn
    enabled_patched_func = True
    if original_grad_fn is None:  # patched twice: the first original is the one to restore
        original_grad_fn = torch.autograd.Function

    class PatchedFunction(original_grad_fn, metaclass=FunctionMeta):
        pass

    torch.autograd.Function = PatchedFunction
    return backward_inputs


def register_backward_frame(frame_key: Hashable) -> None:
    """The next ``CompiledFunction`` class AOT autograd defines belongs to ``frame_key``."""
    backward_frame_keys.append(frame_key)


def unpatch_compiled_func() -> None:
    """torch's ``autograd.Function`` back; every captured input and pending registration dropped."""
    global enabled_patched_func, original_grad_fn
    enabled_patched_func = False
    if original_grad_fn is not None:
        torch.autograd.Function = original_grad_fn
        original_grad_fn = None
    clear_backward_inputs()


def get_backward_inputs(frame_key: Hashable | None = None) -> Any:
    """All captured inputs by frame, or one frame's list ([] if none)."""
    return backward_inputs if frame_key is None else backward_inputs.get(frame_key, [])


def pop_backward_input(frame_key: Hashable) -> Any:
    """The latest inputs captured for ``frame_key`` (None if none), removed."""
    captured = backward_inputs.get(frame_key)
    if not captured:
        return None
    inputs = captured.pop()
    _taken.add(frame_key)
    if not captured:
        del backward_inputs[frame_key]
    return inputs


def clear_backward_inputs(frame_keys: Iterable[Hashable] | None = None) -> None:
    """Drop the captures and pending registrations of ``frame_keys`` (None: of every frame)."""
    if frame_keys is None:
        backward_inputs.clear()
        backward_frame_keys.clear()
        _taken.clear()
        return
    drop = set(frame_keys)
    for key in drop:
        backward_inputs.pop(key, None)
    kept = [key for key in backward_frame_keys if key not in drop]
    backward_frame_keys.clear()
    backward_frame_keys.extend(kept)
