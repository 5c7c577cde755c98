"""Human-readable summary of a :class:`Profile`: per-layer table and top units by saved bytes."""

from __future__ import annotations

from ._profile import Profile

__all__ = ["format_summary"]

MiB = 2**20


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}" if seconds < 0.1 else f"{seconds * 1e3:.1f}"


def format_summary(profile: Profile, *, top: int = 10) -> str:
    """The table ``adaptive-mem profile`` prints."""
    model = profile.model
    kind = "measured" if profile.measured else f"estimated for {profile.hardware.name}"
    lines = [
        f"model {model.get('spec') or '?'}: {model.get('parameters', 0):,} parameters, "
        f"batch {model.get('batch_size', '?')}"
        f" x seq {model.get('seq_len', '?')}, {model.get('dtype', '?')}, device {profile.device} (times {kind})",
        "",
        f"{'layer':>8} {'saved MiB':>11} {'fwd ms':>10} {'bwd ms':>10}",
    ]
    rows: dict[int | None, list[float]] = {}
    for unit in profile.units:
        row = rows.setdefault(unit.layer, [0.0, 0.0, 0.0])
        row[0] += unit.saved_bytes
        row[1] += unit.fwd_time
        row[2] += unit.bwd_time
    outside = rows.pop(None, [0.0, 0.0, 0.0])
    outside[0] += profile.saved_input_bytes
    for layer in sorted(rows):
        saved, fwd, bwd = rows[layer]
        lines.append(f"{layer:>8} {saved / MiB:>11.2f} {_ms(fwd):>10} {_ms(bwd):>10}")
    lines.append(f"{'other':>8} {outside[0] / MiB:>11.2f} {_ms(outside[1]):>10} {_ms(outside[2]):>10}")
    total_fwd = sum(u.fwd_time for u in profile.units)
    total_bwd = sum(u.bwd_time for u in profile.units) + profile.unattributed_time
    lines.append(f"{'total':>8} {profile.saved_bytes / MiB:>11.2f} {_ms(total_fwd):>10} {_ms(total_bwd):>10}")
    lines += ["", _top_units(profile, top), ""]
    static = profile.static
    hw = profile.hardware
    lines += [
        f"static: parameters {static.parameters / MiB:.1f} MiB, buffers {static.buffers / MiB:.1f} MiB, "
        f"gradients {static.gradients / MiB:.1f} MiB, optimizer state ({static.optimizer}) "
        f"{static.optimizer_state / MiB:.1f} MiB"
        + (f", master weights {static.master / MiB:.1f} MiB" if static.master else "")
        + (f" ({profile.model['precision']})" if profile.model.get("precision") else ""),
        f"peak memory {profile.peak_memory / MiB:.1f} MiB; step time {_ms(profile.step_time)} ms "
        f"+ optimizer step {_ms(profile.optimizer_time)} ms; "
        f"link h2d {hw.h2d_bandwidth / 1e9:.1f} GB/s, d2h {hw.d2h_bandwidth / 1e9:.1f} GB/s ({profile.link_source})",
    ]
    if profile.compiled is not None:
        rows = profile.compiled["layers"]
        saved = {v: sum(r[v]["saved_bytes"] for r in rows) / MiB for v in ("eager", "keep", "full")}
        lines.append(f"compiled per block ({profile.compiled['backend']}): blocks save {saved['keep']:.2f} MiB "
                     f"(eager {saved['eager']:.2f}, full recompute {saved['full']:.2f}); step time "
                     f"{_ms(profile.step_time)} ms (eager {_ms(profile.compiled['eager_step_time'])} ms)")
        if profile.compiled.get("whole") is not None:
            lines.append(f"compiled whole: its forward graph saves {sum(profile.compiled['whole'].values()) / MiB:.2f} "
                         "MiB; the units' saved bytes are the whole graph's")
    return "\n".join(lines)


def _top_units(profile: Profile, top: int) -> str:
    """Units by local name: one row for a unit repeated in every layer."""
    groups: dict[str, list] = {}
    for unit in profile.units:
        groups.setdefault(unit.local_name, []).append(unit)
    ranked = sorted(groups.items(), key=lambda kv: -sum(u.saved_bytes for u in kv[1]))[:top]
    width = max([len(name) for name, _ in ranked] + [4])
    lines = [f"top units by saved bytes (per layer, times layers):",
             f"  {'unit':<{width}} {'layers':>6} {'saved MiB':>11} {'fwd ms':>10} {'bwd ms':>10}"]
    for name, units in ranked:
        n = len(units)
        saved = sum(u.saved_bytes for u in units) / n
        fwd = sum(u.fwd_time for u in units) / n
        bwd = sum(u.bwd_time for u in units) / n
        count = str(n) if units[0].layer is not None else "-"
        lines.append(f"  {name:<{width}} {count:>6} {saved / MiB:>11.2f} {_ms(fwd):>10} {_ms(bwd):>10}")
    return "\n".join(lines)
