"""Named hardware specs for estimating step times on fake tensors, and link/CPU measurements.

Datasheet numbers are peak figures (dense, no sparsity), each with the fractions of them that published
microbenchmarks reach (GEMM, fused attention, HBM copy, collectives' bus bandwidth): estimates price every op at
its kernel's achieved rate (Note: [op pricing], ``profiler/_cost.py``). No figure here was measured by this
project on a GPU. ``cpu`` is measured on this machine (efficiency 1: its rates are measured).
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
    """One device's datasheet peaks and the fractions of them its kernels reach in published microbenchmarks
    (each figure cited beside it in :data:`HARDWARE`)."""

    fp32_flops: float
    half_flops: float
    """bf16/fp16 dense tensor-core (cube) throughput."""
    memory_bandwidth: float
    link_bandwidth: float
    """Host link, per direction."""
    device_memory: int
    source: str
    interconnect_bandwidth: float = 0.0
    """Intra-node device-to-device link (NVLink, HCCS), per direction, line rate."""
    matmul_efficiency: float = 1.0
    """Achieved / peak TFLOPS of a large dense GEMM (cuBLAS / CANN through ``torch.matmul``)."""
    attention_efficiency: float = 1.0
    """Achieved / peak TFLOPS of the fused attention kernel ``F.scaled_dot_product_attention`` dispatches to."""
    memory_efficiency: float = 1.0
    """Achieved / peak HBM bandwidth of a STREAM-like device copy."""
    collective_efficiency: float = 1.0
    """Achieved bus bandwidth of the collective library (nccl-tests / HCCL test busbw, 8 devices of one node) over
    the intra-node line rate."""
    internode_bandwidth: float = 0.0
    """Inter-node network bytes/s per device, per direction, line rate (one NIC per device)."""
    gpus_per_node: int = 8
    """Devices sharing one node's intra-node link (NVSwitch, HCCS mesh)."""
    efficiency_source: str = ""
    """Where the efficiencies come from (the comments of :data:`HARDWARE` give each figure and its shape)."""
    kernel_latency: float = 0.0
    """Seconds a kernel takes beyond its roofline time (launch, ramp-up, tail), added to every estimated op."""
    comm_compute_slowdown: float = 0.0
    """Fraction of compute throughput lost while a collective overlaps it (Note: [comm contention])."""

    @property
    def effective_interconnect(self) -> float:
        """Bus bandwidth a ring collective reaches inside a node: ``interconnect_bandwidth x
        collective_efficiency`` (the bandwidth ``profiler.tracing.collective_time`` should be given)."""
        return self.interconnect_bandwidth * self.collective_efficiency

    @property
    def effective_internode(self) -> float:
        """Bus bandwidth a ring collective reaches across nodes, assuming the intra-node protocol efficiency:
        ``internode_bandwidth x collective_efficiency``."""
        return self.internode_bandwidth * self.collective_efficiency


