"""The wheels scripts/gpu-wheels.sh carries to the lent GPU machine bring everything the
trainer needs that the machine lacks. It has Python 3.12 with torch, transformers, peft and
accelerate (and what they require), pytest, and no package index; the wheels are installed
there with --no-deps, so what a wheel requires must be there already or be a wheel too. A
module missing there costs a device call, and a device session is rare and short.

What the machine has is read from this venv's metadata (the requirements of its torch,
transformers, peft and accelerate, recursively), so the check needs no GPU and no network."""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import re
import sys

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.conftest import REPO

SCRIPT = REPO / "scripts/gpu-wheels.sh"
THERE = ("torch", "transformers", "peft", "accelerate", "pytest")
SEEN_THERE = {"pandas", "pyarrow", "xxhash"}
"""datasets' own requirements: every GPU run so far (#22's table) read its data through
datasets, so the machine has them though nothing in THERE requires them."""
NOT_NEEDED = {
    "kopf": "the operator's: the trainer never imports it (training_stack_only refuses it)",
    "kubernetes": "the operator's client",
    "optuna": "the operator's sweeps",
    "tensorboard": "optional: without it the trainer says its event files are not written",
    "mlflow-skinny": "Azure ML's tracking, imported only where the trainer runs on Azure ML",
}
BUILT_THERE = {"deepspeed", "finetune-operator"}  # `pip wheel` of deepspeed and of the project


def shipped() -> set[str]:
    """The distributions gpu-wheels.sh downloads or builds."""
    text = SCRIPT.read_text()
    names = set()
    for array in ("PINNED", "PEERS"):
        match = re.search(rf"^{array}=\(([^)]*)\)", text, re.MULTILINE)
        assert match, f"{SCRIPT.name} no longer has its {array}=(...) list"
        names |= {canonicalize_name(re.split(r"[<>=!~ ]", word.strip('"'))[0])
                  for word in match.group(1).split()}
    assert '"deepspeed==$(version deepspeed)"' in text and '-w "$OUT" .' in text
    return names | BUILT_THERE


def requirements(name: str, extras: tuple[str, ...] = ("",)) -> set[str] | None:
    """What the installed distribution `name` requires (with `extras`), None where it is not
    installed here."""
    try:
        declared = metadata.distribution(name).requires or []
    except metadata.PackageNotFoundError:
        return None
    found = set()
    for line in declared:
        requirement = Requirement(line)
        if requirement.marker is None or any(
                requirement.marker.evaluate({"extra": extra}) for extra in extras):
            found.add(canonicalize_name(requirement.name))
    return found


def with_requirements(names) -> set[str]:
    seen: set[str] = set()
    todo = [canonicalize_name(name) for name in names]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += sorted(requirements(name) or ())
    return seen


@pytest.fixture(scope="module")
def there() -> set[str]:
    return with_requirements(THERE) | shipped() | SEEN_THERE | set(NOT_NEEDED)


def test_the_trainers_requirements_are_there(there):
    needed = requirements("finetune-operator", extras=("", "trainer"))
    assert needed is not None, "the project is not installed in this venv"
    assert sorted(needed - there) == []


def test_what_each_wheel_requires_is_there(there):
    missing = {name: sorted(found - there) for name in sorted(shipped())
               if (found := requirements(name)) is not None}
    assert {name: found for name, found in missing.items() if found} == {}
    # trl, bitsandbytes and liger-kernel (the benchmarks' peers) are checked where `make
    # bench` installed them; deepspeed and datasets always
    assert {"deepspeed", "datasets", "prometheus-client"} <= set(missing)


def test_every_module_the_trainer_imports_is_there(there):
    distributions = metadata.packages_distributions()
    imported = set()
    for path in (REPO / "trainer/finetune_trainer").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.partition(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.partition(".")[0])
    absent = {module: names for module in sorted(imported - set(sys.stdlib_module_names))
              if (names := {canonicalize_name(n) for n in distributions.get(module, [])})
              and not names & there}
    assert absent == {}
    assert {"torch", "prometheus_client", "pynvml", "datasets"} <= imported
