"""``profile_step``: record one training step of a model into a :class:`Profile`."""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ._compiled import CompileBackendError, apply_compiled, check_backend, check_layout, measure_compiled
from ._compiled_whole import measure_whole_graph
from ._fingerprint import model_fingerprint
from ._hardware import hardware_spec, measure_device, measure_link
from ._optimizer_time import estimate_optimizer_seconds, measure_optimizer_seconds
from ._other_memory import AcceleratorMeter, MemoryMeter, measured_memory, read
from ._precision import Precision, PrecisionError, autocast_loss, check_model_dtype, precision_of
from ._profile import HardwareSpec, OpRecord, Profile, UnitRecord
from ._recorder import OpEvent, Recorder
from ._repeats import LayerTimer, take_median_times
from ._sync_fit import fit_to_step
from ._static import allocated_optimizer_state, gradient_split, held_beyond_model, static_memory
from ._target_kernels import cuda_attention
from ._timing import timed

__all__ = ["StepTarget", "profile_compiled", "profile_step"]

log = logging.getLogger(__name__)


@dataclass
class StepTarget:
    """What ``profile_step`` runs: a model, one step's inputs and a loss closure."""

    model: nn.Module
    """The model (parameters on the profiled device, or fake tensors)."""
    inputs: tuple[torch.Tensor, ...]
    """The step's inputs (counted as live memory; saved copies land in ``saved_input_bytes``)."""
    loss: Callable[[], torch.Tensor]
    """Runs the forward and returns the scalar loss."""
    fake_mode: Any = None
    """The ``FakeTensorMode`` of a fake model, or None."""
    info: dict[str, Any] | None = None
    """``spec``, ``batch_size``, ``seq_len``, ``dtype`` recorded in ``Profile.model``."""


def _target(target: Any, inputs: Sequence[torch.Tensor] | None, loss_fn: Callable | None) -> StepTarget:
    if isinstance(target, StepTarget):
        return target
    if isinstance(target, nn.Module):
        if inputs is None or loss_fn is None:
            raise ValueError("profile_step(model): expected inputs= and loss_fn=(model, inputs) -> scalar loss")
        batch = tuple(inputs)
        return StepTarget(model=target, inputs=batch, loss=lambda: loss_fn(target, batch),
                          fake_mode=_fake_mode_of(target))
    # A ModelBundle (duck-typed: the profiler does not import adaptive_mem).
    for attr in ("model", "batch", "loss"):
        if not hasattr(target, attr):
            raise ValueError(f"profile_step target {type(target).__name__}: expected an nn.Module or a ModelBundle")
    fake_mode = getattr(target, "fake_mode", None)
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        batch = tuple(target.batch(seed=0))
    info = {k: getattr(target, k) for k in ("spec", "batch_size", "seq_len") if hasattr(target, k)}
    info["dtype"] = str(getattr(target, "dtype", "")).removeprefix("torch.")
    return StepTarget(model=target.model, inputs=batch, loss=lambda: target.loss(batch), fake_mode=fake_mode, info=info)


def _fake_mode_of(model: nn.Module) -> Any:
    from torch._subclasses.fake_tensor import FakeTensor

    param = next(model.parameters(), None)
    return param.fake_mode if isinstance(param, FakeTensor) else None


def _device(model: nn.Module, fake: bool) -> torch.device:
    if fake:
        return torch.device("meta")
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def _resolve_hardware(hardware: str | HardwareSpec | None, device: torch.device, dtype: torch.dtype) -> HardwareSpec:
    if isinstance(hardware, HardwareSpec):
        return hardware
    if device.type == "meta":
        return hardware_spec(hardware or "h100", dtype=dtype)
    if device.type == "cpu":
        if hardware not in (None, "cpu"):
            raise ValueError(f"hardware={hardware!r}: a cpu profile is measured here; expected hardware=cpu "
                             "(or profile on device=meta to estimate for a named spec)")
        return hardware_spec("cpu", dtype=dtype)
    if hardware is None:
        return measure_device(device, dtype=dtype)
    return hardware_spec(hardware, dtype=dtype)


