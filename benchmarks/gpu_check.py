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
import contextlib
import json
import logging
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from adaptive_mem import DeviceMemory, adaptive_optimize, build_model, optimize, profile_step, search, simulate  # noqa: E402
from search import Plan  # noqa: E402

RESULTS: dict[str, Any] = {}
DEVICE = "cuda"


def _cuda(name: str, *args: Any) -> Any:
    """A ``torch.cuda`` call, 0 on a CPU smoke run (``--device cpu``)."""
    return getattr(torch.cuda, name)(*args) if DEVICE == "cuda" else 0


def big(num_layers: int, **sizes: Any) -> tuple[str, dict]:
    """A 7B-shaped llama cut to ``num_layers`` (bf16, seq 4096) on the GPU; llama-tiny on a CPU smoke run."""
    if DEVICE != "cuda":
        return "llama-tiny", dict(batch_size=2, seq_len=64)
    return "llama2-7b", dict(model_args={"num_layers": num_layers}, batch_size=1, seq_len=4096, dtype="bfloat16",
                             **sizes)


def _plan(decisions: dict) -> Plan:
    return Plan.from_dict({"format": "adaptive-mem-plan", "version": 1, "decisions": decisions, "groups": []})


def _swap(prefetch: int = 1) -> dict:
    return {"action": "swap", "backward_prefetch": prefetch}


def llama_plans(layers: str = "layers") -> dict[str, Plan]:
    L = layers
    return {
        "plain-again": Plan(),
        "recompute-all": _plan({L: "recompute"}),
        "select-mul-l0": _plan({f"{L}.0.feed_forward.mul": "recompute"}),
        "swap-layers-0-2": _plan({f"{L}.{i}": _swap(1) for i in range(3)}),
        "op-swap-w1-l0": _plan({f"{L}.0.feed_forward.w1.matmul": _swap(1)}),
        "mixed": _plan({f"{L}.0": "recompute", f"{L}.1.feed_forward.mul": "recompute",
                        f"{L}.2": _swap(1), f"{L}.3.attention": _swap(0)}),
        "recompute-with-swap": _plan({f"{L}.1.feed_forward.mul": "recompute",
                                      f"{L}.1.feed_forward.w2": _swap(1)}),
    }


def hf_plans() -> dict[str, Plan]:
    L = "model.layers"
    return {
        "plain-again": Plan(),
        "recompute-all": _plan({L: "recompute"}),
        "select-act": _plan({f"{L}.{i}.mlp.act_fn.silu": "recompute" for i in range(2)}),
        "swap-attn": _plan({f"{L}.0.self_attn": _swap(0), f"{L}.1.self_attn": _swap(2)}),
        "mixed": _plan({f"{L}.1.mlp": "recompute", f"{L}.1.self_attn": _swap(1)}),
    }


def section(name: str) -> Callable:
    def wrap(fn: Callable) -> Callable:
        def run(*args: Any) -> None:
            start = time.perf_counter()
            print(f"== {name}", flush=True)
            try:
                RESULTS[name] = fn(*args)
            except BaseException as exc:  # reported in the JSON, the other sections still run
                RESULTS[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
                print(RESULTS[name]["traceback"], flush=True)
            RESULTS.setdefault(name, {})["seconds"] = round(time.perf_counter() - start, 1)
            print(json.dumps(RESULTS[name], default=str)[:1500], flush=True)
        return run
    return wrap


def seeded_step(bundle, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = bundle.model
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1234)
    loss = bundle.loss(batch)
    loss.backward()
    return loss.detach().cpu(), {n.removeprefix("_orig_mod."): p.grad.to("cpu", copy=True)
                                   for n, p in model.named_parameters() if p.grad is not None}


def compare(got, want, exact: bool) -> dict:
    worst = max((float((g.float() - want[1][k].float()).abs().max()) for k, g in got[1].items()), default=0.0)
    equal = torch.equal(got[0], want[0]) and all(torch.equal(g, want[1][k]) for k, g in got[1].items())
    close = all(torch.allclose(g.float(), want[1][k].float(), rtol=2e-2, atol=1e-4) for k, g in got[1].items())
    return {"equal": equal, "close": close, "max_abs_diff": worst, "ok": equal if exact else close,
            "loss": float(got[0]), "ref_loss": float(want[0])}


def _copier_kind(handle) -> str:
    found = set()
    for obj in _walk(handle, depth=4):
        if type(obj).__name__ in ("StreamCopier", "ThreadCopier"):
            found.add(type(obj).__name__)
    return ",".join(sorted(found)) or "none"


def _walk(obj, depth: int, seen=None):
    seen = seen if seen is not None else set()
    if depth < 0 or id(obj) in seen or isinstance(obj, (torch.Tensor, torch.nn.Module, str, int, float)):
        return
    seen.add(id(obj))
    yield obj
    children = vars(obj).values() if hasattr(obj, "__dict__") else (obj if isinstance(obj, (list, tuple)) else [])
    for child in list(children):
        yield from _walk(child, depth - 1, seen)


def run_plans(spec: str, plans: dict[str, Plan], *, dtype: str, compile: Any = None, **sizes: Any) -> dict:
    bundle = build_model(spec, device=DEVICE, dtype=dtype, seed=0, **sizes)
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
        except BaseException as exc:
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
    RESULTS["compiled"] = out
    bundle = build_model("llama-tiny", device=DEVICE, seed=0, batch_size=4, seq_len=256)
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
        except BaseException as exc:
            rows[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:600]}
        finally:
            bundle.model = eager
    return out


