"""Synthetic profiles: L identical (or jittered) layers of K units with chosen bytes and times.

Test fixtures: brute-force checks need small instances with known numbers.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from profiler import HardwareSpec, OpRecord, Profile, StaticMemory, UnitRecord

__all__ = ["SyntheticUnit", "synthetic_profile", "random_profile"]

GiB = 1 << 30


@dataclass(frozen=True)
class SyntheticUnit:
    local_name: str
    """Name inside the layer; a name ending in ``matmul`` / ``flash_attention`` marks a SAC ``MUST_SAVE`` op."""
    saved_bytes: int
    """Bytes autograd saves from the unit's output."""
    fwd_time: float
    """Forward seconds."""
    bwd_time: float
    """Backward seconds."""
    output_bytes: int | None = None
    """Output bytes (default: ``saved_bytes``)."""


def _hardware(bandwidth: float) -> HardwareSpec:
    return HardwareSpec(name="synthetic", peak_flops=1e12, memory_bandwidth=1e12, h2d_bandwidth=bandwidth,
                        d2h_bandwidth=bandwidth, device_memory=80 * GiB, source="synthetic")


def synthetic_profile(*, layers: list[list[SyntheticUnit]], static: int = 0, bandwidth: float = 1e9,
                      boundary_bytes: int = 0, measured: bool = False, gradients: int = 0) -> Profile:
    """A Profile of ``len(layers)`` layers under ``layers.<i>``, units chained in order.

    Each unit consumes the previous unit's output; the last unit of a layer is consumed by the
    first unit of the next layer (the layer output). ``boundary_bytes`` is extra peak memory
    beyond static + saved activations (the loss / logits workspace).
    """
    ops: list[OpRecord] = []
    units: list[UnitRecord] = []
    for li, layer in enumerate(layers):
        for spec in layer:
            idx = len(ops)
            name = f"layers.{li}.{spec.local_name}"
            label = spec.local_name.rsplit(".", 1)[-1]
            aten = {"matmul": "aten.mm.default",
                    "flash_attention": "aten._scaled_dot_product_flash_attention.default"}.get(label, f"aten.{label}.default")
            out = spec.saved_bytes if spec.output_bytes is None else spec.output_bytes
            ops.append(OpRecord(index=idx, op=aten, unit=name, module=name.rsplit(".", 1)[0], layer=li,
                                output_bytes=out, saved_bytes=spec.saved_bytes, fwd_time=spec.fwd_time,
                                bwd_time=spec.bwd_time, flops=0, consumers=[]))
            units.append(UnitRecord(name=name, local_name=spec.local_name, layer=li, ops=[idx], output_bytes=out,
                                    saved_bytes=spec.saved_bytes, fwd_time=spec.fwd_time, bwd_time=spec.bwd_time,
                                    consumers=[]))
    # chain consumers: unit i feeds unit i+1
    for i in range(len(units) - 1):
        units[i].consumers.append(units[i + 1].name)
        ops[i].consumers.append(i + 1)
    saved = sum(u.saved_bytes for u in units)
    fwd = sum(u.fwd_time for u in units)
    bwd = sum(u.bwd_time for u in units)
    return Profile(
        model={"spec": "synthetic", "fingerprint": None, "batch_size": 1, "seq_len": 1, "dtype": "float32",
               "parameters": static // 4},
        device="meta", measured=measured, hardware=_hardware(bandwidth), layer_container="layers",
        num_layers=len(layers), static=StaticMemory(parameters=static // 3, gradients=gradients,
                                                   optimizer_state=static - static // 3),
        ops=ops, units=units, saved_input_bytes=0, peak_memory=static + saved + boundary_bytes,
        step_time=fwd + bwd,
    )


_NAMES = ["norm", "attention.wq.matmul", "attention.flash_attention", "attention.wo.matmul", "add",
          "feed_forward.w1.matmul", "feed_forward.w1.activation.silu", "feed_forward.mul", "feed_forward.w2.matmul",
          "add_1"]


def random_profile(rng: random.Random, *, num_layers: int, units_per_layer: int, identical: bool = True,
                   bandwidth: float | None = None) -> Profile:
    """Random layers of ``units_per_layer`` units (bytes in MiB steps, times in ms steps)."""
    def make_layer() -> list[SyntheticUnit]:
        out = []
        for k in range(units_per_layer):
            label = _NAMES[k % len(_NAMES)] + ("" if k < len(_NAMES) else f"_{k}")
            saved = rng.choice([0, 1, 2, 3, 4, 6, 8]) << 20
            output = saved if rng.random() < 0.7 else saved + (rng.choice([1, 2, 4]) << 20)
            out.append(SyntheticUnit(label, saved, rng.choice([1, 2, 3, 5, 8]) * 1e-3,
                                     rng.choice([2, 3, 4, 6, 10]) * 1e-3, output))
        return out

    first = make_layer()
    layers = [first if identical else make_layer() for _ in range(num_layers)]
    bw = bandwidth if bandwidth is not None else rng.choice([0.5e9, 1e9, 4e9])
    return synthetic_profile(layers=layers, static=rng.choice([0, 64, 256]) << 20, bandwidth=bw,
                             boundary_bytes=rng.choice([0, 2, 8]) << 20)
