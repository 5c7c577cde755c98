"""The cases of tests/test_parallel_comm.py, run in 2 spawned gloo ranks: llama-tiny under DTensor tensor
parallel (tests/_parallel_tp.py), one step with a plan or config acting on the layout's collectives, compared
with the same layout without a plan; each case also records what the plan changed (collectives issued in
backward, bytes held after forward, the sharded layer inputs)."""

from __future__ import annotations

import logging
from functools import partial
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from adaptive_mem import DeviceMemory, optimize
from search import Plan

from _spawn import gloo_rank, guard

__all__ = ["KEEP_COMMS", "TIMEOUT", "worker"]

TIMEOUT = 240
KEEP_COMMS = {f"layers.{i}.{c}": "keep" for i in range(2) for c in ("attention.wo.all_reduce", "feed_forward.w2.all_reduce")}


class _Collectives(TorchDispatchMode):
    """Counts the all-reduces run while active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional" and func.overloadpacket.__name__ == "all_reduce":
            self.count += 1
        return func(*args, **(kwargs or {}))


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _run(model, ids, labels, *, local, grads) -> dict[str, Any]:
    import torch.nn.functional as F

    import gc

    helds = []
    for step in range(5):  # the first step traces op-level layers; the most common of the others is measured
        # (gloo's own threads allocate and free now and then, during a forward too: either way off by a buffer)
        model.zero_grad(set_to_none=True)
        inputs: list[torch.Tensor] = []
        hooks = [layer.register_forward_pre_hook(lambda m, a: inputs.append(a[0])) for layer in model.layers]
        gc.collect()
        with DeviceMemory() as mem:
            before = mem.live
            logits = local(model(ids))
            if step:
                helds.append(mem.live - before)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
            sizes = [x.untyped_storage().nbytes() for x in inputs]
            with _Collectives() as comms:
                loss.backward()
        for h in hooks:
            h.remove()
    return {"loss": loss.detach(), "grads": grads(model), "held": max(set(helds), key=helds.count), "backward_all_reduce": comms.count,
            "input_bytes": sizes, "full_input_bytes": [x.untyped_storage().nbytes() for x in inputs]}


def _cases(results: dict, rank: int, *, guard: Callable, bundle: Callable, local: Callable, grads: Callable) -> None:
    from _parallel_tp import parallelize

    ids, labels = bundle().batch(seed=0)
    wrap = partial(parallelize, sequence=False)
    ref = _run(wrap(bundle().model), ids, labels, local=local, grads=grads)
    cases: dict[str, dict] = {
        "whole": {"plan": {"layers": "recompute"}},
        "keep-comms": {"plan": {"layers": "recompute", **KEEP_COMMS}},
        "keep-comms-before": {"plan": {"layers": "recompute", **KEEP_COMMS}, "before": True},
        "mp-comm-false": {"config": {"recompute_config": {"recompute": True, "mp_comm_recompute": False}}},
        "mp-comm-true": {"config": {"recompute_config": {"recompute": True, "mp_comm_recompute": True}}},
        "distribute": {"plan": {"layers": "recompute"}, "distribute": True},
        "sp-distribute": {"plan": {"layers": "recompute"}, "distribute": True, "sp": True},
    }
    for name, case in cases.items():
        def run(case: dict = case) -> dict:
            sp = case.get("sp", False)
            model = bundle().model
            if not case.get("before"):
                model = parallelize(model, sequence=sp)
            base = ref if not sp else _run(parallelize(bundle().model, sequence=True), ids, labels, local=local,
                                           grads=grads)
            if "plan" in case:
                plan = Plan.from_dict({"format": "adaptive-mem-plan", "version": 1, "decisions": case["plan"],
                                       "distribute_saved_activations": case.get("distribute", False)})
                handle = optimize(model, plan=plan)
            else:
                handle = optimize(model, config=case["config"])
            if case.get("before"):
                model = parallelize(model, sequence=sp)
            catcher = _Warnings()
            logging.getLogger("adaptive_mem").addHandler(catcher)
            try:
                with handle:
                    got = _run(model, ids, labels, local=local, grads=grads)
            finally:
                logging.getLogger("adaptive_mem").removeHandler(catcher)
            mismatched = sorted(n for n in base["grads"] if n not in got["grads"]
                                or not torch.equal(got["grads"][n], base["grads"][n]))
            return {"loss": torch.equal(got["loss"], base["loss"]), "mismatched": mismatched,
                    "count": len(got["grads"]), "decisions": {t: d.action.value for t, d in handle.plan.decisions.items()},
                    "warnings": catcher.lines, "ref": {k: base[k] for k in ("held", "backward_all_reduce", "input_bytes")},
                    **{k: got[k] for k in ("held", "backward_all_reduce", "input_bytes", "full_input_bytes")}}
        guard(results, name, run)


def worker(rank: int, world: int, port: int, out: str) -> None:
    from _parallel_cases import _bundle, _grads, _local

    with gloo_rank(rank, world, port, out, timeout=TIMEOUT) as results:
        _cases(results, rank, guard=guard, bundle=_bundle, local=_local, grads=_grads)
