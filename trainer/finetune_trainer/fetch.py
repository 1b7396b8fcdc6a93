"""Hub models fetched once into the output folder, for every node and every restart (#17).

Without this, every rank of every node asked the hub for the model at each (re)start, and a
node's copy lived in a scratch volume that a restarted pod no longer has. Now, before the
workers start (the pods' `fetch-model` init container; `finetune run`), `finetune-train
--fetch-model` downloads an hf:// model's files into the output folder
(`model-cache/org--name@revision`, layout.py), checks them, and writes `fetched.json` last.
The workers then read that folder, never the hub: a second node, a restarted gang or a
resumed run find the marker and make no request at all.

- Only what `from_pretrained` reads: the repository's top-level files except weights, and
  one set of weights (the safetensors index and the shards it names, else
  `model.safetensors`, else the same for `pytorch_model.bin`); no `original/` copies, GGUF,
  ONNX, TF or Flax weights.
- Pinned: the revision is resolved to a commit once, and every file is read at that commit,
  so the nodes never mix two versions of a branch; restarts keep that commit.
- Checked: each file has the size the hub lists, `config.json` parses and every shard the
  index names is there; huggingface_hub's own local_dir metadata lets a killed fetch keep
  the files it finished.
- Shared volumes: nodes take turns through a lock file made with O_EXCL (atomic on local
  disks, NFS and SMB / Azure Files); its holder rewrites it every few seconds, and one left
  by a killed fetch is taken over once it stops changing (at once on the same host, when
  its process is gone). Correctness does not rest on the lock: files land by rename, and
  the marker is written last, after the check.

Torch-free; huggingface_hub is imported only to download.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from finetune_trainer.config import ModelSource, TrainerConfig
from finetune_trainer.layout import FETCHED_FILE, model_copy_dir

Say = Callable[[str], None]
DOWNLOAD_THREADS = 8
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx",
                   ".onnx_data", ".gguf", ".tflite", ".ot", ".nemo", ".pkl", ".npz")
"""Files the top level of a repository may hold besides the weights `from_pretrained` reads."""
WEIGHT_SETS = (("model.safetensors.index.json", "model.safetensors"),
               ("pytorch_model.bin.index.json", "pytorch_model.bin"))
"""(sharded index, single file), in the order transformers prefers them."""
_DOWNLOAD_LEFTOVERS = ".cache/huggingface/download"
_HELD_HERE: set[str] = set()
"""Ids of the locks this process holds, told apart from an earlier process of its pid."""


class FetchError(Exception):
    """A model that cannot be fetched: `where` (a spec field or a folder), what, and the fix.
    `permanent`: no restart can help (a wrong name, revision or token), as opposed to the
    network or a full volume."""

    def __init__(self, where: str, what: str, fix: str, permanent: bool = False):
        super().__init__(f"{where}: {what} — {fix}")
        self.permanent = permanent


def hub_repo(source: ModelSource) -> str | None:
    """`org/name` of an hf:// model; None for every other location."""
    if not source.uri.startswith("hf://"):
        return None
    return source.uri.removeprefix("hf://").strip("/")


# --- the copy, as the workers see it (no network) ---------------------------------------

def complete_copy(output_dir: Path, source: ModelSource) -> Path | None:
    """The folder holding a complete copy of hf:// `source`, or None: its marker names this
    model and revision, and every file it lists is there with its size."""
    repo = hub_repo(source)
    if repo is None:
        return None
    folder = model_copy_dir(output_dir, repo, source.revision)
    record = read_marker(folder)
    if record is None or (record.get("uri"), record.get("revision")) != (
            source.uri, source.revision):
        return None
    files: dict[str, int | None] = record.get("files") or {}
    if "config.json" not in files or any(not _has_size(folder / name, size)
                                         for name, size in files.items()):
        return None
    return folder


