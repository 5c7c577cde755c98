"""A plan per sequence-length bucket, in one plan file.

Note: [plan buckets] ``adaptive-mem search --seq-lens 512,1024,2048`` writes one plan whose ``buckets`` list holds
``{seq_len, plan}`` per bucket, ascending, each ``plan`` a whole plan (its ``model.seq_len`` the bucket's) searched
on the profile scaled to that length under the same budget. The file's own decisions, groups and model are the
longest bucket's: memory grows with the length, so that plan fits the budget at every shorter length too, and a
reader that takes one plan (``simulate``, the config exports) gets a safe one. ``optimize`` picks per step the
plan of the smallest bucket at least the input's length (``search.seq_len_bucket``); a length above every bucket
is refused. A bucket's plan holds no buckets of its own.

The plan type (``search._plan``) imports this module, never the other way: ``PlanError`` is defined here and the
plan type comes in with the plans.
"""

from __future__ import annotations

from typing import Any, Mapping

__all__ = ["PlanError", "bucketed_plan", "buckets_to_list", "parse_buckets"]

_KEYS = ("seq_len", "plan")


class PlanError(ValueError):
    """A plan is not of the documented form, or does not fit the model it is applied to."""


def _error(message: str) -> PlanError:
    return PlanError(message)


def bucketed_plan(plans: Mapping[int, Any]) -> Any:
    """One plan holding ``plans`` (sequence length -> plan) as its buckets; its own decisions the longest's."""
    if not plans:
        raise _error("plan.buckets=[]: expected at least one {seq_len, plan}")
    Plan = type(next(iter(plans.values())))
    items = sorted(plans.items())
    for s, plan in items:
        if isinstance(s, bool) or not isinstance(s, int) or s <= 0:
            raise _error(f"plan.buckets seq_len={s!r}: expected a positive integer")
        if plan.buckets:
            raise _error(f"plan.buckets seq_len={s}: the plan holds buckets of its own; expected a plain plan")
    top = items[-1][1]
    return Plan(decisions=dict(top.decisions), fingerprint=top.fingerprint, model=dict(top.model),
                meta=dict(top.meta), groups=[list(g) for g in top.groups],
                distribute_saved_activations=top.distribute_saved_activations, buckets=items)


def buckets_to_list(buckets: list[tuple[int, Any]]) -> list[dict[str, Any]]:
    return [{"seq_len": s, "plan": p.to_dict()} for s, p in buckets]


def _rewhere(exc: Exception, i: int) -> Exception:
    """A bucket's plan error, named from the file's root: ``plan.decisions...`` -> ``plan.buckets[i].plan....``."""
    text = str(exc)
    prefix = f"plan.buckets[{i}].plan"
    return _error(prefix + text[len("plan"):] if text.startswith("plan") else f"{prefix}: {text}")


def _bucket(i: int, entry: Any, plan_type: type) -> tuple[int, Any]:
    where = f"plan.buckets[{i}]"
    if not isinstance(entry, dict):
        raise _error(f"{where}={entry!r:.60}: expected a mapping {{seq_len: N, plan: {{...}}}}")
    for key in entry:
        if key not in _KEYS:
            raise _error(f"{where}.{key}: unknown key; expected seq_len, plan")
    s = entry.get("seq_len")
    if isinstance(s, bool) or not isinstance(s, int) or s <= 0:
        raise _error(f"{where}.seq_len={s!r:.60}: expected a positive integer")
    if "plan" not in entry:
        raise _error(f"{where}.plan: missing; expected the bucket's plan (format, version, decisions, ...)")
    if isinstance(entry["plan"], dict) and "buckets" in entry["plan"]:
        raise _error(f"{where}.plan.buckets: a bucket's plan holds no buckets; expected a plain plan")
    try:
        plan = plan_type.from_dict(entry["plan"])
    except PlanError as exc:
        raise _rewhere(exc, i) from None
    seq = plan.model.get("seq_len")
    if seq is not None and seq != s:
        raise _error(f"{where}.plan.model.seq_len={seq}: expected the bucket's seq_len {s}")
    return s, plan


def parse_buckets(raw: Any, top: Any) -> list[tuple[int, Any]]:
    """``plan.buckets`` of a plan file, checked (Note: [plan buckets]); ``top``: the file's own plan."""
    if not isinstance(raw, list) or not raw:
        raise _error(f"plan.buckets={raw!r:.60}: expected a non-empty list of {{seq_len: N, plan: {{...}}}}")
    buckets = [_bucket(i, entry, type(top)) for i, entry in enumerate(raw)]
    for i in range(1, len(buckets)):
        if buckets[i][0] <= buckets[i - 1][0]:
            raise _error(f"plan.buckets[{i}].seq_len={buckets[i][0]}: expected ascending lengths, each above "
                         f"plan.buckets[{i - 1}].seq_len={buckets[i - 1][0]}")
    longest = buckets[-1][1]
    if top.decisions != longest.decisions or top.groups != longest.groups:
        raise _error(f"plan.decisions: differ from the longest bucket's (plan.buckets[{len(buckets) - 1}].plan); "
                     "expected the plan of the longest length at the top")
    return buckets
