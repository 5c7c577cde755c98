"""Training with the plans the configs give: gradients ``torch.equal`` to the unoptimized run."""

from __future__ import annotations

import argparse

import pytest
import torch
import torch.nn.functional as F
import yaml

import _config_seeds as seeds
import adaptive_mem
from adaptive_mem import add_arguments
from adaptive_mem.models import LlamaConfig, LlamaModel


def tiny_llama(num_layers: int) -> LlamaModel:
    torch.manual_seed(0)
    return LlamaModel(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=num_layers,
                                  num_heads=2, num_kv_heads=1, max_seq_len=16))


def step(model: LlamaModel) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 32, (2, 9), generator=gen)
    model.zero_grad(set_to_none=True)
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def megatron(flags: list[str]) -> argparse.Namespace:
    return add_arguments(argparse.ArgumentParser()).parse_args(flags)


CONFIGS = {
    "swap-case-1": (lambda: yaml.safe_load(seeds.SWAP_CASE_1), 4),
    "swap-case-2": (lambda: yaml.safe_load(seeds.SWAP_CASE_2), 4),
    "swap-case-3": (lambda: yaml.safe_load(seeds.SWAP_CASE_3), 4),
    "swap-case-4": (lambda: yaml.safe_load(seeds.SWAP_CASE_4), 4),
    "recompute-48-layers": (lambda: yaml.safe_load(seeds.LAYERS_48_LAYOUT + seeds.LAYERS_48), 48),
    "recompute-deepseek-v3": (lambda: yaml.safe_load(seeds.DEEPSEEK_V3_LAYOUT + seeds.DEEPSEEK_V3), 62),
    "megatron-selective": (lambda: megatron(["--recompute-activations"]), 4),
    "megatron-uniform-2": (lambda: megatron(["--recompute-granularity", "full", "--recompute-method", "uniform",
                                              "--recompute-num-layers", "2"]), 5),
    "megatron-block-3": (lambda: megatron(["--recompute-granularity", "full", "--recompute-method", "block",
                                           "--recompute-num-layers", "3"]), 5),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_training_with_the_config_plan_gives_identical_gradients(name):
    make, layers = CONFIGS[name]
    model = tiny_llama(layers)
    ref_loss, ref_grads = step(model)
    with adaptive_mem.optimize(model, config=make()) as handle:
        assert handle.plan.decisions  # the config did something
        loss, grads = step(model)
    assert torch.equal(loss, ref_loss)
    for param, grad in ref_grads.items():
        assert torch.equal(grads[param], grad), param


def test_optimize_accepts_a_yaml_path(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text(seeds.SWAP_CASE_4)
    model = tiny_llama(4)
    ref_loss, ref_grads = step(model)
    with adaptive_mem.optimize(model, config=str(path)) as handle:
        assert handle.plan.meta["config"] == str(path)
        loss, grads = step(model)
    assert torch.equal(loss, ref_loss) and all(torch.equal(grads[k], v) for k, v in ref_grads.items())
