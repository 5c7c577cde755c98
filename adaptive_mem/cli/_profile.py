"""``adaptive-mem profile``: profile one training step of a model spec and write the Profile JSON."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import profiler
import torch
from profiler.tracing import precision_of, rank_share
from search import fmt_bytes
from search.planning import busiest_stage, device_shortfall, keep_all, rank_peak, simulate_assignment, split_layout

from adaptive_mem._model_spec import DTYPES, FORMS, build_model
from adaptive_mem.config._layout import positive_int

NAME = "profile"
HELP = "profile one training step: per-op saved activations, fwd/bwd times, static memory, link bandwidth"

log = logging.getLogger(__name__)

HARDWARE_NAMES = (*profiler.HARDWARE, "cpu")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model-spec flags every command that builds a model shares."""
    parser.add_argument("--model", required=True, metavar="SPEC", help=f"model spec: {FORMS}")
    parser.add_argument("--model-args", default=None, metavar="K=V,...",
                        help="overrides of the model's config, e.g. num_hidden_layers=2,hidden_size=128")
    parser.add_argument("--batch-size", default=None, metavar="B", help="micro-batch size (default: the spec's)")
    parser.add_argument("--seq-len", default=None, metavar="S", help="sequence length (default: the spec's)")
    parser.add_argument("--dtype", default="float32", metavar="D", help="float32 (default), bfloat16 or float16")
    parser.add_argument("--device", default="cpu", metavar="DEV",
                        help="cpu (measure here, default) or meta (fake tensors: exact sizes, estimated times)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--hardware", default=None, metavar="NAME",
                        help=f"hardware spec for estimated times: {', '.join(HARDWARE_NAMES)} "
                             "(default: cpu on --device cpu, h100 on --device meta)")
    parser.add_argument("--optimizer", default="adam", metavar="OPT",
                        help=f"optimizer whose state counts as static memory: {', '.join(profiler.OPTIMIZERS)} "
                             "(default adam)")
    parser.add_argument("--precision", default=None, metavar="R",
                        help=f"precision recipe: {', '.join(profiler.PRECISIONS)}: static memory in its bytes per "
                             "parameter (master weights, optimizer state dtype, what ZeRO/FSDP shard), the model in "
                             "its dtype and the forward under its autocast (default: the --dtype tensors as they are)")
    parser.add_argument("-o", "--output", default=None, metavar="FILE", help="write the Profile JSON here")
    parser.add_argument("--calibrate", action="store_true",
                        help="also measure the compute that swaps and op-level recompute cost on this device "
                             "(a few plain, swap-every-layer and one-unit-recomputed steps): "
                             "hardware.swap_compute_bandwidth and hardware.sac_op_overhead; one Python dispatch "
                             "and one saved-tensor hook call, hardware.dispatch_call_time and hook_call_time; the "
                             "disk tier's bandwidth, hardware.disk_bandwidth; real devices only")
    parser.add_argument("--compile", default=None, metavar="BACKEND",
                        help="profile the model with every block compiled by this torch.compile backend (inductor, "
                             "aot_eager): what each compiled block saves and its times, for keep and full recompute "
                             "(profile.compiled); plans searched on it are for the model compiled per block; with "
                             "--device meta, inductor modelled (profiler.compiled_estimate)")
    parser.add_argument("--compile-layout", default=None, metavar="LAYOUT",
                        help="with --compile: per-block (default) or whole-model: the saved bytes per unit are those "
                             "of the model compiled whole (torch.compile(model)); times stay the blocks'")
    parser.add_argument("--top", default="10", metavar="N", help="units listed in the top-units table (default 10)")
    from ._layout_args import add_layout_arguments

    add_layout_arguments(parser)


def build_from_args(args: argparse.Namespace):
    recipe = precision_arg(getattr(args, "precision", None), args.dtype)
    return build_model(
        args.model, model_args=args.model_args, batch_size=positive_int("--batch-size", args.batch_size),
        seq_len=positive_int("--seq-len", args.seq_len), device=args.device,
        dtype=args.dtype if recipe is None else recipe.model_dtype,
    )


def precision_arg(name: str | None, dtype: str) -> profiler.Precision | None:
    """The recipe ``--precision`` names (None without one); ``--dtype`` other than its model dtype is refused."""
    recipe = precision_of(name, key="--precision")
    if recipe is None:
        return None
    wanted = str(recipe.model_dtype).removeprefix("torch.")
    if DTYPES.get(str(dtype).lower()) not in (torch.float32, recipe.model_dtype):  # --dtype's default: the recipe's
        raise profiler.PrecisionError(f"--dtype={dtype!r} with --precision={recipe.name}: expected --dtype {wanted} "
                                      "or no --dtype (the recipe sets the parameters' dtype)")
    return recipe


def check_hardware(name: str | None, device: str) -> None:
    """Fail before any work on a hardware name that is unknown or does not fit the device."""
    if name is None:
        return
    if name.lower() not in HARDWARE_NAMES:
        raise ValueError(f"--hardware={name!r}: unknown; expected one of {', '.join(HARDWARE_NAMES)}")
    if device == "cpu" and name.lower() != "cpu":
        raise ValueError(f"--hardware={name!r}: a --device cpu profile is measured; expected cpu, "
                         "or --device meta to estimate times for that hardware")


