"""``deepspeed.linear``: DeepSpeed's LoRA linear layer with a sharded frozen base weight.

:class:`OptimizedLinear` is ``nn.Linear``'s stand-in: with a :class:`LoRAConfig` it is a
:class:`~dsrun.linear.optimized_linear.LoRAOptimizedLinear` (a frozen base weight, sharded over
``base_weight_sharding`` ranks and gathered for each forward, plus trainable ``lora_weight_1``/``lora_weight_2``
adapters scaled by ``lora_alpha / lora_r``); with neither config it is a plain ``nn.Linear``. :class:`Init` makes
every ``nn.Linear`` built inside it one (and initialises the adapters after Hugging Face's
``AutoModelForCausalLM.from_pretrained``/``from_config``); :func:`init_lora` freezes a model built so and
initialises its adapters. See docs/lora.md.
"""
from .config import LoRAConfig, QuantizationConfig
from .context_manager import Init, init_lora
from .optimized_linear import LoRAOptimizedLinear, OptimizedLinear

__all__ = ["Init", "LoRAConfig", "LoRAOptimizedLinear", "OptimizedLinear", "QuantizationConfig", "init_lora"]
