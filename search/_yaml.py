"""YAML for plans and configs: ``yaml.SafeLoader`` that refuses a mapping with a duplicate key.

PyYAML keeps the last of two equal keys without a word; a plan or a training YAML that says
``recompute: True`` and then ``recompute: False`` is ambiguous, so loading names the key and
both lines instead.
"""

from __future__ import annotations

import sys
from typing import Any

import yaml

__all__ = ["DuplicateKeyError", "load_document", "safe_load"]


class DuplicateKeyError(yaml.constructor.ConstructorError):
    def __init__(self, key: Any, first: int, second: int) -> None:
        super().__init__(problem=f"duplicate key {key!r} at line {second} (first at line {first})")
        self.key, self.first, self.second = key, first, second


class _UniqueKeyLoader(yaml.SafeLoader):
    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in seen:
                    raise DuplicateKeyError(key, seen[key], line)
                seen[key] = line
            except TypeError:  # an unhashable key: the base class reports it
                continue
        return super().construct_mapping(node, deep=deep)


def safe_load(text: str) -> Any:
    """``yaml.safe_load`` that raises :class:`DuplicateKeyError` on a repeated mapping key."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)


def load_document(text: str, *, what: str, expected: str, error: type[ValueError], syntax: str = "YAML") -> Any:
    """:func:`safe_load` with every parse failure turned into one line ``{what}: <why>; expected ...`` raised as
    ``error`` (a duplicate key, bad syntax with its line, nesting or an integer literal too long to parse)."""
    try:
        return safe_load(text)
    except DuplicateKeyError as exc:
        raise error(f"{what}: {exc.problem}; expected each key once") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise error(f"{what}: not valid {syntax}{where}") from None
    except RecursionError:
        raise error(f"{what}: nested too deeply; expected {expected}") from None
    except ValueError:  # Python refuses to parse an integer literal this long
        raise error(f"{what}: a number of more than {sys.get_int_max_str_digits()} digits; expected {expected}") from None
