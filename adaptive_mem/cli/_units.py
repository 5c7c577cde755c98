"""``adaptive-mem units``: layer 0's unit tree (and that of each other kind of layer, Note: [layer kinds]), the local
names that config keys and plan targets are written with."""

from __future__ import annotations

import argparse

from profiler import Profile
from search import fmt_bytes
from search.planning import fmt_seconds

from adaptive_mem._model_spec import FORMS
from adaptive_mem.config._names import LayerNames, layer_names

NAME = "units"
HELP = ("print layer 0's unit tree (local module paths and units; one tree per kind of layer) to write "
        "select_recompute / op_swap keys")

__all__ = ["NAME", "HELP", "add_arguments", "run", "unit_tree"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="SPEC", help=f"model spec: {FORMS}")
    parser.add_argument("--model-args", default=None, metavar="K=V,...",
                        help="overrides of the model's config, e.g. num_hidden_layers=2,hidden_size=128")
    parser.add_argument("--profile", default=None, metavar="PROFILE.json",
                        help="a profile of this model (`adaptive-mem profile`): show each unit's saved bytes and "
                             "forward time")


def _profiled(profile: Profile, names: LayerNames, spec: str, layer: int) -> dict[str, tuple[int, float]]:
    """Local name -> (saved bytes, forward seconds) of ``layer``'s units in ``profile``."""
    profiled_spec = profile.model.get("spec")
    if profiled_spec is not None and profiled_spec != spec:
        raise ValueError(f"--profile: a profile of {profiled_spec!r}, not of --model {spec!r}; expected a profile "
                         "of this model")
    if (profile.layer_container or "") != names.container:
        raise ValueError(f"--profile: its layers are {profile.layer_container!r}, this model's {names.container!r}; "
                         "expected a profile of this model")
    return {u.local_name: (u.saved_bytes, u.fwd_time) for u in profile.units if u.layer == layer}


def unit_tree(modules: tuple[str, ...], units_: tuple[str, ...], *,
              profiled: dict[str, tuple[int, float]] | None = None) -> list[str]:
    """Lines of a layer's tree: each module path and unit by its local name, indented under its parent module.

    Units (marked ``*``) are leaves; with ``profiled``, each unit shows its saved bytes and forward time.
    """
    units = set(units_) | set(profiled or ())
    nodes = list(dict.fromkeys(modules + units_ + tuple(profiled or ())))
    present = set(nodes)

    def parent(name: str) -> str:
        parts = name.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            if ".".join(parts[:cut]) in present:
                return ".".join(parts[:cut])
        return ""

    children: dict[str, list[str]] = {}
    for name in nodes:
        children.setdefault(parent(name), []).append(name)
    width = max((len(n) + 2 * n.count(".") for n in nodes), default=0) + 4
    lines: list[str] = []

    def walk(node: str, depth: int) -> None:
        for name in children.get(node, []):
            label = "  " * depth + name + (" *" if name in units else "")
            if profiled is not None and name in units:
                saved, fwd = profiled.get(name, (None, None))
                label = label.ljust(width) + ("ran no op in the profile" if saved is None else
                                              f"saved {fmt_bytes(saved):>10}  fwd {fmt_seconds(fwd):>10}")
            lines.append(label.rstrip())
            walk(name, depth + 1)

    walk("", 0)
    return lines


def run(args: argparse.Namespace) -> int:
    from adaptive_mem._model_spec import build_model

    profile = Profile.load(args.profile) if args.profile is not None else None
    bundle = build_model(args.model, model_args=args.model_args, device="meta")
    names = layer_names(bundle.model)
    kinds = list(dict.fromkeys(names.kinds.first)) if names.kinds is not None else [0]
    for k in kinds:
        profiled = _profiled(profile, names, args.model, k) if profile is not None else None
        if k == 0:
            print(f"layer 0 of {names.container or '<model>'} ({names.count} layers); names are local to a layer, "
                  "* marks a unit" + (f"; its kind: {names.span(names.kinds.layers(0))}" if len(kinds) > 1 else ""))
        else:
            print(f"layer {k} ({names.layer_path(k)}), another kind: {names.span(names.kinds.layers(k))}")
        print("\n".join(unit_tree(*names.names_of(k), profiled=profiled)))
    print("keys: a regex matched whole (re.fullmatch) against these names, else from their start up to a . or _; "
          "a module path covers every unit below it (docs/plan-format.md, Unit names and keys)")
    return 0
