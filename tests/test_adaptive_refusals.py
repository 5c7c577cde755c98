"""The adaptive loop refuses a budget it cannot honour at the start, with the figures: a budget below the
parameters (Python and the ``run`` command line); a wrapper it is not tested under is named in one warning.
Under DDP and FSDP2 (2 gloo ranks), budgets below the measured minimum: tests/test_parallel_adaptive_layouts.py."""

from __future__ import annotations

import logging

import pytest
import torch

from adaptive_mem.cli import main as cli_main
from adaptive_mem import AdaptiveBudgetError, adaptive_optimize

from _adaptive_common import bundle, optimizer


def test_python_budget_below_the_parameters_is_refused_by_adaptive_optimize_itself():
    b = bundle()
    opt = optimizer(b.model)
    with pytest.raises(AdaptiveBudgetError) as info:
        adaptive_optimize(b.model, budget=1024, optimizer=opt, cache=False)
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    needed = 2 * sum(p.untyped_storage().nbytes() for p in b.model.parameters())  # parameters + gradients
    assert message.startswith("--memory-budget=1024: below the minimum feasible"), message
    assert "needed at least" in message and f"({needed} bytes)" in message and "(1024 bytes)" in message, message
    assert "\n" not in message
    # nothing half-applied: no hooks, and the model takes a budget it can honour
    assert not hasattr(b.model, "_adaptive_memory")
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in b.model.modules())
    adaptive_optimize(b.model, budget="1GiB", optimizer=opt, cache=False).remove()


def test_cli_budget_below_the_parameters_is_a_one_line_refusal_with_exit_2(capsys):
    rc = cli_main(["run", "--adaptive-memory-optimization", "--memory-budget", "1KiB", "--steps", "1",
                                "--log-level", "WARNING"])
    out, err = capsys.readouterr()
    assert rc == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("adaptive-mem run: error: --memory-budget=1024: below the minimum feasible; "
                               "needed at least "), err
    assert "budget 1.00 KiB (1024 bytes)" in lines[0], err
    assert "out of device memory" not in err and "Traceback" not in err
    assert out == ""


def test_a_wrapper_the_loop_is_not_tested_under_is_named_in_one_warning(caplog):
    b = bundle()
    model = torch.nn.DataParallel(b.model)
    caplog.set_level(logging.WARNING, logger="adaptive_mem.adaptive._loop")
    adaptive_optimize(model, budget="1GiB", optimizer=optimizer(model), cache=False).remove()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == ["adaptive memory: DataParallel is not a layout the loop is tested under (DDP, FSDP2, tensor "
                        "parallel and pipeline stages are): what it holds on this device is measured at the first "
                        "step, but its plans are unverified"], warnings
