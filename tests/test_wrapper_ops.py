"""What a parallel wrapper runs around the model is no part of any plan (Note: [wrapper ops]), and what it holds is
measured beside the step (Note: [other device memory]). A stand-in wrapper does here what FSDP2 does before each
block: in a ``record_function("FSDP::...")`` region of the block's forward pre-hook it allocates a buffer and copies
the block's weight into it, and keeps the buffer; the same model without the wrapper is the reference. The real
FSDP2 on 2 gloo ranks (its gathered weights saved by the blocks' matmuls, its reshard by ``resize_(0)``):
tests/test_parallel_adaptive_layouts.py."""

from __future__ import annotations

import torch
from torch import nn

import profiler
from adaptive_mem import DeviceMemory, optimize

D = 64


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(D, D, bias=False)
        self.act = nn.Sigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        buf = torch.empty(x.shape)  # the block's own ``empty``: the wrapper's runs before it, in the same module call
        buf.copy_(x)
        return self.act(self.proj(buf)) * buf


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _gather(held: list) -> callable:
    """A forward pre-hook gathering the block's weight into a buffer of its own, as FSDP2's all-gather does."""
    def hook(block: nn.Module, args: tuple) -> None:
        with torch.profiler.record_function("FSDP::pre_forward"), torch.no_grad():
            gathered = torch.empty(D, D)
            gathered.copy_(block.proj.weight)
            held.append(gathered)  # the wrapper keeps its buffers
    return hook


def _net(wrapped: bool) -> tuple[nn.Module, list]:
    torch.manual_seed(0)
    net, held = Net(), []
    if wrapped:
        for block in net.blocks:
            block.register_forward_pre_hook(_gather(held))
    return net, held


def _profile(net: nn.Module, x: torch.Tensor, meter=None) -> profiler.Profile:
    return profiler.profile_step(net, inputs=(x,), loss_fn=lambda m, inp: m(*inp).sum(), warmup=0, repeat=0,
                                 record=1, optimizer="sgd", optimizer_time=0.0, meter=meter)


def test_a_wrappers_ops_are_no_units_and_keep_the_models_names():
    x = torch.randn(8, D)
    plain = _profile(_net(False)[0], x)
    wrapped = _profile(_net(True)[0], x)
    assert [u.name for u in wrapped.units] == [u.name for u in plain.units]
    assert "blocks.0.empty" in {u.name for u in wrapped.units}, "the block's own empty keeps its name"
    assert not [o for o in wrapped.ops if o.op.startswith("profiler.")], "record_function markers are no ops"
    assert [u.saved_bytes for u in wrapped.units] == [u.saved_bytes for u in plain.units]


def test_what_a_wrapper_allocates_is_other_memory_not_activations():
    x = torch.randn(8, D)
    net, held = _net(True)
    prof = _profile(net, x)
    assert prof.static.other == len(net.blocks) * D * D * 4, "the wrapper's buffers, sampled after its ops"
    plain = _profile(_net(False)[0], x)
    assert prof.saved_bytes == plain.saved_bytes
    assert prof.peak_memory == plain.peak_memory + prof.static.other


def test_a_meter_measures_what_the_device_holds_beside_the_step():
    """With a meter (here ``DeviceMemory``), everything held on the device beside the step's tensors counts: a
    tensor the program keeps there, and the wrapper's buffers; the profile's peak is at least the device's."""
    x = torch.randn(8, D)
    net, held = _net(True)
    with DeviceMemory(track_existing=False) as mem:
        kept = torch.zeros(1000)  # another tensor of the program on the device
        mem.track(net, x)
        prof = _profile(net, x, meter=mem)
        assert prof.static.other >= kept.numel() * 4 + len(net.blocks) * D * D * 4
        assert prof.peak_memory >= mem.peak


def test_a_plan_searched_on_the_wrapped_profile_runs_exactly_on_the_wrapped_model(tmp_path):
    from adaptive_mem.cli import main

    x = torch.randn(8, D)
    net, _ = _net(True)
    net(x).sum().backward()
    want = [p.grad.clone() for p in net.parameters()]
    net.zero_grad(set_to_none=True)
    prof = _profile(net, x)
    prof.save(tmp_path / "p.json")
    assert main(["search", str(tmp_path / "p.json"), "--activation-budget", "0.9", "-o", str(tmp_path / "plan.yaml"),
                 "--log-level", "ERROR"]) == 0
    with optimize(net, plan=tmp_path / "plan.yaml", profile=prof) as handle:
        assert handle.summary().takes_effect, handle.summary()
        net(x).sum().backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(net.parameters(), want))