_NVLINK_RING = 370 / 450
"""NCCL on NVLink 4 (8 GPUs, NVSwitch): github.com/NVIDIA/nccl-tests/issues/212, the NCCL maintainer (sjeaugey):
450 GB/s is the line rate, protocol overhead leaves an effective 370 GB/s busbw for ring collectives and every
collective but all-reduce (all-reduce with NVLink SHARP peaks at ~480 GB/s busbw, large sizes). Our collectives
are timed as rings (all-gather, reduce-scatter), so the ring figure."""
_H100_SUSTAINED = 719.72 / 797.51
"""Note: [sustained clocks] a training step keeps the tensor cores busy for its whole length, and a Hopper part at
its power limit then lowers its SM clock below the one a short microbenchmark runs at: on a B200 back-to-back
kernels throttle after about 5 ms, the SM clock falling from 1965 to about 1580 MHz and the TFLOPS 15 %
(github.com/flashinfer-ai/flashinfer/pull/2899); H200 runners at 700 W cannot hold a locked 1830 MHz under full
load, 1500 MHz being what they sustain (github.com/tile-ai/TileOPs/pull/1588); triton's ``do_bench`` returns every
iteration because H100s throttle by kernel before a steady state (github.com/triton-lang/triton/pull/4493). The
H100 sweep of :data:`_H100_GEMM` shows it: bf16 ``torch.matmul`` at 4096 / 8192 / 10240 cubed reaches 788.7 /
797.5 / 719.7 TFLOPS, the longest-running GEMM (10240, 3 ms a call; with 128 x 256 or 128 x 128 tiles on 132 SMs
its last wave no emptier than 8192's) 9.8 % below the 8192 one, and fp16 (760.0 / 736.2 / 668.4) falls the same
way. Compute-bound kernels (GEMM, fused attention) are therefore priced at their short microbenchmark's fraction
times 719.7 / 797.5, the sweep's sustained point over its best; memory-bound kernels are not (the memory clock
stays at its rated value while the power cap lowers the SM clock: github.com/ashalliants/ninfer-3090/pull/72, an
RTX 3090 at its 315 W cap).
The same sweeps on other parts fall the same way: A100-PCIE-40GB bf16 234.1 / 215.3 / 211.7 (issues/108: 0.904 of
its best, :data:`_A100_SUSTAINED`; NVIDIA rates the A100's HPL peak at the 1305 MHz it sustains at its power limit,
0.926 of its 1410 MHz boost: glennklockwood.com/garden/peak-FLOPS), H100 PCIe 495.9 / 492.8 / 471.8 (issues/95).
Assumed: that the 10240 point's drop is the clock's and not cuBLAS's kernel choice, and the H100's ratio for the
H200 (same SMs, same 700 W). The Ascend keeps its microbenchmark's fraction: no sweep of it shows a sustained
point."""
_A100_SUSTAINED = 211.72 / 234.14
"""The A100-PCIE-40GB sweep's 10240 cubed over its best (4096 cubed) bf16 TFLOPS (Note: [sustained clocks])."""
_H100_GEMM = 797.51 / 989.4 * _H100_SUSTAINED
"""github.com/zzc0721/torch-performance-test-data/issues/79: ``torch.matmul`` bf16 8192 x 8192 x 8192 on an H100
80GB HBM3 (PyTorch 2.7, CUDA 12.8) 797.51 TFLOPS of 989.4 (fp32 at 8192: 51.81 of 67 TFLOPS, 0.77), at the
sustained clock (Note: [sustained clocks]): 0.727."""
_H100_SDPA = 329.483 / 989.4 * _H100_SUSTAINED
"""github.com/pytorch/pytorch/issues/142132: ``F.scaled_dot_product_attention`` with its default (flash,
FlashAttention-2) backend on an H100, forward, batch 1, 24 heads, seq 4608, head dim 128: 329.5 TFLOPS (cuDNN
attention 631, not picked by default). The FlashAttention-3 post (pytorch.org blog, 2024-07-11) gives
FlashAttention-2 35 % of the H100 peak. Other shapes, the causal mask and the backward pass follow the
FlashAttention-3 paper's FlashAttention-2 curves relative to this point (Note: [flash attention shape],
``profiler/_cost.py``). At the sustained clock (Note: [sustained clocks]): 0.301."""
_HBM_COPY = 0.90
"""No STREAM / BabelStream copy figure for these parts was found; two published figures bracket 0.90 of the
datasheet bandwidth (about 3.0 TB/s on an H100 SXM5): torchao's roofline utilities take 0.92 as the achievable
fraction observed on Meta's H100s (github.com/pytorch/ao/issues/4054), and PyTorch's own ``torch.maximum`` on an
H200 (github.com/tile-ai/TileOPs/issues/512, fp16, 1024 x 4096 / 10240 / 20480: 1.83 / 2.79 / 3.37 TB/s) fits
``t = latency + bytes / bandwidth`` with 4.27 TB/s, 0.889 of 4.8 (:data:`_KERNEL_LATENCY`)."""
_KERNEL_LATENCY = 7.8e-6
"""The same fit's fixed part: 7.8 us per kernel (least squares over the three points, bytes read and written:
13.8, 22.6, 37.3 us for 25, 63, 126 MB). No H100 or A100 figure was found: the H200's (same CUDA launch path) is
taken for every NVIDIA part and assumed for the Ascend."""

