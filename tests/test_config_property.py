"""Property: any config is either a valid plan or a ConfigError, never another exception."""

from __future__ import annotations

import argparse

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adaptive_mem import ConfigError, plan_from_config, plan_to_megatron, plan_to_mindformers
from adaptive_mem.config._names import layer_names
from search import Plan

NAMES = ["feed_forward", r"feed_forward\.mul", r"feed_forward\.w1\.activation\.silu", "attention",
         r".*\.norm", r"attention\.flash_attention", "nothing", "(", r"feed_forward\.w[13]\.matmul"]

junk = st.one_of(st.none(), st.text(max_size=3), st.floats(allow_nan=False), st.integers(-3, 3), st.booleans())
count = st.one_of(st.integers(-1, 6), st.booleans())
per_stage = st.lists(count, min_size=0, max_size=4)
two_d = st.lists(st.one_of(st.booleans(), per_stage), min_size=0, max_size=3)
indices = st.lists(st.integers(-1, 8), max_size=5)
value = st.one_of(st.booleans(), per_stage, two_d, indices, junk)
select = st.one_of(value, st.lists(st.sampled_from(NAMES), min_size=1, max_size=3),
                   st.dictionaries(st.sampled_from(NAMES), value, max_size=3))
recompute_section = st.fixed_dictionaries({}, optional={
    "recompute": value, "select_recompute": select, "select_comm_recompute": select,
    "mp_comm_recompute": st.one_of(st.booleans(), junk), "recompte": st.booleans()})
swap_entry = st.fixed_dictionaries({"backward_prefetch": st.one_of(st.integers(-1, 5), junk),
                                    "layers": st.one_of(st.booleans(), indices)},
                                   optional={"op_name": st.sampled_from(NAMES)})
swap_section = st.fixed_dictionaries({}, optional={
    "swap": st.one_of(st.booleans(), junk), "default_prefetch": st.one_of(st.integers(-1, 5), junk),
    "layer_swap": st.one_of(st.none(), st.lists(swap_entry, max_size=3)),
    "op_swap": st.one_of(st.none(), st.lists(swap_entry, max_size=3))})
model_config = st.fixed_dictionaries({}, optional={
    "num_layers": st.one_of(st.integers(0, 9), junk), "pp_interleave_num": st.one_of(st.integers(0, 3), junk),
    "offset": st.one_of(st.integers(-1, 1), per_stage, two_d, junk)})
config = st.fixed_dictionaries({}, optional={
    "recompute_config": st.one_of(recompute_section, junk), "swap_config": st.one_of(swap_section, junk),
    "parallel_config": st.fixed_dictionaries({}, optional={"pipeline_stage": st.one_of(st.integers(0, 4), junk)}),
    "model": st.fixed_dictionaries({}, optional={"model_config": model_config})})


VALID_NAMES = [n for n in NAMES if n not in ("nothing", "(")]


