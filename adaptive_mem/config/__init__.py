"""Config front-ends: MindFormers ``recompute_config`` / ``swap_config`` YAML, Megatron recompute flags and the
AC modes of torchtitan, Megatron and Hugging Face (``ac_plan``).

``plan_from_config`` turns what users already have into a :class:`search.Plan`
and logs the seeds' lines (``Formative ...``, ``Set ... at layer N``);
``plan_to_mindformers`` / ``plan_to_megatron`` go the other way.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from torch import nn

from search import PLAN_FORMAT, Plan
from search.planning import load_document

from ._ac_modes import AC_MODES, ac_plan
from ._errors import ConfigError, fmt
from ._export import plan_to_megatron, plan_to_mindformers
from ._export_stages import plan_to_megatron_stages, plan_to_mindformers_stages
from ._megatron import plan_from_megatron
from ._mindformers import plan_from_mindformers
from ._names import layer_names

__all__ = ["AC_MODES", "ConfigError", "ac_plan", "load_config", "plan_from_config", "plan_to_megatron",
           "plan_to_megatron_stages", "plan_to_mindformers", "plan_to_mindformers_stages"]

_FORMS = ("a path to a MindFormers YAML, a dict (the YAML's contents), an argparse.Namespace with Megatron "
          "recompute flags, or a list of those flags")


def load_config(path: str | os.PathLike) -> dict:
    """A MindFormers training YAML as a dict (``yaml.safe_load``)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"config file {str(path)!r}: cannot read ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {str(path)!r}: not UTF-8 text; expected a MindFormers YAML") from None
    data = load_document(text, what=f"config file {str(path)!r}", expected="a MindFormers YAML", error=ConfigError)
    if not isinstance(data, dict):
        what = "empty" if data is None else f"top level is {type(data).__name__}"
        raise ConfigError(f"config file {str(path)!r}: {what}; expected a mapping with recompute_config / swap_config")
    return data


def _megatron_namespace(flags: list[str]) -> argparse.Namespace:
    from ._megatron_args import add_arguments

    parser = argparse.ArgumentParser(prog="megatron flags", add_help=False, exit_on_error=False)
    add_arguments(parser)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    try:
        ns, extra = parser.parse_known_args(flags)
    except argparse.ArgumentError as exc:
        raise ConfigError(f"Megatron flags {fmt(flags)}: {exc}") from None
    if extra:
        raise ConfigError(f"Megatron flag {extra[0]!r}: unknown; expected --recompute-activations, "
                          "--recompute-granularity, --recompute-method, --recompute-num-layers, "
                          "--distribute-saved-activations, --pipeline-model-parallel-size")
    return ns


def plan_from_config(config: Any, *, model: nn.Module | None, num_layers: int | None = None) -> Plan:
    """The plan a MindFormers config or Megatron flags describe for ``model``.

    ``model`` supplies the layers and the op names regexes are matched against; with
    ``model=None`` the reference Llama's names are used and the layer count comes from
    ``num_layers`` or the config. Logs the seeds' lines through ``logging``.
    """
    names = layer_names(model)
    if isinstance(config, list) and all(isinstance(f, str) for f in config):
        config = _megatron_namespace(config)
    if isinstance(config, argparse.Namespace):
        count = names.count or num_layers
        if not count:
            raise ConfigError("num_layers: missing; Megatron flags need model= or num_layers=")
        if names.count and num_layers is not None and num_layers != names.count:
            raise ConfigError(f"num_layers={num_layers}: the model has {names.count} layers; expected {names.count}")
        return plan_from_megatron(config, names=names, num_layers=count)
    source = "<dict>"
    if isinstance(config, (str, os.PathLike)):
        source = str(config)
        config = load_config(config)
    if not isinstance(config, dict):
        raise ConfigError(f"config={fmt(config)}: expected {_FORMS}")
    if config.get("format") == PLAN_FORMAT:
        raise ConfigError(f"config {source}: an adaptive-mem plan file (format: {PLAN_FORMAT}), not a MindFormers "
                          "config; expected it as a plan (--plan, or plan= in Python)")
    return plan_from_mindformers(config, names=names, num_layers=num_layers, source=source)
