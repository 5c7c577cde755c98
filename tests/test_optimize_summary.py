"""optimize() reports what took effect: one INFO summary line, ``handle.summary()``, and a warning naming
the cause when a plan asks for recompute/swap but changes nothing."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from adaptive_mem import ConfigError, PlanSummary, build_model, optimize
from search import Plan

APPLY = "adaptive_mem.runtime._apply"


def _plan(decisions: dict) -> Plan:
    return Plan.from_dict({"format": "adaptive-mem-plan", "version": 1, "decisions": decisions})


@pytest.fixture(scope="module")
def profile():
    from profiler import profile_step

    return profile_step(build_model("llama-tiny"), warmup=0, repeat=0)


@pytest.fixture
def model() -> nn.Module:
    return build_model("llama-tiny").model


def _summary_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == APPLY and r.levelno == logging.INFO and r.getMessage().startswith("optimize: ")]


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def _apply(caplog, model: nn.Module, **kw) -> PlanSummary:
    caplog.clear()
    with caplog.at_level(logging.INFO):
        with optimize(model, **kw) as handle:
            summary = handle.summary()
    assert _summary_lines(caplog) == [str(summary)]  # one INFO line per optimize call, the summary's text
    return summary


def test_full_recompute_config(caplog, model, profile):
    s = _apply(caplog, model, config={"recompute_config": {"recompute": True}}, profile=profile)
    layer_units = sum(1 for u in profile.units if u.layer is not None)
    assert (s.layers_recomputed, s.layers_selective, s.layers_swapping) == (4, 0, 0)
    assert (s.units_recomputed, s.units_swapped, s.units_kept) == (layer_units, 0, len(profile.units) - layer_units)
    assert 0 < s.saved_bytes < s.activation_bytes
    assert s.takes_effect and not s.not_applied and not _warnings(caplog)
    messages = [r.getMessage() for r in caplog.records]
    assert [m for m in messages if m.startswith("Set ")] == [f"Set full recompute at layer {i}" for i in range(4)]
    assert messages[-1].startswith("optimize: 4 layers recomputed, 0 selectively recomputed, 0 swapping; "
                                   f"units: {layer_units} recomputed, 0 swapped, ")
    assert "planned saving " in messages[-1] and " activations" in messages[-1]


def test_select_recompute_config(caplog, model, profile):
    s = _apply(caplog, model, config={"recompute_config": {"select_recompute": {r"feed_forward\.mul": True}}},
               profile=profile)
    mul = [u for u in profile.units if u.local_name == "feed_forward.mul"]
    assert (s.layers_recomputed, s.layers_selective, s.units_recomputed, s.units_swapped) == (0, 4, 4, 0)
    assert s.saved_bytes == sum(u.saved_bytes for u in mul)
    assert not _warnings(caplog)


def test_swap_plan_counts_and_swaps(caplog, model, profile):
    plan = _plan({"layers.1": {"action": "swap", "backward_prefetch": 1}, "norm": "swap"})
    s = _apply(caplog, model, plan=plan, profile=profile)
    swapped = [u for u in profile.units if u.layer == 1 or u.name == "norm"]
    assert (s.layers_swapping, s.units_swapped, s.units_recomputed) == (1, len(swapped), 0)
    assert s.saved_bytes == sum(u.saved_bytes for u in swapped) > 0
    assert not _warnings(caplog)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with optimize(model, plan=plan) as handle:
        model(ids).float().sum().backward()
        assert handle.swap_stats.offloaded_bytes > 0


def test_without_profile_units_and_bytes_are_unknown(caplog, model):
    s = _apply(caplog, model, plan=_plan({"layers.0": "recompute"}))
    assert s.units_recomputed is None and s.saved_bytes is None and s.takes_effect
    assert str(s) == ("optimize: 1 layers recomputed, 0 selectively recomputed, 0 swapping; units not counted "
                      "without a profile or example_inputs; bytes unknown without a profile")
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    s = _apply(caplog, model, plan=_plan({"layers.0": "recompute"}), example_inputs=(ids,))
    assert s.units_recomputed == 15 and s.saved_bytes is None and "bytes unknown without a profile" in str(s)


@pytest.mark.parametrize("kw", [
    {"plan": _plan({"layers.0": "keep", "layers.1.attention": "keep"})},
    {"plan": _plan({})},
    {"config": {"recompute_config": {"recompute": False}}},
], ids=["all-keep", "no-decisions", "recompute-false"])
def test_plan_asking_for_nothing_says_nothing_saved_without_warning(caplog, model, profile, kw):
    s = _apply(caplog, model, profile=profile, **kw)
    assert not s.requested and not s.takes_effect and s.saved_bytes == 0 and s.units_kept == len(profile.units)
    assert str(s) == "optimize: nothing to recompute or swap (the plan keeps every unit); nothing saved"
    assert not _warnings(caplog)


def test_empty_config_is_refused(model):
    with pytest.raises(ConfigError, match="neither recompute_config nor swap_config"):
        optimize(model, config={})
    assert all("forward" not in m.__dict__ and not m._forward_hooks and not m._forward_pre_hooks
               for m in model.modules())


def test_swap_dropped_by_coupling_is_reported(caplog, model, profile):
    silu, mul = "layers.0.feed_forward.w1.activation.silu", "layers.0.feed_forward.mul"
    s = _apply(caplog, model, plan=_plan({silu: "swap", mul: "recompute"}), profile=profile)
    assert s.not_applied == ((silu, f"swap dropped: its output is consumed by recomputed {mul}"),)
    assert (s.units_recomputed, s.units_swapped) == (1, 0) and s.takes_effect
    assert not _warnings(caplog)  # the recompute takes effect
    assert f"not applied: {silu} (swap dropped" in str(s)


def test_plan_that_changes_nothing_warns_once_naming_the_causes(caplog, model, profile):
    fa, wo = "layers.0.attention.flash_attention", "layers.0.attention.wo"
    s = _apply(caplog, model, plan=_plan({fa: "swap", wo: "recompute"}), profile=profile)
    assert not s.takes_effect and s.saved_bytes == 0 and "nothing saved" in str(s)
    assert _warnings(caplog) == [
        "optimize: the plan asks for recompute/swap but nothing takes effect: "
        f"{fa} (swap dropped: its output is consumed by recomputed {wo}.matmul); "
        f"{wo} (its units save no bytes for backward: recomputing frees nothing)"]


def test_swap_of_unit_saving_nothing_warns(caplog, model, profile):
    wq = "layers.0.attention.wq"
    assert profile.unit(f"{wq}.matmul").saved_bytes == 0  # its saved input belongs to the norm before it
    s = _apply(caplog, model, plan=_plan({wq: "swap"}), profile=profile)
    assert s.not_applied == ((wq, "its units save no bytes for backward: nothing to swap"),)
    assert _warnings(caplog) == ["optimize: the plan asks for recompute/swap but nothing takes effect: "
                                 f"{wq} (its units save no bytes for backward: nothing to swap)"]


def test_target_overridden_everywhere_warns(caplog, model, profile):
    attention = [u.name for u in profile.units if u.name.startswith("layers.0.attention.")]
    children = {name.rsplit(".", 1)[0] if name.count(".") > 3 else name for name in attention}
    plan = _plan({"layers.0.attention": "swap", **{c: "keep" for c in children}})
    s = _apply(caplog, model, plan=plan, profile=profile)
    assert s.not_applied == (("layers.0.attention", "every unit under it is decided by a longer target"),)
    assert len(_warnings(caplog)) == 1


class _Unused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(4, 4)
        self.spare = nn.Linear(4, 4)  # never called

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x).relu()


def test_target_covering_no_traced_unit_warns(caplog):
    model = _Unused()
    s = _apply(caplog, model, plan=_plan({"spare": "swap"}), example_inputs=(torch.randn(2, 4),))
    assert s.units_swapped == 0 and not s.takes_effect
    assert _warnings(caplog) == ["optimize: the plan asks for recompute/swap but nothing takes effect: "
                                 "spare (covers no unit of the traced step: the module runs no ops)"]
