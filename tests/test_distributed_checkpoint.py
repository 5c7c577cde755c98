"""``distributed_checkpoint``: Megatron's --distribute-saved-activations over 2 gloo processes on loopback."""

from __future__ import annotations

import datetime
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from adaptive_mem import ConfigError
from adaptive_mem.runtime._distributed_checkpoint import distributed_checkpoint
from adaptive_mem.models import LlamaConfig, LlamaModel

sys.path.insert(0, os.path.dirname(__file__))

from _spawn import spawn_ranks  # noqa: E402

TIMEOUT = 120

CONFIG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4, max_seq_len=32)


def _step(model: LlamaModel, ids: torch.Tensor, labels: torch.Tensor, wrap) -> tuple:
    h = model.tok_embeddings(ids)
    cos, sin = model._rope_tables(ids.shape[1], device=h.device, dtype=h.dtype)
    inputs = []
    for layer in model.layers:
        inputs.append(h)
        h = wrap(layer, h, cos, sin)
    held = [x.untyped_storage().nbytes() for x in inputs]  # what the checkpoints keep of their inputs
    logits = model.output(model.norm(h))
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    loss.backward()
    full = [x.untyped_storage().nbytes() for x in inputs]  # gathered back for the recompute
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, held, full


def _worker(rank: int, world: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT))
    try:
        gen = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, CONFIG.vocab_size, (2, 17), generator=gen)
        ids, labels = tokens[:, :-1], tokens[:, 1:]
        results = {}
        for mode, wrap in (("plain", lambda f, *a: checkpoint(f, *a, use_reentrant=False)),
                           ("distributed", distributed_checkpoint)):
            torch.manual_seed(0)
            results[mode] = _step(LlamaModel(CONFIG), ids, labels, wrap)
        # the executor's path: optimize(config=Megatron flags) with --distribute-saved-activations
        import adaptive_mem

        torch.manual_seed(0)
        model = LlamaModel(CONFIG)
        flags = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--distribute-saved-activations"]
        with adaptive_mem.optimize(model, config=flags):
            logits = model(ids)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
            loss.backward()
        results["optimize"] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
        torch.save(results, f"{out}/rank{rank}.pt")
        dist.barrier()  # no collective in flight when the group goes
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_identical_grads_and_half_the_saved_input_bytes(tmp_path):
    # Note: [sharded checkpoint input] the input tensor's own storage shrinks to 1/world after forward
    for results in spawn_ranks(_worker, out=tmp_path, timeout=TIMEOUT):
        plain_loss, plain_grads, plain_held, _ = results["plain"]
        loss, grads, held, restored = results["distributed"]
        assert torch.equal(loss, plain_loss)
        assert grads.keys() == plain_grads.keys()
        for name in grads:
            assert torch.equal(grads[name], plain_grads[name]), name
        full_bytes = 2 * 16 * CONFIG.hidden_size * 4
        assert plain_held == [full_bytes] * 3
        assert held == [full_bytes // 2] * 3
        assert restored == [full_bytes] * 3
        opt_loss, opt_grads = results["optimize"]
        assert torch.equal(opt_loss, plain_loss)
        for name in opt_grads:
            assert torch.equal(opt_grads[name], plain_grads[name]), name


def test_without_a_process_group_it_is_a_clear_error():
    assert not dist.is_initialized()
    layer = torch.nn.Linear(4, 4)
    with pytest.raises(ConfigError, match="no torch.distributed process group is initialized"):
        distributed_checkpoint(layer, torch.randn(2, 4, requires_grad=True))
