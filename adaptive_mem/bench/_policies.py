"""The registry of bench policies: name -> policy, in the order runs and reports list them.

Policy classes live in ``_policy_eager``, ``_policy_torch`` and ``_policy_ours`` (each importing only
``_policy_base``); this module imports them and none of them imports it.
"""

from __future__ import annotations

from ._policy_base import Applied, Policy, PolicyError, layers_of

__all__ = ["Applied", "Policy", "POLICIES", "get_policy", "policy_names", "layers_of", "PolicyError"]


def _registry() -> dict[str, Policy]:
    from ._policy_eager import FullRecompute, HFGradientCheckpointing, MegatronSelective, NoCheckpointing, OpLevelSAC
    from ._policy_compiled import MilpCompiledPolicy
    from ._policy_ours import AdaptivePolicy, MilpPolicy
    from ._policy_torch import CompileBudget, FullCompiled, SacIlp

    out: dict[str, Policy] = {}
    for cls in (NoCheckpointing, FullRecompute, HFGradientCheckpointing, MegatronSelective, OpLevelSAC, SacIlp,
                CompileBudget, FullCompiled, MilpPolicy, MilpCompiledPolicy, AdaptivePolicy):
        out[cls.name] = cls()
    return out


POLICIES: dict[str, Policy] = {}


def policy_names() -> list[str]:
    if not POLICIES:
        POLICIES.update(_registry())
    return list(POLICIES)


def get_policy(name: str) -> Policy:
    names = policy_names()
    if name not in POLICIES:
        raise PolicyError(f"--policies: {name!r} is not a policy; expected names from {', '.join(names)}")
    return POLICIES[name]
