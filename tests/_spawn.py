"""Spawning gloo ranks in tests: a free local port, a deadline on the whole spawn, results read back per rank.

Every worker sets its own timeout on each collective (``init_process_group(timeout=...)``); the spawn gets
twice that, then its processes are killed and the test fails.
"""

from __future__ import annotations

import contextlib
import datetime
import socket
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.multiprocessing as mp

__all__ = ["free_port", "gloo_rank", "guard", "spawn_ranks"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(worker: Callable[..., Any], *args: Any, out: Path, timeout: float, nprocs: int = 2) -> list[Any]:
    """Run ``worker(rank, nprocs, port, str(out), *args)`` on ``nprocs`` ranks; each writes ``out/rank{r}.pt``."""
    context = mp.spawn(worker, args=(nprocs, free_port(), str(out), *args), nprocs=nprocs, join=False)
    deadline = time.monotonic() + 2 * timeout
    try:
        while not context.join(timeout=2):
            if time.monotonic() > deadline:
                pytest.fail(f"{nprocs} gloo ranks still running after {2 * timeout} s")
    finally:
        for p in context.processes:
            if p.is_alive():
                p.kill()
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(nprocs)]


def guard(results: dict, name: str, fn: Callable[[], dict]) -> None:
    """Run one case on this rank: its result, or the failure (type and message; ``trace``: where it was raised) recorded for the
    parent's assertion, then a barrier so every rank starts the next case together."""
    import torch.distributed as dist

    try:
        results[name] = {"error": None, **fn()}
    except Exception as exc:  # recorded for the parent's assertion, with where it was raised
        results[name] = {"error": f"{type(exc).__name__}: {exc}"[:600], "trace": traceback.format_exc()[-1500:]}
    dist.barrier()


@contextlib.contextmanager
def gloo_rank(rank: int, world: int, port: int, out: str, *, timeout: float) -> Iterator[dict]:
    """This spawned rank in a gloo group on the local ``port`` (every collective with ``timeout`` seconds, one intra-op
    thread): yields the results dict, saved as ``out/rank{rank}.pt`` when the cases end, then the group goes."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout))
    results: dict = {}
    try:
        yield results
        torch.save(results, f"{out}/rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()
