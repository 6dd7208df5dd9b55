"""``dsrun.init_inference`` and the ``InferenceEngine`` it returns (DeepSpeed's names and call forms).

The engine prepares a model once, in this order:

1. refuse the settings dsrun cannot honour (:func:`~dsrun.inference.config.refusals`), one line each;
2. load ``checkpoint`` into the whole model (:mod:`~dsrun.inference.loading`);
3. convert to ``dtype`` (fp16/bf16/fp32; with ``int8`` the float weights are kept until step 5);
4. spread an MoE model's experts over expert-parallel groups of ``moe.ep_size`` ranks
   (:mod:`~dsrun.inference.moe`); split the blocks over the model-parallel group (:mod:`~dsrun.inference.auto_tp`) when
   ``tensor_parallel.tp_size > 1`` (or a user ``injection_policy`` / INT8 asks for the block plan);
5. quantize the blocks' linears to INT8 (weight-only) with ``dtype=torch.int8``;
6. with ``replace_with_kernel_inject`` on a dsrun GPT, swap in the fused KV-cache forward
   (:class:`~dsrun.inference.fused_gpt.FusedGPT`); on a Hugging Face model whose blocks a kernel-injection policy
   names, replace those blocks by DeepSpeed's injected layer (:mod:`~dsrun.inference.injection`), cut over the
   model-parallel group in place of step 4's split.

``engine(*inputs, **kwargs)`` runs the forward without autograd; ``engine.generate(...)`` is the model's
own ``generate`` (the fused one with kernel injection); other attributes read through to the model, so the
engine can stand in for it (``pipe.model = dsrun.init_inference(pipe.model, ...)``).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dsrun.accelerator import get_accelerator
from dsrun.utils.errors import ConfigError, Problem, UserError
from dsrun.utils.logging import logger

from . import moe
from .auto_tp import BlockPlan, quantize_blocks, shard_model
from .config import DeepSpeedInferenceConfig, InferenceConfigSource, merge_config, refusals
from .fused_gpt import FusedGPT
from .groups import TPGroup, model_parallel_group
from .injection import inject, policy_for
from .loading import load_weights


def _is_dsrun_gpt(model: nn.Module) -> bool:
    from dsrun.models.gpt import GPT

    return isinstance(model, GPT)


# The layers DeepSpeed v1's kernel injection replaces (its ``replace_policies``/``generic_policies``, by the module
# and class each policy names); those with a policy in dsrun.inference.injection.policies are injected, the others
# refused (DeepSpeed would swap in a layer dsrun does not have).
KERNEL_INJECTION_LAYERS = frozenset({
    "transformers.models.bert.modeling_bert.BertLayer", "transformers.models.roberta.modeling_roberta.RobertaLayer",
    "transformers.models.distilbert.modeling_distilbert.TransformerBlock",
    "transformers.models.gpt2.modeling_gpt2.GPT2Block", "transformers.models.gptj.modeling_gptj.GPTJBlock",
    "transformers.models.gpt_neo.modeling_gpt_neo.GPTNeoBlock",
    "transformers.models.gpt_neox.modeling_gpt_neox.GPTNeoXLayer",
    "transformers.models.bloom.modeling_bloom.BloomBlock", "transformers.models.opt.modeling_opt.OPTDecoderLayer",
    "transformers.models.clip.modeling_clip.CLIPEncoderLayer", "transformers.models.llama.modeling_llama.LlamaDecoderLayer",
    "llama.model.TransformerBlock", "megatron.model.transformer.ParallelTransformerLayer",
    "diffusers.models.unet_2d_condition.UNet2DConditionModel",
    "diffusers.models.unets.unet_2d_condition.UNet2DConditionModel",
    "diffusers.models.autoencoders.autoencoder_kl.AutoencoderKL", "diffusers.models.vae.AutoencoderKL",
    "diffusers.models.autoencoder_kl.AutoencoderKL"})


def kernel_injection_layer(model: nn.Module) -> str | None:
    """The first layer class of ``model`` that DeepSpeed's kernel injection would replace (None: none is there,
    and DeepSpeed's injection leaves the model as it is); InternLM's decoder layers are matched by name, as
    DeepSpeed finds them in whatever remote-code module holds them."""
    for module in model.modules():
        cls = type(module)
        if f"{cls.__module__}.{cls.__qualname__}" in KERNEL_INJECTION_LAYERS or cls.__name__ == "InternLMDecoderLayer":
            return cls.__name__
    return None


def _injection_refusals(config: DeepSpeedInferenceConfig) -> list[Problem]:
    """Settings the injected layer cannot honour, one line each."""
    p = "init_inference."
    out = []
    if config.dtype == torch.int8:
        out.append(Problem(p + "dtype", "INT8 with kernel injection is DeepSpeed's CUDA INT8 GEMM, which dsrun does "
                           "not have", "use dtype=torch.int8 without replace_with_kernel_inject (weight-only INT8 over "
                           "automatic tensor parallelism)"))
    if config.injection_policy or config.injection_policy_tuple:
        out.append(Problem(p + "injection_policy", "names the blocks automatic tensor parallelism splits; with "
                           "replace_with_kernel_inject the policies of dsrun.inference.injection pick the blocks",
                           "give one of the two"))
    return out


class InferenceEngine(nn.Module):
    """A model prepared for inference: split, quantized, fused as its config says."""

    def __init__(self, model: nn.Module, config: DeepSpeedInferenceConfig):
        super().__init__()
        if isinstance(model, InferenceEngine):
            raise UserError(Problem("init_inference(model=...)", "is already an InferenceEngine",
                                    "pass the original nn.Module without any wrappers"))
        self._config = config
        device = get_accelerator().device()
        problems = refusals(config, device.type)
        injected = kernel_injection_layer(model) if config.replace_with_kernel_inject else None
        injecting = injected is not None and any(policy_for(m) is not None for m in model.modules())
        if injected is not None and not injecting and not _is_dsrun_gpt(model):
            problems.append(Problem("init_inference.replace_with_kernel_inject", f"DeepSpeed would swap its "
                                    f"injected layer into {type(model).__name__}'s {injected} layers; dsrun injects "
                                    "GPT-2, GPT-Neo, GPT-J, OPT, BERT/RoBERTa and Llama blocks only",
                                    "leave it false: automatic tensor parallelism splits any Transformer"))
        if injecting:
            problems += _injection_refusals(config)
        problems += moe.check(model, config)
        if problems:
            raise ConfigError(problems)
        self.checkpoint_loaded = self._load(model, config)
        self._convert_dtype(model, config.dtype)
        self.ep_size = moe.spread_experts(model, config)  # MoE: each rank keeps its experts (collective)
        policy = self._policy(config)
        self.tp: TPGroup = model_parallel_group(config.tp_size, config.tensor_parallel.tp_group,
                                                config.tensor_parallel.mpu or config.mpu)
        self.block_plans: list[BlockPlan] = []
        self.injected_layers = inject(model, config, self.tp) if injecting else 0
        if not injecting and (self.tp.size > 1 or policy or config.dtype == torch.int8):
            self.block_plans = shard_model(model, self.tp, policy)
        self.quantized_linears = 0
        if config.dtype == torch.int8 and config.quant.enabled and config.quant.weight.enabled:
            self.quantized_linears = quantize_blocks(self.block_plans, config.quant.weight.q_groups,
                                                     config.quant.qkv.enabled)
        for param in model.parameters():
            param.requires_grad_(False)
        self.module = model.to(device).eval()
        fused = None
        if config.replace_with_kernel_inject and _is_dsrun_gpt(model):
            fused = FusedGPT(model, config.max_out_tokens, config.min_out_tokens, config.triangular_masking)
        elif config.replace_with_kernel_inject and not injecting:  # no layer a policy names: DeepSpeed replaces none
            logger.info(f"init_inference: replace_with_kernel_inject: {type(model).__name__} has no layer a "
                        f"kernel-injection policy replaces; its own forward runs, as under DeepSpeed")
        self.__dict__["fused"] = fused  # not a submodule: it holds the module's own weights, not copies

    # ------------------------------------------------------------------------------------------- set-up
    @staticmethod
    def _load(model: nn.Module, config: DeepSpeedInferenceConfig) -> str | None:
        source = config.checkpoint_source
        meta = any(p.is_meta for p in model.parameters())
        if meta and not config.set_empty_params:
            raise ConfigError(Problem("init_inference(model=...)", "was built on the meta device (no values)",
                                      "set set_empty_params=True and give a checkpoint"))
        if config.set_empty_params and source is None:
            raise ConfigError(Problem("init_inference.set_empty_params", "needs a checkpoint to fill the "
                                      "parameters from", "pass checkpoint=..."))
        if source is None:
            return None
        return load_weights(model, source, config.checkpoint_base_dir, lambda sd: moe.localize(model, sd))

    @staticmethod
    def _convert_dtype(model: nn.Module, dtype: torch.dtype) -> None:
        if dtype != torch.int8:
            model.to(dtype)

    @staticmethod
    def _policy(config: DeepSpeedInferenceConfig) -> dict[Any, Any] | None:
        policy = dict(config.injection_policy or {})
        if config.injection_policy_tuple:
            block, names = config.injection_policy_tuple[0], config.injection_policy_tuple[1:]
            if len(names) == 1 and isinstance(names[0], (tuple, list)):
                names = tuple(names[0])
            policy[block] = tuple(names)
        return policy or None

    # ------------------------------------------------------------------------------------------- calls
    @property
    def mp_world_size(self) -> int:
        return self.tp.size

    @property
    def config(self) -> Any:
        """The model's own config (Hugging Face pipelines read ``model.config``)."""
        return getattr(self.module, "config", None)

    def forward(self, *inputs: object, **kwargs: object) -> Any:
        """Execute forward propagation (without autograd); any arguments, passed on to the model."""
        with torch.no_grad():
            if self.fused is not None:
                return self.fused(*inputs, **kwargs)
            return self.module(*inputs, **kwargs)

    def generate(self, *args: object, **kwargs: object) -> Any:
        """The model's ``generate`` (the fused KV-cache one with kernel injection); any arguments, passed on."""
        if self.fused is not None:
            return self.fused.generate(*args, **kwargs)
        self._check_budget(args, kwargs)
        with torch.no_grad():
            return self.module.generate(*args, **kwargs)

    def _check_budget(self, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        """``max_out_tokens`` bounds prompt + new tokens, ``min_out_tokens`` the room left for new ones."""
        prompt = args[0] if args else kwargs.get("input_ids", kwargs.get("idx"))
        if not torch.is_tensor(prompt) or prompt.dim() != 2:
            return
        length = prompt.shape[1]
        new = kwargs.get("max_new_tokens", args[1] if len(args) > 1 and isinstance(args[1], int) else None)
        limit = self._config.max_out_tokens
        if limit - length < self._config.min_out_tokens:
            raise UserError(Problem("init_inference.min_out_tokens", f"a {length}-token prompt leaves "
                                    f"{max(limit - length, 0)} of max_out_tokens={limit} for new tokens, fewer "
                                    f"than min_out_tokens={self._config.min_out_tokens}",
                                    "shorten the prompt or raise max_out_tokens"))
        if isinstance(new, int) and length + new > limit:
            raise UserError(Problem("init_inference.max_out_tokens", f"{length} prompt + {new} new tokens exceed "
                                    f"max_out_tokens={limit}", "ask for fewer tokens or raise max_out_tokens"))

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None:
                raise
            return getattr(module, name)


def init_inference(model: nn.Module, config: InferenceConfigSource | None = None, **kwargs: object) -> InferenceEngine:
    """Initialize the inference engine: ``config`` is a dict or a JSON file path, ``kwargs`` the same keys
    (any values; the schema checks them).

    All four call forms are valid: no config and no kwargs (DeepSpeed's defaults, including
    ``dtype=torch.float16``), a config, kwargs, or both (a key given both ways must agree).
    """
    return InferenceEngine(model, merge_config(config, **kwargs))
