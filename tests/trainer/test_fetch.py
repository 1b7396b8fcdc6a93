"""An hf:// model is fetched once into the output folder and every node and restart reads that
copy (#17: "a restarted gang does not download the model again"). The hub is faked over
HTTP (tests/support/hub_fake.py), so the real huggingface_hub client code runs and every
request counts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from finetune_trainer import fetch, trained_with
from finetune_trainer.config import ModelSource, TrainerConfig
from finetune_trainer.layout import FETCHED_FILE, model_copy_dir
from tests.conftest import REPO
from tests.support import waits
from tests.support.hub_fake import FakeHub, Repo, repo_from_folder

DATA = REPO / "examples/data/tiny-chat.jsonl"
WEIGHTS = "model.safetensors"


@pytest.fixture
def hub(tiny_model_dir, tmp_path, monkeypatch):
    """The tiny model as `org/tiny` on a fake hub; no stored token, no shared hub cache."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    repos = {"org/tiny": repo_from_folder(tiny_model_dir),
             "org/gated": repo_from_folder(tiny_model_dir, token="hf_secret")}
    with FakeHub(repos) as served:
        yield served


def source(uri: str = "hf://org/tiny", **fields) -> ModelSource:
    return ModelSource(uri=uri, **fields)


def config_file(where: Path, model: ModelSource, output: Path) -> Path:
    config = TrainerConfig.model_validate({
        "job": {"name": "fetch"}, "model": model.to_dict(), "dataset": {"uri": str(DATA)},
        "strategy": {"type": "ddp"}, "hyperparameters": {"maxSteps": 1},
        "output": {"uri": str(output)}})
    path = where / "trainer.yaml"
    path.write_text(yaml.safe_dump(config.to_dict()))
    return path


def trainer(config: Path, hub: FakeHub, *args: str, wait: bool = True):
    """`finetune-train --config ...` as the pods run it, talking to the fake hub."""
    env = {**os.environ, "HF_ENDPOINT": hub.url, "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "finetune_trainer", f"--config={config}", *args]
    if not wait:
        return subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    return subprocess.run(command, env=env, capture_output=True, text=True,
                          timeout=waits.seconds_left())


def files_of(repo: Repo) -> set[str]:
    return {name for name in repo.files if "/" not in name}


def test_a_second_fetch_makes_no_request_and_the_first_downloads_each_file_once(hub, tmp_path):
    folder = fetch.fetch_model(source(), tmp_path / "out", endpoint=hub.url, say=print)
    assert folder == model_copy_dir(tmp_path / "out", "org/tiny", None)
    assert sorted(hub.downloads()) == sorted(files_of(hub.repos["org/tiny"]))
    api = [path for method, path in hub.requests if path.startswith("/api/")]
    print(f"first fetch: {len(hub.requests)} requests ({len(api)} API, "
          f"{len(hub.downloads())} downloads)")
    marker = json.loads((folder / FETCHED_FILE).read_text())
    assert marker["commit"] == hub.repos["org/tiny"].commit
    assert marker["bytes"] == sum(len(d) for d in hub.repos["org/tiny"].files.values())

    hub.reset()
    again = fetch.fetch_model(source(), tmp_path / "out", endpoint=hub.url)  # the restart
    assert again == folder and hub.requests == []
    print("second fetch: 0 requests")


def test_only_what_from_pretrained_reads_is_fetched(hub, tmp_path):
    repo = hub.repos["org/tiny"]
    extra = {"original/consolidated.00.pth": b"x" * 64, "model.gguf": b"g" * 64,
             "flax_model.msgpack": b"f" * 64, "pytorch_model.bin": b"p" * 64}
    repo.files.update(extra)
    fetch.fetch_model(source(), tmp_path / "out", endpoint=hub.url)
    assert not set(hub.downloads()) & set(extra)  # safetensors first, no other formats
    assert WEIGHTS in hub.downloads()


def test_sharded_weights_come_with_every_shard_the_index_names(hub, tmp_path):
    repo = hub.repos["org/tiny"]
    whole = repo.files.pop(WEIGHTS)
    shards = {"model-00001-of-00002.safetensors": whole[:100],
              "model-00002-of-00002.safetensors": whole[100:]}
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                            "b": "model-00002-of-00002.safetensors"}}
    repo.files.update(shards, **{"model.safetensors.index.json": json.dumps(index).encode()})
    folder = fetch.fetch_model(source(), tmp_path / "out", endpoint=hub.url)
    assert set(shards) <= set(hub.downloads())
    assert fetch.complete_copy(tmp_path / "out", source()) == folder


