"""The CUDA paths, run on a lent GPU: exactness, memory and time against the plain step, and the OOM rescue.

Run on a machine with CUDA (``python benchmarks/gpu_check.py --out DIR``); every section runs on its own and
writes what it measured (or its error) into ``DIR/gpu_check.json``, so one failing path does not hide the others.

Sections:
* ``exact``: eager plans (recompute, select recompute, whole-layer and op-level swap, mixed) on llama-tiny and
  hf qwen2, fp32 and bf16: loss and gradients ``torch.equal`` to the plain step (deterministic kernels), swap
  copies on the side stream (``StreamCopier``) with pinned host buffers.
* ``compiled``: the same plans with every block compiled by inductor, and a whole-model ``torch.compile`` with
  swaps in its graph (the ``adaptive_mem::offload`` / ``reload`` ops): gradients close to the compiled plain step,
  offloaded bytes counted.
* ``predict``: a 7B-shaped llama (8 layers, bf16, seq 4096) profiled on the GPU, a plan searched at 60 % of the
  activations, run: measured peak and step against the simulator's, and the fake-tensor estimate for the named
  device against the measured profile.
* ``oom``: the adaptive loop under a per-process memory fraction with the caching allocator's out-of-memory
  observer (``pluggable_allocator=True``): steps survive, gradients equal to the plain run's.
* ``machinery``: step time of the plain model against one-unit and whole-layer plans (interleaved rounds, medians).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from _gpu_common import (RUN, _copier_kind, _cuda, _plan, _swap, big, compare, hf_plans, llama_plans,  # noqa: E402
                         section, seeded_step)
from adaptive_mem import build_model, optimize, profile_step, search, simulate  # noqa: E402
from gpu_oom import check_oom  # noqa: E402
from search import Plan  # noqa: E402

def run_plans(spec: str, plans: dict[str, Plan], *, dtype: str, compile: Any = None, **sizes: Any) -> dict:
    bundle = build_model(spec, device=RUN.device, dtype=dtype, seed=0, **sizes)
    batch = bundle.batch(seed=0)
    exact = compile is None
    if compile is not None:
        with optimize(bundle.model, plan=Plan(), compile=compile):
            ref = seeded_step(bundle, batch)
    else:
        ref = seeded_step(bundle, batch)
    out = {}
    for name, plan in plans.items():
        try:
            with optimize(bundle.model, plan=plan, compile=compile) as handle:
                got = [seeded_step(bundle, batch) for _ in range(2)]
                stats = handle.swap_stats
                row = compare(got[-1], ref, exact)
                row["first_step"] = compare(got[0], ref, exact)["ok"]
                row["offloaded_MiB"] = round(stats.offloaded_bytes / 2**20, 2) if stats else 0
                row["copier"] = _copier_kind(handle)
        except Exception as exc:
            row = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:600]}
        out[name] = row
    return out


@section("exact")
def check_exact() -> dict:
    torch.use_deterministic_algorithms(True, warn_only=True)  # a kernel without one warns; "plain-again" shows it
    try:
        return {
            "llama-tiny-fp32": run_plans("llama-tiny", llama_plans(), dtype="float32", batch_size=4, seq_len=256),
            "llama-tiny-bf16": run_plans("llama-tiny", llama_plans(), dtype="bfloat16", batch_size=4, seq_len=256),
            "hf-qwen2-fp32": run_plans("hf:qwen2", hf_plans(), dtype="float32", batch_size=2, seq_len=128),
        }
    finally:
        torch.use_deterministic_algorithms(False)


@section("compiled")
def check_compiled() -> dict:
    names = ("select-mul-l0", "swap-layers-0-2", "op-swap-w1-l0", "recompute-with-swap")
    plans = {k: v for k, v in llama_plans().items() if k in names}
    out = {"per-block-inductor": run_plans("llama-tiny", plans, dtype="float32", compile="inductor",
                                           batch_size=4, seq_len=256)}
    RUN.results["compiled"] = out
    bundle = build_model("llama-tiny", device=RUN.device, seed=0, batch_size=4, seq_len=256)
    batch = bundle.batch(seed=0)
    eager = bundle.model
    ref = seeded_step(bundle, batch)
    rows = out["whole-model-inductor"] = {}
    for name in names[1:]:
        torch._dynamo.reset()
        try:
            with optimize(eager, plan=plans[name]) as handle:  # then torch.compile(model): swaps in its graph
                bundle.model = torch.compile(eager)
                got = [seeded_step(bundle, batch) for _ in range(2)]
                rows[name] = compare(got[-1], ref, exact=False)
                stats = handle.swap_stats
                rows[name]["offloaded_MiB"] = round(stats.offloaded_bytes / 2**20, 2) if stats else 0
        except Exception as exc:
            rows[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:600]}
        finally:
            bundle.model = eager
    return out


def _peak_step(bundle, batch, opt) -> tuple[int, float]:
    _cuda("synchronize")
    _cuda("reset_peak_memory_stats")
    start = time.perf_counter()
    bundle.model.zero_grad(set_to_none=True)  # as the profile assumes: gradients freed between steps
    bundle.loss(batch).backward()
    opt.step()
    _cuda("synchronize")
    return _cuda("max_memory_allocated"), time.perf_counter() - start


def measure(bundle, batch, opt, plan: Plan | None, steps: int = 4) -> tuple[int, float]:
    def run() -> tuple[int, float]:
        results = [_peak_step(bundle, batch, opt) for _ in range(steps)]
        return max(r[0] for r in results[1:]), statistics.median(r[1] for r in results[1:])
    if plan is None:
        return run()
    with optimize(bundle.model, plan=plan):
        return run()


@section("predict")
def check_predict() -> dict:
    spec, sizes = big(8)
    bundle = build_model(spec, device=RUN.device, seed=0, **sizes)
    batch = bundle.batch(seed=0)
    opt = torch.optim.SGD(bundle.model.parameters(), lr=1e-4)
    profile = profile_step(bundle, optimizer="sgd")
    fake = profile_step(build_model(spec, device="meta", **sizes), hardware="h200", optimizer="sgd")
    out = {"profile_step_s": profile.step_time, "fake_h200_step_s": fake.step_time,
           "profile_peak_GiB": simulate(profile, Plan()).peak_bytes / 2**30,
           "fake_peak_GiB": simulate(fake, Plan()).peak_bytes / 2**30,
           "link_GBps": {"h2d": profile.hardware.h2d_bandwidth / 1e9, "d2h": profile.hardware.d2h_bandwidth / 1e9},
           "recorded_op_s": sum(o.fwd_time + o.bwd_time for o in profile.ops) + profile.unattributed_time,
           "optimizer_s": profile.optimizer_time}
    out["plain_phases_GiB"] = phase_peaks(bundle, batch, opt)
    for label, plan, predicted in _predict_plans(profile):
        on_fake = simulate(fake, plan)
        peak, step = measure(bundle, batch, opt, plan)
        out[label] = {"measured_peak_GiB": peak / 2**30, "predicted_peak_GiB": predicted.peak_bytes / 2**30,
                      "peak_err_pct": 100 * (predicted.peak_bytes - peak) / max(peak, 1),
                      "predicted_swapped_MiB": predicted.swapped_bytes / 2**20,
                      "measured_step_s": step, "predicted_step_s": predicted.step_time,
                      "step_err_pct": 100 * (predicted.step_time - step) / step,
                      "fake_h200_peak_GiB": on_fake.peak_bytes / 2**30, "fake_h200_step_s": on_fake.step_time,
                      "plan": {k: str(v.action.value) for k, v in list(plan.decisions.items())[:12]}}
    return out


def phase_peaks(bundle, batch, opt) -> dict:
    """Peak device memory of the plain step's forward, backward and optimizer step, each on its own."""
    out = {}
    for _ in range(2):  # the second step: gradients were freed, the caches warm
        bundle.model.zero_grad(set_to_none=True)
        _cuda("synchronize")
        out["before"] = _cuda("memory_allocated") / 2**30
        _cuda("reset_peak_memory_stats")
        loss = bundle.loss(batch)
        out["forward"] = _cuda("max_memory_allocated") / 2**30
        _cuda("reset_peak_memory_stats")
        loss.backward()
        out["backward"] = _cuda("max_memory_allocated") / 2**30
        _cuda("reset_peak_memory_stats")
        opt.step()
        out["optimizer"] = _cuda("max_memory_allocated") / 2**30
    return out


