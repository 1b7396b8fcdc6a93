"""The session's shared results (tests/support/shared.py): made once however many tests (on
however many workers) ask at the same moment, and made again after a failed attempt."""

from __future__ import annotations

import threading
import time

import pytest

from tests.support.shared import Shared


def test_a_result_asked_for_at_once_is_made_once(tmp_path):
    shared, made, found = Shared(tmp_path), [], []

    def make(folder):
        made.append(folder)
        time.sleep(0.2)  # the other asker arrives meanwhile
        (folder / "run.log").write_text("trained")

    def ask():
        found.append(shared.get("ddp lora", make, name="run"))

    askers = [threading.Thread(target=ask) for _ in range(2)]  # a lock each, as two workers
    for asker in askers:
        asker.start()
    for asker in askers:
        asker.join()
    assert len(made) == 1 and found[0] == found[1] == made[0]
    assert (found[0] / "run.log").read_text() == "trained"  # complete when handed out
    assert shared.get("ddp lora", make, name="run") == found[0] and len(made) == 1
    assert shared.get("fsdp lora", make, name="run") != found[0] and len(made) == 2


def test_a_failed_making_is_made_again_by_the_next_asker_from_nothing(tmp_path):
    shared = Shared(tmp_path)

    def broken(folder):
        (folder / "half-written").write_text("...")
        raise AssertionError("the run failed")

    with pytest.raises(AssertionError, match="the run failed"):
        shared.get("key", broken)
    folder = shared.get("key", lambda folder: (folder / "whole").write_text("ok"))
    assert sorted(p.name for p in folder.iterdir()) == ["whole"]
