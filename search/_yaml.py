"""YAML for plans and configs: ``yaml.SafeLoader`` that refuses a mapping with a duplicate key.

PyYAML keeps the last of two equal keys without a word; a plan or a training YAML that says
``recompute: True`` and then ``recompute: False`` is ambiguous, so loading names the key and
both lines instead.
"""

from __future__ import annotations

from typing import Any

import yaml

__all__ = ["DuplicateKeyError", "safe_load"]


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
