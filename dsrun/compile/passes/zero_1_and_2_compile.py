"""DeepSpeed's ZeRO-1/2 reduce passes (``zero1_compile``, ``zero2_compile``): their contracts, and a refusal.

DeepSpeed's insert its reduce ops into the compiled backward. dsrun's ZeRO-1/2 strategies reduce each gradient
from the hook that fires when it reaches the parameter, which a compiled backward feeds as an eager one does, so
DeepCompile at stages 1-2 compiles the whole module with no reduce pass (:mod:`dsrun.compile.init`); a
schedule naming these passes is refused with that reason.
"""
from __future__ import annotations

from dsrun.compile.passes import refused_pass
from dsrun.compile.passes.contract import PassContract

NAME_Z1 = "zero1_compile"
NAME_Z2 = "zero2_compile"
CONTRACT_Z1 = PassContract(conflicts_with=frozenset({"zero3_compile"}))
CONTRACT_Z2 = PassContract(conflicts_with=frozenset({"zero3_compile", NAME_Z1}))
REASON = ("dsrun's ZeRO-1/2 gradients are reduced by the stage's hooks, which the compiled backward feeds: "
          "DeepCompile runs no reduce pass at stages 1-2")

add_z1_reduce = refused_pass("add_z1_reduce", NAME_Z1, REASON, "leave it out of the schedule")
add_z2_reduce = refused_pass("add_z2_reduce", NAME_Z2, REASON, "leave it out of the schedule")
