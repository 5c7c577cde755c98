"""Unit names: the seeds' names on the reference model, stable names on HF families, view ops, counters."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import profiler
from adaptive_mem import build_model
from profiler.naming import UnitNamer, is_view_op, op_label

aten = torch.ops.aten


def _units(spec: str, **kwargs) -> list[str]:
    return [u.name for u in profiler.profile_step(build_model(spec, device="meta", **kwargs)).units]


def _layer_rows(result) -> list[tuple]:
    return [(u.name, u.saved_bytes, u.output_bytes) for u in result.units if u.layer is not None or u.saved_bytes]


def test_op_labels_and_views():
    assert op_label(aten.mm.default) == "matmul"
    assert op_label(aten.addmm.default) == "matmul"
    assert op_label(aten._scaled_dot_product_flash_attention_for_cpu.default) == "flash_attention"
    assert op_label(aten._scaled_dot_product_flash_attention_for_cpu_backward.default) != "flash_attention"
    assert op_label(aten.silu.default) == "silu"
    for view in (aten.view.default, aten.transpose.int, aten.t.default, aten.detach.default, aten._unsafe_view.default,
                 torch.ops.prim.device.default, aten.sym_size.int):
        assert is_view_op(view), view
    assert not is_view_op(aten.mul.Tensor) and not is_view_op(aten.add_.Tensor)


def test_llama_layer_units_in_order():
    names = _units("llama-tiny", model_args="num_layers=1")
    layer = [n.removeprefix("layers.0.") for n in names if n.startswith("layers.0.")]
    assert layer == [
        "attention_norm.norm", "attention.wq.matmul", "attention.wk.matmul", "attention.wv.matmul",
        "attention.apply_rotary_emb.rope", "attention.flash_attention", "attention.wo.matmul", "add",
        "ffn_norm.norm", "feed_forward.w1.matmul", "feed_forward.w1.activation.silu", "feed_forward.w3.matmul",
        "feed_forward.mul", "feed_forward.w2.matmul", "add_1",
    ]
    assert {"tok_embeddings.embedding", "norm", "output.matmul", "log_softmax", "nll_loss_forward"} <= set(names)


@pytest.mark.parametrize("spec,expected", [
    ("hf:llama", ["model.layers.0.input_layernorm.norm", "model.layers.0.self_attn.q_proj.matmul",
                  "model.layers.0.self_attn.flash_attention", "model.layers.0.mlp.act_fn.silu",
                  "model.layers.0.mlp.mul",
                  "model.layers.0.add_1", "model.rotary_emb.rope", "lm_head.matmul"]),
    ("hf:qwen2", ["model.layers.1.post_attention_layernorm.norm", "model.layers.1.mlp.gate_proj.matmul"]),
    ("hf:gpt2", ["transformer.h.0.ln_1.norm", "transformer.h.0.attn.c_attn.matmul",
                 "transformer.h.0.attn.flash_attention",
                 "transformer.h.1.mlp.act.newgelu", "transformer.wte.embedding"]),
    ("hf:mixtral", ["model.layers.0.mlp.gate.router", "model.layers.0.mlp.experts.act_fn.silu",
                    "model.layers.0.self_attn.o_proj.matmul"]),
])
def test_hf_families_get_stable_names(spec, expected):
    fake = profiler.profile_step(build_model(spec, device="meta"))
    first = [u.name for u in fake.units]
    assert set(expected) <= set(first), sorted(set(expected) - set(first))
    assert _units(spec) == first  # a second build names every unit the same way
    assert len(first) == len(set(first))
    # Real tensors: the same layer units with the same bytes (only transformers' packed-sequence probe
    # on the position ids, outside the layers and saving nothing, runs on real values alone).
    real = profiler.profile_step(build_model(spec))
    assert _layer_rows(real) == _layer_rows(fake)
    assert real.saved_bytes == fake.saved_bytes and real.peak_memory == fake.peak_memory


def test_repeated_ops_in_one_module_call_get_suffixes():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x):
            y = x + 1
            return self.proj(y + x) * 2 + y

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(2))

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    net = Net()
    x = torch.randn(4, 8, requires_grad=True)
    result = profiler.profile_step(net, inputs=(x,), loss_fn=lambda m, inp: m(*inp).sum())
    names = [u.name for u in result.units]
    assert names[:5] == ["blocks.0.add", "blocks.0.add_1", "blocks.0.proj.matmul", "blocks.0.mul", "blocks.0.add_2"]
    assert result.unit("blocks.1.proj.matmul").local_name == "proj.matmul"
    assert result.num_layers == 2 and result.layer_container == "blocks"


def test_namer_pops_modules_after_an_exception():
    class Boom(nn.Module):
        def forward(self, x):
            raise RuntimeError("boom")

    root = nn.Sequential(nn.Linear(2, 2), Boom())
    namer = UnitNamer(root)
    namer.enter(root)
    namer.enter(root[1])
    namer.exit(root)  # Boom's exit was skipped
    assert namer.module_path == ""


def test_swap_machinery_ops_are_no_units():
    """Note: [machinery ops]: the executor's swap hooks run ``empty`` and ``set_`` in the middle of a module call;
    the model's own ``empty`` after them keeps its profiled name, so a plan swapping it swaps that op."""
    from adaptive_mem import optimize
    from profiler import machinery_scope

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(256, 256)
            self.w = nn.Parameter(torch.randn(256))

        def forward(self, x):
            h = self.proj(x).exp()  # exp saves its output: swapped below, the swap hook runs first
            buf = torch.empty(h.shape)  # the model's own ``empty``
            buf.copy_(h)
            return buf * self.w  # saves ``buf``, whose storage the ``empty`` unit produced

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(2))

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    torch.manual_seed(0)
    net, x = Net(), torch.randn(4, 256)
    prof = profiler.profile_step(net, inputs=(x,), loss_fn=lambda m, inp: m(*inp).sum())
    swapped = ["blocks.0.exp", "blocks.0.empty"]
    assert all(prof.unit(u).saved_bytes == 4 * 256 * 4 for u in swapped)
    net(x).sum().backward()
    want = [p.grad.clone() for p in net.parameters()]
    net.zero_grad(set_to_none=True)
    plan = {"format": "adaptive-mem-plan", "version": 1,
            "decisions": {u: {"action": "swap", "backward_prefetch": 1} for u in swapped}}
    with optimize(net, plan=plan, profile=prof) as handle:
        net(x).sum().backward()
        assert handle.swap_stats.offloaded_bytes == sum(prof.unit(u).saved_bytes for u in swapped)
    assert all(torch.equal(p.grad, w) for p, w in zip(net.parameters(), want))
    with machinery_scope():
        assert UnitNamer(net).name(torch.ops.aten.empty.memory_format) is None


def test_machinery_marked_only_where_a_dispatch_mode_could_see_it():
    """Note: [machinery ops]: a decorated function marks its ops inside a Python dispatch mode, and skips the mark
    (a hot path's cost) where none is entered; ``with`` always marks."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from profiler import machinery_scope
    from profiler._machinery import in_machinery

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    scoped = machinery_scope()(in_machinery)
    assert scoped() is False and not in_machinery()
    with Seen():
        assert scoped() is True
    assert not in_machinery()
    with machinery_scope():
        assert in_machinery()
