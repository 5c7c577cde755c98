"""Named hardware specs for estimating step times on fake tensors, and link/CPU measurements.

Datasheet numbers are peak figures (dense, no sparsity); estimates made from
them are lower bounds on real time. ``cpu`` is measured on this machine.
"""

from __future__ import annotations

import functools
import logging
import statistics
import time
from dataclasses import dataclass

import torch

from ._profile import HardwareSpec
from ._timing import timed

__all__ = ["HARDWARE", "HardwareError", "hardware_spec", "measure_cpu", "measure_device", "measure_link"]

log = logging.getLogger(__name__)

GB = 1e9
TFLOPS = 1e12


class HardwareError(ValueError):
    """An unknown hardware name."""


@dataclass(frozen=True)
class _Datasheet:
    fp32_flops: float
    half_flops: float
    """bf16/fp16 dense tensor-core (cube) throughput."""
    memory_bandwidth: float
    link_bandwidth: float
    """Host link, per direction."""
    device_memory: int
    source: str
    interconnect_bandwidth: float = 0.0
    """Intra-node device-to-device link (NVLink, HCCS), per direction: the bus bandwidth the
    collectives of a parallel layout are timed at (``profiler._shard``)."""


HARDWARE: dict[str, _Datasheet] = {
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5 80GB): FP32 67 TFLOPS, BF16 989.4 TFLOPS dense
    # (1979 with sparsity), HBM3 3.35 TB/s, 80 GB; host link PCIe Gen5 x16 = 64 GB/s per direction.
    "h100": _Datasheet(67 * TFLOPS, 989.4 * TFLOPS, 3.35e12, 64 * GB, 80 * 2**30,
                       "NVIDIA H100 SXM5 datasheet; PCIe Gen5 x16; NVLink 4 900 GB/s",
                       interconnect_bandwidth=450 * GB),  # NVLink 4: 900 GB/s bidirectional per GPU
    # NVIDIA H200 Tensor Core GPU datasheet (SXM 141GB): same Hopper compute as H100 SXM,
    # HBM3e 4.8 TB/s, 141 GB; PCIe Gen5 x16 = 64 GB/s per direction.
    "h200": _Datasheet(67 * TFLOPS, 989.4 * TFLOPS, 4.8e12, 64 * GB, 141 * 10**9,
                       "NVIDIA H200 SXM datasheet; PCIe Gen5 x16; NVLink 4 900 GB/s",
                       interconnect_bandwidth=450 * GB),  # NVLink 4: 900 GB/s bidirectional per GPU
    # NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB): FP32 19.5 TFLOPS, BF16 312 TFLOPS dense,
    # HBM2e 2039 GB/s, 80 GB; PCIe Gen4 x16 = 32 GB/s per direction.
    "a100": _Datasheet(19.5 * TFLOPS, 312 * TFLOPS, 2.039e12, 32 * GB, 80 * 2**30,
                       "NVIDIA A100 SXM4 80GB datasheet; PCIe Gen4 x16; NVLink 3 600 GB/s",
                       interconnect_bandwidth=300 * GB),  # NVLink 3: 600 GB/s bidirectional per GPU
    # Huawei Ascend 910B (Atlas 800T A2): FP16 cube ~313 TFLOPS, 64 GB HBM2e at ~1.6 TB/s, PCIe 5.0 x16
    # host interface (64 GB/s per direction). Public figures vary by SKU (910B1..B4); no public FP32
    # figure was found, so FP32 is assumed to run at 1/4 of the FP16 cube rate. The 8 NPUs of an
    # Atlas 800T A2 are a full mesh of HCCS links, 7 x 56 GB/s = 392 GB/s bidirectional per NPU (Huawei's
    # public Atlas 800T A2 / 910B figures; HCCL bus bandwidth measured in practice is lower).
    "ascend-910b": _Datasheet(313 * TFLOPS / 4, 313 * TFLOPS, 1.6e12, 64 * GB, 64 * 2**30,
                              "Huawei Atlas 800T A2 / Ascend 910B public figures; PCIe 5.0 x16; HCCS 392 GB/s",
                              interconnect_bandwidth=196 * GB),
}

NAMES = (*HARDWARE, "cpu")


def hardware_spec(name: str, *, dtype: torch.dtype = torch.float32) -> HardwareSpec:
    """The spec of ``name`` for ``dtype``: a datasheet, or ``cpu`` measured here."""
    key = str(name).lower()
    if key == "cpu":
        return measure_cpu(dtype=dtype)
    if key not in HARDWARE:
        raise HardwareError(f"hardware={name!r}: unknown; expected one of {', '.join(NAMES)}")
    sheet = HARDWARE[key]
    flops = sheet.fp32_flops if dtype == torch.float32 else sheet.half_flops
    return HardwareSpec(
        name=key, peak_flops=flops, memory_bandwidth=sheet.memory_bandwidth, h2d_bandwidth=sheet.link_bandwidth,
        d2h_bandwidth=sheet.link_bandwidth, device_memory=sheet.device_memory, source=sheet.source,
    )


