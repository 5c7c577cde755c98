"""Ours with ``torch.compile``: the ``milp`` plan searched on the profile of the model compiled per block, applied
to the model, then compiled (torchtitan's order: the plan first, then compile).

Note: [ours + compile layout]. A plan without swap decisions runs under a whole-model ``torch.compile`` (as the
``compile`` policy, ``activation_memory_budget`` 1.0): it fuses across blocks, head and loss, which per-block
compile cannot (llama-small 2x512: 2.3 MiB less with no plan), and its recompute runs through the compiled
selective-checkpoint policy. A plan with swaps compiles every block (``layer.compile``): swap is refused under a
whole-model compile (``runtime/_compiled_swap.py``). ``info["compile"]`` records which
(tests/test_compile_whole.py)."""

from __future__ import annotations

from typing import Any

from ._policy_base import Applied, Policy, compile_whole_model, layers_of

__all__ = ["MilpCompiledPolicy", "compile_blocks", "compile_layout"]


def compile_blocks(model: Any, backend: str) -> Any:
    """Compile every block of ``model`` in place (``nn.Module.compile``); returns the undo."""
    import torch._dynamo

    layers = layers_of(model)
    for layer in layers:
        layer.compile(backend=backend)

    def undo() -> None:
        for layer in layers:
            layer._compiled_call_impl = None
        torch._dynamo.reset()
    return undo


def compile_layout(plan: Any) -> str:
    """``"whole-model"`` for a plan without swap decisions, else ``"per-block"`` (Note: [ours + compile layout])."""
    from search import Action

    swaps = any(d.action is Action.SWAP for d in plan.decisions.values())
    return "per-block" if swaps else "whole-model"


class MilpCompiledPolicy(Policy):
    name = "ours-milp+compile"
    label = ("adaptive-mem: the milp plan searched on the profile of the model compiled per block ({backend}), "
             "applied, then the whole model compiled (plans without swaps) or every block (plans with swaps)")
    budgeted = True
    eager = False
    ours = True
    compiled_profile = True

    def label_for(self, backend: str) -> str:
        return self.label.format(backend=backend)

    def prepare(self, ctx: Any, budget: float | None) -> dict[str, Any]:
        assert budget is not None and ctx.compiled is not None
        return ctx.compiled.predict("milp", self.name, budget=budget)

    def apply(self, bundle, optimizer, job):
        import dataclasses

        from adaptive_mem._optimize import optimize
        from search import Plan

        backend = job.get("compile_backend", "inductor")
        plan = Plan.load(job["plan"])
        layout = compile_layout(plan)
        handle = optimize(bundle.model, plan=plan)
        info = {"decisions": len(plan.decisions), "backend": backend, "compile": layout}
        if layout == "per-block":
            executor = handle._executor  # Note: [compiled search space]: searched plans leave none eager
            info["eager_blocks"] = executor.eager_blocks() if executor is not None else []
            undo = compile_blocks(bundle.model, backend)

            def remove() -> None:
                undo()
                handle.remove()
            return Applied(bundle, remove, info=info)
        compiled, undo_compile = compile_whole_model(bundle.model, backend=backend, budget=1.0)

        def remove_whole() -> None:
            undo_compile()
            handle.remove()
        return Applied(dataclasses.replace(bundle, model=compiled), remove_whole, info=info)
