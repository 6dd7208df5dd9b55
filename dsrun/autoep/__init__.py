"""AutoEP: turn a Hugging Face MoE model's expert blocks into expert-parallel layers (docs/moe.md, "AutoEP").

:mod:`.spec` (the config and detection dataclasses), :mod:`.presets` (model families), :mod:`.config` (the
``expert_parallel`` section), :mod:`.detect` (find and replace blocks), :mod:`.layer` (the replacement layer),
:mod:`.router`, :mod:`.experts`, :mod:`.repack` (weights from the source block), :mod:`.folding` (the rank layout
with AutoTP). DeepSpeed's paths (``deepspeed.module_inject.auto_ep*``, ``deepspeed.moe.ep_*``) name these modules.
"""
