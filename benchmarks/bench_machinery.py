"""The machinery at small step times: what a plan costs beyond its copies and recomputes, measured and predicted.

    python benchmarks/bench_machinery.py [--quick] [--rounds 16] [--device cpu|cuda] [--models llama-tiny,hf:llama]
                                         [--calibrate] [--json FILE]

One model at batch 8 x seq 128 (llama-tiny's layer forward is ~2 ms on one CPU thread: the GPU regime's ratio of
Python to kernels), one thread, SGD step included. Every plan runs on its own copy of the model (same weights),
applied once; each round runs one step of every plan in turn (interleaved), and the table gives medians of the
rounds. Rows: plain; an op-level swap of one unit; an op-level select recompute of one unit; 10 op-level swaps (the
feed-forward units of layers 0-1 and two of layer 2: the plan ``search --maximize throughput`` picked at batch 8
under 20 MiB); whole-layer swap and whole-layer recompute of layers 0-2 (of the first layers up to 3 on smaller
models). Columns: the median step, its overhead over plain, the target and whether it is met, the copy time of
the row's swapped bytes (out and back) over plain's step (the floor of a swap row wherever its copies do not overlap
compute: on this CPU device and host share one memory bus and copies up to 1 MiB run inline), the copies in the
step and the machinery alone (each swap row also runs a twin with its copies skipped, :func:`copies_skipped`: the
twin over plain is the machinery, the row over its twin the copies as the step pays them), the simulator's
prediction on the model's own profile (``--calibrate``: the profile after ``adaptive_mem.calibrate``) and its
error, the error of the step relative to plain (predicted / predicted plain against measured / measured plain: the
plan's overhead alone, free of the drift between the profile's timing and the rounds on a busy machine), and the
machinery's calls per step (``FOOTPRINT``: Python dispatch calls, pack hook calls).

Targets: a one-unit op-level swap or select recompute at most +2 % over plain; the 10 swaps at most +3 %; the
whole-layer swap at most plain + the measured copy time of its bytes (out and back) + 2 %; the whole-layer
recompute at most plain + the recomputed layers' profiled forward (their ops' times, or the layer's measured forward
where longer) + 2 %; every prediction within 10 %.
On ``--device cuda`` the steps are timed between synchronizations.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import logging
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from adaptive_mem import build_model, calibrate, optimize, profile_step
from adaptive_mem.runtime._footprint import FOOTPRINT
from adaptive_mem.runtime._host_pool import MemoryHostPool
from adaptive_mem.runtime._spill import TieredHostPool
from search import Action, Decision, Plan, machinery_calls, maximize_throughput, simulate

BATCH, SEQ = 8, 128


@dataclass
class Row:
    name: str
    plan: Plan
    target: str  # "plain", "+2%", "+3%", "copy", "forward"
    layers: tuple[int, ...] = ()
    times: list[float] = field(default_factory=list)
    calls: dict[str, int] = field(default_factory=dict)
    swapped: int = 0
    bare_times: list[float] = field(default_factory=list)
    """A swap row's steps with its copies skipped (:func:`copies_skipped`): the machinery alone."""

    @property
    def swaps(self) -> bool:
        return any(d.action is Action.SWAP for d in self.plan.decisions.values())


@contextlib.contextmanager
def copies_skipped(handle: Any) -> Iterator[None]:
    """The copies out and back do nothing, the host pools' and the native store's of ``handle``'s engine: every
    other part of a swap runs (records, hooks, buffers, reload allocations), so the step times the machinery alone.
    The bytes are not moved: timing only."""
    pools = (MemoryHostPool, TieredHostPool)
    saved = [(pool, pool.write, pool.read) for pool in pools]
    store = handle._executor.engine.store  # Note: [native swap records]
    for pool in pools:
        pool.write = pool.read = lambda self, buf, tensor, *, non_blocking: None
    if store is not None:
        store.skip_copies = True
    try:
        yield
    finally:
        for pool, write, read in saved:
            pool.write, pool.read = write, read
        if store is not None:
            store.skip_copies = False


def _swap(prefetch: int = 1) -> Decision:
    return Decision(Action.SWAP, backward_prefetch=prefetch)


def _unit(profile: Any, layer: int, suffixes: tuple[str, ...]) -> str:
    names = [u.name for u in profile.layer_units(layer)]
    for suffix in suffixes:
        hit = [n for n in names if n.endswith(suffix)]
        if hit:
            return hit[0]
    raise ValueError(f"layer {layer}: no unit ending in any of {suffixes}")