@st.composite
def mostly_valid_config(draw):
    """A config of the documented forms, with one field corrupted in about one example of five."""
    n = draw(st.integers(1, 9))
    pp, vv = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    k = pp * vv
    grid = [[0] * pp for _ in range(vv)]
    for cell in draw(st.permutations(range(k)))[: n - (n // k) * k]:
        grid[cell // pp][cell % pp] += 1
    offset = grid[0] if vv == 1 and draw(st.booleans()) else grid
    swap_mode = draw(st.booleans())
    if swap_mode:
        value = st.one_of(st.booleans(), st.lists(st.integers(0, n - 1), max_size=4))
    else:
        item = st.one_of(st.integers(0, 5), st.booleans())
        row = st.lists(item, min_size=pp, max_size=pp)
        value = st.one_of(st.booleans(), row, st.lists(st.one_of(st.booleans(), row), min_size=vv, max_size=vv))
    sel = st.one_of(value, st.lists(st.sampled_from(VALID_NAMES), min_size=1, max_size=3, unique=True),
                    st.dictionaries(st.sampled_from(VALID_NAMES), value, max_size=3))
    entry = st.fixed_dictionaries({"backward_prefetch": st.integers(0, 5),
                                   "layers": st.one_of(st.just(True), st.lists(st.integers(0, n - 1), max_size=3))})
    op_entry = st.fixed_dictionaries({"op_name": st.sampled_from(VALID_NAMES), "backward_prefetch": st.integers(0, 5),
                                      "layers": st.one_of(st.just(True), st.lists(st.integers(0, n - 1), max_size=3))})
    cfg = {"model": {"model_config": {"num_layers": n, "pp_interleave_num": vv, "offset": offset}},
           "parallel_config": {"pipeline_stage": pp},
           "recompute_config": {"recompute": draw(value), "select_recompute": draw(sel),
                                "select_comm_recompute": draw(sel), "mp_comm_recompute": draw(st.booleans())},
           "swap_config": {"swap": swap_mode, "default_prefetch": draw(st.integers(0, 4)),
                           "layer_swap": draw(st.one_of(st.none(), st.lists(entry, max_size=2))),
                           "op_swap": draw(st.one_of(st.none(), st.lists(op_entry, max_size=3)))}}
    if draw(st.integers(0, 4)) == 0:
        section = draw(st.sampled_from(["recompute_config", "swap_config"]))
        key = draw(st.sampled_from(sorted(cfg[section])))
        cfg[section][key] = draw(junk)
    return cfg


def check_plan(plan: Plan, n: int) -> None:
    names = layer_names(None)
    units = [f"layers.{i}.{u}" for i in range(n) for u in names.units]
    modules = [f"layers.{i}" for i in range(n)] + [f"layers.{i}.{m}" for i in range(n) for m in names.modules]
    plan.check_targets(units=units, modules=modules)
    assert Plan.from_dict(plan.to_dict()).decisions == plan.decisions


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config)
def test_random_mindformers_configs_give_a_plan_or_a_config_error(cfg):
    try:
        plan = plan_from_config(cfg, model=None)
    except ConfigError as exc:
        assert str(exc) and "\n" not in str(exc)
        return
    n = plan.model["num_layers"]
    check_plan(plan, n)
    # and the exporter either refuses or round-trips
    try:
        exported = plan_to_mindformers(plan, num_layers=n)
    except ConfigError:
        return
    assert plan_from_config(exported, model=None, num_layers=n).decisions == plan.decisions


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mostly_valid_config())
def test_documented_forms_give_a_plan_or_a_config_error_and_export_round_trips(cfg):
    test_random_mindformers_configs_give_a_plan_or_a_config_error.hypothesis.inner_test(cfg)


megatron = st.fixed_dictionaries({}, optional={
    "recompute_activations": st.one_of(st.booleans(), junk),
    "recompute_granularity": st.one_of(st.sampled_from(["full", "selective", "x"]), junk),
    "recompute_method": st.one_of(st.sampled_from(["uniform", "block", "y"]), junk),
    "recompute_num_layers": st.one_of(st.integers(-1, 9), junk),
    "distribute_saved_activations": st.one_of(st.booleans(), junk),
    "pipeline_model_parallel_size": st.one_of(st.integers(0, 4), junk)})


@settings(max_examples=200, deadline=None)
@given(megatron, st.integers(1, 8))
def test_random_megatron_namespaces_give_a_plan_or_a_config_error(attrs, n):
    try:
        plan = plan_from_config(argparse.Namespace(**attrs), model=None, num_layers=n)
    except ConfigError as exc:
        assert str(exc) and "\n" not in str(exc)
        return
    check_plan(plan, n)
    one_stage = attrs.get("pipeline_model_parallel_size") in (1, None)
    try:
        flags = plan_to_megatron(plan, num_layers=n)
    except ConfigError:
        assert not one_stage, "a plan made from one-stage Megatron flags must export back to flags"
        return
    if one_stage:
        again = plan_from_config(flags, model=None, num_layers=n)
        assert again.decisions == plan.decisions and again.groups == plan.groups
