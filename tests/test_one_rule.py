"""Property: the simulator and the executor resolve a plan onto the same action for every unit.

Note: [one resolution rule] in ``search/_plan.py``. Hypothesis draws plans whose targets are real unit names,
module paths above them and layer-level keys (a layer, the layers' container), with keep / recompute / swap and
``swap_input`` on whole layers, on the profiles of llama-tiny and a Hugging Face family (meta device: only names
are needed). The simulator's assignment (``search._simulator.resolve``, before the coupling rule drops a swap)
and the executor's per-unit resolution (``adaptive_mem.runtime._resolve.decide``) give each unit the same
action, and ``resolve_plan`` on the real model refuses exactly the plans the simulator refuses.
"""

from __future__ import annotations

import functools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import profiler
from adaptive_mem import build_model
from adaptive_mem.runtime._resolve import decide, resolve_plan
from search import Action, Plan, PlanError, StepModel
from search._simulator import read_by_recompute
from search.planning import resolve
from profiler.naming import find_layers

MODELS = ("llama-tiny", "hf:qwen2")


@functools.lru_cache(maxsize=None)
def _model(spec: str):
    bundle = build_model(spec, batch_size=1, device="meta")
    step = StepModel.build(profiler.profile_step(bundle, hardware="h100"))
    layers = find_layers(bundle.model)
    units = [u.name for u in step.units]
    modules = sorted({n.rsplit(".", k)[0] for n in units for k in range(1, n.count(".") + 1)})
    layer_paths = [layers.layer_path(i) for i in range(layers.count)]
    inside = [t for t in units + modules if any(t == p or t.startswith(p + ".") for p in layer_paths)]
    return bundle.model, step, units, modules, layer_paths, inside, sorted(layers.containers)


def _decision(action: str, prefetch: int, swap_input: bool) -> dict:
    if action == "swap":
        return {"action": "swap", "backward_prefetch": prefetch}
    if action == "recompute" and swap_input:
        return {"action": "recompute", "swap_input": True, "backward_prefetch": prefetch}
    return {"action": action}


def _target(kind: int, index: int, spec: str) -> str:
    """A target of one kind: a unit, a module path, a layer, a layers' container, a unit or module inside a layer."""
    _, _, units, modules, layer_paths, inside, containers = _model(spec)
    pool = (units, modules, layer_paths, containers, inside)[kind]
    return pool[index % len(pool)]


_one = st.tuples(st.integers(0, 4), st.integers(0, 10_000), st.sampled_from(("keep", "recompute", "swap")),
                 st.integers(0, 3), st.booleans())


def _plan(spec: str, drawn: list) -> Plan:
    decisions: dict[str, dict] = {}
    for kind, index, action, prefetch, swap_input in drawn:
        target = _target(kind, index, spec)
        decisions[target] = _decision(action, prefetch, swap_input and kind in (2, 3))
    return Plan.from_dict({"format": "adaptive-mem-plan", "version": 1, "decisions": decisions})


def _simulated(step: StepModel, plan: Plan):
    try:
        return resolve(step, plan)
    except PlanError:
        return None


def _executed(module, plan: Plan, units: list[str]):
    try:
        return resolve_plan(plan, module, units=units)
    except PlanError:
        return None


@pytest.mark.parametrize("spec", MODELS)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(drawn=st.lists(_one, min_size=1, max_size=12))
def test_simulator_and_executor_resolve_every_unit_alike(spec, drawn):
    module, step, units, *_ = _model(spec)
    plan = _plan(spec, drawn)
    asg = _simulated(step, plan)
    assert (asg is None) == (_executed(module, plan, units) is None), plan.to_dict()["decisions"]
    if asg is None:
        return
    for u in step.units:
        executed = decide(plan, u.name).action
        if executed is Action.SWAP and asg.actions[u.index] is Action.KEEP:
            assert read_by_recompute(step, asg, u.index), u.name  # the coupling rule dropped the swap
            continue
        assert asg.actions[u.index] is executed, (u.name, plan.to_dict()["decisions"])
        if executed is Action.SWAP:
            assert asg.prefetch[u.index] == decide(plan, u.name).backward_prefetch


@pytest.mark.parametrize("spec", MODELS)
def test_longest_target_decides_on_dotted_boundaries(spec):
    _, step, _, _, layer_paths, _, _ = _model(spec)
    plan = Plan.from_dict({"format": "adaptive-mem-plan", "version": 1, "decisions": {
        layer_paths[1]: "recompute", layer_paths[0]: {"action": "swap", "backward_prefetch": 2}}})
    asg = resolve(step, plan)
    for u in step.units:
        want = {0: Action.SWAP, 1: Action.RECOMPUTE}.get(step.layer_of(u.position), Action.KEEP)
        assert decide(plan, u.name).action is want, u.name
        assert asg.actions[u.index] is want or (want is Action.SWAP and read_by_recompute(step, asg, u.index))
    assert plan.target_for(layer_paths[1] + "0.mlp") is None  # layers.1 does not cover layers.10


def test_one_budget_error_base_and_one_bytes_parser():
    from adaptive_mem.adaptive._measure import AdaptiveBudgetError
    from search import BudgetError, DeviceMemoryError, InfeasibleBudgetError, parse_bytes

    for error in (InfeasibleBudgetError, DeviceMemoryError, AdaptiveBudgetError):
        assert issubclass(error, BudgetError) and issubclass(error, ValueError)
    for text in ("40GiB", "1.5 MB", "3k", "2T", "100b", "7 kib"):
        assert parse_bytes(text) == parse_bytes(text, key="x", plain=True)
    assert parse_bytes("1500", key="x", plain=True) == 1500
    with pytest.raises(BudgetError, match="--budget='1500': expected a positive size"):
        parse_bytes("1500")