_NCCL_SMS_H100 = 24 / 132
"""Note: [comm contention] an NCCL collective is one kernel of one thread block per channel, and each block holds
its SM for the collective's whole length: NCCL's blocks take all of an SM's registers, so no compute block shares
their SMs (the NCCL maintainer, github.com/NVIDIA/nccl/issues/689). On an H100 (132 SMs) Nsight Systems shows an
NCCL all-gather (a test mimicking FSDP's prefetch) launching 24 blocks beside a 132-block GEMM
(forums.developer.nvidia.com threads 337991 and 339078): one per channel NCCL builds over NVSwitch (an HGX A100
builds as many, :data:`_NCCL_SMS_A100`). Compute that overlaps a collective therefore runs on 108 of 132 SMs:
24 / 132 = 0.18 of its throughput lost while the collective runs. A lower bound: the same forum thread measured
a 132-block GEMM at about half its speed beside the all-gather (an extra wave of blocks), and the collective also
takes HBM bandwidth (nccl#1433); neither is counted. Assumed: the intra-node channel count for every
data-parallel group (across nodes NCCL may use fewer SMs, 16 on a DGX with 8 NICs per nccl#689), and the H100's
figure for the H200 (same 132 SMs, same NVLink 4)."""
_NCCL_SMS_A100 = 24 / 108
"""The A100 (108 SMs) over NVSwitch: NCCL's 24 rings on an HGX A100 (``Channel n/24``,
github.com/NVIDIA/nccl-tests/issues/100), one SM each (Note: [comm contention])."""

