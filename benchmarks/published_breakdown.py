"""Where a published run's predicted memory goes: one rank's peak of ``benchmarks/published_runs.py`` taken apart.

    python benchmarks/published_breakdown.py [--rows NAME,...]

SIMULATION on fake tensors (``device="meta"``), no GPU. For each row the rank's profile is built as
``adaptive_mem.estimate`` builds it and printed by kind: static memory (parameters, gradients, master weights,
optimizer state, FSDP's gathered and reduce-scatter buffers), the bytes saved per layer by unit with the ops that
save them, the saved bytes outside the layers (embeddings, logits, loss), the loss/logits workspace the simulator
holds at the start of backward beside them (``boundary``), what the published AC mode keeps, and the allocator
reserve (reserved less allocated). For a GELU-MLP block (the MPT rows) the saved bytes per layer are set beside a
hand count: Korthikanti et al. 2022 (section 4.1) without dropout masks and with flash attention (no ``s x s``
terms): ``s b (16 h + 4 f)`` bytes (LayerNorm inputs 2 + 2, QKV and fc1 inputs 2 + 2, Q K V 6, attention output 2,
GELU input and output 4 f / h) plus the logsumexp, ``4 b a s``. ``mindspeed-seed`` prints the same per pipeline
stage of the seed table's Megatron block-recompute baselines.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import profiler
import torch
from adaptive_mem import ac_plan, build_model
from profiler import Layout
from profiler.tracing import precision_of, rank_share
from search import StepModel, simulate
from search.planning import resolve, split_layout

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_parallel_sim  # noqa: E402
import published_runs  # noqa: E402

GIB, MIB = 2 ** 30, 2 ** 20
STATIC = ("parameters", "gradients", "master", "optimizer_state", "buffers", "other")


def _profiles(run: published_runs.Run) -> tuple[profiler.Profile, profiler.Profile, object]:
    """(whole-model profile, one rank's profile, the model bundle) as ``adaptive_mem.estimate`` builds them."""
    kw = run.kwargs
    recipe = precision_of(kw["precision"], optional=False)
    bundle = build_model(run.model, model_args=run.model_args, batch_size=kw["batch_size"], seq_len=kw["seq_len"],
                         device="meta", dtype=recipe.model_dtype)
    spec = profiler.hardware_spec(kw["hardware"], dtype=getattr(torch, recipe.compute))
    whole = profiler.profile_step(bundle, hardware=spec, optimizer="adam", precision=recipe.name)
    if run.compiled and published_runs.COMPILE_MODELLED:
        whole = profiler.compiled_estimate(whole)
    layout = Layout(data_parallel=kw["gpus"], zero=kw.get("zero", 0))
    return whole, rank_share(whole, bundle.model, layout), bundle


def _static(static: profiler.StaticMemory) -> str:
    return ", ".join(f"{k} {getattr(static, k) / GIB:.2f}" for k in STATIC) + f"; total {static.total / GIB:.2f} GiB"


def _layer_units(rank: profiler.Profile, layer: int) -> None:
    for u in rank.units:
        if u.layer != layer:
            continue
        ops = [rank.ops[i] for i in u.ops if rank.ops[i].saved_bytes]
        saved = ", ".join(f"{o.op.split('.')[-2] if '.' in o.op else o.op} {o.saved_bytes / MIB:.0f}" for o in ops)
        print(f"      {u.local_name:<34}{u.saved_bytes / MIB:>9.1f} MiB  [{saved}]")


def _hand_count(bundle: object, run: published_runs.Run) -> str:
    config = getattr(bundle.model, "config", None)
    if getattr(config, "model_type", "") != "gpt2":
        return ""
    s, b, h = run.kwargs["seq_len"], run.kwargs["batch_size"], config.n_embd
    f, a = config.n_inner or 4 * h, config.n_head
    return f"; hand count s b (16 h + 4 f) + 4 b a s = {(s * b * (16 * h + 4 * f) + 4 * b * a * s) / MIB:.1f} MiB"


def breakdown(run: published_runs.Run) -> None:
    """One row's rank peak by kind (module docstring)."""
    whole, rank, bundle = _profiles(run)
    model = StepModel.build(rank)
    arm = run.arms[0]
    result = published_runs._estimate(run, arm.ac, arm.solver)
    grads = sum(p.numel() * p.element_size() for p in {id(p): p for p in bundle.model.parameters()}.values()
                if p.requires_grad)
    print(f"\n== {run.name}: {arm.label} ({arm.ac}), {run.kwargs['precision']}")
    print(f"   static (rank): {_static(rank.static)}")
    print(f"   gradients: the recipe's {whole.static.gradients / GIB:.2f} GiB (whole model), recorded in the model's "
          f"dtype {grads / GIB:.2f} GiB; the recorded peak holds the {(whole.static.gradients - grads) / GIB:.2f} "
          f"GiB between them for the whole step (Note: [precision peak]), which the boundary below inherits")
    layer = [u.saved_bytes for u in rank.units if u.layer == 0]
    print(f"   saved per layer (layer 0): {sum(layer) / MIB:.1f} MiB{_hand_count(bundle, run)}; all "
          f"{rank.num_layers} layers {sum(u.saved_bytes for u in rank.units if u.layer is not None) / GIB:.2f} GiB")
    _layer_units(rank, 0)
    for u in rank.units:
        if u.layer is None and u.saved_bytes:
            print(f"      outside the layers: {u.name:<26}{u.saved_bytes / MIB:>9.1f} MiB")
    asg = resolve(model, ac_plan(arm.ac, rank))
    kept = Counter()
    for u in model.units:
        kept["in layers" if model.layer_of(u.position) is not None else "outside"] += (
            u.saved if asg.actions[u.index].name == "KEEP" else 0)
    print(f"   {arm.ac} keeps: " + ", ".join(f"{k} {v / GIB:.2f} GiB" for k, v in kept.items()))
    print(f"   held for the whole step (static less gradients, FSDP buffers in) {model.base / GIB:.2f} GiB; "
          f"loss/logits workspace at the start of backward (boundary) {model.boundary / GIB:.2f} GiB; largest "
          f"allocation {model.largest_allocation / GIB:.2f} GiB")
    print(f"   {arm.label}: allocated {result.peak_allocated_bytes / GIB:.2f} GiB, reserved "
          f"{result.peak_reserved_bytes / GIB:.2f} GiB (allocator reserve "
          f"{(result.peak_reserved_bytes - result.peak_allocated_bytes) / GIB:.2f} GiB) of "
          f"{result.device_memory_bytes / GIB:.2f} GiB")


def breakdown_seed(precision: str = "megatron-bf16") -> None:
    """The seed table's Megatron block-recompute baselines per pipeline stage."""
    for name, layout, batch, n, _ in bench_parallel_sim.SEED:
        rank = bench_parallel_sim.rank_profile(layout, batch, precision)
        print(f"\n== {published_runs.SEED_NAME} {name}: micro-batch {batch}, recompute-num-layers {n}, {precision}")
        print(f"   static (rank): {_static(rank.static)}")
        stages = split_layout(rank, layout=layout)
        base = bench_parallel_sim.megatron_block(layout, rank.num_layers, n)
        for st in stages:
            m = st.model
            sim = simulate(m, bench_parallel_sim._only(base, st.layers), in_flight=st.in_flight)
            saved = [sum(m.units[i].saved for i in m.positions[p + 1]) / GIB for p in st.layers]
            print(f"   stage {st.index} layers {list(st.layers)}, {st.in_flight} in flight: held {m.base / GIB:.2f}, "
                  f"boundary {m.boundary / GIB:.2f}, saved per layer {', '.join(f'{x:.2f}' for x in saved)}, "
                  f"peak {sim.peak_bytes / GIB:.2f} GiB")
        print(f"   saved per layer (layer 0): {sum(u.saved_bytes for u in rank.units if u.layer == 0) / MIB:.1f} MiB")
        _layer_units(rank, 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", help="comma-separated row names (default: all)")
    args = parser.parse_args(argv)
    print("SIMULATION on fake tensors, no GPU: predicted bytes by kind")
    for name in published_runs._selected(args.rows):
        if name == published_runs.SEED_NAME:
            breakdown_seed()
        else:
            breakdown(next(r for r in published_runs.ROWS if r.name == name))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
