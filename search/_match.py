"""Does a plan belong to a profile? The check ``run`` makes against the model, made against a profile."""

from __future__ import annotations

from profiler import Profile
from profiler.naming import split_fingerprint

from ._plan import Plan, PlanError

__all__ = ["check_plan_matches"]

_DESCRIBED = ("batch_size", "seq_len", "dtype", "num_layers")


def check_plan_matches(plan: Plan, profile: Profile, *, source: str = "plan") -> None:
    """Raise :class:`PlanError` when ``plan`` was made for another model or input shape than ``profile``."""
    have = {**profile.model, "num_layers": profile.num_layers}
    for key in _DESCRIBED:
        want, got = plan.model.get(key), have.get(key)
        if want is not None and got is not None and str(want).removeprefix("torch.") != str(got).removeprefix("torch."):
            raise PlanError(f"{source}: plan.model.{key}={want!r}, but the profile is of {key}={got!r}; expected a "
                            "plan searched on this profile (or a profile of the plan's model)")
    if plan.fingerprint and profile.model.get("fingerprint"):
        plan_structure, plan_inputs = split_fingerprint(plan.fingerprint)
        prof_structure, prof_inputs = split_fingerprint(profile.model["fingerprint"])
        if plan_structure != prof_structure:
            raise PlanError(f"{source}: plan.fingerprint={plan.fingerprint!r} is of another model structure than the "
                            f"profile ({profile.model['fingerprint']!r}); expected a plan searched on this profile")
        if plan_inputs and prof_inputs and plan_inputs != prof_inputs:
            raise PlanError(f"{source}: plan.fingerprint={plan.fingerprint!r} is of other input shapes than the "
                            f"profile ({profile.model['fingerprint']!r}); expected a plan searched on this profile")
