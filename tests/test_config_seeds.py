"""The seeds' examples, YAML verbatim: exact log lines, and the plan their prose describes.

Log checks emulate the seeds' own ``grep`` commands over the captured log.
"""

from __future__ import annotations

import logging
import re

import pytest
import torch
import yaml

import _config_seeds as seeds
from adaptive_mem import plan_from_config
from adaptive_mem.models import LlamaConfig, LlamaModel
from search import Action, Decision

LOGGER = "adaptive_mem.config"


def tiny_llama(num_layers: int, *, seed: int = 0) -> LlamaModel:
    torch.manual_seed(seed)
    return LlamaModel(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=num_layers,
                                  num_heads=2, num_kv_heads=1, max_seq_len=16))


def messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith(LOGGER)]


def grep(lines: list[str], pattern: str, context: int = 0) -> list[str]:
    """``grep PATTERN [-C N]`` over log lines (group separators omitted, as in the seed's output)."""
    hits = [i for i, line in enumerate(lines) if re.search(pattern, line)]
    keep = sorted({j for i in hits for j in range(max(0, i - context), min(len(lines), i + context + 1))})
    return [lines[j] for j in keep]


def seed_lines(text: str) -> list[str]:
    return [line.split("INFO - ", 1)[1] for line in text.splitlines()]


def run(caplog, text: str, model, **kwargs):
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        plan = plan_from_config(yaml.safe_load(text), model=model, **kwargs)
    return plan, messages(caplog)


R, S = Action.RECOMPUTE, Action.SWAP


# ---------------------------------------------------------------- swap seed, cases 1-4
@pytest.mark.parametrize("case", [1, 2, 3])
def test_swap_seed_cases_print_the_documented_lines(caplog, case):
    text = getattr(seeds, f"SWAP_CASE_{case}")
    _, lines = run(caplog, text, tiny_llama(4))
    assert grep(lines, getattr(seeds, f"SWAP_CASE_{case}_GREP")) == seed_lines(getattr(seeds, f"SWAP_CASE_{case}_LOG"))


def test_swap_seed_case_4_prints_the_documented_lines_with_context(caplog):
    # Note: [per-layer recompute line] -C 1 shows that swap mode prints nothing for layers 1 and 2
    _, lines = run(caplog, seeds.SWAP_CASE_4, tiny_llama(4))
    assert grep(lines, seeds.SWAP_CASE_4_GREP, context=1) == seed_lines(seeds.SWAP_CASE_4_LOG)


def test_swap_case_1_default_strategy_swaps_attention_core_of_every_layer(caplog):
    plan, _ = run(caplog, seeds.SWAP_CASE_1, tiny_llama(4))
    assert plan.decisions == {f"layers.{i}.attention.flash_attention": Decision(S, 10) for i in range(4)}


def test_swap_case_2_swaps_whole_layers_0_and_3(caplog):
    plan, _ = run(caplog, seeds.SWAP_CASE_2, tiny_llama(4))
    assert plan.decisions == {"layers.0": Decision(S, 20), "layers.3": Decision(S, 20)}
    assert plan.decision_for("layers.1.attention.flash_attention").action is Action.KEEP


def test_swap_case_3_swaps_ops_per_layer_first_entry_wins(caplog):
    plan, _ = run(caplog, seeds.SWAP_CASE_3, tiny_llama(4))
    assert plan.decisions == {
        "layers.0.attention": Decision(S, 20),
        "layers.1.attention": Decision(S, 20), "layers.1.feed_forward": Decision(S, 15),
        "layers.2.attention": Decision(S, 20), "layers.2.feed_forward": Decision(S, 15),
        "layers.3.attention": Decision(S, 10),
    }
    # a module target covers every unit below it
    assert plan.decision_for("layers.1.feed_forward.w1.activation.silu") == Decision(S, 15)
    assert plan.decision_for("layers.0.feed_forward.mul").action is Action.KEEP


def test_swap_case_4_recompute_by_layer_index_with_op_swap(caplog):
    plan, _ = run(caplog, seeds.SWAP_CASE_4, tiny_llama(4))
    assert plan.decisions == {
        "layers.0.feed_forward": Decision(R), "layers.0.attention": Decision(S, 20),
        "layers.1.attention": Decision(S, 20), "layers.1.feed_forward": Decision(S, 15),
        "layers.2.attention": Decision(S, 20), "layers.2.feed_forward": Decision(S, 15),
        "layers.3.feed_forward": Decision(R), "layers.3.attention": Decision(S, 10),
    }


