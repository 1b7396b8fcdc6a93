"""`make cluster-bin` (cluster/controlplane.py build) when another build of the same binaries
is under way: a `make cluster` in one terminal while `make test` builds in another."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.support import waits

pytestmark = [pytest.mark.process,
              pytest.mark.skipif(shutil.which("go") is None,
                                 reason="the binaries' cache key names the Go version: no Go")]


def test_a_second_build_waits_for_the_first_and_builds_nothing(tmp_path):
    """The first builder holds the folder's lock; the second waits, then finds every binary
    there (before: both built, and the second's rename of the first's file failed)."""
    sys.path.insert(0, str(REPO / "cluster"))
    import controlplane

    env = {**os.environ, "FINETUNE_CLUSTER_CACHE": str(tmp_path)}
    with pytest.MonkeyPatch.context() as patch:  # a cache set for the session stays set
        patch.setenv("FINETUNE_CLUSTER_CACHE", str(tmp_path))
        target = controlplane.binaries_dir()
        tools = controlplane.registry_tools_dir()
    tools.mkdir(parents=True)
    for name in controlplane.REGISTRY_TOOLS:  # built before: the second builds nothing
        (tools / name).write_bytes(b"")
    target.mkdir(parents=True)
    with open(target / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the first builder, at work
        second = subprocess.Popen([sys.executable, str(REPO / "cluster" / "controlplane.py"),
                                   "build"], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
        said = second.stdout.readline()  # printed at once (flushed), then it waits
        assert "another process is building the control plane" in said, said
        assert second.poll() is None  # waiting, not building nor failed
        built = [*controlplane.BINARIES, controlplane.kueue_manager.MANIFESTS]
        for name in built:  # what the first builder leaves
            (target / name).write_bytes(b"")
    out, _ = second.communicate(timeout=waits.seconds_left())
    assert second.returncode == 0, said + out
    assert out == ""  # it built nothing (a build says "building the control plane (...) into")
    assert sorted(p.name for p in target.iterdir()) == sorted([*built, ".build.lock"])
