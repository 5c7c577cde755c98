"""Planning leaves no state on the user's model (Note: [throw-away clone] in adaptive_mem/config/_clone.py).

For each plan kind, on a plain, a ``torch.compile``d, a DDP-wrapped and an FSDP2-sharded (``fully_shard``
before ``optimize``) llama-tiny: after ``optimize`` and one training step every parameter and buffer is
the same object, of the same type, on the same device, with the same values as before ``optimize``; no
FakeTensor or meta tensor is reachable from the model (its tensors, every module's ``__dict__``, hooks and
the objects they hold), the handle, the loss, the logits or the gradients; and the gradients are
``torch.equal`` to the same run without a plan (FSDP2: the sharded gradients of the same rank).
"""

from __future__ import annotations

import datetime
import functools
import socket
import time
import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

import adaptive_mem
from adaptive_mem.models import PRESETS, LlamaModel

PRESET = PRESETS["llama-tiny"]
PLANS = {
    "full-recompute": {"recompute_config": {"recompute": True}},
    "select-recompute-mlp": {"recompute_config": {"select_recompute": {"feed_forward": True}}},
    "layer-swap": {"swap_config": {"swap": True, "layer_swap": [{"backward_prefetch": 1, "layers": True}]}},
    "op-swap": {"swap_config": {"swap": True,
                                "op_swap": [{"op_name": "attention", "backward_prefetch": 1, "layers": True}]}},
}
TIMEOUT_S = 600  # the whole distributed test
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _tokens(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, PRESET.config.vocab_size, (PRESET.batch_size, PRESET.seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _step(model: nn.Module, seed: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    ids, labels = _tokens(seed)
    logits = model(ids)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    loss.backward()
    return loss, logits, {n: p.grad for n, p in model.named_parameters()}


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **{f"buffer:{n}": b for n, b in model.named_buffers()}}


def _snapshot(model: nn.Module) -> dict[str, tuple]:
    return {n: (t, type(t), t.device, _local(t).detach().clone()) for n, t in _tensors(model).items()}


def _assert_unchanged(model: nn.Module, snap: dict[str, tuple], when: str) -> None:
    now = _tensors(model)
    assert now.keys() == snap.keys(), when
    for name, (obj, cls, device, value) in snap.items():
        t = now[name]
        assert t is obj, f"{name} replaced {when}"
        assert type(t) is cls and t.device == device, f"{name}: {type(t).__name__} on {t.device} {when}"
        assert torch.equal(_local(t).detach(), value), f"{name} changed value {when}"


_ATOMS = (str, bytes, int, float, bool, complex, type(None), type, types.ModuleType, torch.device, torch.dtype,
          types.BuiltinFunctionType, types.CodeType)


def _fake_or_meta(*roots: tuple[str, object]) -> list[str]:
    """Paths to every FakeTensor or meta tensor reachable from ``roots`` through containers, object
    attributes, bound methods, partials and closures."""
    found: list[str] = []
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        path, obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _ATOMS):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            local = getattr(obj, "_local_tensor", obj)
            if any(isinstance(x, FakeTensor) or x.is_meta for x in (obj, local)):
                found.append(f"{path}: {type(local).__name__} on {local.device}")
            if obj.is_leaf and obj.grad is not None:
                stack.append((path + ".grad", obj.grad))
            continue
        if isinstance(obj, dict):
            stack.extend((f"{path}[{k!r}]", v) for k, v in list(obj.items()))
            stack.extend((f"{path}.key", k) for k in list(obj))
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(list(obj)))
        elif isinstance(obj, types.MethodType):
            stack.append((path + ".__self__", obj.__self__))
        elif isinstance(obj, functools.partial):
            stack.extend([(path + ".func", obj.func), (path + ".args", obj.args), (path + ".kw", obj.keywords)])
        elif isinstance(obj, types.FunctionType):
            for i, cell in enumerate(obj.__closure__ or ()):
                try:
                    stack.append((f"{path}.<closure {i}>", cell.cell_contents))
                except ValueError:  # an empty cell
                    pass
        else:
            attrs = getattr(obj, "__dict__", None)
            if isinstance(attrs, dict):
                stack.append((f"{path}.__dict__", attrs))
            for slot in getattr(type(obj), "__slots__", ()):
                if isinstance(slot, str) and hasattr(obj, slot):
                    stack.append((f"{path}.{slot}", getattr(obj, slot)))
    return found


def _run_plans(build, seed: int, plans: dict = PLANS) -> None:
    """Each of ``plans`` on a fresh ``build()`` against the unplanned run of the same model."""
    model = build()
    _, _, ref_grads = _step(model, seed)
    ref = {n: _local(g).clone() for n, g in ref_grads.items()}
    for kind, config in plans.items():
        model = build()
        snap = _snapshot(model)
        handle = adaptive_mem.optimize(model, config=config)
        _assert_unchanged(model, snap, f"after optimize ({kind})")
        loss, logits, grads = _step(model, seed)
        _assert_unchanged(model, snap, f"after the step ({kind})")
        bad = _fake_or_meta(("model", model), ("handle", handle), ("loss", loss), ("logits", logits),
                            ("grads", grads))
        assert not bad, f"{kind}: {bad[:5]}"
        assert grads.keys() == ref.keys()
        for name, grad in grads.items():
            assert torch.equal(_local(grad), ref[name]), f"{kind}: gradient of {name} differs from no plan"
        handle.remove()
        assert not _fake_or_meta(("model", model)), kind


def _llama() -> LlamaModel:
    torch.manual_seed(0)
    return LlamaModel(PRESET.config)


