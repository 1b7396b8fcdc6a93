"""YAML output that people read: multi-line strings as `|` blocks, keys in model order."""

from __future__ import annotations

from typing import Any

import yaml


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def dump(obj: Any) -> str:
    return yaml.dump(obj, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=100)


def dump_all(objs: list[Any]) -> str:
    return yaml.dump_all(objs, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=100)
