"""What `controlplane.py up` tells a user to stop their control plane with (#51, item 9:
`--folder X up` said `make cluster-down`, which stops the repo's own, not X)."""

from __future__ import annotations

import sys

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "cluster"))
import controlplane  # a script beside the tests, not a package


def test_the_repos_own_control_plane_stops_with_make(tmp_path):
    assert controlplane.stop_command(REPO / ".cluster") == "`make cluster-down`"


def test_a_control_plane_of_another_folder_is_stopped_by_its_folder(tmp_path):
    said = controlplane.stop_command(tmp_path / "mine")
    assert said == (f"`.venv/bin/python cluster/controlplane.py --folder {tmp_path / 'mine'} "
                    "down`")
    assert "make cluster-down" not in said
