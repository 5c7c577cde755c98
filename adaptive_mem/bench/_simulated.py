"""The target-hardware report: fake-tensor profiles of big models, plans per pipeline stage, throughput.

Nothing is allocated: each model is built under ``FakeTensorMode`` and profiled with roofline
estimates for the hardware (``profile_step`` on a ``device="meta"`` bundle); every configuration
is searched per pipeline stage (1F1B, ``min(P - s, M)`` micro-batches in flight on stage ``s``)
under the device's memory, and compared with full recompute in the seeds' table form.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

__all__ = ["SimConfig", "DEFAULT_CONFIGS", "simulate_targets", "model_flops"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SimConfig:
    model: str
    """A preset (``llama2-7b``, ``llama2-70b``)."""
    micro_batch: int
    """Micro-batch size (sequences)."""
    stages: int
    """Pipeline stages P (1 = single device per replica)."""
    micro_batches: int
    """Micro-batches per step M."""
    dp: int
    """Data-parallel replicas; the optimizer state is sharded over them (distributed optimizer)."""

    def describe(self, seq: int) -> str:
        return (f"seq-length={seq}, micro-batch-size={self.micro_batch}, global-batch-size="
                f"{self.micro_batch * self.micro_batches * self.dp}, PP={self.stages}, DP={self.dp}, "
                f"distributed optimizer")


DEFAULT_CONFIGS: tuple[SimConfig, ...] = (
    SimConfig("llama2-7b", micro_batch=4, stages=1, micro_batches=1, dp=8),
    SimConfig("llama2-7b", micro_batch=4, stages=4, micro_batches=8, dp=2),
    SimConfig("llama2-70b", micro_batch=1, stages=1, micro_batches=1, dp=8),
    SimConfig("llama2-70b", micro_batch=1, stages=8, micro_batches=16, dp=8),
)

POLICIES = (("adaptive-mem (milp)", "milp"), ("Megatron selective", "selective"), ("full recompute", "full"))


def model_flops(profile: Any) -> float:
    """Model FLOPs of one micro-batch (forward + backward, recompute not counted): its tokens times
    ``adaptive_mem.estimate``'s FLOPs per token."""
    from adaptive_mem._estimate import model_flops_per_token

    params = profile.static.parameters / _dtype_bytes(profile.model.get("dtype", "bfloat16"))
    tokens = profile.model["batch_size"] * profile.model["seq_len"]
    return tokens * model_flops_per_token(parameters=params, num_layers=profile.num_layers,
                                          hidden_size=profile.model.get("hidden_size") or 0,
                                          seq_len=profile.model["seq_len"])


def _dtype_bytes(name: str) -> int:
    return 4 if str(name) in ("float32", "fp32") else 2


def _profile(spec: str, micro_batch: int, hardware: str) -> Any:
    import profiler

    from adaptive_mem._model_spec import build_model

    bundle = build_model(spec, device="meta", dtype="bfloat16", batch_size=micro_batch)
    profile = profiler.profile_step(bundle, hardware=hardware, optimizer="adam")
    cfg = bundle.model.config
    return replace(profile, model={**profile.model, "hidden_size": cfg.hidden_size})


def _sharded(profile: Any, dp: int) -> Any:
    st = profile.static
    cut = st.optimizer_state - st.optimizer_state // dp
    return replace(profile, static=replace(st, optimizer_state=st.optimizer_state // dp),
                   peak_memory=profile.peak_memory - cut)


def _run_config(profile: Any, cfg: SimConfig, solver: str, capacity: int) -> dict[str, Any]:
    from search import InfeasibleBudgetError, Problem, StepModel, get_solver
    from search.planning import split_stages

    if cfg.stages == 1:
        stages = [(StepModel.build(profile), 1)]
    else:
        stages = [(st.model, st.in_flight) for st in split_stages(profile, stages=cfg.stages,
                                                                  micro_batches=cfg.micro_batches)]
    times = []
    peaks = []
    for model, in_flight in stages:
        try:
            r = get_solver(solver).solve(Problem(model, capacity, in_flight=in_flight))
        except InfeasibleBudgetError as exc:
            return {"tflops": None, "note": str(exc).split(":")[0] + ": does not fit in device memory"}
        times.append(r.cost.step_time)
        peaks.append(r.cost.peak_bytes)
    # 1F1B: (M + P - 1) slots of the slowest stage's micro-batch time.
    step = (cfg.micro_batches + cfg.stages - 1) * max(times)
    flops = cfg.micro_batches * model_flops(profile)
    return {"tflops": flops / step / cfg.stages / 1e12, "step_time": step, "peak_bytes": max(peaks)}


def simulate_targets(*, hardware: str = "h100", configs: tuple[SimConfig, ...] = DEFAULT_CONFIGS,
                     pareto_model: str | None = "llama2-7b", capacity: int | None = None,
                     progress: bool = False) -> dict[str, Any]:
    """The ``simulated`` section of results.json: table rows and the Pareto curves of ``pareto_model``.

    ``capacity``: device bytes per device (default: the hardware's memory)."""
    import profiler
    from tqdm import tqdm

    if capacity is None:
        capacity = profiler.hardware_spec(hardware).device_memory
    profiles: dict[tuple[str, int], Any] = {}
    rows = []
    for cfg in tqdm(configs, desc="simulated configs", disable=not progress, leave=False):
        key = (cfg.model, cfg.micro_batch)
        if key not in profiles:
            log.info("fake-tensor profile of %s (micro-batch %d) for %s", cfg.model, cfg.micro_batch, hardware)
            profiles[key] = _profile(cfg.model, cfg.micro_batch, hardware)
        profile = _sharded(profiles[key], cfg.dp)
        results = {name: _run_config(profile, cfg, solver, capacity) for name, solver in POLICIES}
        full = results["full recompute"].get("tflops")
        for name, res in results.items():
            gain = None
            if res.get("tflops") is not None and full and name != "full recompute":
                gain = res["tflops"] / full - 1
            rows.append({"model": cfg.model, "policy": name, "configuration": cfg.describe(profile.model["seq_len"]),
                         "devices": cfg.stages * cfg.dp, "tflops": res.get("tflops"), "gain": gain,
                         "step_time": res.get("step_time"), "peak_bytes": res.get("peak_bytes"),
                         "note": res.get("note")})
    out: dict[str, Any] = {
        "hardware": hardware, "device_memory": capacity, "rows": rows,
        "method": (f"Budget: the {hardware}'s {capacity / 2**30:.0f} GiB per device. bf16, Adam state sharded over "
                   "DP (distributed optimizer). Times are roofline estimates of the fake-tensor profile; a 1F1B "
                   "step is (M + P - 1) x the slowest stage's micro-batch time; TFLOPs per device = model FLOPs "
                   "(6 N T + 12 L h s T, recompute not counted) / step time / P."),
    }
    if pareto_model:
        from search import StepModel

        from ._sweep import sweep

        cfg = next((c for c in configs if c.model == pareto_model and c.stages == 1), None)
        if cfg is not None:
            model = StepModel.build(_sharded(profiles[(cfg.model, cfg.micro_batch)], cfg.dp))
            curves = sweep(model, ["milp", "full", "selective", "greedy", "swap-only"], 10)
            out["pareto"] = {k: [list(p) for p in v] for k, v in curves.items()}
            out["pareto_model"] = f"{cfg.model} (micro-batch {cfg.micro_batch}, DP={cfg.dp})"
    return out
