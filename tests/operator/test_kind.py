"""The kind end-to-end run, when this machine can run it (Docker, kind, kubectl, helm)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.conftest import REPO

TOOLS = ("docker", "kind", "kubectl", "helm")
missing = [tool for tool in TOOLS if shutil.which(tool) is None]
engine = not missing and subprocess.run(["docker", "info"], capture_output=True).returncode == 0


@pytest.mark.cluster  # its own kind cluster, not the one KUBECONFIG names
@pytest.mark.skipif(bool(missing) or not engine,
                    reason="kind e2e needs a Docker engine and kind, kubectl, helm "
                           f"(missing: {', '.join(missing) or 'a running Docker engine'}); "
                           "the same scenarios run against the emulator in tests/operator")
def test_kind_end_to_end():
    result = subprocess.run(["bash", str(REPO / "scripts/kind-e2e.sh")], capture_output=True,
                            text=True, timeout=3600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "kind-e2e passed" in result.stdout
