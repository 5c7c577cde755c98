"""Blocks compiled the torchtitan way (``model.layers[i] = torch.compile(block)``) are named as the plain blocks.

Note: [compile wrapper names] (profiler/_paths.py): torch.compile's ``OptimizedModule`` holds the block as
``_orig_mod``; profiles, unit and module names, layer discovery, plan targets, config keys and
``adaptive-mem units`` leave that component out, so what is written for the plain model applies to the compiled
one. Steps are compared with ``torch.equal`` against the same compiled model without a plan (aot_eager keeps the
numerics; the inductor case compares with ``assert_close``).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

import profiler
from adaptive_mem import build_model, optimize, plan_from_config
from adaptive_mem.cli._main import main
from adaptive_mem.config._names import layer_names
from search import Plan, PlanError

from _compile_common import compiled_step

SWAP = {"action": "swap", "backward_prefetch": 1}


def _fresh(backend: str | None = "aot_eager", seq_len: int = 32):
    """llama-tiny with 2 layers, each block compiled as torchtitan does (``backend=None``: plain)."""
    torch._dynamo.reset()
    bundle = build_model("llama-tiny", model_args={"num_layers": 2}, batch_size=2, seq_len=seq_len, seed=0)
    if backend is not None:
        for i in range(len(bundle.model.layers)):
            bundle.model.layers[i] = torch.compile(bundle.model.layers[i], backend=backend)
    return bundle


def _profile(bundle):
    return profiler.profile_step(bundle, warmup=0, repeat=0, record=1, optimizer_time=0.0)


def _plan(decisions: dict) -> Plan:
    return Plan.from_dict({"format": "adaptive-mem-plan", "version": 1, "decisions": decisions})


def test_profile_and_names_of_a_compiled_model_are_the_plain_models(tmp_path, capsys):
    plain_bundle, bundle = _fresh(None), _fresh()
    assert type(bundle.model.layers[0]).__name__ == "OptimizedModule"
    plain, compiled = _profile(plain_bundle), _profile(bundle)
    names = [u.name for u in compiled.units] + [o.module for o in compiled.ops] + [u.local_name for u in compiled.units]
    assert not [n for n in names if "_orig_mod" in n]
    assert [(u.name, u.local_name, u.layer) for u in compiled.units] == [
        (u.name, u.local_name, u.layer) for u in plain.units]
    assert [(o.unit, o.module, o.layer) for o in compiled.ops] == [(o.unit, o.module, o.layer) for o in plain.ops]
    assert (compiled.layer_container, compiled.num_layers) == ("layers", 2)
    assert compiled.model["fingerprint"] == plain.model["fingerprint"]
    assert compiled.gradient_split == plain.gradient_split
    want, got = layer_names(plain_bundle.model), layer_names(bundle.model)
    assert (got.container, got.modules, got.units) == (want.container, want.modules, want.units)
    path = tmp_path / "compiled.json"
    compiled.save(path)
    assert main(["units", "--model", "llama-tiny", "--model-args", "num_layers=2", "--profile", str(path)]) == 0
    out = capsys.readouterr().out
    assert "_orig_mod" not in out
    line = next(line for line in out.splitlines() if line.strip().startswith("feed_forward.w1.matmul *"))
    assert "saved" in line and "ran no op" not in line


def test_plan_targets_with_orig_mod_mean_the_plain_paths():
    plan = _plan({"layers.0._orig_mod.feed_forward": "recompute", "layers.1": "recompute"})
    assert {t: d.action.value for t, d in plan.decisions.items()} == {"layers.0.feed_forward": "recompute",
                                                                      "layers.1": "recompute"}
    with pytest.raises(PlanError, match=r"'layers.0._orig_mod.feed_forward': names 'layers.0.feed_forward'"):
        _plan({"layers.0.feed_forward": "recompute", "layers.0._orig_mod.feed_forward": SWAP})


CASES = {
    # name -> (plan or config, (layers recomputed, selectively, swapping))
    "plan": ({"plan": {"format": "adaptive-mem-plan", "version": 1, "decisions": {
        "layers.0.feed_forward": "recompute", "layers.0.attention.wq": "recompute", "layers.1": SWAP}}}, (0, 1, 1)),
    "mindformers": ({"config": {"recompute_config": {"select_recompute": {r"feed_forward\.w1": [0]}, "recompute": [1]},
                                "swap_config": {"swap": True, "layer_swap": []}}}, (1, 1, 0)),
}


@pytest.mark.parametrize("how", list(CASES))
def test_keys_written_for_the_plain_model_apply_to_the_compiled_one(how):
    bundle = _fresh()
    batch = bundle.batch(seed=0)
    ref = compiled_step(bundle.model, bundle.model, batch)
    planned = _fresh()
    kwargs, modes = CASES[how]
    if how == "mindformers":
        plain_plan = plan_from_config(kwargs["config"], model=_fresh(None).model)
        assert plan_from_config(kwargs["config"], model=planned.model).decisions == plain_plan.decisions
    with optimize(planned.model, example_inputs=(batch[0],), **kwargs) as handle:
        summary = handle.summary()
        assert (summary.layers_recomputed, summary.layers_selective, summary.layers_swapping) == modes
        assert summary.takes_effect and not summary.not_applied, summary
        for _ in range(2):
            got = compiled_step(planned.model, planned.model, batch)
            assert got.keys() == ref.keys()
            for key, grad in ref.items():
                assert torch.equal(got[key], grad), f"{how}: {key} differs"
        if how == "plan":
            assert handle.swap_stats.offloaded_bytes > 0


def test_a_plan_searched_on_the_compiled_models_profile_runs_exactly(tmp_path):
    bundle = _fresh()
    batch = bundle.batch(seed=0)
    ref = compiled_step(bundle.model, bundle.model, batch)
    _profile(bundle).save(tmp_path / "p.json")
    assert main(["search", str(tmp_path / "p.json"), "--activation-budget", "0.5", "-o", str(tmp_path / "plan.yaml")]) == 0
    plan = Plan.load(tmp_path / "plan.yaml")
    assert plan.decisions and not [t for t in plan.decisions if "_orig_mod" in t]
    with optimize(bundle.model, plan=plan) as handle:
        assert handle.summary().takes_effect
        got = compiled_step(bundle.model, bundle.model, batch)
    assert all(torch.equal(got[k], v) for k, v in ref.items())


def test_inductor_blocks_take_a_plain_models_plan():
    """The shapes and plan of tests/test_compile_sac.py's inductor case: the compiled graphs are the same."""
    bundle = _fresh("inductor", seq_len=16)
    batch = bundle.batch(seed=0)
    ref = compiled_step(bundle.model, bundle.model, batch)
    planned = _fresh("inductor", seq_len=16)
    plan = _plan({f"layers.{i}.feed_forward": "recompute" for i in range(2)})
    with optimize(planned.model, plan=plan, example_inputs=(batch[0],)) as handle:
        summary = handle.summary()
        assert summary.layers_selective == 2 and summary.takes_effect and not summary.not_applied
        got = compiled_step(planned.model, planned.model, batch)
    for key, grad in ref.items():
        torch.testing.assert_close(got[key], grad, msg=f"inductor: {key} differs")
