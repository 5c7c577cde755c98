"""One bench run in its own process: build the model, apply one policy, measure, write JSON.

    python -m adaptive_mem.bench._worker JOB.json RESULT.json

Protocol (the same for every policy):

1. build the model from the spec and seed, Adam, the policy applied;
2. warm-up steps (one, or until the policy says it is ready, e.g. the adaptive loop converged);
3. one step under a memory tracker that records the live device bytes after every op
   (:class:`TimelineMemory`, an independent :class:`~adaptive_mem.DeviceMemory`): the peak and the timeline;
4. ``steps`` timed steps without the tracker (its per-op bookkeeping would tax policies that run more ops).

A job with ``"kind": "paired"`` instead times several ``candidates`` (batch size and plan) in this one process,
a step of each per round (:func:`run_paired`): what ranks candidates whose tokens/s differ by less than the
spread between processes (Note: [paired rounds]).

Batches come from ``bundle.batch(seed=k)`` for step ``k``; every policy sees the same sequence.
"""

from __future__ import annotations

import json
import logging
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from adaptive_mem.runtime._accounting import DeviceMemory
from ._prepare import _thin

__all__ = ["EntryScanMemory", "TimelineMemory", "run_job", "run_paired"]

log = logging.getLogger(__name__)


class EntryScanMemory(DeviceMemory):
    """:class:`DeviceMemory` that counts the tensors alive at entry and lets compiled code run compiled."""

    supports_higher_order_operators = True
    """A compiled block's checkpoint runs higher-order operators (``run_and_save_rng_state``) at run time: they
    run inside this handler with the mode off; their allocations are still counted by the C++ allocator."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Lets torch.compile'd code run as compiled under this mode (dynamo skips frames under other
        # modes, i.e. it would measure the eager model). The compiled graphs' aten ops still pass here.
        return True


class TimelineMemory(EntryScanMemory):
    """Also records ``(seconds since entry, live bytes)`` after every op."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.points: list[tuple[float, int]] = []
        self._t0 = 0.0

    def __enter__(self) -> "TimelineMemory":
        out = super().__enter__()
        self._t0 = time.perf_counter()
        self.points = [(0.0, self.live)]
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.points.append((time.perf_counter() - self._t0, self.live))
        return out


def _step(bundle: Any, optimizer: torch.optim.Optimizer, seed: int) -> float:
    batch = bundle.batch(seed=seed)
    loss = bundle.loss(batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    value = float(loss.detach())
    del loss
    return value


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    torch.manual_seed(int(job.get("seed", 0)))
    bundle, optimizer, applied = _built(job)
    run_bundle = applied.bundle
    seed = 0
    losses: list[float] = []
    warm_times: list[float] = []
    try:
        warmups = max(1, int(job.get("warmup", 1)))
        limit = 50
        for k in range(limit):
            cap = applied.accounted_warmup
            start = time.perf_counter()
            if cap is not None:
                with EntryScanMemory(cap=cap):
                    losses.append(_step(run_bundle, optimizer, seed))
            else:
                losses.append(_step(run_bundle, optimizer, seed))
            warm_times.append(time.perf_counter() - start)
            seed += 1
            ready = applied.warmup_until() if applied.warmup_until is not None else True
            if k + 1 >= warmups and ready:
                break
        with TimelineMemory() as mem:
            mem.reset_peak()
            losses.append(_step(run_bundle, optimizer, seed))
        seed += 1
        times = []
        for _ in range(int(job["steps"])):
            start = time.perf_counter()
            losses.append(_step(run_bundle, optimizer, seed))
            times.append(time.perf_counter() - start)
            seed += 1
    finally:
        applied.remove()
    median = statistics.median(times)
    tokens = bundle.batch_size * bundle.seq_len
    return {
        "status": "ok",
        "peak_bytes": int(mem.peak),
        "step_times": times,
        "median_step_time": median,
        "tokens_per_s": tokens / median,
        "warmup_steps": len(warm_times),
        "warmup_times": [round(t, 4) for t in warm_times],
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "timeline_measured": _thin(mem.points),
        "info": applied.info,
    }


def _built(job: dict[str, Any]) -> tuple[Any, torch.optim.Optimizer, Any]:
    from adaptive_mem._model_spec import build_model
    from ._policies import get_policy

    bundle = build_model(job["spec"], model_args=job.get("model_args"), batch_size=job.get("batch_size"),
                         seq_len=job.get("seq_len"), dtype=job.get("dtype", "float32"), seed=int(job.get("seed", 0)))
    optimizer = torch.optim.Adam([p for p in bundle.model.parameters() if p.requires_grad], lr=1e-4)
    return bundle, optimizer, get_policy(job["policy"]).apply(bundle, optimizer, job)


def run_paired(job: dict[str, Any]) -> dict[str, Any]:
    """Every candidate (``{"batch_size", **policy args}`` over the job's keys) built and warmed up in this process,
    then ``rounds`` rounds of one timed step each (after an untimed one), the order reversed every other round.

    Note: [paired rounds] Load on a shared machine drifts over minutes and a process's speed varies from one
    process to the next (2-5 % here); both hit every candidate of a round alike, so the per-round ratio of two
    candidates' tokens/s is far steadier than either's. The candidates share the process, so the device holds all
    of them at once; peaks are measured by the one-process runs, not here. A step right after another
    candidate's is not a training step: the host allocator has handed back or cut up what the other freed, and
    the largest candidate pays to fault its memory in again (llama-small, plain batch 8 after batch 4: 10 s;
    after itself: 8 s). So each timed step follows an untimed step of its own, as in training."""
    torch.manual_seed(int(job.get("seed", 0)))
    built = []
    try:
        for cand in job["candidates"]:
            built.append(_built({**job, **cand}))
            _, optimizer, applied = built[-1]
            for seed in range(max(1, int(job.get("warmup", 1)))):
                _step(applied.bundle, optimizer, seed)
        times: list[list[float]] = [[] for _ in built]
        for r in range(int(job["rounds"])):
            order = list(range(len(built)))
            for k in (order if r % 2 == 0 else order[::-1]):
                _, optimizer, applied = built[k]
                _step(applied.bundle, optimizer, 1000 + r)
                start = time.perf_counter()
                _step(applied.bundle, optimizer, 2000 + r)
                times[k].append(time.perf_counter() - start)
    finally:
        for _, _, applied in built:
            applied.remove()
    return {"status": "ok", "step_times": times,
            "tokens_per_step": [b.batch_size * b.seq_len for b, _, _ in built],
            "info": [applied.info for _, _, applied in built]}


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s - %(message)s", stream=sys.stderr)
    job_path, result_path = argv
    job = json.loads(Path(job_path).read_text())
    torch.set_num_threads(int(job.get("threads") or torch.get_num_threads()))
    try:
        result = run_paired(job) if job.get("kind") == "paired" else run_job(job)
    except Exception as exc:  # noqa: BLE001 - a failing policy is a result row, not a crash of the bench
        result = {"status": "failed", "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                  "traceback": traceback.format_exc(limit=8)}
    Path(result_path).write_text(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