_W1 = (".feed_forward.w1.matmul", ".mlp.gate_proj.matmul", ".mlp.c_fc.matmul")
_MUL = (".feed_forward.mul", ".mlp.mul")


def _ffn_units(profile: Any, layer: int) -> list[str]:
    """The feed-forward units of ``layer`` in forward order (w1, its activation, w3, mul: or the HF names)."""
    prefix = f"{profile.layer_path(layer)}."
    units = [u.name for u in profile.layer_units(layer) if u.saved_bytes > 0]
    return [n for n in units if n.startswith(prefix) and (".feed_forward." in n or ".mlp." in n)
            and not n.endswith(("w2.matmul", "down_proj.matmul"))]


def rows_for(profile: Any) -> list[Row]:
    n = profile.num_layers
    whole = tuple(range(min(3, n)))
    ten = [u for i in range(min(3, n)) for u in _ffn_units(profile, i)][:10]
    return [
        Row("plain", Plan(), "plain"),
        Row("op-level swap of one unit", Plan(decisions={_unit(profile, 0, _W1): _swap()}), "+2%"),
        Row("op-level select recompute of one unit",
            Plan(decisions={_unit(profile, 0, _MUL): Decision(Action.RECOMPUTE)}), "+2%"),
        Row(f"{len(ten)} op-level swaps", Plan(decisions={u: _swap() for u in ten}), "+3%"),
        Row(f"whole-layer swap of layers {whole[0]}-{whole[-1]}",
            Plan(decisions={profile.layer_path(i): _swap() for i in whole}), "copy", whole),
        Row(f"whole-layer recompute of layers {whole[0]}-{whole[-1]}",
            Plan(decisions={profile.layer_path(i): Decision(Action.RECOMPUTE) for i in whole}), "forward", whole),
    ]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _stepper(bundle: Any) -> Callable[[Any], None]:
    opt = torch.optim.SGD(bundle.model.parameters(), lr=1e-3)

    def step(batch: Any) -> None:
        bundle.loss(batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def _timed(step: Callable[[Any], None], batch: Any, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    step(batch)
    _sync(device)
    return time.perf_counter() - start


def run_rows(bundle: Any, rows: list[Row], rounds: int, device: torch.device) -> None:
    """Every row's plan applied to its own copy of ``bundle``'s model: :func:`run_variants`."""
    run_variants([(row, bundle) for row in rows], rounds, device)


def run_variants(variants: list[tuple[Row, Any]], rounds: int, device: torch.device, *, bare: bool = True) -> None:
    """Each row's plan applied to its own copy of its bundle's model; ``rounds`` interleaved rounds of one step each,
    after two warm-up steps; each row's calls per step and swapped bytes per step from its last step."""
    runs = []
    for row, bundle in variants:
        for skip in (False, True) if bare and row.swaps else (False,):  # a swap row also runs its copies skipped
            copy_ = copy.copy(bundle)
            copy_.model = copy.deepcopy(bundle.model)
            handle = optimize(copy_.model, plan=row.plan) if row.plan.decisions else None
            runs.append((row, skip, _stepper(copy_), handle, [bundle.batch(seed=k) for k in range(rounds + 2)]))
    try:
        for k in range(rounds + 2):
            for row, skip, step, handle, batches in runs:
                if skip:
                    with copies_skipped(handle):
                        seconds = _timed(step, batches[k], device)
                    row.bare_times += [seconds] if k >= 2 else []
                    continue
                stats = handle.swap_stats if handle is not None else None
                before = stats.offloaded_bytes if stats is not None else 0
                FOOTPRINT.reset()
                seconds = _timed(step, batches[k], device)
                row.calls = FOOTPRINT.snapshot()
                row.swapped = (stats.offloaded_bytes - before) if stats is not None else 0
                if k >= 2:
                    row.times.append(seconds)
    finally:
        for _, _, _, handle, _ in runs:
            if handle is not None:
                handle.remove()


def throughput_check(rounds: int, device: torch.device, calibrated: bool, budget: str = "20MiB",
                     batches: range = range(1, 17)) -> list[dict[str, Any]]:
    """``search --maximize throughput`` on llama-tiny seq 128 under ``budget`` (every batch size profiled; with
    ``calibrated`` the hardware calibrated at batch 8 in every profile), then each fitting batch size measured with
    its plan (interleaved): is the picked batch's measured tokens/s within 5 % of the best measured?"""
    bundles = {b: build_model("llama-tiny", batch_size=b, seq_len=SEQ, seed=0, device=str(device)) for b in batches}
    profiles = {b: profile_step(bb, optimizer=torch.optim.SGD(bb.model.parameters(), lr=1e-3), warmup=1, repeat=3)
                for b, bb in bundles.items()}
    if calibrated:
        hardware = calibrate(bundles[8], profiles[8], pairs=max(3, rounds // 4)).hardware
        profiles = {b: dataclasses.replace(p, hardware=hardware) for b, p in profiles.items()}
    result = maximize_throughput(profiles=profiles, batch_sizes=list(batches), budget=budget)
    fitting = [r for r in result.rows if r.fits]
    rows = {r.batch_size: Row(f"batch {r.batch_size}", r.result.plan, "-") for r in fitting}
    run_variants([(rows[b], bundles[b]) for b in rows], rounds, device, bare=False)
    measured = {b: b * SEQ / statistics.median(row.times) for b, row in rows.items()}
    picked, best = result.best_row.batch_size, max(measured, key=measured.get)
    print(f"\nmaximize throughput: llama-tiny seq {SEQ} under {budget} on {device.type}, "
          f"{'calibrated' if calibrated else 'uncalibrated'} profiles")
    print("| batch | decisions | predicted tokens/s | measured tokens/s | |")
    print("|---|---|---|---|---|")
    for r in fitting:
        mark = " ".join(m for m, b in (("picked", picked), ("best measured", best)) if b == r.batch_size)
        print(f"| {r.batch_size} | {len(r.result.plan.decisions)} | {r.tokens_per_second:,.0f} | "
              f"{measured[r.batch_size]:,.0f} | {mark} |")
    ratio = measured[picked] / measured[best]
    print(f"picked batch {picked}: {ratio * 100:.1f} % of the best measured (batch {best}); target >= 95 %: "
          f"{'met' if ratio >= 0.95 else 'not met'}")
    return [{"batch": b, "decisions": sorted(rows[b].plan.decisions), "measured_tokens_per_s": measured[b],
             "predicted_tokens_per_s": next(r.tokens_per_second for r in fitting if r.batch_size == b),
             "picked": b == picked} for b in rows]


def copy_seconds(nbytes: int, device: torch.device, repeats: int = 5) -> float:
    """Median seconds to copy ``nbytes`` from the device to host memory and back (pinned on CUDA)."""
    if nbytes <= 0:
        return 0.0
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        host.copy_(src, non_blocking=True)
        src.copy_(host, non_blocking=True)
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _limit(row: Row, plain: float, profile: Any, device: torch.device) -> tuple[float | None, str]:
    """The row's target step seconds and how it reads."""
    if row.target == "plain":
        return None, "-"
    if row.target.startswith("+"):
        pct = float(row.target[1:-1]) / 100
        return plain * (1 + pct), f"<= {row.target}"
    if row.target == "copy":
        extra = copy_seconds(row.swapped, device)
        return plain * 1.02 + extra, f"<= copy {extra * 1e3:.2f} ms + 2%"
    extra = sum(profile.replayed_forward(i) for i in row.layers)
    return plain * 1.02 + extra, f"<= fwd {extra * 1e3:.2f} ms + 2%"


def table(spec: str, rows: list[Row], profile: Any, device: torch.device) -> list[dict[str, Any]]:
    plain = statistics.median(rows[0].times)
    out = []
    shape = f"b{profile.model.get('batch_size')} s{profile.model.get('seq_len')} {profile.model.get('dtype', '')}"
    print(f"\n{spec} {shape.strip()} on {device.type} ({torch.get_num_threads()} thread(s)), "
          f"medians of {len(rows[0].times)} interleaved rounds; per call: dispatch "
          f"{profile.hardware.dispatch_call_time * 1e6:.2f} us, hook {profile.hardware.hook_call_time * 1e6:.2f} us")
    plain_predicted = simulate(profile, rows[0].plan).step_time
    print("| plan | step ms | vs plain | target | met | copies alone | copies in step | machinery alone | "
          "predicted ms | error | vs plain error | dispatch (model) | pack (model) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        step = statistics.median(row.times)
        predicted = simulate(profile, row.plan).step_time
        limit, reads = _limit(row, plain, profile, device)
        met = "-" if limit is None else ("yes" if step <= limit else "no")
        error = predicted / step - 1
        relative = (predicted / plain_predicted) / (step / plain) - 1  # the plan's overhead, the profile's drift out
        over = step / plain - 1
        model = machinery_calls(profile, row.plan)
        copies = copy_seconds(row.swapped, device) / plain  # the floor of a swap row where copies do not overlap
        floor = f"{copies * 100:+.1f} %" if row.swapped else "-"
        bare = statistics.median(row.bare_times) if row.bare_times else None  # the same plan, copies skipped
        split = ((step - bare) / plain, bare / plain - 1) if bare is not None else None
        parts = " | ".join(f"{v * 100:+.1f} %" for v in split) if split else "- | -"
        print(f"| {row.name} | {step * 1e3:.2f} | {over * 100:+.1f} % | {reads} | {met} | {floor} | {parts} | "
              f"{predicted * 1e3:.2f} | "
              f"{error * 100:+.1f} % | {relative * 100:+.1f} % | "
              f"{row.calls.get('dispatch', 0)} ({model.dispatch}) | "
              f"{row.calls.get('pack', 0)} ({model.pack}) |")
        out.append({"model": spec, "plan": row.name, "step_ms": step * 1e3, "vs_plain": over, "target": reads,
                    "met": met, "copies_vs_plain": copies if row.swapped else None,
                    "copies_in_step_vs_plain": split and split[0], "machinery_alone_vs_plain": split and split[1],
                    "predicted_ms": predicted * 1e3, "error": error, "relative_error": relative,
                    "calls": row.calls,
                    "calls_model": {"dispatch": model.dispatch, "pack": model.pack, "unpack": model.unpack},
                    "swapped_bytes": row.swapped, "times_ms": [t * 1e3 for t in row.times],
                    "decisions": sorted(row.plan.decisions)})
    return out


def run_model(spec: str, rounds: int, device: torch.device, calibrated: bool, **sizes: Any) -> list[dict[str, Any]]:
    """One model's table; ``sizes``: ``build_model``'s batch_size, seq_len, dtype and model_args (b8 s128 fp32)."""
    bundle = build_model(spec, **{"batch_size": BATCH, "seq_len": SEQ, **sizes}, seed=0, device=str(device))
    opt = torch.optim.SGD(bundle.model.parameters(), lr=1e-3)
    profile = profile_step(bundle, optimizer=opt, warmup=1, repeat=max(3, rounds // 2))
    if calibrated:  # more pairs than the default 3: a noisy machine moves a median of 3 steps by percents
        profile = calibrate(bundle, profile, pairs=max(3, rounds // 4))
    rows = rows_for(profile)
    run_rows(bundle, rows, rounds, device)
    return table(spec, rows, profile, device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds, llama-tiny only")
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--models", default="llama-tiny,hf:llama")
    parser.add_argument("--batch-size", type=int, default=BATCH)
    parser.add_argument("--seq-len", type=int, default=SEQ)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--layers", type=int, default=None, help="cut each model to this many layers (a 7B shape "
                        "on a GPU: --models llama2-7b --layers 4 --batch-size 1 --seq-len 4096 --dtype bfloat16)")
    parser.add_argument("--calibrate", action="store_true", help="predict on the calibrated profile")
    parser.add_argument("--throughput", action="store_true",
                        help="also search --maximize throughput on llama-tiny seq 128 under 20 MiB and measure")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    logging.getLogger("adaptive_mem").setLevel(logging.WARNING)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rounds, models = (3, ["llama-tiny"]) if args.quick else (args.rounds, args.models.split(","))
    results = []
    sizes = dict(batch_size=args.batch_size, seq_len=args.seq_len, dtype=args.dtype,
                 model_args={"num_layers": args.layers} if args.layers else None)
    for spec in models:
        results += run_model(spec, rounds, device, args.calibrate, **sizes)
    throughput = throughput_check(rounds, device, args.calibrate) if args.throughput else []
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": _device_name(device), "threads": args.threads, "rounds": rounds,
                       "rows": results, "throughput": throughput}, f, indent=1)
    return 0


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.__version__})"


if __name__ == "__main__":
    sys.exit(main())