@pytest.mark.process
def test_a_fetch_killed_halfway_leaves_no_marker_and_the_next_completes(hub, tmp_path):
    config = config_file(tmp_path, source(), tmp_path / "out")
    weights = hub.repos["org/tiny"].files[WEIGHTS]
    hub.hold(WEIGHTS, after_bytes=len(weights) // 2)
    killed = trainer(config, hub, "--fetch-model", wait=False)
    assert hub.holding.wait(waits.seconds_left()), killed.communicate()[0]
    killed.send_signal(signal.SIGKILL)
    killed.wait()  # reaped: its pid is gone, as a killed pod's is
    hub.release()
    folder = model_copy_dir(tmp_path / "out", "org/tiny", None)
    assert not (folder / FETCHED_FILE).exists()
    assert fetch.complete_copy(tmp_path / "out", source()) is None
    assert folder.with_name(folder.name + ".lock").exists()  # left behind by kill -9

    hub.reset()
    started = time.monotonic()
    done = trainer(config, hub, "--fetch-model")
    assert done.returncode == 0, done.stdout + done.stderr
    # its lock was taken over at once, not waited out (the default staleness, 180 s)
    assert time.monotonic() - started < fetch.LockTiming().stale
    assert "taking over" in done.stdout
    assert hub.downloads() == [WEIGHTS]  # the files the killed fetch finished are kept
    assert fetch.complete_copy(tmp_path / "out", source()) == folder
    assert not folder.with_name(folder.name + ".lock").exists()


@pytest.mark.process
def test_sigterm_gives_the_lock_back_and_exits_143(hub, tmp_path):
    config = config_file(tmp_path, source(), tmp_path / "out")
    hub.hold(WEIGHTS, after_bytes=1000)
    stopped = trainer(config, hub, "--fetch-model", wait=False)
    assert hub.holding.wait(waits.seconds_left())
    stopped.send_signal(signal.SIGTERM)
    output, _ = stopped.communicate(timeout=waits.seconds_left())
    hub.release()
    assert stopped.returncode == 143, output
    folder = model_copy_dir(tmp_path / "out", "org/tiny", None)
    assert not folder.with_name(folder.name + ".lock").exists()
    assert not (folder / FETCHED_FILE).exists()


@pytest.mark.process
def test_two_fetches_at_once_leave_one_good_copy_downloaded_once(hub, tmp_path):
    """Two nodes sharing the output volume: one downloads, the other waits on the lock and
    then finds the copy complete."""
    config = config_file(tmp_path, source(), tmp_path / "out")
    hub.hold(WEIGHTS, after_bytes=1000)
    first = trainer(config, hub, "--fetch-model", wait=False)
    assert hub.holding.wait(waits.seconds_left())
    second = trainer(config, hub, "--fetch-model", wait=False)
    said = []
    for line in second.stdout:  # until the second waits for the lock (it says so)
        said.append(line)
        if "waiting for another node's fetch" in line:
            break
    hub.release()
    outputs = [p.communicate(timeout=waits.seconds_left())[0] for p in (first, second)]
    outputs[1] = "".join(said) + outputs[1]
    assert [p.returncode for p in (first, second)] == [0, 0], outputs
    assert "waiting for another node's fetch" in outputs[1]
    assert "meanwhile" in outputs[1]
    assert sorted(hub.downloads()) == sorted(files_of(hub.repos["org/tiny"]))  # once each
    copies = list((tmp_path / "out" / "model-cache").iterdir())
    assert [c.name for c in copies] == ["org--tiny@default"]  # the lock has gone too
    assert fetch.complete_copy(tmp_path / "out", source()) == copies[0]


@pytest.mark.process
def test_the_workers_read_the_copy_without_a_single_request(hub, tmp_path):
    """The trainer's own entry point (the preflight reads the tokenizer and the
    architecture), after the fetch: the hub hears nothing more."""
    config = config_file(tmp_path, source(), tmp_path / "out")
    assert trainer(config, hub, "--fetch-model").returncode == 0
    hub.reset()
    checked = trainer(config, hub, "--preflight")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "model and data look usable" in checked.stdout
    assert hub.requests == []


def test_the_copy_loads_as_the_model_and_checkpoints_record_the_spec(hub, tmp_path):
    from finetune_trainer.config import MethodConfig
    from finetune_trainer.model import load_model, load_tokenizer

    config = TrainerConfig.load(config_file(tmp_path, source(revision="main"), tmp_path / "out"))
    assert fetch.with_local_copy(config, tmp_path / "out") is config  # nothing fetched yet
    fetch.fetch_model(config.model, tmp_path / "out", endpoint=hub.url)
    hub.reset()
    local = fetch.with_local_copy(config, tmp_path / "out")
    assert local.model.uri == str(model_copy_dir(tmp_path / "out", "org/tiny", "main"))
    assert local.model_fetched_from == config.model
    assert trained_with.record(local) == trained_with.record(config)
    model = load_model(local.model, MethodConfig(type="full"), "fp32", False)
    assert load_tokenizer(local.model).pad_token_id is not None
    assert model.config.num_hidden_layers == 2 and hub.requests == []


def test_a_damaged_copy_is_not_used_and_the_next_fetch_mends_it(hub, tmp_path):
    folder = fetch.fetch_model(source(), tmp_path / "out", endpoint=hub.url)
    (folder / WEIGHTS).write_bytes(b"truncated")
    assert fetch.complete_copy(tmp_path / "out", source()) is None
    config = TrainerConfig.load(config_file(tmp_path, source(), tmp_path / "out"))
    assert fetch.with_local_copy(config, tmp_path / "out") is config
    hub.reset()
    fetch.fetch_model(source(), tmp_path / "out", endpoint=hub.url)
    assert hub.downloads() == [WEIGHTS]
    assert fetch.complete_copy(tmp_path / "out", source()) == folder


def test_each_revision_has_its_own_copy(hub, tmp_path):
    repo = hub.repos["org/tiny"]
    repo.branches["refs/pr/1"] = repo.commit
    a = fetch.fetch_model(source(revision="main"), tmp_path / "out", endpoint=hub.url)
    b = fetch.fetch_model(source(revision="refs/pr/1"), tmp_path / "out", endpoint=hub.url)
    assert a != b and b.name == "org--tiny@refs%2Fpr%2F1"
    assert fetch.complete_copy(tmp_path / "out", source(revision="main")) == a


@pytest.mark.parametrize(("model", "token", "field", "words"), [
    (source(revision="v9"), None, "spec.model.revision", "'v9' is not a branch, tag or commit"),
    (source("hf://org/missing"), None, "spec.model.uri", "does not exist on the hub"),
    (source("hf://org/gated"), None, "spec.model.tokenSecretRef", "gated or private and no "
                                                                  "token was given"),
    (source("hf://org/gated"), "hf_wrong", "spec.model.tokenSecretRef", "refused the token"),
], ids=["revision", "repository", "gated-no-token", "gated-wrong-token"])
def test_the_hubs_refusals_name_the_field_and_the_fix(hub, tmp_path, monkeypatch, model, token,
                                                      field, words):
    if token:
        monkeypatch.setenv("HF_TOKEN", token)
    with pytest.raises(fetch.FetchError) as refused:
        fetch.fetch_model(model, tmp_path / "out", endpoint=hub.url)
    assert str(refused.value).startswith(f"{field}: ") and words in str(refused.value)
    assert refused.value.permanent  # exit 2: no restart can help
    assert " — " in str(refused.value)  # and the fix


@pytest.mark.process
def test_a_gated_model_with_its_token_and_the_cli_exit_codes(hub, tmp_path, monkeypatch):
    config = config_file(tmp_path, source("hf://org/gated"), tmp_path / "out")
    refused = trainer(config, hub, "--fetch-model")
    assert refused.returncode == 2 and "spec.model.tokenSecretRef" in refused.stderr
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    assert trainer(config, hub, "--fetch-model").returncode == 0
    other = config_file(tmp_path, source(), tmp_path / "other")
    unreachable = subprocess.run(
        [sys.executable, "-m", "finetune_trainer", f"--config={other}", "--fetch-model"],
        capture_output=True, text=True, timeout=waits.seconds_left(),
        env={**os.environ, "HF_ENDPOINT": "http://127.0.0.1:1"})
    assert unreachable.returncode == 1, unreachable.stderr  # the network: a restart may help
    assert "cannot be fetched from the hub" in unreachable.stderr


def test_a_volume_too_small_is_said_before_the_weights_download(hub, tmp_path, monkeypatch):
    monkeypatch.setattr(fetch, "free_bytes", lambda folder: 1000)
    with pytest.raises(fetch.FetchError) as refused:
        fetch.fetch_model(source(), tmp_path / "out", endpoint=hub.url)
    assert "need" in str(refused.value) and "spec.output.uri" in str(refused.value)
    assert WEIGHTS not in hub.downloads() and not refused.value.permanent


@pytest.mark.process
def test_other_locations_need_no_fetch(tmp_path, tiny_model_dir):
    config = config_file(tmp_path, source(str(tiny_model_dir)), tmp_path / "out")
    done = subprocess.run([sys.executable, "-m", "finetune_trainer", f"--config={config}",
                           "--fetch-model"], capture_output=True, text=True,
                          timeout=waits.seconds_left())
    assert done.returncode == 0 and "nothing to fetch" in done.stdout
    assert not (tmp_path / "out").exists()


def test_the_export_names_the_hub_model_not_the_copy(tmp_path):
    copy = tmp_path / "out/model-cache/org--tiny@main"
    spec = source(revision="main")
    config = TrainerConfig.model_validate({
        "job": {"name": "x"}, "model": {"uri": str(copy)}, "modelFetchedFrom": spec.to_dict(),
        "dataset": {"uri": str(DATA)}, "strategy": {"type": "ddp"},
        "hyperparameters": {"maxSteps": 1}, "output": {"uri": str(tmp_path / "out")}})
    final = tmp_path / "out/final"
    final.mkdir(parents=True)
    (final / "adapter_config.json").write_text(json.dumps(
        {"base_model_name_or_path": str(copy), "r": 8}))
    (final / "README.md").write_text(f"---\nbase_model: {copy}\n---\n")
    fetch.name_hub_model(final, config)
    adapter = json.loads((final / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == "org/tiny" and adapter["revision"] == "main"
    assert str(copy) not in (final / "README.md").read_text()


def test_a_lock_left_by_a_process_of_another_host_is_taken_over_once_it_stops_changing(
        tmp_path):
    path = tmp_path / "copy.lock"
    path.write_text(json.dumps({"host": "another-node", "pid": 1, "id": "x", "beat": 3}))
    timing = fetch.LockTiming(heartbeat=0.05, stale=0.5, poll=0.05)
    started = time.monotonic()
    with fetch.VolumeLock(path, timing, say=lambda line: None):
        assert json.loads(path.read_text())["host"] != "another-node"
    assert 0.5 <= time.monotonic() - started < 60  # once still for `stale` (0.55 s here)
    assert not path.exists()


def test_a_live_holder_keeps_its_lock_by_its_heartbeat(tmp_path):
    path = tmp_path / "copy.lock"
    timing = fetch.LockTiming(heartbeat=0.05, stale=0.5, poll=0.05)
    with fetch.VolumeLock(path, timing, say=lambda line: None) as holder:
        time.sleep(1.0)  # twice the staleness: only its heartbeat keeps others out
        waits.wait_until(lambda: holder.owner["beat"] >= 5, "five heartbeats")
        # read as the holder's: a read while the heartbeat rewrites the file finds it empty
        # (a waiter then keeps waiting), so a read of this thread may need another
        waits.wait_until(lambda: holder._holder() == holder.owner["id"], "its holder's lock")
        other = fetch.VolumeLock(path, timing, say=lambda line: None)
        assert not other._create() and not other._gone(path.read_text())


@pytest.mark.process
def test_finetune_run_fetches_once_and_a_second_run_asks_the_hub_nothing(hub, tmp_path):
    """The issue's check, end to end on one machine: `finetune run` fetches the hf:// model
    into its output folder; the same command again (a restart) resumes with no request at
    all, and the exported adapter names the hub model."""
    job = {"apiVersion": "finetune.dev/v1alpha1", "kind": "FineTuneJob",
           "metadata": {"name": "fetched"},
           "spec": {"model": {"uri": "hf://org/tiny"},
                    "dataset": {"uri": str(DATA), "maxSeqLength": 64},
                    "method": {"type": "lora", "lora": {"r": 4, "alpha": 8}},
                    "strategy": {"type": "ddp", "precision": "fp32"},
                    "hyperparameters": {"maxSteps": 2, "batchSizePerDevice": 2,
                                        "learningRate": 1e-3},
                    "resources": {"gpusPerNode": 0, "processesPerNode": 1},
                    "preflight": {"enabled": False},
                    "output": {"uri": "./out", "checkpointEverySteps": 1}}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    env = {**os.environ, "HF_ENDPOINT": hub.url, "PYTHONUNBUFFERED": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "finetune_operator.cli", "run", str(tmp_path / "job.yaml")]

    first = subprocess.run(command, env=env, capture_output=True, text=True,
                           timeout=waits.seconds_left())
    assert first.returncode == 0, first.stdout + first.stderr
    assert hub.downloads().count(WEIGHTS) == 1
    print(f"first run: {len(hub.requests)} requests, {len(hub.downloads())} downloads "
          f"({', '.join(sorted(hub.downloads()))})")
    hub.reset()
    job["spec"]["hyperparameters"]["maxSteps"] = 3  # resumed (the same 2 would be done)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    second = subprocess.run(command, env=env, capture_output=True, text=True,
                            timeout=waits.seconds_left())
    assert second.returncode == 0, second.stdout + second.stderr
    assert "(step 2/3)" in second.stdout, second.stdout
    assert hub.requests == [], hub.requests
    adapter = json.loads((tmp_path / "out/final/adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == "org/tiny"
