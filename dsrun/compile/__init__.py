"""DeepCompile (DeepSpeed's ``deepspeed.compile``): ZeRO inside ``torch.compile``'s graphs.

``compile: {deepcompile: true}`` with ``engine.compile()`` (or ``compile.enabled``) at ZeRO-3 compiles the model
with a backend (:mod:`.backend`) whose FX passes (:mod:`.passes`) place each parameter's all-gather before its
first use and its release after its last, reduce each gradient where the backward computes it, prefetch
gathers ahead and keep the parameters that fit gathered; the ops are :mod:`.ops` over :mod:`.handle`.
:mod:`.init` connects it to an engine. docs/deepcompile.md.
"""
