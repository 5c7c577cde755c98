"""The cases of tests/test_parallel_comm.py, run in 2 spawned gloo ranks: llama-tiny under DTensor tensor
parallel (tests/_parallel_tp.py), one step with a plan or config acting on the layout's collectives, compared
with the same layout without a plan; each case also records what the plan changed (collectives issued in
backward, bytes held after forward, the sharded layer inputs)."""

from __future__ import annotations

import gc
import logging
import time
from functools import partial
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from adaptive_mem import DeviceMemory, optimize
from search import Plan

from _spawn import gloo_rank, guard

__all__ = ["KEEP_COMMS", "TIMEOUT", "worker"]

TIMEOUT = 240
MEASURED, MAX_STEPS = 2, 12  # exact measurements wanted (Note: [exact held bytes]), steps at most
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


class _Held:
    """Note: [exact held bytes]: the bytes a forward leaves held for backward, exact whatever other threads of the
    rank allocate or free. A C++ accounting session enters around the forward only, counting only the
    allocations of this (the forward's) thread (``own_thread``): a collective's worker thread allocating does not
    count. What it counted and what is still alive after the forward is held, less what a collective worker
    thread frees afterwards: the worker holds the collective's tensors until it has finished its loop step,
    possibly after this thread dropped its last reference, and then frees them itself (``foreign_freed``). A
    worker freeing one only after backward began is ambiguous (a tensor the plan held until backward could be
    freed so too): ``measure`` then says None and the step is measured again. The counted storages all die by
    the end of a step (waited for, collecting cycles), so every late free is seen."""

    def __init__(self) -> None:
        self.mem = DeviceMemory(track_existing=False, backend="cpp")  # ValueError without the built extension
        self.session = self.mem._counter.session
        self.session.own_thread()

    def forward_done(self) -> None:
        self.live, self.freed = self.mem.live, self.session.foreign_freed()

    def backward_starts(self) -> None:
        self.settled = self.session.foreign_freed()

    def measure(self) -> int | None:
        """After the step's tensors were dropped: the held bytes, or None when ambiguous."""
        deadline = time.monotonic() + TIMEOUT / 4  # within the other rank's wait at the next collective
        while self.mem.live:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.mem.live} bytes allocated in the forward outlive the step")
            gc.collect()  # reference cycles (autograd graphs with hooks) die here, on this thread
            time.sleep(0.001)
        if self.session.foreign_freed() != self.settled:
            return None
        return self.live - (self.settled - self.freed)


def _all_ranks(flag: bool) -> bool:
    """Whether ``flag`` holds on every rank: each runs as many steps as the others (their collectives pair up)."""
    import torch.distributed as dist

    found = torch.tensor([int(flag)])
    dist.all_reduce(found, op=dist.ReduceOp.MIN)
    return bool(found.item())


def _run(model, ids, labels, *, local, grads) -> dict[str, Any]:
    import torch.nn.functional as F

    helds: list[int] = []
    for step in range(MAX_STEPS):  # the first step traces op-level layers; the others hold the same bytes
        model.zero_grad(set_to_none=True)
        inputs: list[torch.Tensor] = []
        hooks = [layer.register_forward_pre_hook(lambda m, a: inputs.append(a[0])) for layer in model.layers]
        gc.collect()
        held = _Held()
        with held.mem:
            logits = local(model(ids))
        held.forward_done()
        for h in hooks:
            h.remove()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        sizes = [x.untyped_storage().nbytes() for x in inputs]
        held.backward_starts()
        with _Collectives() as comms:
            loss.backward()
        full = [x.untyped_storage().nbytes() for x in inputs]
        loss = loss.detach()
        del logits
        inputs.clear()
        got = held.measure() if step else None
        if got is not None:
            helds.append(got)
        if _all_ranks(len(helds) >= MEASURED):
            break
    if len(helds) < MEASURED or len(set(helds)) > 1:
        raise RuntimeError(f"held bytes after forward: {helds} in {step + 1} steps, "
                           f"expected {MEASURED} or more, all equal")
    return {"loss": loss, "grads": grads(model), "held": helds[0], "backward_all_reduce": comms.count,
            "input_bytes": sizes, "full_input_bytes": full}


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