def live_device_memory() -> dict:
    """What stays on the device after a section: allocated bytes, and the modules and tensors still alive."""
    import gc
    import warnings
    gc.collect()
    warnings.simplefilter("ignore", FutureWarning)  # isinstance over every object touches deprecated aliases
    tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.device.type == RUN.device]
    modules = [o for o in gc.get_objects() if isinstance(o, torch.nn.Module)
               and any(p.device.type == RUN.device for p in o.parameters(recurse=False))]
    roots = {type(m).__name__ for m in modules}
    holders = []
    for t in sorted(tensors, key=lambda t: -t.numel())[:3]:
        holders.append([type(r).__name__ for r in gc.get_referrers(t)][:6])
    return {"allocated_MiB": _cuda("memory_allocated") / 2**20, "tensors": len(tensors),
            "tensor_MiB": sum(t.numel() * t.element_size() for t in tensors) / 2**20,
            "module_types": sorted(roots)[:12], "largest_holders": holders}


def _predict_plans(profile):
    yield "plain", Plan(), simulate(profile, Plan())
    for share in ("60%", "30%"):
        result = search(profile, budget=share)
        yield f"milp@{share}", result.plan, simulate(profile, result.plan)
    full = _plan({"layers": "recompute"})
    yield "full-recompute", full, simulate(profile, full)
    swaps = _plan({f"layers.{i}": _swap(1) for i in range(3)})
    yield "swap-layers-0-2", swaps, simulate(profile, swaps)


