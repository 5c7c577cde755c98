"""optimize(): validation before anything is installed, exact removal, swap-engine corner cases."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from adaptive_mem import build_model, optimize
from adaptive_mem.models import PRESETS, LlamaModel
from adaptive_mem.models._llama import LlamaDecoderLayer
from adaptive_mem.runtime._layer_pack import LayerHooks
from profiler.naming import model_fingerprint
from search import Plan, PlanError


def _plan(decisions: dict, **extra) -> Plan:
    return Plan.from_dict({"format": "adaptive-mem-plan", "version": 1, "decisions": decisions, **extra})


def _tiny(layers: int = 4) -> LlamaModel:
    torch.manual_seed(0)
    cfg = PRESETS["llama-tiny"].config
    if layers != cfg.num_layers:
        from dataclasses import replace
        cfg = replace(cfg, num_layers=layers)
    return LlamaModel(cfg)


def _ids(batch: int = 2, seq: int = 32) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(0))


def _untouched(model: nn.Module) -> None:
    for path, module in model.named_modules():
        assert "forward" not in module.__dict__, path
        assert not module._forward_hooks and not module._forward_pre_hooks, path
        assert not module._forward_hooks_with_kwargs and not module._forward_pre_hooks_with_kwargs, path
        assert not module._backward_hooks and not module._backward_pre_hooks, path
    assert all(type(layer).forward is LlamaDecoderLayer.forward for layer in getattr(model, "layers", []))


def test_all_keep_plan_installs_nothing():
    model = _tiny()
    with optimize(model, plan=_plan({"layers.0": "keep", "layers.1.attention": "keep"})):
        _untouched(model)


def test_remove_restores_bit_identical_outputs_and_no_hooks():
    model = _tiny()
    ids = _ids()
    before = model(ids)
    plan = _plan({"layers.0": "recompute", "layers.1.feed_forward.mul": "recompute",
                  "layers.2": {"action": "swap", "backward_prefetch": 1}, "norm": {"action": "swap"}})
    handle = optimize(model, plan=plan)
    assert "forward" in model.layers[0].__dict__
    model(ids).sum().backward()
    handle.remove()
    handle.remove()  # idempotent
    _untouched(model)
    assert torch.equal(model(ids), before)
    with optimize(model, plan=plan):  # and it can be applied again
        model(ids).sum().backward()
    _untouched(model)


def test_applying_twice_is_refused():
    model = _tiny()
    with optimize(model, plan=_plan({"layers.0": "recompute"})):
        with pytest.raises(ValueError, match="already has a plan"):
            optimize(model, plan=_plan({"layers.1": "recompute"}))


def test_plan_for_another_structure_is_refused():
    other = _tiny(layers=2)
    plan = _plan({"layers.0": "recompute"},
                 fingerprint=model_fingerprint(other, input_shapes=[[2, 32]], dtype="float32"),
                 model={"spec": "llama-tiny", "num_layers": 2})
    model = _tiny()
    with pytest.raises(PlanError, match="structure mismatch.*num_layers=2"):
        optimize(model, plan=plan)
    _untouched(model)


def test_plan_for_another_input_shape_is_refused_at_first_forward():
    model = _tiny()
    plan = _plan({"layers.0": "recompute"},
                 fingerprint=model_fingerprint(model, input_shapes=[[2, 32]], dtype="float32"),
                 model={"spec": "llama-tiny", "batch_size": 2, "seq_len": 32, "dtype": "float32"})
    handle = optimize(model, plan=plan)
    with pytest.raises(PlanError, match=r"input shape mismatch.*batch_size=2, seq_len=32.*\(4, 32\)"):
        model(_ids(batch=4))
    assert not handle.active
    _untouched(model)


def test_input_fingerprint_checked_without_model_description():
    model = _tiny()
    good = model_fingerprint(model, input_shapes=[[2, 32]], dtype="float32")
    with optimize(model, plan=_plan({"layers.0": "recompute"}, fingerprint=good)):
        model(_ids()).sum().backward()
    with optimize(model, plan=_plan({"layers.0": "recompute"}, fingerprint=good)) as handle:
        with pytest.raises(PlanError, match="input shape mismatch"):
            model(_ids(seq=16))
        assert not handle.active


def test_op_unit_that_does_not_run_is_refused_at_first_forward():
    model = _tiny()
    handle = optimize(model, plan=_plan({"layers.0.attention.sigmoid": "recompute"}))
    with pytest.raises(PlanError, match=r"'layers.0.attention.sigmoid': no such unit"):
        model(_ids())
    assert not handle.active
    _untouched(model)


def test_example_inputs_check_everything_up_front():
    model = _tiny()
    with pytest.raises(PlanError, match="layers.0.nosuchop"):
        optimize(model, plan=_plan({"layers.0.nosuchop": "recompute"}), example_inputs=(_ids(),))
    _untouched(model)
    with optimize(model, plan=_plan({"layers.0.add_1": "recompute"}), example_inputs=(_ids(),)):
        model(_ids()).sum().backward()


BAD_PLANS = [
    ({"decisions": {"layers.9": "recompute"}}, r"plan.decisions.'layers.9'.*expected a module path or a unit name"),
    ({"decisions": {"layers.0.attention.flash": "swap"}}, r"'layers.0.attention.flash'.*no such unit"),
    ({"decisions": {"layers.0": "offload"}}, r"plan.decisions.layers.0.action='offload'.*keep, recompute, swap"),
    ({"decisions": {"layers.0": {"action": "swap", "backward_prefetch": -1}}},
     r"backward_prefetch=-1.*integer >= 0"),
    ({"decisions": {"layers.0": {"action": "swap", "prefetch": 1}}}, r"layers.0.prefetch: unknown key"),
    ({"decisions": {"output": "recompute"}}, r"'output'.*recompute outside the repeated layers"),
    ({"decisions": {"layers.0": "swap"}, "groups": [[0, 1]]}, r"plan.groups\[0\]=\[0, 1\].*recompute as a whole"),
    ({"decisions": {"layers": "recompute"}, "groups": [[3, 4]]}, r"plan.groups\[0\].*layer 4 does not exist"),
    ({"decisions": {"layers": "recompute"}, "groups": [[0, 2]]}, r"plan.groups=.*consecutive"),
    ({"decisions": [], "format": "adaptive-mem-plan"}, r"plan.decisions=\[\]: expected a mapping"),
    ({"format": "other"}, r"plan.format='other'"),
    ({"version": 2}, r"plan.version=2"),
]


@pytest.mark.parametrize("body,message", BAD_PLANS)
def test_bad_plans_fail_with_one_clear_error_and_nothing_applied(body: dict, message: str):
    model = _tiny()
    data = {"format": "adaptive-mem-plan", "version": 1, **body}
    with pytest.raises(PlanError, match=message):
        optimize(model, plan=data)
    _untouched(model)


def test_plan_files_invalid_yaml_or_schema(tmp_path):
    model = _tiny()
    bad = tmp_path / "bad.yaml"
    bad.write_text("format: adaptive-mem-plan\ndecisions: {layers.0: [\n")
    with pytest.raises(PlanError, match=r"not valid YAML/JSON at line"):
        optimize(model, plan=bad)
    wrong = tmp_path / "wrong.json"
    wrong.write_text('["layers.0", "recompute"]')
    with pytest.raises(PlanError, match=r"plan: expected a mapping, got list"):
        optimize(model, plan=wrong)
    with pytest.raises(PlanError, match=r"cannot read"):
        optimize(model, plan=tmp_path / "missing.yaml")
    _untouched(model)
    good = tmp_path / "good.yaml"
    _plan({"layers.1": {"action": "swap", "backward_prefetch": 2}}).save(good)
    with optimize(model, plan=str(good)) as handle:
        model(_ids()).sum().backward()
        assert handle.swap_stats.offloaded_bytes > 0


def test_plan_and_config_are_exclusive():
    with pytest.raises(ValueError, match="both given"):
        optimize(_tiny(), plan=_plan({}), config={"recompute_config": {"recompute": True}})
    with pytest.raises(ValueError, match="no plan"):
        optimize(_tiny())


def test_coupling_rule_swap_dropped_when_consumed_by_recompute_is_logged(caplog):
    model = _tiny()
    plan = _plan({"layers.1.feed_forward.w1.activation.silu": "recompute",
                  "layers.1.feed_forward.w1": {"action": "swap", "backward_prefetch": 1}})
    with caplog.at_level(logging.INFO, logger="adaptive_mem"), optimize(model, plan=plan) as handle:
        model(_ids()).sum().backward()
        stats = handle.swap_stats
    assert "Swap of layers.1.feed_forward.w1.matmul dropped: its output is consumed by recomputed " \
           "layers.1.feed_forward.w1.activation.silu" in caplog.text
    assert stats.offloaded_bytes == 0


def test_seed_log_lines(caplog):
    model = _tiny()
    plan = _plan({"layers.0": {"action": "swap", "backward_prefetch": 20},
                  "layers.1.attention.flash_attention": {"action": "swap", "backward_prefetch": 10},
                  "layers.3.feed_forward": "recompute"})
    with caplog.at_level(logging.INFO, logger="adaptive_mem"), optimize(model, plan=plan):
        pass
    assert "Set layer swap at layer 0 and value is: 20" in caplog.text
    assert "Set op_swap at layer 1: attention.flash_attention, value=10" in caplog.text
    assert "Set select recompute at layer 3: feed_forward" in caplog.text


class _SavesViewsTwice(nn.Module):
    """Autograd saves two views of one storage (and one of them twice): one host copy, exact grads."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])

    def forward(self, x):
        for layer in self.layers:
            h = layer(x)
            a, b = h[:, :4], h[:, 4:]
            x = torch.cat([a * a.t().sum(), b * b * a], dim=1)
        return x


