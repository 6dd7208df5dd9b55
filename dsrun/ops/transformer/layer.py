"""``DeepSpeedTransformerLayer``: a BERT layer with DeepSpeed's parameters, in plain torch (CPU and CUDA).

Parameters (DeepSpeed's names and shapes; ``H`` hidden, ``I`` intermediate)::

    attn_qkvw [3H, H]  attn_qkvb [3H]   query, key and value projections stacked (one matmul)
    attn_ow   [H, H]   attn_ob   [H]    attention output projection
    attn_nw   [H]      attn_nb   [H]    LayerNorm after the attention residual (Post-LN),
                                        or before the feed-forward block (Pre-LN)
    inter_w   [I, H]   inter_b   [I]    feed-forward up-projection, then GELU
    output_w  [H, I]   output_b  [H]    feed-forward down-projection
    norm_w    [H]      norm_b    [H]    LayerNorm of the layer output (Post-LN), or of its input (Pre-LN)

The computation (``attention_mask`` is BERT's additive mask, added to the scores)::

    Pre-LN:  a = x + drop(attn(LN_norm(x)));   out = a + drop(ffn(LN_attn_n(a)))
    Post-LN: a = LN_attn_n(x + drop(attn(x))); out = LN_norm(a + drop(ffn(a)))

Without active attention dropout (eval, ``attn_dropout_ratio`` 0, or ``stochastic_mode``) the attention is
torch's fused ``scaled_dot_product_attention``; with it, the probabilities are materialised so the
``attn_dropout_checkpoint`` flag can choose what is kept. GELU is the exact (erf) form, as in BERT.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dsrun.accelerator import get_accelerator
from dsrun.ops.transformer.config import DeepSpeedTransformerConfig
from dsrun.ops.transformer.functions import DropoutContext, GeluLinear, InvertibleLayerNorm, dropout

DEFAULT_INITIALIZER_RANGE = 0.02  # BERT's, used when initializer_range is unset (-1)
GRAD_NAMES = ("Q_W", "K_W", "V_W", "Q_B", "K_B", "V_B", "O_W", "O_B", "N2_W", "N2_B", "int_W", "int_B",
              "out_W", "out_B", "norm_W", "norm_B")
_GENERATORS: dict[tuple[int, str], torch.Generator] = {}
_UNSUPPORTED_ARGUMENTS = ("head_mask", "layer_head_mask", "encoder_hidden_states", "encoder_attention_mask",
                          "past_key_value")


def _seeded_generator(seed: int, device: torch.device) -> torch.Generator | None:
    """One generator per (seed, device), shared by every layer with that seed; None for an unset seed."""
    if seed < 0:
        return None
    key = (seed, str(device))
    if key not in _GENERATORS:
        _GENERATORS[key] = torch.Generator(device=device)
        _GENERATORS[key].manual_seed(seed)
    return _GENERATORS[key]


def _parameter(t: torch.Tensor) -> nn.Parameter:
    return t if isinstance(t, nn.Parameter) else nn.Parameter(t.detach().clone())


class DeepSpeedTransformerLayer(nn.Module):
    """A BERT transformer layer configured by a :class:`DeepSpeedTransformerConfig`.

    ``layer_id`` (class attribute) counts the layers built so far; each layer records its own in
    ``config.layer_id``. ``initial_weights``/``initial_biases`` (DeepSpeed: "only used for unit tests")
    are eight tensors each in the order query, key, value, attention output, attention LayerNorm,
    intermediate, output, output LayerNorm; they are used as the layer's parameters (the same objects when
    they are ``nn.Parameter``). DeepSpeed zeroes the query/key/value biases; dsrun uses the given ones.
    """

    layer_id = 0

    def __init__(self, config: DeepSpeedTransformerConfig, initial_weights: list[torch.Tensor] | None = None,
                 initial_biases: list[torch.Tensor] | None = None):
        super().__init__()
        config.check()
        self.config = config
        config.layer_id = DeepSpeedTransformerLayer.layer_id
        DeepSpeedTransformerLayer.layer_id += 1
        if config.local_rank >= 0:
            get_accelerator().set_device(config.local_rank)
        hidden, inter = config.hidden_size, config.intermediate_size
        if initial_weights is None and initial_biases is None:
            shapes = {"attn_qkvw": (3 * hidden, hidden), "attn_qkvb": (3 * hidden,), "attn_ow": (hidden, hidden),
                      "attn_ob": (hidden,), "attn_nw": (hidden,), "attn_nb": (hidden,), "inter_w": (inter, hidden),
                      "inter_b": (inter,), "output_w": (hidden, inter), "output_b": (hidden,),
                      "norm_w": (hidden,), "norm_b": (hidden,)}
            for name, shape in shapes.items():
                setattr(self, name, nn.Parameter(torch.empty(shape)))
            self.init_transformer_weights(config.adjust_init_range)
        else:
            if initial_weights is None or initial_biases is None or {len(initial_weights), len(initial_biases)} != {8}:
                raise ValueError("initial_weights and initial_biases must both be lists of 8 tensors")
            self.attn_qkvw = nn.Parameter(torch.cat([w.detach() for w in initial_weights[:3]]))
            self.attn_qkvb = nn.Parameter(torch.cat([b.detach() for b in initial_biases[:3]]))
            for i, (weight_name, bias_name) in enumerate((("attn_ow", "attn_ob"), ("attn_nw", "attn_nb"),
                                                          ("inter_w", "inter_b"), ("output_w", "output_b"),
                                                          ("norm_w", "norm_b")), start=3):
                setattr(self, weight_name, _parameter(initial_weights[i]))
                setattr(self, bias_name, _parameter(initial_biases[i]))
        self.train(config.training)

    def init_transformer_weights(self, adjust_init_range: bool = False) -> None:
        """N(0, initializer_range) weights, zero biases, unit LayerNorm gains; with ``adjust_init_range``
        the two output projections use ``initializer_range / sqrt(2 * num_hidden_layers)``."""
        std = self.config.initializer_range if self.config.initializer_range > 0 else DEFAULT_INITIALIZER_RANGE
        output_std = std
        if adjust_init_range and self.config.num_hidden_layers > 0:
            output_std = std / math.sqrt(2.0 * self.config.num_hidden_layers)
        with torch.no_grad():
            for weight, weight_std in ((self.attn_qkvw, std), (self.attn_ow, output_std), (self.inter_w, std),
                                       (self.output_w, output_std)):
                weight.normal_(mean=0.0, std=weight_std)
            for bias in (self.attn_qkvb, self.attn_ob, self.attn_nb, self.inter_b, self.output_b, self.norm_b):
                bias.zero_()
            self.attn_nw.fill_(1.0)
            self.norm_w.fill_(1.0)

    # ------------------------------------------------------------------------------------------- pieces
    def _layer_norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        if self.config.normalize_invertible and torch.is_grad_enabled():
            return InvertibleLayerNorm.apply(x, weight, bias, self.config.layer_norm_eps)
        return F.layer_norm(x, (x.shape[-1],), weight, bias, self.config.layer_norm_eps)

    def _attention(self, x: torch.Tensor, w: dict[str, torch.Tensor], mask: torch.Tensor | None,
                   generator: torch.Generator | None) -> torch.Tensor:
        """Self-attention of ``x`` through the output projection (no residual, no output dropout)."""
        batch, seq, hidden = x.shape
        heads = self.config.heads
        q, k, v = (t.view(batch, seq, heads, hidden // heads).transpose(1, 2)
                   for t in F.linear(x, w["attn_qkvw"], w["attn_qkvb"]).split(hidden, dim=-1))
        if mask is not None:
            mask = mask.to(q.dtype)
        p = max(self.config.attn_dropout_ratio, 0.0) if self.training else 0.0
        if p == 0 or self.config.stochastic_mode:
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        else:
            scores = torch.matmul(q * (q.shape[-1] ** -0.5), k.transpose(-1, -2))
            probs = F.softmax(scores if mask is None else scores + mask, dim=-1)
            v = v.contiguous()  # both branches then keep the same copy of v
            if self.config.attn_dropout_checkpoint and torch.is_grad_enabled():
                context = DropoutContext.apply(probs, v, p, generator)
            else:
                context = torch.matmul(dropout(probs, p, generator), v)
        return F.linear(context.transpose(1, 2).reshape(batch, seq, hidden), w["attn_ow"], w["attn_ob"])

    def _feed_forward(self, x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        h = F.linear(x, w["inter_w"], w["inter_b"])
        if self.config.gelu_checkpoint and torch.is_grad_enabled():
            return GeluLinear.apply(h, w["output_w"], w["output_b"])
        return F.linear(F.gelu(h), w["output_w"], w["output_b"])

    # ------------------------------------------------------------------------------------------ forward
    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                head_mask: torch.Tensor | None = None, layer_head_mask: torch.Tensor | None = None,
                encoder_hidden_states: torch.Tensor | None = None, encoder_attention_mask: torch.Tensor | None = None,
                past_key_value: tuple[torch.Tensor, ...] | None = None, output_attentions: bool = False,
                grads: list | None = None) -> torch.Tensor | tuple[torch.Tensor]:
        """The layer's output ``[batch, seq, hidden]`` (``(output,)`` with ``return_tuple``).

        ``attention_mask``: additive, broadcastable to ``[batch, heads, seq, seq]`` (BERT's extended mask
        ``[batch, 1, 1, seq]``). ``grads``: a list that receives ``[gradient, name]`` for each parameter in
        backward (names as DeepSpeed's tests: ``Q_W`` ... ``norm_B``). The Hugging Face arguments
        ``head_mask`` ... ``past_key_value`` and ``output_attentions`` are not supported (an error if given).
        """
        given = [name for name, value in zip(_UNSUPPORTED_ARGUMENTS, (head_mask, layer_head_mask,
                 encoder_hidden_states, encoder_attention_mask, past_key_value)) if value is not None]
        given += ["output_attentions"] if output_attentions else []
        if given:
            raise NotImplementedError(f"DeepSpeedTransformerLayer does not support {', '.join(given)} (a "
                                      "self-attention encoder layer without head masks or caches)")
        config = self.config
        batch, seq = hidden_states.shape[:2]
        if 0 < config.batch_size < batch or 0 < config.max_seq_length < seq:
            raise ValueError(f"input [{batch}, {seq}] exceeds the configured batch_size {config.batch_size} / "
                             f"max_seq_length {config.max_seq_length}")
        dtype = torch.float16 if config.fp16 else hidden_states.dtype
        w = {name: param.to(dtype) for name, param in self.named_parameters(recurse=False)}
        if grads is not None:
            w = self._record_grads(w, grads)
        x = hidden_states.to(dtype)
        generator = _seeded_generator(config.seed, x.device)
        p = max(config.hidden_dropout_ratio, 0.0) if self.training else 0.0
        if config.pre_layer_norm:
            attended = x + dropout(self._attention(self._layer_norm(x, w["norm_w"], w["norm_b"]), w,
                                                   attention_mask, generator), p, generator)
            ffn = self._feed_forward(self._layer_norm(attended, w["attn_nw"], w["attn_nb"]), w)
            out = attended + dropout(ffn, p, generator)
        else:
            attention = self._attention(x, w, attention_mask, generator)
            attended = self._layer_norm(x + dropout(attention, p, generator), w["attn_nw"], w["attn_nb"])
            out = self._layer_norm(attended + dropout(self._feed_forward(attended, w), p, generator),
                                   w["norm_w"], w["norm_b"])
        return (out,) if config.return_tuple else out

    def _record_grads(self, weights: dict[str, torch.Tensor], grads: list) -> dict[str, torch.Tensor]:
        """Aliases of the weights whose gradients, when backward reaches them, are appended to ``grads`` as
        ``[gradient, name]`` (the stacked query/key/value weight and bias as three entries each)."""
        hidden = self.config.hidden_size
        labels = dict(zip(("attn_ow", "attn_ob", "attn_nw", "attn_nb", "inter_w", "inter_b", "output_w", "output_b",
                           "norm_w", "norm_b"), GRAD_NAMES[6:]))

        def record(name: str, grad: torch.Tensor) -> None:
            if name in ("attn_qkvw", "attn_qkvb"):
                kind = "W" if name == "attn_qkvw" else "B"
                grads.extend([piece, f"{part}_{kind}"] for piece, part in zip(grad.split(hidden), "QKV"))
            else:
                grads.append([grad, labels[name]])

        aliases = {}
        for name, tensor in weights.items():
            aliases[name] = tensor.view_as(tensor)
            if aliases[name].requires_grad:
                aliases[name].register_hook(lambda grad, name=name: record(name, grad))
        return aliases
