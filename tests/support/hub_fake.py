"""The Hugging Face Hub, faked over HTTP on 127.0.0.1: the real huggingface_hub client runs
(HfApi.model_info, hf_hub_download's HEAD then GET, its local_dir metadata and checks), only
the network ends here. Point HF_ENDPOINT (or `endpoint=`) at `hub.url`.

It answers what a fetch asks, as huggingface.co does:
- `GET /api/models/{repo}[/revision/{rev}]?blobs=true`: the commit and the files with sizes;
  404 with `X-Error-Code: RepoNotFound` / `RevisionNotFound`;
- `HEAD` / `GET /{repo}/resolve/{rev}/{file}`: `X-Repo-Commit`, `ETag` (the sha256),
  `Content-Length`, ranges; a gated repo wants `Authorization: Bearer <token>`, else 401
  with `X-Error-Code: GatedRepo` (its metadata stays public, as on the hub).

Every request is recorded (`requests`, `downloads`). `hold(file, after_bytes)` stops a GET of
`file` halfway until `release()`, so a test can kill the client mid-download.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

API = re.compile(r"^/api/models/(?P<repo>[^/]+(?:/[^/]+)?)(?:/revision/(?P<rev>[^/]+))?$")
RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+|[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")


@dataclass
class Repo:
    files: dict[str, bytes]
    commit: str = "0123456789abcdef0123456789abcdef01234567"
    branches: dict[str, str] = field(default_factory=dict)  # name → commit
    token: str | None = None  # gated: only this token may read the files

    def at(self, revision: str | None) -> str | None:
        """The commit `revision` names (None: the default branch)."""
        if revision in (None, "main") or revision == self.commit:
            return self.commit
        return self.branches.get(revision)


def repo_from_folder(folder: Path, **options) -> Repo:
    """Every file of a save_pretrained folder (subfolders included), as a hub repo holds it."""
    return Repo(files={str(p.relative_to(folder)): p.read_bytes()
                       for p in sorted(folder.rglob("*")) if p.is_file()}, **options)


class FakeHub:
    def __init__(self, repos: dict[str, Repo]):
        self.repos = repos
        self.requests: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._held: tuple[str, int] | None = None
        self.holding = threading.Event()  # a held GET has sent its first bytes
        self._release = threading.Event()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._release.set()
        self.server.shutdown()
        self.server.server_close()

    def downloads(self) -> list[str]:
        """The files whose content was sent (GET), in order."""
        return [path.split("/resolve/", 1)[1].split("/", 1)[1]
                for method, path in self.requests if method == "GET" and "/resolve/" in path]

    def reset(self) -> None:
        with self._lock:
            self.requests.clear()

    def hold(self, file: str, after_bytes: int) -> None:
        self._held, self._release = (file, after_bytes), threading.Event()
        self.holding.clear()

    def release(self) -> None:
        self._held = None
        self._release.set()

    def _record(self, method: str, path: str) -> None:
        with self._lock:
            self.requests.append((method, path))

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet test output
                pass

            def do_GET(self) -> None:
                hub._record("GET", urlparse(self.path).path)
                hub._answer(self, body=True)

            def do_HEAD(self) -> None:
                hub._record("HEAD", urlparse(self.path).path)
                hub._answer(self, body=False)

        return Handler

    # --- answers ----------------------------------------------------------------------

    def _answer(self, request: BaseHTTPRequestHandler, body: bool) -> None:
        path = urlparse(request.path).path  # quoted: a revision may hold a slash (%2F)
        if match := API.match(path):
            revision = unquote(match["rev"]) if match["rev"] else None
            self._model_info(request, unquote(match["repo"]), revision)
        elif match := RESOLVE.match(path):
            self._file(request, unquote(match["repo"]), unquote(match["rev"]),
                       unquote(match["file"]), body)
        else:
            self._error(request, 404, "EntryNotFound", "no such endpoint")

    def _model_info(self, request, name: str, revision: str | None) -> None:
        repo = self.repos.get(name)
        if repo is None:
            return self._error(request, 404, "RepoNotFound", "Repository not found")
        commit = repo.at(revision)
        if commit is None:
            return self._error(request, 404, "RevisionNotFound", "Invalid rev id")
        siblings = [{"rfilename": n, "size": len(data), "blobId": _sha(data)[:40]}
                    for n, data in sorted(repo.files.items())]
        payload = json.dumps({"id": name, "modelId": name, "sha": commit, "private": False,
                              "gated": "manual" if repo.token else False,
                              "siblings": siblings}).encode()
        self._send(request, 200, {"Content-Type": "application/json"}, payload, True)

    def _file(self, request, name: str, revision: str, file: str, body: bool) -> None:
        repo = self.repos.get(name)
        if repo is None:
            return self._error(request, 404, "RepoNotFound", "Repository not found")
        if repo.token and request.headers.get("Authorization") != f"Bearer {repo.token}":
            return self._error(request, 401, "GatedRepo", "Access to model is restricted")
        commit = repo.at(revision)
        if commit is None:
            return self._error(request, 404, "RevisionNotFound", "Invalid rev id")
        if file not in repo.files:
            return self._error(request, 404, "EntryNotFound", "Entry not found",
                               {"X-Repo-Commit": commit})
        data = repo.files[file]
        start = _range_start(request.headers.get("Range"))
        headers = {"X-Repo-Commit": commit, "ETag": f'"{_sha(data)}"', "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
        if start:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        self._send(request, 206 if start else 200, headers, data[start:], body,
                   held=self._held_after(file))

    def _held_after(self, file: str) -> int | None:
        return self._held[1] if self._held and self._held[0] == file else None

    def _send(self, request, status: int, headers: dict[str, str], payload: bytes,
              body: bool, held: int | None = None) -> None:
        request.send_response(status)
        for key, value in {**headers, "Content-Length": str(len(payload))}.items():
            request.send_header(key, value)
        request.end_headers()
        if not body:
            return
        try:
            if held is not None:
                request.wfile.write(payload[:held])
                request.wfile.flush()
                self.holding.set()
                self._release.wait()
                payload = payload[held:]
            request.wfile.write(payload)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client was killed mid-download

    def _error(self, request, status: int, code: str, message: str,
               extra: dict[str, str] | None = None) -> None:
        payload = json.dumps({"error": message}).encode()
        self._send(request, status, {"Content-Type": "application/json", "X-Error-Code": code,
                                     "X-Error-Message": message, **(extra or {})},
                   payload, request.command != "HEAD")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _range_start(header: str | None) -> int:
    match = re.fullmatch(r"bytes=(\d+)-", header or "")
    return int(match.group(1)) if match else 0