HARDWARE: dict[str, _Datasheet] = {
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5 80GB): FP32 67 TFLOPS, BF16 989.4 TFLOPS dense
    # (1979 with sparsity), HBM3 3.35 TB/s, 80 GB; host link PCIe Gen5 x16 = 64 GB/s per direction.
    # NVLink 4: 900 GB/s bidirectional per GPU; DGX H100: 8 GPUs, 8x 400 Gb/s InfiniBand NDR = 50 GB/s per GPU.
    "h100": _Datasheet(
        67 * TFLOPS, 989.4 * TFLOPS, 3.35e12, 64 * GB, 80 * 2**30,
        "NVIDIA H100 SXM5 datasheet; PCIe Gen5 x16; NVLink 4 900 GB/s; DGX H100 8x IB NDR 400 Gb/s",
        interconnect_bandwidth=450 * GB, matmul_efficiency=_H100_GEMM, attention_efficiency=_H100_SDPA,
        memory_efficiency=_HBM_COPY, kernel_latency=_KERNEL_LATENCY,
        collective_efficiency=_NVLINK_RING, internode_bandwidth=50 * GB, comm_compute_slowdown=_NCCL_SMS_H100,
        efficiency_source="GEMM: torch-performance-test-data#79 (bf16 8192^3, 797.5 TFLOPS); SDPA: "
                          "pytorch#142132 (flash fwd, d128, 329.5 TFLOPS; shape curve: arXiv 2407.08608); both at "
                          "the sustained clock, x 719.7 / 797.5 (the same sweep's 10240^3); HBM: 0.90 "
                          "(ao#4054, TileOPs#512); kernel latency: 7.8 us (TileOPs#512 fit); NCCL: "
                          "nccl-tests#212 (ring busbw 370 of 450 GB/s); contention: 24 of 132 SMs (nccl#689, "
                          "nccl-tests#100)"),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM 141GB): same Hopper compute as H100 SXM,
    # HBM3e 4.8 TB/s, 141 GB; PCIe Gen5 x16 = 64 GB/s per direction; NVLink 4; DGX H200: 8x IB NDR 400 Gb/s.
    # No H200 GEMM or SDPA microbenchmark was found: the H100's fractions (same SMs, same kernels) are assumed.
    # NCCL: github.com/NVIDIA/nccl-tests/issues/272, 8x H200 all-reduce peak busbw 475 GB/s (NVLink SHARP,
    # NCCL 2.20.3), the H100's NVLS figure; the ring fraction of the H100 is taken, as the link is the same.
    "h200": _Datasheet(
        67 * TFLOPS, 989.4 * TFLOPS, 4.8e12, 64 * GB, 141 * 10**9,
        "NVIDIA H200 SXM datasheet; PCIe Gen5 x16; NVLink 4 900 GB/s; DGX H200 8x IB NDR 400 Gb/s",
        interconnect_bandwidth=450 * GB, matmul_efficiency=_H100_GEMM, attention_efficiency=_H100_SDPA,
        memory_efficiency=_HBM_COPY, kernel_latency=_KERNEL_LATENCY,
        collective_efficiency=_NVLINK_RING, internode_bandwidth=50 * GB, comm_compute_slowdown=_NCCL_SMS_H100,
        efficiency_source="H100's GEMM and SDPA fractions, at its sustained clock, assumed (same Hopper SMs); "
                          "HBM: 0.90 (ao#4054, TileOPs#512); "
                          "kernel latency: 7.8 us (TileOPs#512 fit); NCCL: "
                          "nccl-tests#212 ring fraction (nccl-tests#272: NVLS all-reduce 475 GB/s on 8x H200); "
                          "contention: the H100's 24 of 132 SMs"),
    # NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB): FP32 19.5 TFLOPS, BF16 312 TFLOPS dense, HBM2e 2039 GB/s, 80
    # GB; PCIe Gen4 x16 = 32 GB/s per direction; NVLink 3: 600 GB/s bidirectional per GPU; DGX A100: 8 GPUs, 8x 200 Gb/s
    # InfiniBand HDR = 25 GB/s per GPU. GEMM: github.com/zzc0721/torch-performance-test-data/issues/108,
    # ``torch.matmul`` bf16 4096^3 on an A100-PCIE-40GB (PyTorch 2.8, CUDA 12.8): 234.14 TFLOPS of 312 (its best size; a
    # 250 W PCIe card, the 400 W SXM4 is likely faster: a lower bound). SDPA: the FlashAttention-2 paper (Dao 2023,
    # arXiv 2307.08691) reaches 50-73 % of the A100 peak forward and backward (head dims 64/128, seq 512-16k); 0.60 is
    # taken inside that range, the backward (the larger share of the FLOPs) being the slower; the flash shape curve
    # (``profiler/_cost.py``) takes it as its forward reference, so the A100's attention is if anything underrated.
    # GEMM and attention at the sustained clock (Note: [sustained clocks]). NCCL:
    # github.com/NVIDIA/nccl-tests/issues/149, 8x A100-SXM4-80GB over NVLink (HPE Apollo 6500, NCCL 2.18): all-reduce
    # busbw ~200 GB/s of 300.
    "a100": _Datasheet(
        19.5 * TFLOPS, 312 * TFLOPS, 2.039e12, 32 * GB, 80 * 2**30,
        "NVIDIA A100 SXM4 80GB datasheet; PCIe Gen4 x16; NVLink 3 600 GB/s; DGX A100 8x IB HDR 200 Gb/s",
        interconnect_bandwidth=300 * GB, matmul_efficiency=234.14 / 312 * _A100_SUSTAINED,
        attention_efficiency=0.60 * _A100_SUSTAINED,
        memory_efficiency=_HBM_COPY, kernel_latency=_KERNEL_LATENCY,
        collective_efficiency=200 / 300, internode_bandwidth=25 * GB, comm_compute_slowdown=_NCCL_SMS_A100,
        efficiency_source="GEMM: torch-performance-test-data#108 (A100 PCIe, bf16 4096^3, 234.1 TFLOPS); SDPA: "
                          "FlashAttention-2 paper (50-73 % on A100), 0.60; both at the sustained clock, x 211.7 / "
                          "234.1 (the same sweep's 10240^3); HBM: 0.90 (ao#4054, TileOPs#512); kernel "
                          "latency: 7.8 us (TileOPs#512 fit, H200); NCCL: "
                          "nccl-tests#149 (busbw ~200 of 300 GB/s); contention: 24 of 108 SMs (nccl#689, "
                          "nccl-tests#100)"),
    # Huawei Ascend 910B (Atlas 800T A2): FP16 cube ~313 TFLOPS, 64 GB HBM2e at ~1.6 TB/s, PCIe 5.0 x16 host interface
    # (64 GB/s per direction). Public figures vary by SKU (910B1..B4); no public FP32 figure was found, so FP32 is
    # assumed to run at 1/4 of the FP16 cube rate. The 8 NPUs of an Atlas 800T A2 are a full mesh of HCCS links, 7 x 56
    # GB/s = 392 GB/s bidirectional per NPU (Huawei's public Atlas 800T A2 / 910B figures); 8x 200 Gb/s RoCE NICs = 25
    # GB/s per NPU across nodes. GEMM: github.com/zzc0721/torch-performance-test-data/issues/109, ``torch.matmul`` bf16
    # 8192^3 on an Ascend910B2 (torch 2.5.1 + torch_npu): 301.23 TFLOPS (fp16 4096^3: 314.52). The 910B2's own cube peak
    # is not on a Huawei datasheet (it is above this sheet's 313 TFLOPS, which is the 910B3's), so its fraction is
    # unknown: assumed 0.80, about the H100's measured GEMM fraction. No public TFLOPS figure of the fused attention
    # kernel (``npu_fusion_attention``), no HBM copy figure and no HCCL busbw figure was found: attention is assumed at
    # FlashAttention-2's H100 fraction (0.35), HBM at 0.90, HCCL at 0.80 of the HCCS line rate (about NCCL's 370 / 450
    # protocol efficiency on NVLink).
    "ascend-910b": _Datasheet(
        313 * TFLOPS / 4, 313 * TFLOPS, 1.6e12, 64 * GB, 64 * 2**30,
        "Huawei Atlas 800T A2 / Ascend 910B public figures; PCIe 5.0 x16; HCCS 392 GB/s; 8x RoCE 200 Gb/s",
        interconnect_bandwidth=196 * GB, matmul_efficiency=0.80, attention_efficiency=0.35,
        memory_efficiency=_HBM_COPY, kernel_latency=_KERNEL_LATENCY,
        collective_efficiency=0.80, internode_bandwidth=25 * GB,
        efficiency_source="GEMM: assumed 0.80 (torch-performance-test-data#109: 301.2 TFLOPS bf16 8192^3 on a "
                          "910B2, whose peak is not published); SDPA, HBM, HCCL: no public figure, assumed "
                          "0.35, 0.90, 0.80; kernel latency: the NVIDIA parts' 7.8 us, assumed; contention: no "
                          "public figure, 0"),
}

