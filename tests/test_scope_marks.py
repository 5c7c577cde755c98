"""Scopes known by their boundaries (Note: [scopes by their boundaries] in adaptive_mem/runtime/_scope_marks.py):
every op-level swap of a layer, on our Llama and on Hugging Face families, stays bit-identical to the step with no
plan over several steps (the first under the tracker, the later ones by the marks) and offloads the same bytes at
every step; the units that cross a module boundary before their save need no dispatch call after the first step."""

from __future__ import annotations

import pytest

from adaptive_mem import build_model, optimize, profile_step
from adaptive_mem.runtime._footprint import FOOTPRINT
from search import Action, Decision, Plan
from _deterministic import assert_same_step, deterministic, seeded_step  # noqa: F401 - fixture used by name

pytestmark = pytest.mark.usefixtures("deterministic")

MODELS = {"llama-tiny": {}, "hf:llama": {"num_hidden_layers": 2}, "hf:qwen2": {"num_hidden_layers": 2},
          "hf:gpt2": {"num_hidden_layers": 2}}


def _units(spec: str) -> tuple[object, list[str]]:
    bundle = build_model(spec, seed=0, model_args=MODELS[spec] or None)
    profile = profile_step(bundle, warmup=0, repeat=1)
    return bundle, [u.name for u in profile.layer_units(1) if u.saved_bytes > 0]


@pytest.mark.parametrize("spec", sorted(MODELS))
def test_every_op_level_swap_of_a_layer_is_exact_at_every_step(spec):
    bundle, units = _units(spec)
    batch = bundle.batch(seed=0)
    want = seeded_step(bundle, batch)
    untracked = 0
    for unit in units:
        plan = Plan(decisions={unit: Decision(Action.SWAP, backward_prefetch=1)})
        with optimize(bundle.model, plan=plan) as handle:
            moved, calls = [], []
            for step in range(3):
                before = handle.swap_stats.offloaded_bytes
                FOOTPRINT.reset()
                assert_same_step(seeded_step(bundle, batch), want, f"{spec} {unit} step {step}")
                moved.append(handle.swap_stats.offloaded_bytes - before)
                calls.append(FOOTPRINT.dispatch)
        assert moved[0] == moved[1] == moved[2], (unit, moved)
        assert calls[1] == calls[2] <= calls[0], (unit, calls)
        untracked += calls[1] == 0 < calls[0]
    assert untracked > 0, f"{spec}: no unit of {units} was found at a module boundary"
    assert_same_step(seeded_step(bundle, batch), want, f"{spec} after the plans were removed")
