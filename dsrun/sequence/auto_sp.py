"""AutoSP's one call (``deepspeed.sequence.auto_sp.auto_wrap_model_for_sp``) and its model scan
(``deepspeed.sequence.autosp_detector``): sequence parallelism for a multimodal model's vision encoder.

:func:`detect_model_sp_info` finds, by class name, the vision encoder's attention layers (``ViTAttention``,
``CLIPAttention``, ``SiglipAttention``, ... in ``_VIT_ATTN_CLASSNAMES``), the language model's
(``LlamaAttention``, ``Qwen2Attention``, ... in ``_LLM_ATTN_CLASSNAMES``) and the outermost module whose name
holds a vision-projection keyword (``mm_projector``, ``multi_modal_projector``, ...). :func:`auto_wrap_model_for_sp`
replaces each vision attention layer with :class:`~dsrun.sequence.autosp_vit.UlyssesSPViTAttention` (with a
``[CLS]`` token where the architecture has one: ViT and CLIP), and warns, per layer, about what it leaves to
the user, as DeepSpeed does: the language model's attention (its ``hidden_states`` interface is not
``DistributedAttention``'s q/k/v one: wrap its core attention with :mod:`dsrun.sequence.layer`) and the projection
(wrap it with an adapter of :mod:`dsrun.sequence.autosp_fusion`). Register another architecture's class names in
the sets to have it found.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from dsrun import comm
from dsrun.sequence.autosp_vit import UlyssesSPViTAttention
from dsrun.utils.logging import logger

_VIT_HAS_CLS_TOKEN = {"ViTAttention": True, "CLIPAttention": True, "SiglipAttention": False,
                      "InternVisionAttention": False, "Qwen2VLVisionAttention": False,
                      "Idefics2VisionAttention": False, "PaliGemmaVisionAttention": False}
_VIT_ATTN_CLASSNAMES = set(_VIT_HAS_CLS_TOKEN)
_LLM_ATTN_CLASSNAMES = {"LlamaAttention", "MistralAttention", "Qwen2Attention", "InternLM2Attention",
                        "GemmaAttention", "Phi3Attention", "GPTNeoXAttention", "FalconAttention", "MptAttention"}
_VISION_PROJ_KEYWORDS = ("visual_projection", "mm_projector", "vision_proj", "multi_modal_projector",
                         "img_projection")


@dataclass
class SPModelInfo:
    """What :func:`detect_model_sp_info` found: ``(dotted name, module)`` pairs."""

    vit_attn_modules: list[tuple[str, nn.Module]] = field(default_factory=list)
    llm_attn_modules: list[tuple[str, nn.Module]] = field(default_factory=list)
    vision_projection_module: tuple[str, nn.Module] | None = None


def detect_model_sp_info(model: nn.Module) -> SPModelInfo:
    """Scan ``model``'s modules (see the module docstring)."""
    info = SPModelInfo()
    for name, module in model.named_modules():
        kind = type(module).__name__
        if kind in _VIT_ATTN_CLASSNAMES:
            info.vit_attn_modules.append((name, module))
        elif kind in _LLM_ATTN_CLASSNAMES:
            info.llm_attn_modules.append((name, module))
        if info.vision_projection_module is None and any(word in name for word in _VISION_PROJ_KEYWORDS):
            info.vision_projection_module = (name, module)
    return info


def auto_wrap_model_for_sp(model: nn.Module, process_group: comm.ProcessGroup) -> nn.Module:
    """Wrap ``model``'s vision attention layers for sequence parallelism over ``process_group``, in place (and
    return it); ValueError when no attention layer of a known class is found."""
    info = detect_model_sp_info(model)
    if not info.vit_attn_modules and not info.llm_attn_modules:
        raise ValueError("auto_wrap_model_for_sp: no recognisable attention modules found; add the model's "
                         "attention class name(s) to _VIT_ATTN_CLASSNAMES or _LLM_ATTN_CLASSNAMES in "
                         "dsrun/sequence/auto_sp.py and retry")
    for name, module in info.vit_attn_modules:
        wrapped = UlyssesSPViTAttention(module, process_group,
                                        has_cls_token=_VIT_HAS_CLS_TOKEN.get(type(module).__name__, True))
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, wrapped)
    logger.info(f"AutoSP: wrapped {len(info.vit_attn_modules)} ViT attention layer(s)")
    for name, module in info.llm_attn_modules:
        logger.warning(f"AutoSP: LLM attention '{name}' ({type(module).__name__}) takes hidden_states, not "
                       f"DistributedAttention's q/k/v: not wrapped; make its core attention sequence-parallel "
                       f"with dsrun.sequence.layer.DistributedAttention")
    if info.vision_projection_module is not None:
        logger.warning(f"AutoSP: vision projection '{info.vision_projection_module[0]}' is not wrapped; wrap it "
                       f"with an adapter of deepspeed.sequence.autosp_fusion (LlavaFusionAdapter, "
                       f"InternVLFusionAdapter, Qwen2VLFusionAdapter) for the cross-modal gather and scatter")
    return model
