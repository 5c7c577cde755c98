"""What a simulated step looks like: the result type and its event timeline (for reports and plots)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Interval", "Simulation", "Timeline"]


@dataclass(frozen=True)
class Interval:
    stream: str
    """``compute``, ``copy`` or ``comm`` (collectives: ``search._comm_stream``)."""
    kind: str
    """``forward``, ``backward``, ``recompute``, ``stall`` (compute), ``d2h``, ``h2d`` (copy) or the collective
    (comm: ``all_reduce``, ``reduce_scatter``, ``all_gather``)."""
    start: float
    """Seconds from the start of the step."""
    end: float
    label: str
    """Unit or segment name."""


@dataclass
class Timeline:
    intervals: list[Interval] = field(default_factory=list)
    """Everything that ran, on which stream, when."""
    memory: list[tuple[float, int]] = field(default_factory=list)
    """(time, device bytes after the change) at each allocation or release, in time order."""

    def plot(self, path: str, *, title: str = "simulated step") -> None:
        """Write a two-panel figure: streams (Gantt) and device memory over time."""
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        colors = {"forward": "tab:blue", "backward": "tab:green", "recompute": "tab:orange", "stall": "tab:red",
                  "d2h": "tab:purple", "h2d": "tab:brown"}
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 5), sharex=True)
        rows = {"compute": 1, "copy": 0, "comm": 2}
        for iv in self.intervals:
            top.barh(rows[iv.stream], iv.end - iv.start, left=iv.start, color=colors.get(iv.kind, "gray"))
        top.set_yticks([0, 1, 2], ["copy", "compute", "comm"])
        top.set_title(title)
        handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
        top.legend(handles, list(colors), ncol=6, fontsize="small", loc="upper right")
        if self.memory:
            times, values = zip(*self.memory)
            bottom.step(times, [v / 2**30 for v in values], where="post")
        bottom.set_xlabel("time in step (s)")
        bottom.set_ylabel("device memory (GiB)")
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)


@dataclass(frozen=True)
class Simulation:
    peak_bytes: int
    """Predicted peak device memory: static + activations + transient recompute and reload memory."""
    step_time: float
    """Predicted seconds of one step (forward + recompute + backward + stalls + other)."""
    stall_time: float
    """Seconds the compute stream waits for reloads."""
    recompute_time: float
    """Seconds spent replaying forward before backward."""
    activation_peak: int
    """``peak_bytes`` minus static memory and saved model inputs."""
    swapped_bytes: int
    """Bytes copied to host (and back) per step."""
    timeline: Timeline | None = None
    """Event timeline when requested (``record=True``)."""
    spilled_bytes: int = 0
    """Of ``swapped_bytes``, those beyond the host memory budget: written to and read from the disk tier."""
    peak_reserved_bytes: int = 0
    """What the device's allocator holds at the peak: on a CUDA target the caching allocator's reserve over
    ``peak_bytes`` (``search._reserve``, Note: [allocator reserve]); elsewhere ``peak_bytes``."""

    def summary(self) -> dict[str, float | int]:
        return {"peak_bytes": self.peak_bytes, "step_time": self.step_time, "stall_time": self.stall_time,
                "recompute_time": self.recompute_time, "swapped_bytes": self.swapped_bytes}
