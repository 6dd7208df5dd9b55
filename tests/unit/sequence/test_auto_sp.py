"""AutoSP's scan and wrap (``dsrun/sequence/auto_sp.py``) in a one-rank world: vision attention layers are
wrapped by class name with their [CLS] setting, language-model attention and the projection are left with a
warning, and a model with neither kind is refused. (The gather over ranks: tests/integration/test_ulysses.py.)"""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from dsrun.sequence.auto_sp import auto_wrap_model_for_sp, detect_model_sp_info
from dsrun.sequence.autosp_vit import UlyssesSPViTAttention
from dsrun.utils.logging import logger

pytestmark = pytest.mark.usefixtures("world_of_one")


def _named(name: str) -> nn.Module:
    return type(name, (nn.Linear,), {})(4, 4)  # a layer of that class name, as a model's own class is


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_vision_attention_is_wrapped_and_the_rest_reported() -> None:
    model = nn.ModuleDict({"vision": nn.ModuleList([_named("CLIPAttention"), _named("SiglipAttention")]),
                           "mm_projector": nn.Sequential(nn.Linear(4, 4)),
                           "language": nn.ModuleList([_named("LlamaAttention")])})
    info = detect_model_sp_info(model)
    assert [n for n, _ in info.vit_attn_modules] == ["vision.0", "vision.1"]
    assert [n for n, _ in info.llm_attn_modules] == ["language.0"]
    assert info.vision_projection_module[0] == "mm_projector"  # the outermost match only
    x = torch.randn(2, 3, 4)
    before = model["vision"][0](x)
    seen = _Lines()
    logger.addHandler(seen)
    try:
        assert auto_wrap_model_for_sp(model, None) is model
    finally:
        logger.removeHandler(seen)
    clip, siglip = model["vision"]
    assert isinstance(clip, UlyssesSPViTAttention) and clip.has_cls_token
    assert isinstance(siglip, UlyssesSPViTAttention) and not siglip.has_cls_token
    assert torch.equal(clip(x), before)  # one rank: the whole sequence is the local one
    assert not isinstance(model["language"][0], UlyssesSPViTAttention)
    text = " ".join(seen.lines)
    assert "'language.0' (LlamaAttention)" in text and "vision projection 'mm_projector'" in text


def test_a_model_without_known_attention_is_refused() -> None:
    with pytest.raises(ValueError, match="no recognisable attention modules found"):
        auto_wrap_model_for_sp(nn.Sequential(nn.Linear(2, 2)), None)
