"""YAML output that people read: multi-line strings as `|` blocks, keys in model order."""

from __future__ import annotations

from typing import Any

import yaml


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:
        """No `&id001` anchors and `*id001` aliases where one object appears twice (the
        labels a Job and its pod template share): each place spelled out, to read, diff
        and apply piecewise (#51, item 4)."""
        return True


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


class _FastDumper(getattr(yaml, "CSafeDumper", yaml.SafeDumper)):  # type: ignore[misc]
    """libyaml's emitter where PyYAML has it: 4x less CPU; it may wrap long strings
    elsewhere than the pure-Python emitter, so it is for files read by programs."""


for _dumper in (_Dumper, _FastDumper):
    _dumper.add_representer(str, _str)


def dump(obj: Any, *, fast: bool = False) -> str:
    """`fast`: for a program to read (the operator writes one trainer config per launch);
    otherwise the committed, reviewed text (CRDs, `finetune render`)."""
    return yaml.dump(obj, Dumper=_FastDumper if fast else _Dumper, sort_keys=False,
                     allow_unicode=True, width=100)


def dump_all(objs: list[Any]) -> str:
    return yaml.dump_all(objs, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=100)
