"""The pipelining runtime's own memory per stage: Note: [pipelining buffers] in search/_pipeline.py."""

from __future__ import annotations

import pytest

from profiler import Layout
from search import StepModel
from search.planning import split_layout
from search._schedules import RuntimeBuffers as B
from search._schedules import runtime_buffers

HIDDEN = 2 * 32 * 64 * 4  # llama-tiny's hidden state per micro-batch: batch 2 x seq 32 x hidden 64, fp32
LOGITS = 2 * 32 * 256 * 4  # its model output: vocab 256
BATCH = 2 * (2 * 32 * 8)  # ids and labels of one micro-batch, int64


def test_runtime_buffers_hand_counts():
    # 1F1B, P=4, M=8: warm-up forwards w = 4, 3, 2, 1; the last warm-up send (micro-batch w-2) outlives its
    # backward when a steady-state backward follows it (M >= 2w - 1); non-first stages hold the previous
    # backward's input-gradient send (M > w)
    assert runtime_buffers(Layout(pipeline_stages=4, micro_batches=8)) == [
        [B(recv=0, grad_recv=8, sent_outputs=1)],
        [B(recv=8, grad_recv=8, sent_outputs=1, sent_grads=1)],
        [B(recv=8, grad_recv=8, sent_outputs=1, sent_grads=1)],
        [B(recv=8, grad_recv=0, sent_grads=1)],
    ]
    # M=4: stage 0 (w=4) and stage 1 (w=3) have no steady-state backward after micro-batch w-2's
    assert runtime_buffers(Layout(pipeline_stages=4, micro_batches=4)) == [
        [B(grad_recv=4)],
        [B(recv=4, grad_recv=4, sent_grads=1)],
        [B(recv=4, grad_recv=4, sent_outputs=1, sent_grads=1)],
        [B(recv=4, sent_grads=1)],
    ]
    # GPipe: sends waited before the first backward; the last stage caches all 4 model outputs (1 in the profile)
    assert runtime_buffers(Layout(pipeline_stages=2, micro_batches=4, schedule="gpipe")) == [
        [B(grad_recv=4)], [B(recv=4, cached_outputs=3)]]
    # interleaved, P=2 V=2 M=4: in flight [[3, 2], [2, 1]]; chunk c of rank s is pipeline chunk 2c + s
    assert runtime_buffers(Layout(pipeline_stages=2, micro_batches=4, schedule="interleaved-1f1b",
                                  virtual_pipeline_stages=2)) == [
        [B(grad_recv=4), B(recv=4, grad_recv=4)],
        [B(recv=4, grad_recv=4), B(recv=4)]]


@pytest.fixture(scope="module")
def tiny():
    from adaptive_mem import build_model
    from profiler import profile_step

    return profile_step(build_model("llama-tiny", seed=0), optimizer="adam", warmup=0, repeat=0, record=1)


def test_split_layout_runtime_bytes(tiny):
    plain = [st.model.base for st in split_layout(tiny, layout=Layout(pipeline_stages=2, micro_batches=1))]
    stages = split_layout(tiny, layout=Layout(pipeline_stages=2, micro_batches=4))
    # stage 0: 4 gradient receive buffers + the warm-up send + the step's other 3 micro-batches of input
    # stage 1: 4 activation receive buffers + the pending input-gradient send + the step's 4 micro-batches
    assert [st.runtime for st in stages] == [5 * HIDDEN + 3 * BATCH, 5 * HIDDEN + 4 * BATCH]
    one = split_layout(tiny, layout=Layout(pipeline_stages=2, micro_batches=1))
    assert [st.runtime for st in one] == [HIDDEN, HIDDEN + BATCH]  # one buffer each way, nothing pending
    for st, o, base in zip(stages, one, plain):
        assert st.model.base - st.runtime == base - o.runtime + sum(o.model.grads)  # resident gradients
    gpipe = split_layout(tiny, layout=Layout(pipeline_stages=2, micro_batches=4, schedule="gpipe"))
    assert gpipe[1].runtime == 4 * HIDDEN + 3 * LOGITS + 4 * BATCH


def test_last_stage_keeps_the_loss_workspace_with_resident_gradients(tiny):
    # the stage's base holds the gradients when they accumulate over micro-batches: its boundary (loss,
    # logits gradient) must stay the whole model's, not shrink by the gradient bytes
    whole = StepModel.build(tiny)
    for m in (1, 4):
        stages = split_layout(tiny, layout=Layout(pipeline_stages=2, micro_batches=m))
        assert stages[-1].model.boundary == whole.boundary > 0
        assert stages[0].model.boundary == 0
