"""Select and whole-layer recompute inside compiled blocks: 0 graph breaks, exact, and really recomputing.

Note: [compiled SAC names] (adaptive_mem/runtime/_compiled_sac.py): the compile-mode policy names each op
like the eager trace; Note: [compile honoured] (adaptive_mem/runtime/_op_level.py): recompute plans run
inside the compiled blocks. Gradients are compared with ``torch.equal`` against the same compiled model
without a plan (aot_eager), with ``assert_close`` for the one inductor case.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from adaptive_mem import build_model, optimize
from search import Plan

from _compile_common import compiled_step

LAYERS = 2


def _plan(decisions: dict, groups: list | None = None) -> Plan:
    return Plan.from_dict({"format": "adaptive-mem-plan", "version": 1, "decisions": decisions,
                           "groups": groups or []})


PLANS = {
    "full": ({"layers": "recompute"}, []),
    "groups": ({"layers": "recompute"}, [[0, 1]]),
    "feed-forward": ({f"layers.{i}.feed_forward": "recompute" for i in range(LAYERS)}, []),
    "milp-like": ({"layers.0.feed_forward.w1.activation.silu": "recompute",
                   "layers.0.attention.flash_attention": "recompute",
                   "layers.0.add": "recompute",
                   "layers.1.attention_norm.norm": "recompute",
                   "layers.1.feed_forward.mul": "recompute",
                   "layers.1.attention.apply_rotary_emb.rope": "recompute",
                   "layers.1.feed_forward.w2": "keep"}, []),
}
SELECT = ("feed-forward", "milp-like")


def _fresh(spec: str = "llama-tiny", **kwargs):
    torch._dynamo.reset()
    counters.clear()
    model_args = {"num_layers": LAYERS} if spec == "llama-tiny" else {}
    bundle = build_model(spec, model_args=model_args, batch_size=2, seq_len=16, seed=0, **kwargs)
    return bundle, bundle.batch(seed=0)


def _compile(model: torch.nn.Module, mode: str, backend: str = "aot_eager") -> torch.nn.Module:
    if mode == "whole":
        return torch.compile(model, backend=backend)
    for layer in model.layers:
        layer.compile(backend=backend)
    return model


_step = compiled_step


_REFS: dict[tuple[str, str], dict[str, torch.Tensor]] = {}


def _reference(mode: str, backend: str = "aot_eager") -> dict[str, torch.Tensor]:
    if (mode, backend) not in _REFS:
        bundle, batch = _fresh()
        _REFS[mode, backend] = _step(bundle.model, _compile(bundle.model, mode, backend), batch)
    return _REFS[mode, backend]


def _breaks() -> dict:
    return dict(counters["graph_break"])


CASES = [(mode, name) for mode in ("whole", "block") for name in PLANS]


@pytest.mark.parametrize("mode,name", CASES, ids=[f"{m}-{n}" for m, n in CASES])
def test_recompute_runs_compiled_and_exact(mode: str, name: str, caplog):
    ref = _reference(mode)
    bundle, batch = _fresh()
    model = bundle.model
    caplog.set_level(logging.WARNING, logger="adaptive_mem")
    # Whole-model compile: provisional targets verified at install here; without example_inputs the first-forward
    # check runs outside dynamo (Note: [first forward outside dynamo], tests/test_compile_whole.py).
    inputs = (batch[0],) if mode == "whole" else None
    with optimize(model, plan=_plan(*PLANS[name]), example_inputs=inputs) as handle:
        call = _compile(model, mode)
        for _ in range(2):
            grads = _step(model, call, batch)
            for key, grad in ref.items():
                assert torch.equal(grads[key], grad), f"{mode}/{name}: {key} differs"
        assert counters["stats"]["unique_graphs"] > 0
        assert _breaks() == {}
        assert [r.getMessage() for r in caplog.records if r.name.startswith("adaptive_mem")] == []
        if name in SELECT:  # the compiled policy ran and tagged the plan's units for recompute
            for i in range(LAYERS):
                state = handle._executor.selective.states[i]
                assert state.trace is None, "the eager selective path ran"
                recomputed = {u for u in state.compiled[-1].names if state.compiled[-1].action(u) == "recompute"}
                targets = {t for t, d in PLANS[name][0].items() if t.startswith(f"layers.{i}.")
                           and d == "recompute"}
                assert {t for t in targets if any(u == t or u.startswith(t + ".") for u in recomputed)} == targets


def _saved_bytes(model, call, batch) -> int:
    """Bytes of the distinct non-parameter storages autograd holds for backward after one forward."""
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st._cdata not in params:
            seen[st._cdata] = st.nbytes()
        return t

    ids, labels = batch
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = torch.nn.functional.cross_entropy(call(ids).flatten(0, 1), labels.flatten())
    loss.backward()
    return sum(seen.values())


@pytest.mark.parametrize("mode", ["whole", "block"])
def test_compiled_select_recompute_saves_less(mode: str):
    bundle, batch = _fresh()
    keep = _saved_bytes(bundle.model, _compile(bundle.model, mode), batch)
    results = {}
    for name in SELECT:
        bundle, batch = _fresh()
        with optimize(bundle.model, plan=_plan(*PLANS[name]), example_inputs=(batch[0],)):
            results[name] = _saved_bytes(bundle.model, _compile(bundle.model, mode), batch)
        assert _breaks() == {}
    assert all(saved < keep for saved in results.values()), (keep, results)


def test_inductor_select_recompute_close():
    ref = _reference("block", "inductor")
    bundle, batch = _fresh()
    with optimize(bundle.model, plan=_plan(*PLANS["feed-forward"])):
        call = _compile(bundle.model, "block", "inductor")
        grads = _step(bundle.model, call, batch)
        assert _breaks() == {}
    for key, grad in ref.items():
        torch.testing.assert_close(grads[key], grad, msg=f"inductor: {key} differs")


NAMED = {  # spec -> (layers container, the module of layer 0 selected for recompute)
    "llama-tiny": ("layers", "feed_forward"),
    "hf:gpt2": ("transformer.h", "mlp"),
    "hf:qwen2": ("model.layers", "mlp"),
}


@pytest.mark.parametrize("spec", list(NAMED))
def test_compiled_unit_names_equal_eager_trace(spec: str):
    container, module = NAMED[spec]
    bundle, batch = _fresh(spec)
    model = bundle.model
    with optimize(model, plan=_plan({f"{container}.0.{module}": "recompute"})) as handle:
        torch.manual_seed(0)
        bundle.loss(batch).backward()
        state = handle._executor.selective.states[0]
        eager = state.trace.units
        model.get_submodule(f"{container}.0").compile(backend="aot_eager")
        torch.manual_seed(0)
        bundle.loss(batch).backward()
        assert _breaks() == {}
        assert state.compiled, "the compiled selective path did not run"
        compiled = list(dict.fromkeys(state.compiled[-1].names))
    # Dropout(p=0) dispatches nothing eager and a clone when compiled: the one unit only compile names.
    idle = {path for path, m in model.named_modules() if isinstance(m, torch.nn.Dropout) and m.p == 0}
    extra = {u for u in compiled if u in idle or u.rpartition(".")[0] in idle}  # leaf unit names (rule 1)
    assert [u for u in compiled if u not in extra] == eager
    assert set(compiled) - set(eager) == extra
