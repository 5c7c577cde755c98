"""``--adaptive-batch-size``: the micro-batch grows under the budget, the global batch's gradients stay exact."""

from __future__ import annotations

import argparse

import pytest
import torch

from adaptive_mem import DeviceMemory, build_model
from adaptive_mem._flags import add_memory_arguments, apply_arguments
from adaptive_mem.adaptive._batch import AdaptiveBatch

GLOBAL = 8
BUDGET = int(3.0 * 2**20)  # llama-tiny seq 32: micro-batch 4 fits (with a plan), 8 does not


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=GLOBAL)
    add_memory_arguments(parser)
    return parser.parse_args(list(argv))


def test_accumulation_is_exact(tmp_path):
    b = build_model("llama-tiny", batch_size=GLOBAL, seq_len=32, seed=0)
    opt = torch.optim.SGD(b.model.parameters(), lr=0.1)
    args = _args("--adaptive-memory-optimization", "--adaptive-batch-size", "--memory-budget", f"{BUDGET}B",
                 "--memory-plan-cache", str(tmp_path))
    handle = apply_arguments(b.model, args, optimizer=opt)
    ab = handle.batch
    assert isinstance(ab, AdaptiveBatch) and ab.global_batch == GLOBAL and ab.micro_batch == 1
    with DeviceMemory(cap=BUDGET, track_existing=False) as mem:
        mem.track(b.model, opt)
        for step in range(2):  # the first global batch profiles micro-batch 1; the second runs the chosen one
            for piece, weight in ab.split(b.batch(seed=step)):
                (b.loss(piece) * weight).backward()
            if step == 0:
                assert ab.table and ab.micro_batch == 1  # chosen, not yet in effect
                opt.zero_grad(set_to_none=True)
        grads = {n: p.grad.clone() for n, p in b.model.named_parameters()}
    micro = ab.micro_batch
    assert 1 < micro < GLOBAL and ab.accumulation_steps == GLOBAL // micro
    assert mem.peak <= BUDGET
    handle.remove()

    # the same accumulation done by hand on the same weights, no plan
    ref = build_model("llama-tiny", batch_size=GLOBAL, seq_len=32, seed=0)
    ids, labels = ref.batch(seed=1)
    for start in range(0, GLOBAL, micro):
        (ref.loss((ids[start:start + micro], labels[start:start + micro])) * (micro / GLOBAL)).backward()
    for name, p in ref.model.named_parameters():
        assert torch.equal(grads[name], p.grad), name


def test_split_and_refusals():
    ab = AdaptiveBatch(6, micro_batch=2)
    x = torch.arange(12).reshape(6, 2)
    pieces = list(ab.split((x, {"y": x + 1, "n": 3})))
    assert [w for _, w in pieces] == [pytest.approx(1 / 3)] * 3 and ab.accumulation_steps == 3
    assert torch.equal(torch.cat([p[0] for p, _ in pieces]), x) and pieces[1][0][1]["n"] == 3
    with pytest.raises(ValueError, match=r"^micro_batch=4: does not divide the global batch 6; expected one of 1, 2, 3, 6"):
        AdaptiveBatch(6, micro_batch=4)
    with pytest.raises(ValueError, match=r"^global_batch=0: expected a positive integer"):
        AdaptiveBatch(0)
    with pytest.raises(ValueError, match=r"^batch: a tensor of shape \(4, 2\); expected the global batch 6 in dim 0"):
        list(ab.split(torch.zeros(4, 2)))


def test_flag_needs_the_adaptive_loop():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"^--adaptive-batch-size without --adaptive-memory-optimization"):
        apply_arguments(model, _args("--adaptive-batch-size"))