def test_views_and_double_saves_are_swapped_once():
    torch.manual_seed(0)
    model = _SavesViewsTwice()
    x = torch.randn(4, 8)
    model(x).pow(2).sum().backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    plan = _plan({"layers.0": {"action": "swap", "backward_prefetch": 0}})
    with optimize(model, plan=plan) as handle:
        model(x).pow(2).sum().backward()
        stats = handle.swap_stats
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, ref[n]), n
    assert stats.offloaded_bytes == 4 * 8 * 4, "the matmul output storage is copied exactly once"
    assert stats.reloaded_bytes == stats.offloaded_bytes


class _MutatesSaved(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4)])

    def forward(self, x):
        h = self.layers[0](x)
        y = h * h  # saves h
        h.mul_(2)  # invalidates the saved h
        return y.sum()


def test_in_place_change_of_swapped_saved_tensor_fails_like_autograd():
    """Note: [in-place after save]: a change made before the offload copy ran is caught, never swapped."""
    import threading

    model = _MutatesSaved()
    x = torch.randn(2, 4)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        model(x).backward()
    with optimize(model, plan=_plan({"layers.0": {"action": "swap", "backward_prefetch": 0}})) as handle:
        gate = threading.Event()
        handle._executor.engine.copier.submit(lambda non_blocking: gate.wait())  # hold the copy queue
        loss = model(x)  # h is saved, then modified in place while its copy is still queued
        gate.set()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