def _peak_step(bundle, batch, opt) -> tuple[int, float]:
    _cuda("synchronize")
    _cuda("reset_peak_memory_stats")
    start = time.perf_counter()
    bundle.model.zero_grad(set_to_none=False)
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
    bundle = build_model(spec, device=DEVICE, seed=0, **sizes)
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


def live_device_memory() -> dict:
    """What stays on the device after a section: allocated bytes, and the modules and tensors still alive."""
    import gc
    import warnings
    gc.collect()
    warnings.simplefilter("ignore", FutureWarning)  # isinstance over every object touches deprecated aliases
    tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.device.type == DEVICE]
    modules = [o for o in gc.get_objects() if isinstance(o, torch.nn.Module)
               and any(p.device.type == DEVICE for p in o.parameters(recurse=False))]
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


@contextlib.contextmanager
def capped(cap: int):
    """Device memory capped at ``cap`` bytes: a per-process fraction on CUDA, a ``DeviceMemory`` cap on a CPU smoke run."""
    if DEVICE != "cuda":
        with DeviceMemory(cap=cap):
            yield
        return
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(0).total_memory)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def _peaks(bundle, batch) -> tuple[int, int]:
    """(plain peak, live bytes between steps) of one step."""
    if DEVICE != "cuda":
        with DeviceMemory() as mem:
            seeded_step(bundle, batch)
            return mem.peak, mem.live
    _cuda("synchronize")
    _cuda("reset_peak_memory_stats")
    seeded_step(bundle, batch)
    return _cuda("max_memory_allocated"), _cuda("memory_allocated")


@section("oom")
def check_oom() -> dict:
    spec, sizes = ("llama-small", dict(batch_size=2, seq_len=2048)) if DEVICE == "cuda" else ("llama-tiny", {})
    bundle = build_model(spec, device=DEVICE, seed=0, **sizes)
    batch = bundle.batch(seed=0)
    ref = seeded_step(bundle, batch)
    plain_peak, static = _peaks(bundle, batch)
    copies = sum(p.numel() * p.element_size() for p in bundle.model.parameters()) if DEVICE != "cuda" else 0
    out = RESULTS["oom"] = {"plain_peak_MiB": plain_peak / 2**20, "static_MiB": static / 2**20}
    for share in (0.8, 0.6):
        cap = static + copies + int(share * (plain_peak - static))  # on a CPU smoke run the gradients' copies count
        try:
            out[f"cap {share:.0%}"] = _loop_under(bundle, batch, ref, cap)
        except BaseException as exc:
            out[f"cap {share:.0%}"] = {"cap_MiB": cap / 2**20, "error": f"{type(exc).__name__}: {exc}"[:800]}
    return out


def _loop_under(bundle, batch, ref, cap: int) -> dict:
    """The plain step, then 8 steps of the adaptive loop, under ``cap`` device bytes."""
    out: dict[str, Any] = {"cap_MiB": cap / 2**20}
    with capped(cap):
        try:
            seeded_step(bundle, batch)
            out["plain_under_cap"] = "no OOM (cap not binding)"
        except torch.OutOfMemoryError:
            out["plain_under_cap"] = "OOM as expected"
    rows = out["steps"] = []
    with capped(cap), adaptive_optimize(bundle.model, budget=cap, optimizer="sgd", pluggable_allocator=True,
                                        cache=False) as mem:
        for step in range(8):
            _cuda("reset_peak_memory_stats")
            row = compare(seeded_step(bundle, batch), ref, exact=False)
            rows.append({"step": step, "ok": row["ok"], "equal": row["equal"], "diff": row["max_abs_diff"],
                         "peak_MiB": _cuda("max_memory_allocated") / 2**20})
        out["summary"] = mem.summary()
        out["manager_stats"] = repr(mem.manager.stats)[:600]
    return out


@section("machinery")
def check_machinery(rounds: int) -> dict:
    out = {}
    for label, spec, sizes in (
            ("llama-tiny b8 s128 fp32", "llama-tiny", dict(batch_size=8, seq_len=128)),
            ("7B-shaped 4 layers b1 s4096 bf16", *big(4))):
        bundle = build_model(spec, device=DEVICE, seed=0, **sizes)
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
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device", file=sys.stderr)
        return 2
    RESULTS["env"] = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0) if DEVICE == "cuda" else DEVICE,
                      "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(RESULTS["env"], flush=True)
    chosen = args.sections.split(",")
    for name, fn in (("exact", check_exact), ("compiled", check_compiled), ("predict", check_predict),
                     ("oom", check_oom), ("machinery", lambda: check_machinery(args.rounds))):
        if name in chosen:
            fn()
            RESULTS.setdefault("live_after", {})[name] = live_device_memory()
            Path(args.out, "gpu_check.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