@pytest.mark.parametrize("kind", list(PLANS))
def test_plain_model_keeps_its_state(kind):
    _run_plans(_llama, seed=1, plans={kind: PLANS[kind]})


def test_compiled_model_keeps_its_state():
    _run_plans(lambda: torch.compile(_llama(), backend="aot_eager"), seed=1)


def test_the_fake_clone_shares_nothing_with_the_model():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from adaptive_mem.config._clone import fake_clone

    model = torch.compile(_llama(), backend="aot_eager")
    model._orig_mod.layers[0].forward = model._orig_mod.layers[0].forward  # an instance forward bound to it
    clone, originals = fake_clone(model, FakeTensorMode(allow_non_fake_inputs=True))
    real = {id(x) for x in list(model.modules()) + list(model.parameters())}
    assert not real & {id(x) for x in list(clone.modules()) + list(clone.parameters())}
    assert [n for n, _ in clone.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert all(isinstance(p, FakeTensor) for p in clone.parameters())
    assert clone._orig_mod.layers[0].forward.__self__ is clone._orig_mod.layers[0]
    assert originals[id(clone._orig_mod.layers[0])] is model._orig_mod.layers[0]


class _Cached(nn.Module):
    """Keeps a tensor made in its first forward, as rope tables and causal masks are often cached."""

    def __init__(self) -> None:
        super().__init__()
        self.table: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.table is None:
            self.table = torch.linspace(0.5, 1.5, x.shape[-1], dtype=x.dtype, device=x.device)
        return x * self.table


class _Block(nn.Module):
    def __init__(self, d: int, data_dependent: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.scale = _Cached()
        self.mlp = nn.Linear(d, d)
        self.data_dependent = data_dependent

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.data_dependent and bool(x.sum() > 1e9):  # fake tensors cannot run this
            x = x / 2
        return x + self.mlp(torch.relu(self.scale(self.norm(x))))


class _CachingLM(nn.Module):
    def __init__(self, data_dependent: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(PRESET.config.vocab_size, 16)
        self.layers = nn.ModuleList(_Block(16, data_dependent) for _ in range(3))
        self.head = nn.Linear(16, PRESET.config.vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


@pytest.mark.parametrize("how", ["config", "plan-traced-at-first-forward", "plan-with-example-inputs"])
def test_a_model_caching_tensors_in_forward_keeps_them_real(how):
    # no trace (config names, unit check, selective-checkpoint pass) may run the user's own modules under
    # FakeTensorMode: the cache would hold a FakeTensor and the real step would then run on it
    plan = {"format": "adaptive-mem-plan", "version": 1, "decisions": {f"layers.{i}.relu": "recompute" for i in range(3)}}
    kwargs = {"config": {"recompute_config": {"select_recompute": {"relu": True}}}} if how == "config" else {"plan": plan}
    if how == "plan-with-example-inputs":
        kwargs["example_inputs"] = (_tokens(1)[0],)
    _, _, ref = _step(_CachingLM(), seed=1)
    model = _CachingLM()
    with adaptive_mem.optimize(model, **kwargs) as handle:
        assert all(layer.scale.table is None for layer in model.layers)  # optimize ran nothing on the model
        loss, logits, grads = _step(model, seed=1)
        assert not _fake_or_meta(("model", model), ("handle", handle), ("loss", loss), ("grads", grads))
        assert handle.resolution.modes and all(m.value == "sac" for m in handle.resolution.modes)
    for name, grad in grads.items():
        assert torch.equal(grad, ref[name]), name


def test_the_real_tensor_pass_of_a_data_dependent_layer_runs_on_a_copy(caplog):
    # where fake tensors cannot run the layer, the selective-checkpoint pass runs it once for real: on a copy,
    # so the user's hooks and modules see only the real step (never the pass, nor its fake tensors)
    plan = {"format": "adaptive-mem-plan", "version": 1, "decisions": {f"layers.{i}.relu": "recompute" for i in range(3)}}
    _, _, ref = _step(_CachingLM(data_dependent=True), seed=1)
    model = _CachingLM(data_dependent=True)
    seen: list[torch.Tensor] = []
    model.layers[1].mlp.register_forward_hook(lambda m, a, out: seen.append(out))
    with caplog.at_level("INFO", logger="adaptive_mem.runtime._sac_policy"), adaptive_mem.optimize(model, plan=plan):
        loss, _, grads = _step(model, seed=1)
        first = len(seen)
        model.zero_grad(set_to_none=True)
        _step(model, seed=1)
    assert "tracing it on real tensors once" in caplog.text
    assert first == len(seen) - first  # the first step called the module no more often than the second
    assert not _fake_or_meta(("seen", seen), ("model", model), ("loss", loss), ("grads", grads))
    for name, grad in grads.items():
        assert torch.equal(grad, ref[name]), name


# ---------------------------------------------------------------- 2 gloo ranks

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _build_distributed(layout: str) -> nn.Module:
    model = _llama()
    if layout == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def _worker(rank: int, world: int, port: int, layout: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=COLLECTIVE_TIMEOUT)
    try:
        _run_plans(functools.partial(_build_distributed, layout), seed=1 + rank)
    finally:
        dist.destroy_process_group()


def _spawn(layout: str) -> None:
    ctx = mp.start_processes(_worker, args=(2, _free_port(), layout), nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for process in ctx.processes:
                process.kill()
            pytest.fail(f"{layout}: the 2 ranks did not finish in {TIMEOUT_S} s")


@pytest.mark.parametrize("layout", ["ddp", "fsdp2"])
def test_distributed_model_keeps_its_state(layout):
    _spawn(layout)
