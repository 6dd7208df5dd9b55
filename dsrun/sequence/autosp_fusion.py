"""AutoSP's vision-language fusion under sequence parallelism (``deepspeed.sequence.autosp_fusion``).

A multimodal model projects its vision encoder's tokens into the language model's width and splices them into
the text embeddings at placeholder tokens. With the encoder sequence-parallel (each rank holds a shard of the
visual tokens, :mod:`dsrun.sequence.autosp_vit`), the adapter wraps the projection: it projects this rank's
visual tokens, gathers the group's (in rank order, differentiably), splices them into the whole text sequence as
the architecture does, pads the fused sequence with zeros to a multiple of the group size, and returns this
rank's equal slice of it, which the decoder's Ulysses attention (:mod:`dsrun.sequence.layer`) takes.

The splices (``_splice_visual_into_text(text_embeds, visual_embeds, input_ids)``, per sample):

* :class:`LlavaFusionAdapter`: each ``image_token_id`` placeholder is replaced by an equal share of the visual
  tokens (the sequence grows); samples are zero-padded to the longest.
* :class:`InternVLFusionAdapter`: each ``image_token_id`` (``<IMG_CONTEXT>``) position takes one visual token,
  in order (the length is kept).
* :class:`Qwen2VLFusionAdapter`: the positions strictly between each ``vision_start_token_id`` /
  ``vision_end_token_id`` pair take one visual token each, in order (the length is kept).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsrun import comm
from dsrun.sequence.autosp_vit import gather_sequence

_DEFAULT_IMAGE_TOKEN_ID = -200  # LLaVA's image placeholder


class _FusionSP(nn.Module):
    """Project, gather the visual tokens, splice, and keep this rank's slice of the padded fused sequence."""

    def __init__(self, projection: nn.Module, process_group: comm.ProcessGroup) -> None:
        super().__init__()
        self.projection = projection
        self.process_group = process_group
        self.world_size = comm.get_world_size(process_group)

    def forward(self, visual_features: torch.Tensor, text_embeds: torch.Tensor,
                input_ids: torch.Tensor) -> torch.Tensor:
        visual = gather_sequence(self.projection(visual_features), self.process_group)
        fused = self._splice_visual_into_text(text_embeds, visual, input_ids)
        fused = F.pad(fused, (0, 0, 0, -fused.shape[1] % self.world_size))
        piece = fused.shape[1] // self.world_size
        rank = comm.get_rank(self.process_group)
        return fused[:, rank * piece:(rank + 1) * piece].contiguous()

    def _splice_visual_into_text(self, text_embeds: torch.Tensor, visual_embeds: torch.Tensor,
                                 input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__}._splice_visual_into_text: subclass "
                                  "ModalityFusionSPAdapter and splice as your model's prepare_inputs_embeds does")


class ModalityFusionSPAdapter(_FusionSP):
    """``ModalityFusionSPAdapter(projection, process_group, image_token_id=-200)``: the base of the
    placeholder-token adapters; a subclass gives the splice."""

    def __init__(self, projection: nn.Module, process_group: comm.ProcessGroup,
                 image_token_id: int = _DEFAULT_IMAGE_TOKEN_ID) -> None:
        super().__init__(projection, process_group)
        self.image_token_id = image_token_id


class LlavaFusionAdapter(ModalityFusionSPAdapter):
    """LLaVA: every placeholder becomes its share of the sample's visual tokens."""

    def _splice_visual_into_text(self, text_embeds: torch.Tensor, visual_embeds: torch.Tensor,
                                 input_ids: torch.Tensor) -> torch.Tensor:
        samples = []
        for i in range(text_embeds.shape[0]):
            places = (input_ids[i] == self.image_token_id).nonzero(as_tuple=True)[0].tolist()
            if not places:
                samples.append(text_embeds[i])
                continue
            chunks = torch.chunk(visual_embeds[i], len(places), dim=0)
            pieces, previous = [], 0
            for place, chunk in zip(places, chunks):
                pieces += [text_embeds[i, previous:place], chunk]
                previous = place + 1  # the placeholder itself goes
            pieces.append(text_embeds[i, previous:])
            samples.append(torch.cat(pieces, dim=0))
        longest = max(s.shape[0] for s in samples)
        return torch.stack([F.pad(s, (0, 0, 0, longest - s.shape[0])) for s in samples])


class InternVLFusionAdapter(ModalityFusionSPAdapter):
    """InternVL: each ``<IMG_CONTEXT>`` position (``image_token_id``) takes the next visual token."""

    def _splice_visual_into_text(self, text_embeds: torch.Tensor, visual_embeds: torch.Tensor,
                                 input_ids: torch.Tensor) -> torch.Tensor:
        out = text_embeds.clone()
        for i in range(text_embeds.shape[0]):
            places = (input_ids[i] == self.image_token_id).nonzero(as_tuple=True)[0]
            out[i, places] = visual_embeds[i, :places.numel()]
        return out


class Qwen2VLFusionAdapter(_FusionSP):
    """``Qwen2VLFusionAdapter(projection, process_group, vision_start_token_id, vision_end_token_id)``: the
    positions between each start/end pair take the visual tokens in order; the boundary tokens stay."""

    def __init__(self, projection: nn.Module, process_group: comm.ProcessGroup, vision_start_token_id: int,
                 vision_end_token_id: int) -> None:
        super().__init__(projection, process_group)
        self.vision_start_token_id = vision_start_token_id
        self.vision_end_token_id = vision_end_token_id

    def _splice_visual_into_text(self, text_embeds: torch.Tensor, visual_embeds: torch.Tensor,
                                 input_ids: torch.Tensor) -> torch.Tensor:
        out = text_embeds.clone()
        for i in range(text_embeds.shape[0]):
            starts = (input_ids[i] == self.vision_start_token_id).nonzero(as_tuple=True)[0].tolist()
            ends = (input_ids[i] == self.vision_end_token_id).nonzero(as_tuple=True)[0].tolist()
            inner = [p for s, e in zip(starts, ends) for p in range(s + 1, e)]
            if inner:
                places = torch.tensor(inner, dtype=torch.long, device=text_embeds.device)
                out[i, places] = visual_embeds[i, :len(inner)]
        return out
