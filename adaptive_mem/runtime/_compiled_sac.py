"""Select recompute inside a compiled block: the selective-checkpoint policy that AOT autograd calls.

Note: [compiled SAC names]. Under ``torch.compile`` a checkpoint with a ``context_fn`` becomes the
``tag_activation_checkpoint`` higher-order op; AOT autograd interprets its body with the policy of a
fresh ``context_fn()`` and tags each aten op with the policy's answer, and the partitioner saves
``MUST_SAVE`` outputs and recomputes ``PREFER_RECOMPUTE`` ones in backward. The policy runs outside
dynamo (plain Python, once per traced body), so it may name ops freely: each op's
``torch.fx.traceback.get_current_meta()["nn_module_stack"]`` lists the modules running it, outermost
first, keyed by ``str(id(module))`` with ``@n`` appended for the (n+1)-th call of a module in the body.
The unit name follows ``UnitNamer``'s rules from that stack (Note: [graph unit names] in
``profiler/_graph_names.py``), the layer itself naming ops of no inner module; view ops have no unit.
Note: [compiled keep]: a kept unit is tagged ``PREFER_SAVE``, not ``MUST_SAVE``: the default partitioner
(aot_eager) saves every ``MUST_SAVE`` output even when backward never reads it (llama-tiny, a per-op plan:
314,820 saved bytes against 302,212 without a plan), while ``PREFER_SAVE`` leaves a kept output to the
partitioner as without a plan (saved when backward reads it; inductor's min-cut may still recompute it).

Modules outside the layer are skipped, as the eager namer, whose hooks sit on the layer's modules only,
skips them. Guarded by tests/test_compile_sac.py (names equal ``trace_layer``'s on llama-tiny, hf:gpt2,
hf:qwen2). Ops of ``wrap_function`` calls are named by module here, not as one Function unit.
"""

from __future__ import annotations

from typing import Any, Callable

import torch.fx.traceback as fx_traceback
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from profiler.naming import UnitNamer, is_view_op, stack_frames, stack_unit

__all__ = ["CompiledSacPolicy", "compiled_sac_context"]


class CompiledSacPolicy:
    """Names each op of one traced layer body like the eager namer and tags it from ``action(unit)``."""

    def __init__(self, *, namer: UnitNamer, layer: nn.Module, action: Callable[[str], str]) -> None:
        self.namer = namer
        self.layer_path = namer.paths[id(layer)]
        self.inside = {id(m) for m in layer.modules() if m is not layer and id(m) in namer.paths}
        self.action = action
        self.counts: dict[tuple[str, str], int] = {}
        self.names: list[str] = []

    def unit(self, func: Any) -> str | None:
        if is_view_op(func):
            return None
        meta = fx_traceback.get_current_meta() or {}
        frames = [(key, mid) for key, mid in stack_frames(meta.get("nn_module_stack")) if mid in self.inside]
        return stack_unit(self.namer, func, frames, self.counts, self.layer_path)

    def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        unit = self.unit(func)
        if unit is None:
            return CheckpointPolicy.PREFER_RECOMPUTE
        self.names.append(unit)
        if self.action(unit) == "recompute":
            return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.PREFER_SAVE  # Note: [compiled keep]


def compiled_sac_context(*, namer: UnitNamer, layer: nn.Module, action: Callable[[str], str],
                         seen: list[CompiledSacPolicy] | None = None) -> Callable[[], tuple[Any, Any]]:
    """The ``context_fn`` of a compiled selective checkpoint: a fresh policy (fresh ordinals) per traced
    body; ``seen`` collects the policies made, for tests."""

    def context_fn() -> tuple[Any, Any]:
        policy = CompiledSacPolicy(namer=namer, layer=layer, action=action)
        if seen is not None:
            seen.append(policy)
        return create_selective_checkpoint_contexts(policy)
    return context_fn
