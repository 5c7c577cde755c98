"""Ours with ``torch.compile``: the ``milp`` plan searched on the profile of the model compiled whole (Note:
[whole-model compiled profile]), applied to the model, then compiled (torchtitan's order: the plan first, then
compile).

Note: [ours + compile layout]. Ours + compile runs its plan under a whole-model ``torch.compile`` (as the
``compile`` policy, ``activation_memory_budget`` 1.0): it fuses across blocks, head and loss, which per-block
compile cannot (llama-small 2x512: 2.3 MiB less with no plan); its recompute runs through the compiled
selective-checkpoint policy and its swaps inside the compiled graph (Note: [partitioner hook] in
``runtime/_graph_plan.py``). ``info["compile"]`` records the layout (tests/test_compile_whole.py)."""

from __future__ import annotations

from typing import Any

from ._policy_base import Applied, Policy, compile_whole_model

__all__ = ["MilpCompiledPolicy", "compile_layout"]


def compile_layout(plan: Any) -> str:
    """The layout ours + compile runs ``plan`` under: always ``"whole-model"`` (Note: [ours + compile layout])."""
    return "whole-model"


class MilpCompiledPolicy(Policy):
    name = "ours-milp+compile"
    label = ("adaptive-mem: the milp plan searched on the profile of the model compiled whole ({backend}), "
             "applied, then the whole model compiled")
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
        compiled, undo_compile = compile_whole_model(bundle.model, backend=backend, budget=1.0)

        def remove_whole() -> None:
            undo_compile()
            handle.remove()
        return Applied(dataclasses.replace(bundle, model=compiled), remove_whole, info=info)
