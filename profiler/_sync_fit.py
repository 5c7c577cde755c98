"""Recorded op times on an accelerator, fitted to the measured step.

Note: [synchronized op times]. On an accelerator the recorder times each op between two synchronizations
(``Recorder._run``), so every op's time carries a kernel launch and a host round trip that a running step
overlaps with the kernels before it. Summed over a step's ops this is far from negligible: a 7B-shaped llama
(8 layers, seq 4096, bf16) recorded 0.177 s of ops against a measured plain step of 0.092 s on an H200, and
the simulator, which adds op times, priced every plan at about twice its step and hid the swaps' copies
behind time that does not exist. When the recorded times (forward, backward and the backward time no op
claims) add up to more than the measured plain step, every one of them is scaled by measured / recorded:
the keep-all step simulates as measured, each op keeps its share. The rule is the same on CPU, where op times
usually add up to less than the step (the simulator's ``other`` time holds the rest) and exceed it only when
a busy machine slowed the recorded steps; on fake tensors (estimated, not timed) nothing changes. Guarded by
tests/test_sync_fit.py.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["fit_to_step"]


def fit_to_step(recorder: Any, device: torch.device, step_time: float | None) -> float:
    """Scale ``recorder``'s op times in place to ``step_time`` where they exceed it; returns the factor applied
    (1.0 when nothing changed)."""
    if device.type == "meta" or not step_time:
        return 1.0
    recorded = sum(e.fwd_time + e.bwd_time for e in recorder.events) + recorder.unattributed_bwd_time
    if recorded <= step_time:
        return 1.0
    factor = step_time / recorded
    for event in recorder.events:
        event.fwd_time *= factor
        event.bwd_time *= factor
    recorder.unattributed_bwd_time *= factor
    return factor
