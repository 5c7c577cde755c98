"""What the GPU check's sections share: the run's device and results, the plans, the seeded step and its
comparison (``benchmarks/gpu_check.py`` says what the check is)."""

from __future__ import annotations

import json
import time
import traceback
from typing import Any, Callable

import torch

from search import Plan


class RUN:
    """The run's device (``cuda``; ``cpu`` on a smoke run) and what each section measured."""
    device = "cuda"
    results: dict[str, Any] = {}


def _cuda(name: str, *args: Any) -> Any:
    """A ``torch.cuda`` call, 0 on a CPU smoke run (``--device cpu``)."""
    return getattr(torch.cuda, name)(*args) if RUN.device == "cuda" else 0


def big(num_layers: int, **sizes: Any) -> tuple[str, dict]:
    """A 7B-shaped llama cut to ``num_layers`` (bf16, seq 4096) on the GPU; llama-tiny on a CPU smoke run."""
    if RUN.device != "cuda":
        return "llama-tiny", dict(batch_size=2, seq_len=64)
    return "llama2-7b", dict(model_args={"num_layers": num_layers}, batch_size=1, seq_len=4096, dtype="bfloat16",
                             **sizes)


def _plan(decisions: dict) -> Plan:
    return Plan.from_dict({"format": "adaptive-mem-plan", "version": 1, "decisions": decisions, "groups": []})


def _swap(prefetch: int = 1) -> dict:
    return {"action": "swap", "backward_prefetch": prefetch}


def llama_plans(layers: str = "layers") -> dict[str, Plan]:
    L = layers
    return {
        "plain-again": Plan(),
        "recompute-all": _plan({L: "recompute"}),
        "select-mul-l0": _plan({f"{L}.0.feed_forward.mul": "recompute"}),
        "swap-layers-0-2": _plan({f"{L}.{i}": _swap(1) for i in range(3)}),
        "op-swap-w1-l0": _plan({f"{L}.0.feed_forward.w1.matmul": _swap(1)}),
        "mixed": _plan({f"{L}.0": "recompute", f"{L}.1.feed_forward.mul": "recompute",
                        f"{L}.2": _swap(1), f"{L}.3.attention": _swap(0)}),
        "recompute-with-swap": _plan({f"{L}.1.feed_forward.mul": "recompute",
                                      f"{L}.1.feed_forward.w2": _swap(1)}),
    }


def hf_plans() -> dict[str, Plan]:
    L = "model.layers"
    return {
        "plain-again": Plan(),
        "recompute-all": _plan({L: "recompute"}),
        "select-act": _plan({f"{L}.{i}.mlp.act_fn.silu": "recompute" for i in range(2)}),
        "swap-attn": _plan({f"{L}.0.self_attn": _swap(0), f"{L}.1.self_attn": _swap(2)}),
        "mixed": _plan({f"{L}.1.mlp": "recompute", f"{L}.1.self_attn": _swap(1)}),
    }


def section(name: str) -> Callable:
    def wrap(fn: Callable) -> Callable:
        def run(*args: Any) -> None:
            start = time.perf_counter()
            print(f"== {name}", flush=True)
            try:
                RUN.results[name] = fn(*args)
            except Exception as exc:  # reported in the JSON, the other sections still run
                RUN.results[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
                print(RUN.results[name]["traceback"], flush=True)
            RUN.results.setdefault(name, {})["seconds"] = round(time.perf_counter() - start, 1)
            print(json.dumps(RUN.results[name], default=str)[:1500], flush=True)
        return run
    return wrap


def seeded_step(bundle, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = bundle.model
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1234)
    loss = bundle.loss(batch)
    loss.backward()
    return loss.detach().cpu(), {n.removeprefix("_orig_mod."): p.grad.to("cpu", copy=True)
                                   for n, p in model.named_parameters() if p.grad is not None}


def compare(got, want, exact: bool) -> dict:
    worst = max((float((g.float() - want[1][k].float()).abs().max()) for k, g in got[1].items()), default=0.0)
    equal = torch.equal(got[0], want[0]) and all(torch.equal(g, want[1][k]) for k, g in got[1].items())
    close = all(torch.allclose(g.float(), want[1][k].float(), rtol=2e-2, atol=1e-4) for k, g in got[1].items())
    return {"equal": equal, "close": close, "max_abs_diff": worst, "ok": equal if exact else close,
            "loss": float(got[0]), "ref_loss": float(want[0])}


def _copier_kind(handle) -> str:
    found = set()
    for obj in _walk(handle, depth=4):
        if type(obj).__name__ in ("StreamCopier", "ThreadCopier"):
            found.add(type(obj).__name__)
    return ",".join(sorted(found)) or "none"


def _walk(obj, depth: int, seen=None):
    seen = seen if seen is not None else set()
    if depth < 0 or id(obj) in seen or isinstance(obj, (torch.Tensor, torch.nn.Module, str, int, float)):
        return
    seen.add(id(obj))
    yield obj
    children = vars(obj).values() if hasattr(obj, "__dict__") else (obj if isinstance(obj, (list, tuple)) else [])
    for child in list(children):
        yield from _walk(child, depth - 1, seen)