def _median_seconds(fn, device: torch.device, repeats: int = 5) -> float:
    """Median of ``repeats`` synchronized timings of ``fn`` after one untimed call."""
    timed(fn, device)
    return statistics.median([timed(fn, device) for _ in range(repeats)])


def measure_cpu(*, dtype: torch.dtype = torch.float32) -> HardwareSpec:
    """Measure this host: matmul FLOP/s in ``dtype``, copy bandwidth (also the "link" for host swaps)."""
    return measure_device(torch.device("cpu"), dtype=dtype)


@functools.lru_cache(maxsize=None)
def measure_device(device: torch.device, *, dtype: torch.dtype = torch.float32) -> HardwareSpec:
    """Measure ``device``: matmul FLOP/s in ``dtype``, memory copy bandwidth, host link (pinned) bandwidth."""
    device = torch.device(device)
    accel = device.type != "cpu"
    n = 2048 if accel else 512
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    flops = 2 * n**3 / _median_seconds(lambda: torch.mm(a, b), device)
    size = (256 if accel else 16) * 2**20
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_bw = size / _median_seconds(lambda: dst.copy_(src), device)
    if accel:
        h2d, d2h = measure_link(device)
        total = _device_memory(device)
    else:
        h2d = d2h = copy_bw  # swapping "to host" on a CPU is a host memcpy
        total = _host_memory()
    name = str(dtype).removeprefix("torch.")
    log.debug("%s: %.1f GFLOP/s (%s), copy %.1f GB/s", device, flops / 1e9, name, copy_bw / 1e9)
    return HardwareSpec(
        name=device.type, peak_flops=flops, memory_bandwidth=2 * copy_bw,  # a copy reads and writes every byte
        h2d_bandwidth=h2d, d2h_bandwidth=d2h, device_memory=total,
        source=f"measured on this {device.type} ({n}x{n} {name} mm, {size >> 20} MiB copy)",
    )


def _host_memory() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except ImportError:  # pragma: no cover - psutil is a dependency
        return 0


def _device_memory(device: torch.device) -> int:
    info = getattr(torch.accelerator, "get_memory_info", None)
    try:
        return int(info(device)[1]) if info is not None else 0
    except (RuntimeError, TypeError):
        return 0


def measure_link(device: torch.device, *, nbytes: int = 64 * 2**20) -> tuple[float, float]:
    """Host<->device copy bandwidth ``(h2d, d2h)`` in bytes/s, with pinned host memory."""
    assert device.type not in ("cpu", "meta"), device
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def bandwidth(dst: torch.Tensor, src: torch.Tensor) -> float:
        return nbytes / _median_seconds(lambda: dst.copy_(src, non_blocking=True), device)

    return bandwidth(dev, host), bandwidth(host, dev)


def measure_disk(directory: str | None = None, *, nbytes: int = 64 * 2**20) -> float:
    """Bytes/s of the swap store's disk tier: write ``nbytes`` to a file in ``directory`` (default
    ``$ADAPTIVE_MEM_SPILL_DIR`` or the temporary directory, where spill files go) and ``fsync``, drop its
    pages from the cache, read it back; the slower of the two. The file is removed."""
    import os
    import tempfile

    directory = directory or os.environ.get("ADAPTIVE_MEM_SPILL_DIR") or tempfile.gettempdir()
    chunk = b"\x5a" * min(nbytes, 8 * 2**20)
    handle, path = tempfile.mkstemp(prefix="adaptive-mem-disk-probe-", dir=directory)
    try:
        start = time.perf_counter()
        done = 0
        while done < nbytes:
            done += os.write(handle, chunk[: nbytes - done])
        os.fsync(handle)
        write = nbytes / max(time.perf_counter() - start, 1e-9)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(handle, 0, nbytes, os.POSIX_FADV_DONTNEED)  # read from the disk, not the cache
        os.lseek(handle, 0, os.SEEK_SET)
        start = time.perf_counter()
        while os.read(handle, len(chunk)):
            pass
        read = nbytes / max(time.perf_counter() - start, 1e-9)
    finally:
        os.close(handle)
        os.unlink(path)
    log.debug("disk tier in %s: write %.2f GB/s, read %.2f GB/s", directory, write / 1e9, read / 1e9)
    return min(write, read)
