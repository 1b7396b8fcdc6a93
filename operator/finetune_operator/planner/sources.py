"""Where a model's config.json comes from: a local folder, the hub, or the built-in table.

The operator cannot download weights, and needs none: the planner reads only the model's
config. Lookups that touch the disk or the network live here, at the edge; everything
downstream is pure.
"""

from __future__ import annotations

import json
import os
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from finetune_operator.planner import known_models

HubFetch = Callable[[str, str | None], dict[str, Any] | None]
"""(repo id, revision) → the parsed config.json, or None when it cannot be had."""
HUB_TIMEOUT_SECONDS = 5.0


class ModelConfig(BaseModel):
    """A model's config.json and where it was read from."""

    model_config = ConfigDict(frozen=True)
    config: dict[str, Any]
    source: str
    """`path:/models/x/config.json`, `hub:org/name@rev` or `built-in table: org/name`."""


def read_local(path: Path) -> ModelConfig | None:
    """A folder holding config.json, or the config.json file itself; None also when the
    path cannot be looked at here (a name too long for this filesystem, no permission)."""
    try:
        candidate = path / "config.json" if path.is_dir() else path
        if not candidate.is_file():
            return None
        return ModelConfig(config=json.loads(candidate.read_text(encoding="utf-8")),
                           source=f"path:{candidate}")
    except (OSError, ValueError):
        return None


def hub_offline() -> bool:
    """HF_HUB_OFFLINE=1 (the hub's own switch) is set: the hub is not asked."""
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")


class HubUnanswered(Exception):
    """The hub gave no config.json; the message says why (not reached, refused, no such
    repo), for the plan to say where `--offline` says the hub was not asked."""


_HTTP_REASONS = {401: "no such repo, or a gated or private one (set HF_TOKEN)",
                 403: "a gated repo HF_TOKEN may not read (accept its terms on the hub)",
                 404: "no such repo, revision or file"}
"""The hub answers 401 for a repo it does not show this caller: missing or private alike."""


def ask_hub(repo: str, revision: str | None,
            timeout: float = HUB_TIMEOUT_SECONDS) -> dict[str, Any]:
    """GET config.json from huggingface.co (only that file, `HF_ENDPOINT` for another hub);
    HF_TOKEN is sent when set, for gated models. Never waits longer than `timeout`;
    HubUnanswered, saying why, when no config comes back."""
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    url = f"{endpoint}/{repo}/resolve/{revision or 'main'}/config.json"
    request = urllib.request.Request(url, headers={"User-Agent": "finetune-operator-planner"})
    if token := os.environ.get("HF_TOKEN"):
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read(1_000_000))
    except urllib.error.HTTPError as error:
        why = _HTTP_REASONS.get(error.code, error.reason)
        raise HubUnanswered(f"HTTP {error.code}: {why}") from error
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        if isinstance(reason, TimeoutError):
            why = f"no answer within {timeout:g} s"
        else:
            why = getattr(reason, "strerror", None) or str(reason)
        host = urllib.parse.urlsplit(endpoint).netloc
        raise HubUnanswered(f"{host}: {why}") from error
    except ValueError as error:
        raise HubUnanswered("its config.json is not JSON") from error


def fetch_from_hub(repo: str, revision: str | None,
                   timeout: float = HUB_TIMEOUT_SECONDS) -> dict[str, Any] | None:
    """`ask_hub`, None on any failure (the caller falls back); HF_HUB_OFFLINE=1 (the hub's
    own switch) skips the request."""
    if hub_offline():
        return None
    try:
        return ask_hub(repo, revision, timeout)
    except HubUnanswered:
        return None


def _registry_name(uri: str) -> str | None:
    """The model name in an Azure ML registry or workspace model URI."""
    match = re.search(r"/models/([^/]+)", uri)
    return match.group(1) if match else None


class ModelConfigs:
    """Finds model configs; remembers hub answers (found or not) for the process's life.

    `fetch` is None for offline lookups (tests, and wherever the network must not be
    touched): then hub models come from the built-in table only. A `fetch` raising
    HubUnanswered (`ask_hub`) leaves why, for `unanswered`.
    """

    def __init__(self, fetch: HubFetch | None = None, base_dir: Path | None = None) -> None:
        self.fetch = fetch
        self.base_dir = base_dir
        self._hub: dict[tuple[str, str | None], dict[str, Any] | None] = {}
        self._unanswered: dict[tuple[str, str | None], str] = {}

    def unanswered(self, uri: str, revision: str | None = None) -> str | None:
        """Why the hub gave no config.json for hf:// `uri` when asked; None when it gave
        one, was not asked, or its fetch said no reason."""
        return self._unanswered.get((uri.removeprefix("hf://").strip("/"), revision))

    def resolve(self, uri: str, revision: str | None = None) -> ModelConfig | None:
        """The config for a `spec.model.uri`, or None when nothing can be found."""
        if uri.startswith("hf://"):
            repo = uri.removeprefix("hf://").strip("/")
            if self.fetch is not None:
                key = (repo, revision)
                if key not in self._hub:
                    try:
                        self._hub[key] = self.fetch(repo, revision)
                    except HubUnanswered as error:
                        self._hub[key], self._unanswered[key] = None, str(error)
                if self._hub[key] is not None:
                    return ModelConfig(config=self._hub[key],
                                       source=f"hub:{repo}@{revision or 'main'}")
            return self._from_table(repo)
        if uri.startswith("azureml://"):
            name = _registry_name(uri)
            return self._from_table(name) if name else None
        if uri.startswith("pvc://"):
            return None  # inside a claim the operator does not mount
        path = Path(uri)
        if not path.is_absolute():
            path = (self.base_dir or Path.cwd()) / path
        return read_local(path)

    @staticmethod
    def _from_table(name: str) -> ModelConfig | None:
        found = known_models.lookup(name)
        if found is None:
            return None
        repo, config = found
        return ModelConfig(config=config, source=f"built-in table: {repo}")


def from_table(uri: str) -> ModelConfig | None:
    """The built-in table's entry for a hub or Azure ML registry URI; no I/O at all."""
    if uri.startswith("hf://"):
        return ModelConfigs._from_table(uri.removeprefix("hf://").strip("/"))
    if uri.startswith("azureml://") and (name := _registry_name(uri)):
        return ModelConfigs._from_table(name)
    return None
