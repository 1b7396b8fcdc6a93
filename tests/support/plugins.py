"""A plugin installed as a user installs one: a package and a distribution's metadata
declaring its entry point, in a folder put first on PYTHONPATH (`importlib.metadata` reads
the `.dist-info` there as it reads a pip-installed one)."""

from __future__ import annotations

import textwrap
from pathlib import Path


def install(root: Path, package: str, source: str, group: str, entry: str) -> None:
    """`package` (its `__init__.py` is `source`) under `root`, with an entry point
    `entry = package:OBJECT` in `group` (`entry` is `name = package:OBJECT`)."""
    (root / package).mkdir()
    (root / package / "__init__.py").write_text(textwrap.dedent(source))
    info = root / f"{package}-1.0.dist-info"
    info.mkdir()
    name = package.replace("_", "-")
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[{group}]\n{entry}\n")
