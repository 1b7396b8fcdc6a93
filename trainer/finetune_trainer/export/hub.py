"""A model folder committed to a Hugging Face Hub model repository (`hf://owner/name`).

huggingface_hub does the pushing (`HfApi.create_repo`, `upload_folder`: weights by Xet when
hf_xet is installed, else git-LFS; the rest inline), to `HF_ENDPOINT` (the hub by default, or
an Enterprise Hub's or a mirror's address). The repository is created private when it does
not exist: a fine-tuned model is the user's until they publish it. The folder's model card
(README.md) is the repository's card. What this module adds: the target parsed and refused
early, the token a job's Secret holds, a transient fault (no answer, 429, 5xx) tried again,
a refusal said with the fix, and nothing secret in what it says.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from finetune_trainer.export.oci import model_files
from finetune_trainer.export.retry import ATTEMPTS, ExportError, unresolved, wait_to_try_again

REPO_ID = re.compile(r"^hf://(?P<repo>(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95})$")
"""The hub's repository names: an optional owner and a name, letters, digits, `-`, `_`, `.`."""
HIDDEN = [".*", "*/.*"]
"""What is not pushed: hidden files and folders (as an OCI export leaves them out)."""


@dataclass(frozen=True)
class HubRepo:
    repo_id: str

    @classmethod
    def parse(cls, uri: str) -> HubRepo:
        match = REPO_ID.match(uri)
        if match is None or "--" in match["repo"] or ".." in match["repo"] or match[
                "repo"].endswith((".git", ".", "-")):
            raise ExportError(uri, "is not a hub repository name", "write hf://owner/name "
                              "(letters, digits, '-', '_' and '.'; no '--' or '..')")
        return cls(match["repo"])

    def __str__(self) -> str:
        return f"hf://{self.repo_id}"


def push(folder: Path, repo: HubRepo, *, token: str | None = None, say=print,
         sleep: Callable[[float], None] = time.sleep, endpoint: str | None = None) -> str:
    """Commit `folder`'s files (hidden ones left out) to `repo`, creating it private when it
    does not exist. `token`: one with write access (None: HF_TOKEN or `hf auth login`'s).
    Returns `hf://owner/name@commit`. Raises ExportError."""
    from huggingface_hub import HfApi  # the hub's client: only a push to hf:// loads it

    files = model_files(folder)
    size = sum(path.stat().st_size for path in files)
    say(f"pushing {len(files)} files ({size / 2**20:.1f} MiB) from {folder} to {repo}")
    api = HfApi(endpoint=endpoint, token=token)
    for attempt in range(1, ATTEMPTS + 1):
        try:
            api.create_repo(repo.repo_id, private=True, exist_ok=True)
            commit = api.upload_folder(folder_path=folder, repo_id=repo.repo_id,
                                       ignore_patterns=HIDDEN, commit_message=(
                                           f"Upload {folder.name}/ from finetune-operator"))
            break
        except Exception as error:
            if unresolved(error):  # no other try: a missing name stays missing
                raise ExportError(str(repo), f"the hub's host {urlparse(api.endpoint).hostname}"
                                  " does not resolve (no such name)", "check HF_ENDPOINT "
                                  "(unset: huggingface.co), and that this machine's DNS "
                                  "knows it") from None
            fault = _transient(error)
            if fault is None:
                raise _refusal(repo, error) from None
            wait_to_try_again(attempt, fault, str(repo), "the hub (HF_ENDPOINT)", say, sleep)
    pushed = f"{repo}@{commit.oid}"
    say(f"pushed {pushed}")
    return pushed


def _status(error: Exception) -> int | None:
    response = getattr(error, "response", None)
    return getattr(response, "status_code", None)


def _transient(error: Exception) -> str | None:
    """What went wrong when another try may go through (no answer, 429, 5xx); else None. No
    answer is the HTTP client's TransportError (huggingface_hub 2 uses httpx2, 1.x httpx:
    matched by name, not imported)."""
    if any(kind.__name__ == "TransportError" for kind in type(error).__mro__):
        return f"the hub did not answer ({type(error).__name__})"
    status = _status(error)
    if status is not None and (status == 429 or status >= 500):
        return f"the hub answered {status}"
    return None


def _refusal(repo: HubRepo, error: Exception) -> ExportError:
    """A refusal said with its fix, in the hub's own words (never the token)."""
    status = _status(error)
    said = (getattr(error, "server_message", None) or str(error).splitlines()[0]).strip()
    owner = repo.repo_id.split("/")[0] if "/" in repo.repo_id else "your namespace"
    if status in (401, 403):
        return ExportError(str(repo), f"the hub refused the token ({status}: {said})",
                           f"give a token with write access to {owner}: a Secret with the "
                           "key `token` named by secretName (kubectl create secret generic "
                           "NAME --from-literal=token=hf_...), or HF_TOKEN where no Secret "
                           "is mounted")
    return ExportError(str(repo), f"the hub answered {status or type(error).__name__}: "
                       f"{said}", "check the repository name and that the token may write "
                       "there")