def run(args: argparse.Namespace) -> int:
    from ._layout_args import layout_from_args

    top = positive_int("--top", args.top)
    check_hardware(args.hardware, args.device)
    layout = layout_from_args(args)
    if layout.tensor_parallel > 1 and args.device == "cpu":
        raise ValueError(f"--tensor-parallel={layout.tensor_parallel} with --device cpu: the collectives are timed on "
                         "a device's interconnect; expected --device meta with --hardware naming it")
    if args.optimizer.lower() not in profiler.OPTIMIZERS:
        raise ValueError(f"--optimizer={args.optimizer!r}: expected one of {', '.join(profiler.OPTIMIZERS)}")
    if args.compile is not None:
        from profiler.tracing import check_backend

        check_backend(args.compile)
        if args.device == "meta" and args.compile != "inductor":
            raise ValueError(f"--compile={args.compile!r} with --device meta: expected inductor (modelled on fake "
                             "tensors: profiler.compiled_estimate) or a real device (compiled blocks are measured)")
    compile_layout = _compile_layout(args)
    output = Path(args.output) if args.output else None
    if output is not None and not output.parent.exists():
        raise ValueError(f"--output={args.output!r}: directory {str(output.parent)!r} does not exist")
    bundle = build_from_args(args)
    log.info("profiling %s (batch %d x seq %d, %s) on %s", bundle.spec, bundle.batch_size, bundle.seq_len,
             str(bundle.dtype).removeprefix("torch."), args.device)
    if args.calibrate and bundle.is_fake:
        raise ValueError(f"--calibrate with --device {args.device}: expected a real device (fake tensors "
                         "have no copies to time)")
    modelled = args.compile if bundle.is_fake else None  # Note: [compile model]: inductor on fake tensors
    result = profiler.profile_step(bundle, hardware=args.hardware, optimizer=args.optimizer.lower(),
                                   compile=None if modelled else args.compile, compile_layout=compile_layout,
                                   precision=args.precision)
    if modelled:
        result = profiler.compiled_estimate(result, backend=modelled)
    if args.calibrate:
        from adaptive_mem.adaptive._calibrate import calibrate

        result = calibrate(bundle, result)
    if layout != profiler.Layout():
        result = _shard(result, bundle, layout)
    print(profiler.format_summary(result, top=top))
    static, where = result.static.total, ""
    if layout.pipeline_stages > 1:
        static, where = _busiest_rank(result)
    shortfall = device_shortfall(result.hardware, static=static)
    if shortfall:
        log.warning("%s%s", where, shortfall)
    if output is not None:
        result.save(output)
        log.info("profile written to %s", output)
    return 0


def _busiest_rank(result: profiler.Profile) -> tuple[int, str]:
    """Print the static memory and keep-all peak of one rank of the pipeline stage with the most static memory
    (Note: [stage static]); return its static bytes and the phrase naming it."""
    layout = profiler.Layout.from_dict(result.model["layout"])
    busiest = busiest_stage(result, layout)
    mine = [st for st in split_layout(result, layout=layout) if st.index == busiest.index]
    peak = rank_peak(mine, [simulate_assignment(st.model, keep_all(st.model), in_flight=st.in_flight).peak_bytes
                            for st in mine])
    static, where = busiest.static, f"one rank of {busiest.describe(layout.pipeline_stages)}, the busiest: "
    print(f"{where}static {fmt_bytes(static.total)}: parameters {fmt_bytes(static.parameters)}, gradients "
          f"{fmt_bytes(static.gradients)}, optimizer state {fmt_bytes(static.optimizer_state)}"
          + (f", master weights {fmt_bytes(static.master)}" if static.master else "")
          + (f", buffers {fmt_bytes(static.buffers)}" if static.buffers else "")
          + (f", beside the step {fmt_bytes(static.other)}" if static.other else "")
          + f"; keep-all peak {fmt_bytes(peak)} with {sum(st.in_flight for st in mine)} micro-batches in flight")
    return static.total, where


def _shard(result: profiler.Profile, bundle, layout: profiler.Layout) -> profiler.Profile:
    """One rank's share of the profiled step (``profiler.tracing.rank_share``)."""
    shared = rank_share(result, bundle.model, layout)
    log.info("cut to one rank of %s: static %s -> %s, saved activations %s -> %s",
             ", ".join(f"{k}={v}" for k, v in layout.to_dict().items() if v != getattr(profiler.Layout(), k)),
             fmt_bytes(result.static.total), fmt_bytes(shared.static.total), fmt_bytes(result.saved_bytes),
             fmt_bytes(shared.saved_bytes))
    return shared


def _compile_layout(args: argparse.Namespace) -> str:
    """``--compile-layout`` checked against ``--compile`` and ``--device``."""
    if args.compile_layout is None:
        return "per-block"
    from profiler.tracing import check_layout

    check_layout(args.compile_layout, "--compile-layout")
    if args.compile is None:
        raise ValueError(f"--compile-layout={args.compile_layout!r} without --compile: expected --compile BACKEND")
    if args.device == "meta" and args.compile_layout != "per-block":
        raise ValueError(f"--compile-layout={args.compile_layout!r} with --device meta: expected per-block (the "
                         "compile model on fake tensors is per block) or a real device")
    return args.compile_layout