NAMES = (*HARDWARE, "cpu")


def hardware_spec(name: str, *, dtype: torch.dtype = torch.float32) -> HardwareSpec:
    """The spec of ``name`` for ``dtype``: a datasheet (``peak_flops`` the dtype's peak; ops priced at their own
    dtype's peak and the kernel efficiencies, Note: [op pricing]), or ``cpu`` measured here."""
    key = str(name).lower()
    if key == "cpu":
        return measure_cpu(dtype=dtype)
    if key not in HARDWARE:
        raise HardwareError(f"hardware={name!r}: unknown; expected one of {', '.join(NAMES)}")
    sheet = HARDWARE[key]
    flops = sheet.fp32_flops if dtype == torch.float32 else sheet.half_flops
    return HardwareSpec(
        name=key, peak_flops=flops, memory_bandwidth=sheet.memory_bandwidth, h2d_bandwidth=sheet.link_bandwidth,
        d2h_bandwidth=sheet.link_bandwidth, device_memory=sheet.device_memory,
        source=f"{sheet.source}; kernel efficiencies: {sheet.efficiency_source}", fp32_flops=sheet.fp32_flops,
        half_flops=sheet.half_flops, matmul_efficiency=sheet.matmul_efficiency,
        attention_efficiency=sheet.attention_efficiency, memory_efficiency=sheet.memory_efficiency,
        kernel_latency=sheet.kernel_latency, comm_compute_slowdown=sheet.comm_compute_slowdown,
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
