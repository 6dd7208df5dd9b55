"""ZeRO-3 leaf modules: DeepSpeed's ``deepspeed.utils.z3_leaf_module``.

(Named otherwise here because DeepSpeed's ``deepspeed.utils`` binds ``z3_leaf_module`` to the function of that
name, which ``dsrun.utils`` serves too; the alias serves this module under DeepSpeed's path.)

A *leaf* module is gathered whole: ZeRO-3's parameter coordinator (:mod:`dsrun.zero.hooks`) gathers every
parameter of its subtree at the leaf's forward pre-hook, releases them after its forward, and puts no hooks on
its children. That is what a Mixture-of-Experts block needs, whose experts run data-dependently (a rank whose
tokens skip an expert would otherwise issue one gather fewer than its peers), and what a model of very
fine-grained modules gains from (fewer hooks). The leaf's parameters' gradients are reduced once backward is
done, a zero gradient standing in for an expert that received no tokens (:mod:`dsrun.zero.stage3`).

The flag is an attribute of the module (``_z3_leaf``) and of each parameter under a hooked leaf
(``ds_z3_leaf_module``), as in DeepSpeed; set it before ``deepspeed.initialize`` builds the ZeRO-3 engine, which
reads it once. The config sets it too, when the ZeRO-3 strategy is built (:mod:`dsrun.zero.stage3`):
``zero_optimization.leaf_module`` names leaves by class, by name and by name suffix
(:func:`apply_zero_leaf_module_config`), and ``stage3_module_granularity_threshold`` makes a leaf of every
outermost module whose parameters per layer are at most the threshold (:func:`set_z3_leaf_modules_by_threshold`).
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Iterable, List, Tuple, Type, Union

if TYPE_CHECKING:
    import torch

LEAF_ATTR = "_z3_leaf"
PARAM_LEAF_ATTR = "ds_z3_leaf_module"


def z3_leaf_module(model: "torch.nn.Module") -> bool:
    """Whether ``model`` is flagged as a leaf module (see :func:`set_z3_leaf_modules`)."""
    return bool(getattr(model, LEAF_ATTR, False))


def z3_leaf_parameter(model: "torch.nn.Parameter") -> bool:
    """Whether a parameter belongs to a leaf module (ZeRO-3 marks them when it hooks the model)."""
    return hasattr(model, PARAM_LEAF_ATTR)


def get_z3_leaf_modules(model: "torch.nn.Module") -> List["torch.nn.Module"]:
    """The modules of ``model`` (itself included) flagged as leaves, in ``model.modules()`` order."""
    return [module for module in model.modules() if z3_leaf_module(module)]


def set_z3_leaf_module(model: "torch.nn.Module", flag: bool) -> None:
    """Flag (or unflag) one module."""
    setattr(model, LEAF_ATTR, flag)


def _qualified_name(module: "torch.nn.Module") -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def _matches(module: "torch.nn.Module", leaf_class: Union[Type, str]) -> bool:
    if isinstance(leaf_class, type):
        return isinstance(module, leaf_class)
    return type(module).__name__ == leaf_class or _qualified_name(module) == leaf_class


def _set_by_class(model: "torch.nn.Module", leaf_module_classes: Iterable[Union[Type, str]], flag: bool,
                  raise_if_not_found: bool) -> List["torch.nn.Module"]:
    classes = list(leaf_module_classes)
    if not all(isinstance(c, (type, str)) for c in classes):
        # DeepSpeed asserts this; the same error type
        raise AssertionError(f"leaf_module_classes must be a list of types or names, got {classes}")
    flagged: List["torch.nn.Module"] = []

    def visit(module: "torch.nn.Module") -> None:
        if any(_matches(module, c) for c in classes):
            set_z3_leaf_module(module, flag)
            flagged.append(module)

    model.apply(visit)  # children before their parent: DeepSpeed's order of the returned list
    if not flagged and raise_if_not_found:
        raise ValueError(f"No modules of type {classes} found in model {model}")
    return flagged


def set_z3_leaf_modules(model: "torch.nn.Module", leaf_module_classes: Union[List[Type], List[str]],
                        raise_if_not_found: bool = True) -> List["torch.nn.Module"]:
    """Flag every module of ``model`` that is an instance of one of ``leaf_module_classes`` (classes, or class
    names: plain or ``module.Qualified`` names) as a ZeRO-3 leaf; return them. Raises ValueError when none
    matches, unless ``raise_if_not_found`` is False."""
    return _set_by_class(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: "torch.nn.Module", leaf_module_classes: Union[List[Type], List[str]],
                          raise_if_not_found: bool = True) -> List["torch.nn.Module"]:
    """Clear the leaf flag of the modules :func:`set_z3_leaf_modules` would flag; return them."""
    return _set_by_class(model, leaf_module_classes, False, raise_if_not_found)


def set_z3_leaf_modules_by_name(model: "torch.nn.Module", module_names: List[str], flag: bool = True,
                                raise_if_not_found: bool = True) -> Tuple[List["torch.nn.Module"], List[str]]:
    """Set the leaf flag of the modules named (as ``model.named_modules()`` names them); return them and the
    names that matched nothing (a ValueError instead when ``raise_if_not_found``)."""
    by_name = dict(model.named_modules())
    flagged, missing = [], []
    for name in module_names:
        if name not in by_name:
            missing.append(name)
            continue
        set_z3_leaf_module(by_name[name], flag)
        flagged.append(by_name[name])
    if missing and raise_if_not_found:
        raise ValueError(f"No modules named {missing} found in model {model}")
    return flagged, missing


def set_z3_leaf_modules_by_suffix(model: "torch.nn.Module", module_name_suffixes: List[str], flag: bool = True,
                                  raise_if_not_found: bool = True) -> Tuple[List["torch.nn.Module"], List[str]]:
    """Set the leaf flag of every module whose ``named_modules()`` name ends with one of the suffixes; return
    them (each once) and the suffixes that matched nothing (a ValueError instead when ``raise_if_not_found``)."""
    by_name = dict(model.named_modules())
    flagged: List["torch.nn.Module"] = []
    missing = []
    for suffix in module_name_suffixes:
        matched = [module for name, module in by_name.items() if name.endswith(suffix)]
        if not matched:
            missing.append(suffix)
        for module in matched:
            set_z3_leaf_module(module, flag)
            if all(module is not seen for seen in flagged):
                flagged.append(module)
    if missing and raise_if_not_found:
        raise ValueError(f"No modules matching suffixes {missing} found in model {model}")
    return flagged, missing


def apply_zero_leaf_module_config(model: "torch.nn.Module", classes: Iterable[str] = (), names: Iterable[str] = (),
                                  name_suffixes: Iterable[str] = ()) -> List["torch.nn.Module"]:
    """``zero_optimization.leaf_module``: flag the modules of ``model`` matching any of ``classes`` (class names,
    plain or qualified), ``names`` (``named_modules()`` names) or ``name_suffixes``; return them, each once. A name
    or suffix that matches nothing is logged as a warning, as DeepSpeed does (a class may simply not be in this
    model)."""
    from dsrun.utils.logging import logger

    flagged: List["torch.nn.Module"] = []

    def keep(modules: Iterable["torch.nn.Module"]) -> None:
        flagged.extend(m for m in modules if all(m is not seen for seen in flagged))

    if classes:
        keep(set_z3_leaf_modules(model, list(classes), raise_if_not_found=False))
    for what, setter, wanted in (("names", set_z3_leaf_modules_by_name, names),
                                 ("name suffixes", set_z3_leaf_modules_by_suffix, name_suffixes)):
        if wanted:
            modules, missing = setter(model, list(wanted), raise_if_not_found=False)
            keep(modules)
            if missing:
                logger.warning(f"zero_optimization.leaf_module: no module matches the {what} {missing}")
    return flagged


def _granularity(module: "torch.nn.Module", found: dict[int, int]) -> Tuple[int, int]:
    """(layers, parameter elements) under ``module``; records in ``found`` the granularity of each module that
    may become a leaf: its elements per layer (itself counted as a layer), DeepSpeed's measure."""
    import torch

    largest_leaf = 10 ** 9  # a bigger leaf would hold too many parameters gathered at once
    params = list(module.parameters())
    if not params:
        return 0, 0
    numel = sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters(recurse=False))
    children = list(module.children())
    if not children:  # a torch layer: hooked anyway, never a leaf of its own
        return 1, numel
    layers = 0
    for child in children:
        child_layers, child_numel = _granularity(child, found)
        layers, numel = layers + child_layers, numel + child_numel
    if type(module).__name__ in torch.nn.modules.container.__all__:  # ModuleList & co. run no forward
        return layers, numel
    layers += 1
    found[id(module)] = numel // layers if numel <= largest_leaf else sys.maxsize
    return layers, numel


def set_z3_leaf_modules_by_threshold(model: "torch.nn.Module", threshold: int) -> List["torch.nn.Module"]:
    """``stage3_module_granularity_threshold``: flag as leaves the outermost modules of ``model`` whose parameter
    elements per layer are at most ``threshold`` (a module of many small layers costs a hook and a gather per
    layer; as a leaf it is gathered at once); return them. Containers (``ModuleList`` ...) and torch layers
    without children never become leaves. Logs when no module is small enough, as DeepSpeed does."""
    from dsrun.utils.logging import logger

    found: dict[int, int] = {}
    _granularity(model, found)
    flagged: List["torch.nn.Module"] = []

    def visit(module: "torch.nn.Module") -> None:  # parents first: a leaf's children need no flag of their own
        if not any(True for _ in module.parameters()):
            return
        if found.get(id(module), sys.maxsize) <= threshold:
            set_z3_leaf_module(module, True)
            flagged.append(module)
            return
        for child in module.children():
            visit(child)

    visit(model)
    if not flagged:
        smallest = min(found.values(), default=None)
        logger.warning(f"stage3_module_granularity_threshold {threshold} makes no leaf: the smallest granularity "
                       f"(parameter elements per layer) of this model's modules is {smallest}")
    return flagged