# ---------------------------------------------------------------- recompute seed
def test_48_layer_example_prints_the_formative_lines_exactly(caplog):
    _, lines = run(caplog, seeds.LAYERS_48_LAYOUT + seeds.LAYERS_48, tiny_llama(48))
    assert grep(lines, "Formative") == seed_lines(seeds.LAYERS_48_LOG)


def test_48_layer_example_one_line_per_layer_with_its_final_setting(caplog):
    _, lines = run(caplog, seeds.LAYERS_48_LAYOUT + seeds.LAYERS_48, tiny_llama(48))
    per_layer = [line for line in lines if re.search(r" at layer \d+", line)]
    assert [int(re.search(r"at layer (\d+)", line).group(1)) for line in per_layer] == list(range(48))
    assert per_layer[0] == "Set full recompute at layer 0"
    assert per_layer[2] == ("Set select recompute at layer 2: feed_forward.w1.activation.silu, feed_forward.mul; "
                            "select comm recompute: ffn_norm.norm, attention_norm.norm")
    assert per_layer[25] == ("Set select recompute at layer 25: feed_forward.w1.activation.silu, feed_forward.mul, "
                             "feed_forward.w1.matmul; select comm recompute: ffn_norm.norm, attention_norm.norm")


def chunks_48() -> list[list[range]]:
    """Layers of chunk [interleave][stage], derived independently: 4 each plus the offset, row by row."""
    offset = [[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    out, at = [], 0
    for row in offset:
        out.append([])
        for o in row:
            out[-1].append(range(at, at + 4 + o))
            at += 4 + o
    assert at == 48
    return out


def test_48_layer_example_plan_per_layer_and_per_op(caplog):
    plan, _ = run(caplog, seeds.LAYERS_48_LAYOUT + seeds.LAYERS_48, tiny_llama(48))
    chunk = chunks_48()

    def first(grid):
        return {layer for v, row in enumerate(grid) for s, n in enumerate(row) for layer in list(chunk[v][s])[:n]}

    full = first([[2, 1, 0, 0, 0], [1, 0, 0, 0, 0]])
    assert full == {0, 1, 4, 24}
    w1_matmul = first([[1, 0, 0, 0, 0], [2, 1, 0, 0, 0]]) - full
    w3_matmul = first([[1, 1, 0, 0, 0], [1, 0, 0, 0, 0]]) - full  # [2,1,0,0,0] spread over the 2 interleaves
    assert w1_matmul == {25, 29} and w3_matmul == set()
    for i in range(48):
        for local in ("feed_forward.w1.activation.silu", "feed_forward.mul", "ffn_norm.norm", "attention_norm.norm"):
            assert plan.decision_for(f"layers.{i}.{local}").action is R
        expected = R if i in w1_matmul or i in full else Action.KEEP
        assert plan.decision_for(f"layers.{i}.feed_forward.w1.matmul").action is expected
        assert plan.decision_for(f"layers.{i}.feed_forward.w3.matmul").action is (R if i in full else Action.KEEP)
        assert plan.decision_for(f"layers.{i}.attention.wq.matmul").action is (R if i in full else Action.KEEP)
        # full recompute wins: no op-level target inside a fully recomputed layer
        inside = [t for t in plan.decisions if t.startswith(f"layers.{i}.")]
        assert (f"layers.{i}" in plan.decisions) == (i in full)
        assert not (inside and i in full)


def test_deepseek_v3_list_is_accepted_and_recomputes_the_first_layers_of_each_stage(caplog):
    plan, lines = run(caplog, seeds.DEEPSEEK_V3_LAYOUT + seeds.DEEPSEEK_V3, tiny_llama(62))
    counts = [3, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 3, 2, 0]
    per_stage = [4] * 15 + [2]
    starts = [sum(per_stage[:s]) for s in range(16)]
    full = {starts[s] + k for s in range(16) for k in range(counts[s])}
    assert {t for t, d in plan.decisions.items() if d.action is R} == {f"layers.{i}" for i in full}
    assert len(plan.decisions) == sum(counts) == 56
    assert grep(lines, "Formative") == [
        f"Formative layer_recompute: [{counts}]",
        "Formative select_recompute: {'feed_forward\\.mul': [%s], 'feed_forward\\.w1\\.activation\\.silu': [%s]}"
        % ([0] * 16, [0] * 16),
        "Formative select_comm_recompute: {'.*\\.norm': [%s]}" % ([0] * 16,),
    ]
    assert plan.meta["inactive"] == ["parallel_optimizer_comm_recompute", "mp_comm_recompute",
                                     "recompute_slice_activation"]
    for key in plan.meta["inactive"]:
        assert any(line.startswith(f"recompute_config.{key}=True: accepted; inactive here") for line in lines)
    assert plan.meta["layer_stage"] == [s for s in range(16) for _ in range(per_stage[s])]
