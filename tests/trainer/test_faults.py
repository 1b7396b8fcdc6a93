"""Worker faults on a real `finetune run` (2 gloo ranks on CPU), each made for real: a rank
SIGKILLed mid-step, and an output volume that fills up mid-run. The product must lose
nothing: the run ends where an uninterrupted run of the same job ends, weights included.

(SIGTERM and a half-written checkpoint left by a dead writer are in test_training.py.)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import yaml

from finetune_trainer.checkpoint import complete_checkpoints
from tests.support import waits
from tests.trainer.test_metrics import metrics_ports, scrape
from tests.trainer.test_training import losses, manifest

pytestmark = pytest.mark.process
STEPS, EVERY = 60, 10  # ~50 ms a step here: a fault lands seconds before the end
# Same data order (seeded), fp32 on CPU with one thread per rank (torchrun's default) and a
# resume that restores weights, optimizer, schedule and RNG: a restarted run is expected to
# be bit-identical to an uninterrupted one. 1e-6 leaves room for nothing but rounding: one
# lost or repeated Adam step moves every weight by about the learning rate (5e-3).
WEIGHTS_ATOL = 1e-6


def fault_job(model_dir: Path, out_dir: Path, name: str, **spec) -> dict:
    """The same training for every run here (full fine-tune, so the weights are compared
    whole), checkpointed every EVERY steps."""
    job = manifest(model_dir, out_dir, method="full", steps=STEPS, checkpoint_every=EVERY)
    job["metadata"]["name"] = name
    for section, values in spec.items():
        job["spec"].setdefault(section, {}).update(values)
    return job


def start(job: dict, where: Path, *extra: str) -> tuple[subprocess.Popen, Path]:
    """`finetune run` in the background, its output in a file (a pipe nobody reads would
    fill up and stall the run)."""
    where.mkdir(parents=True, exist_ok=True)
    path = where / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    log = where / "run.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "finetune_operator.cli", "run", str(path), *extra],
            stdout=out, stderr=subprocess.STDOUT, env=env)
    return process, log


@pytest.fixture()
def launch():
    """`start`, and whatever is still running at the end of the test is killed: torchrun
    runs in its own session, so the whole tree is."""
    started: list[subprocess.Popen] = []

    def run(job: dict, where: Path, *extra: str) -> tuple[subprocess.Popen, Path]:
        process, log = start(job, where, *extra)
        started.append(process)
        return process, log

    yield run
    for process in started:
        if process.poll() is None:
            tree = psutil.Process(process.pid)
            for member in [*tree.children(recursive=True), tree]:
                with contextlib.suppress(psutil.Error):  # gone meanwhile
                    member.kill()
            process.wait(timeout=60)


def wait_until(check: Callable[[], object], what: str, process: subprocess.Popen,
               log: Path) -> None:
    timeout = waits.seconds_left()
    deadline = time.monotonic() + timeout
    while not check():
        if process.poll() is not None:
            raise AssertionError(f"the run ended (exit {process.returncode}) before {what}:\n"
                                 + log.read_text()[-4000:])
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f}s: {what}")
        time.sleep(0.01)


def progress_step(output: Path) -> int:
    try:
        return json.loads((output / "progress.json").read_text())["step"]
    except (OSError, ValueError, KeyError):
        return 0


def ranks(process: subprocess.Popen) -> dict[int, psutil.Process]:
    """The training processes under a `finetune run`, by global rank (from their RANK)."""
    found = {}
    for child in psutil.Process(process.pid).children(recursive=True):
        try:
            if "finetune_trainer" in " ".join(child.cmdline()) and "RANK" in child.environ():
                found[int(child.environ()["RANK"])] = child
        except psutil.Error:  # gone meanwhile
            continue
    return found


def digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def size_of(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def assert_same_weights(output: Path, reference: Path) -> None:
    from safetensors.torch import load_file

    expected = load_file(reference / "final" / "model.safetensors")
    got = load_file(output / "final" / "model.safetensors")
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert got[name].allclose(tensor, rtol=0, atol=WEIGHTS_ATOL), name


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, tmp_path_factory) -> Path:
    """The run the faulted ones must end equal to."""
    where = tmp_path_factory.mktemp("uninterrupted")
    started = time.monotonic()
    process, log = start(fault_job(tiny_model_dir, where / "out", "t-faults"), where)
    assert process.wait(timeout=waits.seconds_left()) == 0, log.read_text()
    print(f"\nuninterrupted run of {STEPS} steps: {time.monotonic() - started:.1f}s")
    return where / "out"


def test_kill_9_of_one_rank_restarts_the_gang_from_the_last_checkpoint(
        uninterrupted, tiny_model_dir, tmp_path, launch):
    output = tmp_path / "out"
    port = metrics_ports(2)  # its own: no other run on this machine takes them
    process, log = launch(fault_job(tiny_model_dir, output, "t-faults-kill"), tmp_path,
                          "--metrics-port", str(port))
    began = time.monotonic()
    wait_until(lambda: (output / "checkpoints" / f"step-{EVERY:08d}").is_dir()
               and progress_step(output) >= EVERY + 2,
               "a checkpoint exists and training went on", process, log)
    killed_at = progress_step(output)
    victim = ranks(process)[1]
    victim.send_signal(signal.SIGKILL)
    kill_time = time.monotonic()

    restarts_seen: dict[str, float] = {}  # rank → finetune_restarts on the restarted gang
    resumed_after = None
    while process.poll() is None:
        text = log.read_text()
        if resumed_after is None and "resuming from" in text:
            resumed_after = time.monotonic() - kill_time
        if "restart 1 of at most" in text:
            for rank in (0, 1):
                if series := scrape(port + rank).get("finetune_restarts"):
                    assert series["labels"]["job"] == "t-faults-kill", series
                    restarts_seen[series["labels"]["rank"]] = series["value"]
        time.sleep(0.05)
    done_after = time.monotonic() - kill_time
    text = log.read_text()
    assert process.returncode == 0, text[-4000:]
    assert not victim.is_running()
    assert re.search(r"finetune-train: rank 1 was ended by SIGKILL .*\n"
                     r"finetune run: a worker failed \(exit 1\); restarting every worker from "
                     r"the newest complete checkpoint: restart 1 of at most 3 "
                     r"\(spec.runPolicy.backoffLimit\)", text), text[-4000:]
    resumed = [line for line in text.splitlines() if line.startswith("resuming from")]
    assert len(resumed) == 1, resumed
    resumed_from = int(resumed[0].split("step-")[1][:8])
    assert resumed_from % EVERY == 0 and EVERY <= resumed_from <= killed_at

    progress = json.loads((output / "progress.json").read_text())
    assert progress["phase"] == "Succeeded" and progress["step"] == STEPS
    assert losses(output) == pytest.approx(losses(uninterrupted), rel=1e-5)
    assert_same_weights(output, uninterrupted)
    # torchrun's restart on the restarted ranks' gauge
    assert restarts_seen and set(restarts_seen.values()) == {1.0}, restarts_seen
    print(f"\nkill -9 of rank 1 at step {killed_at} ({kill_time - began:.1f}s into the run): "
          f"gang restarted and resumed from step {resumed_from} after {resumed_after:.1f}s, "
          f"{killed_at - resumed_from} step(s) redone, finished {done_after:.1f}s after "
          "the kill")


# --- a full output volume ---------------------------------------------------------------

LIMITED_FILE_SIZE = 256 * 1024  # below one rank's checkpoint shard (~0.9 MB), above the rest


def can_mount_tmpfs(where: Path) -> bool:
    probe = where / "mount-probe"
    probe.mkdir()
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs",
                                  str(probe)], capture_output=True).returncode == 0
    except OSError:  # no mount command
        return False
    if mounted:
        subprocess.run(["umount", str(probe)], check=True)
    return mounted


class SmallVolume:
    """An output folder whose writes start failing mid-run, for real.

    Where this machine lets us mount (root, as in the dev container): a tmpfs sized for one
    checkpoint and a half, so the first checkpoint fits and the second runs out of space
    part-way: ENOSPC. Elsewhere (CI runners are not root): RLIMIT_FSIZE, set with prlimit on
    the running `finetune run`, torchrun and workers once the first checkpoint is complete,
    so the next checkpoint's shard files hit the limit: EFBIG, which is how a quota or a
    per-file limit of a network volume fails. Restarted workers inherit the limit.
    """

    def __init__(self, path: Path, checkpoint_bytes: int, use_tmpfs: bool):
        self.path = path
        self.kind = "tmpfs" if use_tmpfs else "rlimit"
        path.mkdir(parents=True)
        if use_tmpfs:
            size = checkpoint_bytes * 3 // 2 + 256 * 1024  # + progress files and the config
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                           check=True)

    def fill(self, process: subprocess.Popen) -> None:
        """After the first checkpoint: nothing to do on the tmpfs, which fills by itself."""
        if self.kind == "rlimit":
            tree = [psutil.Process(process.pid),
                    *psutil.Process(process.pid).children(recursive=True)]
            for member in tree:
                member.rlimit(psutil.RLIMIT_FSIZE, (LIMITED_FILE_SIZE, LIMITED_FILE_SIZE))

    def lift(self) -> None:
        """The user frees space (a new run is started without the limit)."""
        if self.kind == "tmpfs":
            subprocess.run(["mount", "-o", "remount,size=64m", str(self.path)], check=True)

    def close(self) -> None:
        if self.kind == "tmpfs":
            subprocess.run(["umount", "--lazy", str(self.path)], check=False)


@pytest.fixture()
def small_volume(uninterrupted, tmp_path):
    checkpoint = complete_checkpoints(uninterrupted)[-1]
    volume = SmallVolume(tmp_path / "out", size_of(checkpoint), can_mount_tmpfs(tmp_path))
    yield volume
    volume.close()


def test_a_full_output_volume_fails_clearly_and_keeps_the_earlier_checkpoint(
        uninterrupted, tiny_model_dir, small_volume, tmp_path, launch):
    output = small_volume.path
    job = fault_job(tiny_model_dir, output, "t-faults-full", output={"keepLast": 1},
                    runPolicy={"backoffLimit": 1})
    process, log = launch(job, tmp_path / "first")
    first = output / "checkpoints" / f"step-{EVERY:08d}"
    wait_until(first.is_dir, "the first checkpoint", process, log)
    small_volume.fill(process)
    before = digests(first)
    assert process.wait(timeout=waits.seconds_left()) == 1
    text = log.read_text()

    second = f"step-{2 * EVERY:08d}.partial"
    assert f"finetune-train: {output}: writing checkpoint {second} failed" in text, text[-4000:]
    if small_volume.kind == "tmpfs":
        assert "No space left on device" in text
        assert "the output volume is full" in text
        assert "free space there or point spec.output.uri at a larger volume" in text
    else:
        assert "File too large" in text
    assert f"then run the job again: it resumes from step-{EVERY:08d}, which is complete " \
           "and untouched" in text
    # torchrun restarted the gang once (backoffLimit 1) into the same full volume
    assert "restart 1 of at most 1" in text
    assert "training failed (exit 1)" in text
    # keepLast 1 did not delete the only complete checkpoint for one that never completed
    assert [p.name for p in complete_checkpoints(output)] == [first.name]
    assert digests(first) == before
    assert (output / "checkpoints" / second).is_dir()  # the write really died part-way

    small_volume.lift()
    process, log = launch(job, tmp_path / "again")
    assert process.wait(timeout=waits.seconds_left()) == 0, log.read_text()[-4000:]
    text = log.read_text()
    # the half-written checkpoint next to it was not taken for a complete one
    assert f"resuming from {output / 'checkpoints' / first.name} (step {EVERY}/{STEPS})" in text
    assert "finetune-train: restart" not in text
    assert not list((output / "checkpoints").glob("*.partial"))  # removed by the next write
    assert json.loads((output / "progress.json").read_text())["step"] == STEPS
    assert_same_weights(output, uninterrupted)
    print(f"\nfull output volume ({small_volume.kind}): failed at checkpoint {second}, "
          f"resumed from {first.name} once space was freed, weights equal the "
          "uninterrupted run's")


def test_restart_count_reaches_the_metrics_from_torchrun_and_the_operator(monkeypatch):
    """The gauge adds torchrun's in-place restarts to the operator's pod restarts."""
    from finetune_trainer.metrics import TrainerMetrics, gang_restarts

    assert gang_restarts({}) == 0
    assert gang_restarts({"TORCHELASTIC_RESTART_COUNT": "2"}) == 2
    assert gang_restarts({"FINETUNE_RESTARTS": "1", "TORCHELASTIC_RESTART_COUNT": "2"}) == 3
    assert gang_restarts({"FINETUNE_RESTARTS": "x", "TORCHELASTIC_RESTART_COUNT": ""}) == 0
    monkeypatch.setenv("FINETUNE_RESTARTS", "1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    metrics = TrainerMetrics("demo", "default", rank=0, node="n")
    labels = {"job": "demo", "namespace": "default", "rank": "0", "node": "n"}
    assert metrics.registry.get_sample_value("finetune_restarts", labels) == 2


def test_refused_data_is_not_restarted(tiny_model_dir, tmp_path):
    """The workers' refusal of the data (exit 2) ends the run at once with their line:
    torchrun's restarts repeated it backoffLimit times (`finetune run` checks the data
    first, so here the workers are started by hand on a config the check never saw)."""
    from finetune_operator.local.config import local_config, write_config
    from finetune_operator.local.processes import run_trainer
    from finetune_operator.validation import parse_job

    data = tmp_path / "chats.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n[1, 2]\n')
    job = manifest(tiny_model_dir, tmp_path / "out", steps=4)
    job["spec"]["dataset"]["uri"] = str(data)
    config, _ = local_config(parse_job(job), tmp_path)
    log = tmp_path / "run.log"
    assert run_trainer(write_config(config, tmp_path / "out"), 2, log, max_restarts=3,
                       on_gpus=False) == 2
    text = log.read_text()
    assert "restarting every worker" not in text, text[-3000:]
    assert text.strip().splitlines()[-1] == (
        f"finetune-train: {data}:2: is a JSON list, not an object — write one JSON object "
        "per line"), text[-3000:]


def test_a_failed_write_says_where_why_and_where_a_rerun_resumes(tmp_path):
    """The message's other branches: a folder that refuses writes with room to spare, and
    a failure before any checkpoint completed."""
    import errno

    from finetune_trainer.checkpoint import STATE_FILE, write_failure

    partial = tmp_path / "checkpoints" / "step-00000020.partial"
    refused = OSError(errno.EACCES, "Permission denied")
    message = write_failure(tmp_path, partial, refused)
    assert message.startswith(f"{tmp_path}: writing checkpoint step-00000020.partial failed "
                              "([Errno 13] Permission denied); the output folder refused")
    assert "check that every worker can write there" in message
    assert message.endswith("it starts from step 0 (no checkpoint is complete yet)")
    complete = tmp_path / "checkpoints" / "step-00000010"
    complete.mkdir(parents=True)
    (complete / STATE_FILE).write_text("{}")
    assert write_failure(tmp_path, partial, refused).endswith(
        "it resumes from step-00000010, which is complete and untouched")


def test_a_peer_dying_mid_save_is_not_blamed_on_the_output_folder():
    """#25, item 6: the survivor of a rank killed during a checkpoint write said the output
    folder refused the write; it is the gang's failure, and torchrun restarts the gang."""
    import errno

    import torch.distributed as dist

    from finetune_trainer.checkpoint import peer_failure

    class DcpFailure(Exception):  # the shape of DCP's CheckpointException
        def __init__(self, failures):
            self._failures = failures

    gone = RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]")
    assert peer_failure(gone)
    assert peer_failure(dist.DistBackendError("NCCL communicator was aborted on rank 1"))
    assert peer_failure(DcpFailure({1: (gone, None)}))
    full = OSError(errno.ENOSPC, "No space left on device")
    assert not peer_failure(full)
    assert not peer_failure(RuntimeError("PytorchStreamWriter failed writing file: unexpected pos"))
    assert not peer_failure(DcpFailure({0: (full, None), 1: (gone, None)}))
