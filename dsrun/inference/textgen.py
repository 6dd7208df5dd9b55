"""``dsrun generate``'s work: from a run directory or checkpoint to text, on one rank or split over several.

:func:`resolve_request` finds what a path means (the model the run trained, its tokenizer, the checkpoint)
and checks that the checkpoint fits the model before any rank starts; :func:`run_request` runs on every
rank: it builds the model, hands it to :func:`dsrun.init_inference` (tensor-parallel over all ranks; an MoE
GPT, ``dsrun.models.moe_gpt.MoEGPT``, is built whole and its experts spread over all ranks with expert
parallelism instead, on the plain path) and generates, timing the generation alone.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from dsrun.utils.errors import Problem, UserError

SOURCE = "RUN_DIR_OR_CHECKPOINT"
WORKER = "dsrun.inference.worker"
MOE_TARGET = "dsrun.models.moe_gpt.MoEGPT"


@dataclass
class GenerationRequest:
    model: dict[str, Any]  # the _target_ mapping of a dsrun GPT
    tokenizer: str
    checkpoint: str
    prompt: str
    max_new_tokens: int = 100
    temperature: float = 0.8
    top_k: int | None = None
    seed: int = 1234
    dtype: str = "fp32"
    kernel_inject: bool = True

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _find_run_dir(path: Path) -> Path | None:
    """The run directory (holding resolved.yaml) at or up to three levels above ``path``."""
    from dsrun.rundir import RESOLVED_YAML

    start = path if path.is_dir() else path.parent
    for candidate in [start, *list(start.parents)[:3]]:
        if (candidate / RESOLVED_YAML).is_file():
            return candidate
    return None


def _parse_value(text: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def split_overrides(overrides: list[str]) -> tuple[dict[str, Any], dict[str, Any], str | None]:
    """``launcher.KEY=V`` / ``model=NAME`` / ``model.KEY=V`` / ``data.tokenizer=SPEC`` into (launcher
    mapping, model keys, tokenizer); anything else is an error naming the override."""
    launcher: dict[str, Any] = {}
    model: dict[str, Any] = {}
    tokenizer = None
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise UserError(Problem(item, "is not KEY=VALUE", "e.g. launcher.num_procs=2"))
        if key.startswith("launcher."):
            launcher[key.split(".", 1)[1]] = _parse_value(value)
        elif key == "model":
            model["_name_"] = value
        elif key.startswith("model."):
            model[key.split(".", 1)[1]] = _parse_value(value)
        elif key == "data.tokenizer":
            tokenizer = value
        else:
            raise UserError(Problem(key, "is not an option of dsrun generate",
                                    "allowed: launcher.KEY=VALUE, model=NAME, model.KEY=VALUE, data.tokenizer=SPEC"))
    return launcher, model, tokenizer


def resolve_request(source: str, prompt: str, overrides: list[str], **options: int | float | str | bool | None
                    ) -> tuple[GenerationRequest, dict[str, Any], int]:
    """The request every rank runs, the launcher mapping and the world size (= the tensor-parallel size);
    checks that the checkpoint fits the model and the model splits over the ranks."""
    from dsrun.launcher import plan_from_mapping
    from omegaconf import OmegaConf

    from dsrun.models.registry import GPT_TARGET, model_spec
    from dsrun.rundir import RESOLVED_YAML

    path = Path(source).expanduser()
    if not path.exists():
        raise UserError(Problem(SOURCE, f"no such file or folder: {path}",
                                "pass a run directory (outputs/DATE/TIME), a checkpoint folder or a model file"))
    launcher, model_keys, tokenizer = split_overrides(overrides)
    run_dir = _find_run_dir(path)
    spec: dict[str, Any] = {}
    if run_dir is not None:
        saved = OmegaConf.to_container(OmegaConf.load(run_dir / RESOLVED_YAML), resolve=True)
        spec = dict(saved.get("model") or {})
        tokenizer = tokenizer or (saved.get("data") or {}).get("tokenizer")
    name = model_keys.pop("_name_", None)
    if name is not None:
        spec = model_spec(name)
    if not spec:
        raise UserError(Problem(SOURCE, f"found no run directory (resolved.yaml) at or above {path}, so the model "
                                "is unknown", "name it: model=gpt-nano (and model.KEY=VALUE)"))
    spec.update(model_keys)
    if spec.get("_target_") not in (GPT_TARGET, MOE_TARGET):
        raise UserError(Problem("model._target_", f"dsrun generate runs dsrun's GPT, not {spec.get('_target_')}",
                                "for other models call dsrun.init_inference in your own script"))
    if spec["_target_"] == MOE_TARGET:  # built whole, spread at init_inference; no fused MoE path
        spec["moe"] = {**dict(spec.get("moe") or {}), "ep_size": 1}
        options["kernel_inject"] = False
    if not prompt:
        raise UserError(Problem("--prompt", "is empty", "give some text to continue"))
    request = GenerationRequest(model=spec, tokenizer=str(tokenizer or "bytes"), checkpoint=str(path.resolve()),
                                prompt=prompt, **options)
    launcher = {"runner": "local", "num_procs": 1, **launcher}
    world = plan_from_mapping(launcher, WORKER, module=True).world_size
    check_request(request, world)
    return request, launcher, world


def _is_moe(request: GenerationRequest) -> bool:
    return request.model.get("_target_") == MOE_TARGET


def _ep(result: Mapping[str, Any]) -> str:
    return f"EP={result['ep_size']}, " if result.get("ep_size", 1) > 1 else ""


def _build(request: GenerationRequest, device: str | None = None) -> torch.nn.Module:
    from dsrun.models.registry import build_model

    return build_model(request.model, device=device)


def check_request(request: GenerationRequest, tp_size: int = 1) -> None:
    """Fail in the calling process, before any rank starts: a bad tokenizer, a checkpoint that is missing,
    unreadable or does not fit the model, a model that does not split over ``tp_size`` ranks, a request
    longer than the model's context."""
    from dsrun.data.tokenizers import get_tokenizer

    from .auto_tp import check_split
    from .loading import check_fits, read_state_dict

    tokenizer = get_tokenizer(request.tokenizer)
    model = _build(request, device="meta")
    if _is_moe(request) and tp_size > 1:
        from dsrun.moe.layer import moe_layers

        counts = sorted({layer.num_experts for layer in moe_layers(model)})
        if any(c % tp_size for c in counts):
            raise UserError(Problem("launcher.num_procs", f"{tp_size} ranks do not divide the model's {counts} "
                                    "experts per MoE layer (expert parallelism over all ranks)",
                                    "launch a number of ranks that divides the experts"))
    elif tp_size > 1:
        check_split(model, tp_size)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise UserError(Problem("data.tokenizer", f"{tokenizer.name} has {tokenizer.vocab_size} tokens, the model "
                                f"{model.config.vocab_size}", "use the run's own tokenizer"))
    state_dict, where = read_state_dict(request.checkpoint)
    check_fits(model, state_dict, where)
    prompt = len(tokenizer.encode(request.prompt.encode()))
    if prompt + request.max_new_tokens > model.config.block_size:
        raise UserError(Problem("--max-new-tokens", f"{prompt} prompt tokens + {request.max_new_tokens} new tokens "
                                f"exceed the model's context (block_size={model.config.block_size})",
                                f"ask for at most {max(model.config.block_size - prompt, 0)} new tokens"))