def _clear_grads(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def _plain_step_seconds(target: StepTarget, device: torch.device) -> float:
    """Seconds of one unrecorded forward + backward (``.grad`` cleared before and after)."""
    _clear_grads(target.model)
    seconds = timed(lambda: target.loss().backward(), device)
    _clear_grads(target.model)
    return seconds


def profile_step(
    target: Any,
    *,
    inputs: Sequence[torch.Tensor] | None = None,
    loss_fn: Callable[[nn.Module, tuple], torch.Tensor] | None = None,
    hardware: str | HardwareSpec | None = None,
    optimizer: str | torch.optim.Optimizer | None = None,
    warmup: int = 1,
    repeat: int = 3,
    record: int = 3,
    optimizer_time: float | None = None,
    compile: str | None = None,
    compile_layout: str = "per-block",
    meter: MemoryMeter | None = None,
    precision: str | Precision | None = None,
) -> Profile:
    """Profile one training step (forward + backward) of ``target``.

    ``target`` is a ``ModelBundle`` (from ``adaptive_mem.build_model``), a
    :class:`StepTarget`, or an ``nn.Module`` with ``inputs`` and ``loss_fn``.
    On a real device times are measured (``warmup`` untimed plain steps, then ``repeat`` timed plain steps whose
    median is ``step_time``, alternating with ``record`` recorded steps whose per-op median times are the ops'
    times (Note: [op time medians]); ``repeat=0`` takes ``step_time`` from the recorded ops); on fake tensors
    they are estimated for ``hardware`` (default ``h100``) from one recorded step.
    Parameter ``.grad`` are restored afterwards; the RNG state is untouched.
    ``optimizer_time``: seconds of one optimizer step when the caller knows them; None times a
    scratch copy of ``optimizer`` (Adam when None) on a real device and estimates it on fake tensors.
    ``compile``: a ``torch.compile`` backend (``inductor``, ``aot_eager``): the profile describes the model with
    every block compiled (:func:`profile_compiled`; ``compile_layout="whole-model"``: the whole model's saves).
    ``meter``: the device's live and peak bytes (``live()``, ``peak()``, ``reset_peak()``; on CPU an
    ``adaptive_mem.DeviceMemory``; on an accelerator its allocator's statistics by default): what the device
    holds beside the step's tensors is measured with it (``static.other``: Note: [other device memory]) and
    ``peak_memory`` is at least its peak; without one, ``other`` is what a parallel wrapper's own ops allocate
    (Note: [wrapper ops]) and the peak the recorder's count.
    ``precision``: a recipe of ``profiler.PRECISIONS`` (its static bytes, its autocast); None: the tensors' dtypes.
    """
    if compile is not None:
        check_backend(compile)
        check_layout(compile_layout, "compile_layout")
    if record < 1:
        raise ValueError(f"record={record}: expected at least one recorded step")
    step = _target(target, inputs, loss_fn)
    model = step.model
    fake = step.fake_mode is not None
    device = _device(model, fake)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    step, recipe = _with_recipe(step, precision_of(precision), dtype, compile)
    hw = _resolve_hardware(hardware, device, dtype)
    static = static_memory(model, optimizer=optimizer, precision=recipe)
    start = time.perf_counter()
    recorder, step_time = _record_restoring(step, device, hw, fake, warmup, repeat, 1 if fake else record, meter)
    present = allocated_optimizer_state(optimizer) if recorder.other.meter is not None else 0
    static, peak = measured_memory(recorder, static, present=present)
    result = _build(step, recorder, hw, static, device, fake, step_time, dtype, peak)
    result.optimizer_time = _optimizer_seconds(optimizer_time, model, optimizer or "adam", hw, fake)
    if compile is not None:
        result = profile_compiled(step, result, backend=compile, repeat=max(1, repeat), layout=compile_layout)
    log.info("profiled %d ops in %d units (%s, %s) in %.1f s", len(result.ops), len(result.units), device.type,
             "measured" if result.measured else f"estimated for {hw.name}", time.perf_counter() - start)
    return result


def _with_recipe(step: StepTarget, recipe: Precision | None, dtype: torch.dtype,
                 compile: str | None) -> tuple[StepTarget, Precision | None]:
    """``step`` run the recipe's way (its loss under the recipe's autocast, the recipe named in ``Profile.model``)."""
    if recipe is None:
        return step, None
    check_model_dtype(recipe, dtype)
    if recipe.autocast and compile is not None:
        raise PrecisionError(f"precision={recipe.name!r} with compile={compile!r}: expected no compile (compiled "
                             "blocks are measured without the recipe's autocast)")
    device_type = next(step.model.parameters()).device.type
    return replace(step, loss=autocast_loss(step.loss, recipe, device_type),
                   info={**(step.info or {}), "precision": recipe.name}), recipe


def _record_restoring(step: StepTarget, device: torch.device, hw: HardwareSpec, fake: bool, warmup: int, repeat: int,
                      record: int, meter: MemoryMeter | None) -> tuple[Recorder, float | None]:
    """:func:`_record` in training mode, under the step's fake mode and a forked RNG; the model's training flag
    and parameter ``.grad`` restored afterwards."""
    model = step.model
    saved_grads = [(p, p.grad) for p in model.parameters()]
    was_training = model.training
    model.train()
    rng_devices = [device] if device.type not in ("cpu", "meta") else []
    try:
        with torch.random.fork_rng(devices=rng_devices), (step.fake_mode or contextlib.nullcontext()):
            return _record(step, device, hw, fake, warmup, repeat, record, meter)
    finally:
        model.train(was_training)
        for p, grad in saved_grads:
            p.grad = grad


def _optimizer_seconds(given: float | None, model: nn.Module, optimizer: str | torch.optim.Optimizer,
                       hw: HardwareSpec, fake: bool) -> float:
    """``given`` seconds of one optimizer step (checked), else timed on a scratch copy, or estimated on fake tensors."""
    if given is not None:
        if given < 0:
            raise ValueError(f"optimizer_time={given}: expected seconds >= 0")
        return float(given)
    if fake:
        return estimate_optimizer_seconds(model, optimizer, hw)
    try:
        return measure_optimizer_seconds(model, optimizer)
    except (TypeError, ValueError) as exc:  # an optimizer class whose defaults are not its constructor's
        log.warning("optimizer step of %s not measurable on scratch parameters (%s); estimated from memory "
                    "bandwidth", type(optimizer).__name__, exc)
        return estimate_optimizer_seconds(model, optimizer, hw)


def _record(step: StepTarget, device: torch.device, hw: HardwareSpec, fake: bool, warmup: int,
            repeat: int, record: int, meter: MemoryMeter | None) -> tuple[Recorder, float | None]:
    if fake:
        return _record_once(step, device, hw, fake, None), None
    for _ in range(warmup):
        _plain_step_seconds(step, device)
    # Plain and recorded steps alternate, so each median draws on samples spread over the whole
    # profile rather than on one stretch of it that a slow spell of the machine may cover.
    plain: list[float] = []
    recorders: list[Recorder] = []
    blocks = LayerTimer(step.model, device)  # Note: [layer forward time]
    for i in range(max(repeat, record)):
        if i < repeat:
            with blocks:
                plain.append(_plain_step_seconds(step, device))
        if i < record:
            recorders.append(_record_once(step, device, hw, fake, meter))
    take_median_times(recorders)
    recorders[0].layer_forward = blocks.medians()
    recorders[0].other.peak = max(r.other.peak for r in recorders)
    recorders[0].device_peak = max((r.device_peak for r in recorders if r.device_peak is not None), default=None)
    return recorders[0], (statistics.median(plain) if plain else None)


def _record_once(step: StepTarget, device: torch.device, hw: HardwareSpec, fake: bool,
                 meter: MemoryMeter | None) -> Recorder:
    model = step.model
    _clear_grads(model)
    static_tensors = [*model.parameters(), *(b for b in model.buffers() if b is not None)]
    if meter is None and device.type not in ("cpu", "meta"):
        meter = AcceleratorMeter(device)
    recorder = Recorder(model, timing="estimate" if fake else "measure", hardware=hw, static=static_tensors,
                        sync_device=device if device.type not in ("cpu", "meta") else None, meter=meter)
    recorder.start_memory([*static_tensors, *step.inputs])
    if meter is not None:
        meter.reset_peak()
    with recorder.forward(), cuda_attention(hw.name if fake else None):  # Note: [fake attention on a CUDA target]
        loss = step.loss()
    with recorder.backward():
        loss.backward()
    if meter is not None:
        recorder.device_peak = read(meter, "peak")
    del loss
    _clear_grads(model)
    return recorder


def _build(step: StepTarget, recorder: Recorder, hw: HardwareSpec, static, device: torch.device, fake: bool,
           step_time: float | None, dtype: torch.dtype, peak: int) -> Profile:
    namer = recorder.namer
    if not fake:
        factor = fit_to_step(recorder, device, step_time)  # Note: [synchronized op times]
        if factor < 1.0:
            log.info("recorded op times scaled by %.3f to the measured %.4f s step (per-op synchronization)",
                     factor, step_time)
    ops = [_op_record(e, namer) for e in recorder.events]
    units = _units(recorder.events, namer)
    if step_time is None:
        step_time = sum(o.fwd_time + o.bwd_time for o in ops) + recorder.unattributed_bwd_time + recorder.wrapper_time
    link_source = "spec"
    if device.type == "cpu" or (device.type != "meta" and hw.source.startswith("measured")):
        link_source = "measured"  # the spec itself was measured on this device
    elif device.type != "meta":
        h2d, d2h = measure_link(device)
        hw = HardwareSpec(**{**hw.__dict__, "h2d_bandwidth": h2d, "d2h_bandwidth": d2h})
        link_source = "measured"
    info = dict(step.info or {})
    info.setdefault("spec", "")
    info.setdefault("dtype", str(dtype).removeprefix("torch."))
    info["parameters"] = sum(p.numel() for p in {id(p): p for p in step.model.parameters()}.values())
    info["fingerprint"] = model_fingerprint(step.model, input_shapes=[list(t.shape) for t in step.inputs],
                                            dtype=info["dtype"])
    layers = namer.layers
    split, largest = gradient_split(step.model, ops, layers.count if layers else 0)
    return Profile(
        model=info, device=device.type, measured=not fake, hardware=hw,
        layer_container=layers.container if layers else None, num_layers=layers.count if layers else 0,
        static=static, ops=ops, units=units, saved_input_bytes=recorder.saved_input_bytes,
        peak_memory=int(peak + held_beyond_model(static, step.model)), step_time=float(step_time),
        link_source=link_source, unattributed_time=recorder.unattributed_bwd_time,
        layer_stacks=[{"container": c, "count": n} for c, n in layers.stacks] if layers and len(layers.stacks) > 1
        else [],
        gradient_split=split, gradient_largest=largest, layer_forward=recorder.layer_forward,
    )


def _op_record(event: OpEvent, namer) -> OpRecord:
    layer, _ = namer.split(event.unit)
    return OpRecord(
        index=event.index, op=str(event.func), unit=event.unit, module=event.module, layer=layer,
        output_bytes=event.output_bytes, saved_bytes=event.saved_bytes, fwd_time=event.fwd_time,
        bwd_time=event.bwd_time, flops=event.flops, consumers=sorted(event.consumers),
        saves_inputs=event.saves_inputs, saves_outputs=event.saves_outputs, saved_tensors=event.saved_tensors,
        view_ops=event.view_ops,
    )


def _units(events: list[OpEvent], namer) -> list[UnitRecord]:
    order: dict[str, list[OpEvent]] = {}
    for e in events:
        order.setdefault(e.unit, []).append(e)
    unit_of = {e.index: e.unit for e in events}
    out = []
    for name, members in order.items():
        layer, local = namer.split(name)
        consumers = []
        for e in members:
            for c in sorted(e.consumers):
                if unit_of[c] != name and unit_of[c] not in consumers:
                    consumers.append(unit_of[c])
        out.append(UnitRecord(
            name=name, local_name=local, layer=layer, ops=[e.index for e in members],
            output_bytes=sum(e.output_bytes for e in members), saved_bytes=sum(e.saved_bytes for e in members),
            fwd_time=sum(e.fwd_time for e in members), bwd_time=sum(e.bwd_time for e in members),
            consumers=consumers,
        ))
    return out


def profile_compiled(target: Any, profile: Profile, *, backend: str, repeat: int = 3,
                     layout: str = "per-block") -> Profile:
    """``profile`` (eager, of ``target``) rewritten to the model with every block compiled by ``backend``
    (``torch.compile`` per block): what each compiled block saves and its times, measured on ``target``
    (``profiler._compiled``; Note: [compiled profile]). ``layout="whole-model"``: the saved bytes are those of
    the model compiled whole (Note: [whole-model compiled profile]). The model is left as it was."""
    check_backend(backend)
    check_layout(layout)
    if profile.compiled is not None:
        raise CompileBackendError(f"profile.compiled.backend={profile.compiled['backend']!r}: already a compiled profile; "
                         "expected the eager profile of the model")
    step = _target(target, None, None)
    if step.fake_mode is not None:
        raise CompileBackendError(f"compile={backend!r} on fake tensors: expected a real device (compiled blocks are measured)")
    info = profile.layer_info()
    if info is None:
        raise CompileBackendError(f"compile={backend!r}: the model has no repeated blocks to compile per block")
    model = step.model
    layers = [model.get_submodule(info.layer_path(i)) for i in range(info.count)]
    was_training = model.training
    model.train()
    device = _device(model, False)
    saved_grads = [(p, p.grad) for p in model.parameters()]
    try:
        with torch.random.fork_rng(devices=[device] if device.type != "cpu" else []):
            figures = measure_compiled(model, step.loss, layers, backend=backend, device=device, repeat=repeat)
            whole = measure_whole_graph(model, step.loss, backend=backend) if layout == "whole-model" else None
    finally:
        model.train(was_training)
        for p, grad in saved_grads:
            p.grad = grad
    if whole is None:
        return apply_compiled(profile, figures)
    return apply_compiled(profile, {**figures, "layout": layout, "whole": whole})
