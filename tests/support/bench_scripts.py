"""The scripts under benchmarks/ as modules, for tests that run their harness small (a
reworded trainer line or a changed API then fails a test, not the next benchmark run)."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from tests.conftest import REPO


def bench_script(name: str) -> ModuleType:
    """benchmarks/<name>.py, imported once under its own name (its dataclasses look their
    module up in sys.modules)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / f"benchmarks/{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
