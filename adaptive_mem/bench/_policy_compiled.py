"""Ours with ``torch.compile``: the ``milp`` plan searched on the profile of the model compiled per block, applied
to the model, then every block compiled (``layer.compile``, torchtitan's order: the plan first, then compile)."""

from __future__ import annotations

from typing import Any

from ._policy_base import Applied, Policy, layers_of

__all__ = ["MilpCompiledPolicy", "compile_blocks"]


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


class MilpCompiledPolicy(Policy):
    name = "ours-milp+compile"
    label = ("adaptive-mem: the milp plan searched on the profile of the model compiled per block ({backend}), "
             "applied, then every block compiled")
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
        from adaptive_mem._optimize import optimize

        backend = job.get("compile_backend", "inductor")
        handle = optimize(bundle.model, plan=job["plan"])
        undo = compile_blocks(bundle.model, backend)

        def remove() -> None:
            undo()
            handle.remove()
        return Applied(bundle, remove, info={"decisions": len(handle.plan.decisions), "backend": backend})