def test_parameters_are_never_swapped(monkeypatch):
    # the layers' saves through the Python hooks, which call the spied offload (tests/test_layer_pack.py: the C++
    # pack of a whole layer offloads the same bytes)
    monkeypatch.setattr(LayerHooks, "available", staticmethod(lambda engine, opaque: False))
    model = _tiny()
    plan = _plan({"layers": {"action": "swap", "backward_prefetch": 1}, "output": {"action": "swap"}})
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    offloaded = []
    with optimize(model, plan=plan) as handle:
        engine = handle._executor.engine
        original = engine.offload

        def spy(t, **kw):
            offloaded.append(t.untyped_storage()._cdata)
            return original(t, **kw)

        engine.offload = spy
        model(_ids()).sum().backward()
    assert offloaded and not params & set(offloaded)


def test_no_grad_forward_runs_plain():
    model = _tiny()
    ids = _ids()
    with torch.no_grad():
        expected = model(ids)
    plan = _plan({"layers.0": "recompute", "layers.1.feed_forward.mul": "recompute", "layers.2": "swap"})
    with optimize(model, plan=plan) as handle, torch.no_grad():
        assert torch.equal(model(ids), expected)
        assert handle.swap_stats.offloaded_bytes == 0


def test_hf_model_plans_by_module_and_op_names():
    bundle = build_model("hf:llama", seed=0)
    batch = bundle.batch(seed=0)
    with pytest.raises(PlanError, match="model.layers.0.mlp.nosuch"):
        optimize(bundle.model, plan=_plan({"model.layers.0.mlp.nosuch": "recompute"}), example_inputs=(batch[0],))
    with optimize(bundle.model, plan=_plan({"model.layers.0.mlp.mul": "recompute"}), example_inputs=(batch[0],)):
        bundle.loss(batch).backward()