@section("machinery")
def check_machinery(rounds: int) -> dict:
    out = {}
    for label, spec, sizes in (
            ("llama-tiny b8 s128 fp32", "llama-tiny", dict(batch_size=8, seq_len=128)),
            ("7B-shaped 4 layers b1 s4096 bf16", *big(4))):
        bundle = build_model(spec, device=RUN.device, seed=0, **sizes)
        batch = bundle.batch(seed=0)
        opt = torch.optim.SGD(bundle.model.parameters(), lr=1e-4)
        plans = {"plain": None, **{k: v for k, v in llama_plans().items() if k not in ("mixed", "plain-again")},
                 "recompute-layers-0-2": _plan({f"layers.{i}": "recompute" for i in range(3)})}
        times: dict[str, list[float]] = {k: [] for k in plans}
        peaks: dict[str, int] = {}
        for _ in range(rounds):
            for name, plan in plans.items():
                peak, step = measure(bundle, batch, opt, plan, steps=6)
                times[name].append(step)
                peaks[name] = peak
        base = statistics.median(times["plain"])
        out[label] = {name: {"step_ms": 1e3 * statistics.median(t), "vs_plain_pct": 100 * (statistics.median(t) / base - 1),
                             "peak_MiB": peaks[name] / 2**20} for name, t in times.items()}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".", help="folder for gpu_check.json")
    parser.add_argument("--sections", default="exact,compiled,predict,oom,machinery")
    parser.add_argument("--device", default="cuda", help="cuda; cpu only to smoke-test the script")
    parser.add_argument("--rounds", type=int, default=5, help="machinery: interleaved rounds")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("adaptive_mem.memory").setLevel(logging.DEBUG)
    RUN.device = args.device
    if RUN.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device", file=sys.stderr)
        return 2
    RUN.results["env"] = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0) if RUN.device == "cuda" else RUN.device,
                      "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(RUN.results["env"], flush=True)
    sections = {"exact": check_exact, "compiled": check_compiled, "predict": check_predict, "oom": check_oom,
                "machinery": lambda: check_machinery(args.rounds)}
    names = args.sections.split(",")
    unknown = [n for n in names if n not in sections]
    if unknown:
        parser.error(f"--sections={args.sections!r}: unknown {unknown[0]!r}; expected names from {','.join(sections)}")
    for name in names:  # in the order asked
        sections[name]()
        RUN.results.setdefault("live_after", {})[name] = live_device_memory()
        Path(args.out, "gpu_check.json").write_text(json.dumps(RUN.results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