def read_marker(folder: Path) -> dict[str, Any] | None:
    try:
        record = json.loads((folder / FETCHED_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _has_size(path: Path, size: int | None) -> bool:
    try:
        found = path.stat().st_size
    except OSError:
        return False
    return size is None or found == size


def with_local_copy(config: TrainerConfig, output_dir: Path) -> TrainerConfig:
    """`config` reading its hub model from the complete copy in `output_dir`, when there is
    one (unchanged otherwise: the workers then read the hub, as before this step existed).
    `model_fetched_from` keeps the spec's model for the checkpoints' record."""
    folder = complete_copy(output_dir, config.model)
    if folder is None:
        return config
    local = ModelSource(uri=str(folder), trust_remote_code=config.model.trust_remote_code)
    return config.model_copy(update={"model": local, "model_fetched_from": config.model})


def name_hub_model(export_dir: Path, config: TrainerConfig) -> None:
    """An adapter trained on the copy names the hub model, as one trained from the hub does:
    peft records the folder the base model was read from, which means nothing outside this
    volume (vLLM on another machine, `AutoPeftModel` elsewhere)."""
    origin = config.model_fetched_from
    adapter = export_dir / "adapter_config.json"
    if origin is None or not adapter.is_file():
        return
    repo, folder = hub_repo(origin), config.model.uri
    record = json.loads(adapter.read_text())
    if record.get("base_model_name_or_path") == folder:
        record["base_model_name_or_path"] = repo
        if origin.revision:
            record["revision"] = origin.revision
        adapter.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    card = export_dir / "README.md"
    if card.is_file():
        card.write_text(card.read_text().replace(folder, repo or folder))


# --- fetching -----------------------------------------------------------------------------

@dataclass(frozen=True)
class LockTiming:
    """How often a lock's holder shows it is alive, and how long a lock may stay unchanged
    before another node takes it over: longer than NFS caches a file's attributes (60 s)."""

    heartbeat: float = 10.0
    stale: float = 180.0
    poll: float = 2.0


def fetch_model(source: ModelSource, output_dir: Path, *, endpoint: str | None = None,
                say: Say = print, timing: LockTiming = LockTiming()) -> Path:
    """The folder holding a complete copy of hf:// `source` in `output_dir`, downloaded
    unless a complete one is there already (then without any request). `endpoint`: the
    hub's address (default: huggingface_hub's, i.e. HF_ENDPOINT or huggingface.co)."""
    repo = hub_repo(source)
    if repo is None:
        raise ValueError(f"{source.uri} is not an hf:// model: nothing to fetch")
    folder = model_copy_dir(output_dir, repo, source.revision)
    if complete_copy(output_dir, source) is not None:
        say(f"{_named(source)} is in {folder} already: nothing to download")
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    with VolumeLock(folder.with_name(folder.name + ".lock"), timing, say):
        if complete_copy(output_dir, source) is not None:  # fetched while this one waited
            say(f"{_named(source)} was fetched into {folder} meanwhile")
            return folder
        _download(source, repo, folder, endpoint, say)
    return folder


def _named(source: ModelSource) -> str:
    return f"{source.uri}@{source.revision}" if source.revision else source.uri


@dataclass(frozen=True)
class _Hub:
    """One fetch's view of the hub: the spec's model, pinned to `commit` once known."""

    source: ModelSource
    repo: str
    endpoint: str | None
    token: str | None
    commit: str = ""


def _download(source: ModelSource, repo: str, folder: Path, endpoint: str | None,
              say: Say) -> None:
    """Every file the copy needs, then the check, then the marker (under the lock)."""
    hub = _Hub(source, repo, endpoint, os.environ.get("HF_TOKEN") or None)
    info = _model_info(hub)
    if not info.sha or info.siblings is None:
        raise _unreachable(source, ValueError("the hub's answer names no commit or files"))
    hub = replace(hub, commit=info.sha)
    sizes = {s.rfilename: s.size for s in info.siblings}
    (folder / FETCHED_FILE).unlink(missing_ok=True)  # the copy changes: not complete now
    _remove_leftovers(folder)
    started = time.monotonic()
    small = sorted(n for n in sizes if "/" not in n and not n.endswith(WEIGHT_SUFFIXES))
    say(f"{_named(source)}: commit {info.sha}, into {folder}")
    _get(hub, small, folder, sizes, say)
    weights = _weight_files(folder, sizes, source)
    _check_space(folder, {n: sizes[n] for n in weights})
    _get(hub, weights, folder, sizes, say)
    files = {n: sizes[n] for n in small + weights}
    verify(folder, files)
    write_marker(folder, source, info.sha, files)
    say(f"{_named(source)}: {len(files)} files, {_size(sum(s or 0 for s in files.values()))} "
        f"in {time.monotonic() - started:.0f} s; every node and restart reads {folder}")


def _model_info(hub: _Hub):
    """The repository at the spec's revision: its commit and its files with their sizes."""
    from huggingface_hub import HfApi  # the hub's client: the operator imports this module

    api = HfApi(endpoint=hub.endpoint, token=hub.token)
    try:
        return api.model_info(hub.repo, revision=hub.source.revision, files_metadata=True)
    except Exception as error:  # the hub's refusals, and the transport's own errors
        raise _hub_error(hub.source, error) from None


def _hub_error(source: ModelSource, error: Exception) -> FetchError:
    """The hub's refusal as an error naming the field to change; anything else (refused,
    reset, timed out, 5xx) as the network's."""
    from huggingface_hub.errors import (  # the hub's client, as in _model_info
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(error, GatedRepoError):
        return _gated(source)
    if isinstance(error, RevisionNotFoundError):
        return FetchError("spec.model.revision", f"{source.revision!r} is not a branch, tag or "
                          f"commit of {source.uri}", "use one the repository has, or leave "
                          "revision out for its default branch", permanent=True)
    if isinstance(error, RepositoryNotFoundError):
        return FetchError("spec.model.uri", f"{source.uri} does not exist on the hub, or is "
                          "private", "check the name; for a private model set spec.model."
                          "tokenSecretRef to a token that can read it", permanent=True)
    response = getattr(error, "response", None) if isinstance(error, HfHubHTTPError) else None
    if response is not None and response.status_code in (401, 403):
        return _gated(source)
    return _unreachable(source, error)


def _gated(source: ModelSource) -> FetchError:
    if not os.environ.get("HF_TOKEN"):
        return FetchError("spec.model.tokenSecretRef", f"{source.uri} is gated or private and "
                          "no token was given", "create a Secret with a hub token of an account "
                          "that accepted the model's licence and name it in spec.model."
                          "tokenSecretRef", permanent=True)
    return FetchError("spec.model.tokenSecretRef", f"the hub refused the token for "
                      f"{source.uri}", "accept the model's licence on its hub page with the "
                      "token's account, or put a valid token in the Secret", permanent=True)


def _unreachable(source: ModelSource, error: Exception) -> FetchError:
    first = (str(error).strip().splitlines() or [""])[0][:300]
    return FetchError(source.uri, f"cannot be fetched from the hub ({type(error).__name__}: "
                      f"{first})", "check that the pods reach the hub (HF_ENDPOINT, proxies "
                      "in spec.kubernetes.env); the next attempt keeps the files already "
                      "fetched")


def _remove_leftovers(folder: Path) -> None:
    """Half-downloaded files of a fetch that was killed (huggingface_hub gives each a unique
    name, so nothing else would ever remove them); only the lock's holder gets here."""
    leftovers = folder / _DOWNLOAD_LEFTOVERS
    if leftovers.is_dir():
        for partial in leftovers.rglob("*.incomplete"):
            partial.unlink(missing_ok=True)


def _get(hub: _Hub, names: list[str], folder: Path, sizes: dict[str, int | None],
         say: Say) -> None:
    """Download `names` at the pinned commit into `folder`, a few at a time. A file
    huggingface_hub recorded as complete at this commit is skipped without a request."""
    from huggingface_hub import hf_hub_download  # the hub's client, as in _model_info

    def one(name: str) -> str:
        hf_hub_download(hub.repo, name, revision=hub.commit, local_dir=folder,
                        endpoint=hub.endpoint, token=hub.token)
        return name

    for name in names:  # a damaged file: huggingface_hub trusts its metadata, so it goes
        if (folder / name).exists() and not _has_size(folder / name, sizes.get(name)):
            (folder / name).unlink()

    pool = ThreadPoolExecutor(min(DOWNLOAD_THREADS, max(len(names), 1)))
    try:
        for count, name in enumerate(pool.map(one, names), 1):
            if name.endswith(WEIGHT_SUFFIXES):
                say(f"  [{count}/{len(names)}] {name}, {_size(sizes.get(name) or 0)}")
    except Exception as error:
        # the volume's own errors (full, read-only) carry an errno; the hub's and the
        # transport's (some of them OSErrors too) do not
        if isinstance(error, OSError) and error.errno is not None:
            raise
        raise _hub_error(hub.source, error) from None
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def _weight_files(folder: Path, sizes: dict[str, int | None], source: ModelSource) -> list[str]:
    """The weights `from_pretrained` reads: the shards the first index names (read from the
    copy, fetched with the small files), else the single file."""
    for index, single in WEIGHT_SETS:
        if index in sizes:
            weight_map = _weight_map(folder / index)
            missing = sorted(set(weight_map.values()) - set(sizes))
            if missing:
                raise FetchError(source.uri, f"{index} names files the repository lacks "
                                 f"({', '.join(missing[:3])})", "use a revision whose "
                                 "weights are complete", permanent=True)
            return sorted(set(weight_map.values()))
        if single in sizes:
            return [single]
    raise FetchError(source.uri, "holds no weights from_pretrained reads (model.safetensors, "
                     "pytorch_model.bin, or their .index.json with shards)", "point spec.model."
                     "uri at a transformers causal language model", permanent=True)


def _weight_map(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError):
        raise FetchError(str(index), "is not a weight index (no weight_map)", "use a revision "
                         "with a valid index", permanent=True) from None
    return {str(k): str(v) for k, v in weight_map.items()}


def _check_space(folder: Path, weights: dict[str, int | None]) -> None:
    """Refuse before downloading what the volume cannot hold (files already complete are
    not counted again)."""
    needed = sum(size or 0 for name, size in weights.items()
                 if not _has_size(folder / name, size))
    free = free_bytes(folder)
    if needed > free:
        raise FetchError(str(folder), f"the model's weights need {_size(needed)} and the "
                         f"volume has {_size(free)} free", "free space on the output volume "
                         "or point spec.output.uri at a larger one")


def free_bytes(folder: Path) -> int:
    return shutil.disk_usage(folder).free


def verify(folder: Path, files: dict[str, int | None]) -> None:
    """Every file there with the size the hub lists, `config.json` readable, and every
    shard an index names present. Raises FetchError (not permanent: fetch again)."""
    wrong = [name for name, size in files.items() if not _has_size(folder / name, size)]
    if wrong:
        raise FetchError(str(folder), f"{len(wrong)} files are missing or of the wrong size "
                         f"({', '.join(sorted(wrong)[:3])})", "run the fetch again")
    try:
        json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as error:
        raise FetchError(str(folder / "config.json"), f"cannot be read ({error})",
                         "run the fetch again") from None
    for index, _ in WEIGHT_SETS:
        if index in files:
            absent = sorted(set(_weight_map(folder / index).values()) - set(files))
            if absent:
                raise FetchError(str(folder / index), "names files not fetched "
                                 f"({', '.join(absent[:3])})", "run the fetch again")


def write_marker(folder: Path, source: ModelSource, commit: str, files: dict[str, int | None]
                 ) -> None:
    """`fetched.json`, atomically and last: the copy is complete from this moment on."""
    record = {"uri": source.uri, "revision": source.revision, "commit": commit,
              "files": files, "bytes": sum(size or 0 for size in files.values()),
              "fetchedAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    partial = folder / f"{FETCHED_FILE}.{uuid.uuid4().hex[:8]}.tmp"
    with open(partial, "w", encoding="utf-8") as handle:
        json.dump(record, handle, indent=2)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(partial, folder / FETCHED_FILE)


def _size(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if count < 1000 or unit == "GB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    return f"{count:.1f} GB"


# --- a lock on a shared volume ----------------------------------------------------------

class VolumeLock:
    """One holder at a time across the nodes that share a volume: the lock is a file made
    with O_EXCL, holding its owner and a heartbeat count the holder rewrites every
    `timing.heartbeat` seconds. A waiter takes it over once its content has stayed the same
    for `timing.stale` seconds by the waiter's own clock (no clocks compared across nodes),
    or at once when its owner was a process of this host that is gone (a restarted pod keeps
    its hostname; `finetune run` after kill -9)."""

    def __init__(self, path: Path, timing: LockTiming = LockTiming(), say: Say = print):
        self.path, self.timing, self.say = path, timing, say
        self.owner = {"host": socket.gethostname(), "pid": os.getpid(),
                      "id": uuid.uuid4().hex, "beat": 0}
        self._stop = threading.Event()
        self._beating: threading.Thread | None = None

    def __enter__(self) -> VolumeLock:
        self._acquire()
        _HELD_HERE.add(self.owner["id"])
        self._beating = threading.Thread(target=self._beat, daemon=True,
                                         name="fetch-lock-heartbeat")
        self._beating.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._beating is not None:
            self._beating.join()
        if self._holder() == self.owner["id"]:
            self.path.unlink(missing_ok=True)
        _HELD_HERE.discard(self.owner["id"])

    def _acquire(self) -> None:
        seen, since, told = None, time.monotonic(), float("-inf")
        while not self._create():
            content = self._read()
            if content is None:
                continue  # released between the two calls
            now = time.monotonic()
            if content != seen:
                seen, since = content, now
            if self._gone(content) or now - since > self.timing.stale:
                self.say(f"taking over {self.path.name} from a fetch that is gone ({content})")
                if self._read() == content:
                    self.path.unlink(missing_ok=True)
                continue
            if now - told >= 60:
                self.say(f"waiting for another node's fetch to finish ({content})")
                told = now
            time.sleep(self.timing.poll)

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as handle:
            handle.write(json.dumps(self.owner))
        return True

    def _read(self) -> str | None:
        """The lock's content, read through open() (NFS revalidates on open, where a plain
        stat may answer from a minute-old cache); None when there is no lock."""
        try:
            with open(self.path, encoding="utf-8") as handle:
                return handle.read()
        except FileNotFoundError:
            return None

    def _holder(self) -> str | None:
        try:
            return json.loads(self._read() or "")["id"]
        except (ValueError, KeyError, TypeError):
            return None

    def _gone(self, content: str) -> bool:
        try:
            owner = json.loads(content)
            host, pid, held = owner["host"], int(owner["pid"]), owner["id"]
        except (ValueError, KeyError, TypeError):
            return False  # being written, or not ours to judge: wait for it to go stale
        if host != socket.gethostname():
            return False
        if pid == os.getpid():  # another thread here, or an earlier process of this pid
            return held not in _HELD_HERE  # (PID 1 of a restarted pod's init container)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    def _beat(self) -> None:
        while not self._stop.wait(self.timing.heartbeat):
            if self._holder() != self.owner["id"]:
                return  # taken over: the other fetch goes on; the marker is still written last
            self.owner["beat"] += 1
            with open(self.path, "w", encoding="utf-8") as handle:
                handle.write(json.dumps(self.owner))