def run_request(request: GenerationRequest | Mapping[str, Any]) -> dict[str, Any]:
    """Generate on this rank (every rank of the world takes part: the model is split over all of them)."""
    import dsrun
    from dsrun import comm
    from dsrun.data.tokenizers import get_tokenizer

    if not isinstance(request, GenerationRequest):
        request = GenerationRequest(**request)
    world = comm.get_world_size() if comm.is_initialized() else 1
    tokenizer = get_tokenizer(request.tokenizer)
    torch.manual_seed(request.seed)
    model = _build(request)
    split = {"moe": {"ep_size": world}} if _is_moe(request) else {"tensor_parallel": {"tp_size": world}}
    engine = dsrun.init_inference(model, checkpoint=request.checkpoint, dtype=request.dtype, **split,
                                  replace_with_kernel_inject=request.kernel_inject,
                                  max_out_tokens=model.config.block_size)  # the request was checked against it
    device = next(engine.module.parameters()).device
    ids = torch.as_tensor(tokenizer.encode(request.prompt.encode()).astype("int64"))[None, :].to(device)
    generator = torch.Generator(device=ids.device).manual_seed(request.seed)  # the same draws on every rank
    started = time.perf_counter()
    out = engine.generate(ids, request.max_new_tokens, temperature=request.temperature, top_k=request.top_k,
                          generator=generator)
    seconds = time.perf_counter() - started
    new = out[0, ids.shape[1]:].tolist()
    return {"text": tokenizer.decode(out[0].tolist()), "completion": tokenizer.decode(new),
            "prompt_tokens": int(ids.shape[1]), "new_tokens": len(new), "seconds": seconds,
            "tokens_per_second": len(new) / seconds if seconds > 0 else float("inf"), "tp_size": engine.mp_world_size,
            "ep_size": engine.ep_size,
            "path": "fused KV-cache" if request.kernel_inject else "plain", "dtype": request.dtype,
            "checkpoint": engine.checkpoint_loaded}


def summary_line(result: Mapping[str, Any]) -> str:
    return (f"[dsrun] {result['new_tokens']} new tokens in {result['seconds']:.2f}s: "
            f"{result['tokens_per_second']:,.1f} tokens/s (prompt: {result['prompt_tokens']} token(s); "
            f"TP={result['tp_size']}, {_ep(result)}{result['path']} path, {result['dtype']}; {result['checkpoint']})")