def test_config_front_end_plan_gives_exact_gradients():
    model = _tiny()
    ids = _ids()
    model(ids).logsumexp(-1).sum().backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    config = {"recompute_config": {"recompute": [1], "select_recompute": {r"feed_forward\.mul": [0, 1, 0, 1]}},
              "swap_config": {"swap": True, "op_swap": [{"op_name": "attention", "backward_prefetch": 2,
                                                         "layers": [2]}]}}
    with optimize(model, config=config) as handle:
        assert handle.plan.decisions
        model(ids).logsumexp(-1).sum().backward()
        assert handle.swap_stats.offloaded_bytes > 0
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, ref[n]), n


@pytest.mark.distributed
def test_distribute_saved_activations_uses_the_sharded_checkpoint(monkeypatch):
    import torch.distributed as dist

    import adaptive_mem.runtime._distributed_checkpoint as dc

    model = _tiny()
    ids = _ids()
    model(ids).logsumexp(-1).sum().backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    calls = []
    original = dc.distributed_checkpoint

    def spy(fn, *args, **kwargs):
        calls.append(len(args))
        return original(fn, *args, **kwargs)

    monkeypatch.setattr(dc, "distributed_checkpoint", spy)
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        plan = _plan({"layers": "recompute"}, groups=[[2, 3]], distribute_saved_activations=True)
        with optimize(model, plan=plan):
            model(ids).logsumexp(-1).sum().backward()
    finally:
        dist.destroy_process_group()
    assert len(calls) == 3  # layers 0, 1 and the group [2, 3]
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, ref[n]), n


def test_plan_fingerprinted_by_the_profiler_is_accepted_and_checked():
    from profiler import profile_step

    bundle = build_model("llama-tiny", seed=0)
    prof = profile_step(bundle, warmup=0, repeat=0)
    plan = _plan({"layers.0.feed_forward.mul": "recompute"}, fingerprint=prof.model["fingerprint"])
    with optimize(bundle.model, plan=plan, profile=prof):
        bundle.loss(bundle.batch(seed=0)).backward()
    other = build_model("llama-tiny", seed=0, seq_len=16)
    with optimize(other.model, plan=plan) as handle:
        with pytest.raises(PlanError, match="input shape mismatch"):
            other.loss(other.batch(seed=0))
        assert not handle.active
    _untouched(other.model)
