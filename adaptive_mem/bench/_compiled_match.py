"""Matched ``ours-milp+compile`` rows in whole-model terms (Note: [whole-model offset]).

Note: [whole-model offset]. Ours + compile plans on the profile of the model compiled whole (Note: [whole-model
compiled profile]): its units save what the whole-model graph saves. What remains between its keep-all plan's
predicted peak and the measured peak of ``compile`` at budget 1.0 (the same whole-model compile with no plan) is
the simulator's error at keep-all: the offset. A matched row at a compile row's measured peak P is searched at
P + offset, and predicted peaks are reported less the offset. Guarded by tests/test_compile_whole.py.
"""

from __future__ import annotations

from typing import Any

from search.planning import keep_all, simulate_assignment

__all__ = ["whole_model_offset", "whole_model_prediction"]


def whole_model_offset(ctx: Any, rows: list, measured: list) -> int | None:
    """Keep-all predicted peak on ``ctx`` (the compiled context) minus compile@1.0's measured peak; None without
    an ok compile@1.0 first run."""
    for k, (row, job) in enumerate(rows):
        first = measured[k][0] if measured[k] else {}
        if job is not None and row["policy"] == "compile" and row["budget"] == 1.0 and first.get("status") == "ok":
            return int(simulate_assignment(ctx.model, keep_all(ctx.model)).peak_bytes) - int(first["peak_bytes"])
    return None


def whole_model_prediction(prepared: dict[str, Any], offset: int | None) -> dict[str, Any] | None:
    """``prepared`` in whole-model terms (every plan runs whole-model); None without an offset."""
    if offset is None:
        return None
    return {**prepared, "predicted_peak_bytes": int(prepared["predicted_peak_bytes"]) - offset,
            "predicted_peak_bytes_simulated": int(prepared["predicted_peak_bytes"]), "planned_for": "whole-model",
            "whole_model_offset_bytes": offset}
