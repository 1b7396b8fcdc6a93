"""The Hugging Face Hub, faked over HTTP on 127.0.0.1: the real huggingface_hub client runs
(HfApi.model_info, hf_hub_download's HEAD then GET, its local_dir metadata and checks), only
the network ends here. Point HF_ENDPOINT (or `endpoint=`) at `hub.url`.

It answers what a fetch asks, as huggingface.co does:
- `GET /api/models/{repo}[/revision/{rev}]?blobs=true`: the commit and the files with sizes;
- `GET /api/models/{repo}/tree/{rev}?recursive=true`: the files (what snapshot_download lists);
  404 with `X-Error-Code: RepoNotFound` / `RevisionNotFound`;
- `HEAD` / `GET /{repo}/resolve/{rev}/{file}`: `X-Repo-Commit`, `ETag` (the sha256),
  `Content-Length`, ranges; a gated repo wants `Authorization: Bearer <token>`, else 401
  with `X-Error-Code: GatedRepo` (its metadata stays public, as on the hub).

And what an upload asks (`HfApi.create_repo`, then `upload_folder`'s preupload, LFS batch,
PUT and commit), for a holder of `writer` (`Authorization: Bearer <writer>`; else 401):
- `POST /api/validate-yaml`: a README.md's front matter, a YAML mapping or 400;
- `POST /api/repos/create`: the repo made (private ones read with the writer's token only),
  409 when it exists;
- `POST /api/models/{repo}/preupload/{rev}`: weights (`.safetensors`, `.bin`, `.pt`, or over
  10 MiB) go by LFS, the rest inline, as the hub sorts them;
- `POST /{repo}.git/info/lfs/objects/batch` and `PUT /lfs/{oid}?signature=...`: git-LFS's
  `basic` transfer to a signed URL (an object already held gets no upload action);
- `POST /api/models/{repo}/commit/{rev}`: the ndjson commit applied, a new commit id.
It speaks git-LFS, not Xet's content-addressed storage (which hf_xet uses when installed):
an upload to it runs with HF_HUB_DISABLE_XET=1, the hub client's own switch.

Every request is recorded (`requests`, `downloads`, `commits`). `hold(file, after_bytes)` stops
a GET of `file` halfway until `release()`, so a test can kill the client mid-download.
"""

from __future__ import annotations

import base64
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
TREE = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+|[^/]+)/tree/(?P<rev>[^/]+)$")
PREUPLOAD = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/preupload/(?P<rev>[^/]+)$")
COMMIT = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/commit/(?P<rev>[^/]+)$")
LFS_BATCH = re.compile(r"^/(?P<repo>[^/]+/[^/]+)\.git/info/lfs/objects/batch$")
LFS_OBJECT = re.compile(r"^/lfs/(?P<oid>[0-9a-f]{64})$")
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


@dataclass
class Repo:
    files: dict[str, bytes]
    commit: str = "0123456789abcdef0123456789abcdef01234567"
    branches: dict[str, str] = field(default_factory=dict)  # name → commit
    token: str | None = None  # gated or private: only this token may read the files
    private: bool = False

    def at(self, revision: str | None) -> str | None:
        """The commit `revision` names (None: the default branch)."""
        if revision in (None, "main") or revision == self.commit:
            return self.commit
        return self.branches.get(revision)


def repo_from_folder(folder: Path, **options) -> Repo:
    """Every file of a save_pretrained folder (subfolders included), as a hub repo holds it."""
    return Repo(files={str(p.relative_to(folder)): p.read_bytes()
                       for p in sorted(folder.rglob("*")) if p.is_file()}, **options)


@dataclass
class Commit:
    repo: str
    oid: str
    summary: str
    files: list[str]  # the paths it added, in the order sent


class FakeHub:
    def __init__(self, repos: dict[str, Repo], writer: str | None = None):
        self.repos = repos
        self.writer = writer
        self.lfs: dict[str, bytes] = {}  # sha256 → content, as uploaded
        self.commits: list[Commit] = []
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

            def do_POST(self) -> None:
                hub._record("POST", urlparse(self.path).path)
                hub._upload(self, self.rfile.read(int(self.headers.get("Content-Length", 0))))

            def do_PUT(self) -> None:
                hub._record("PUT", urlparse(self.path).path)
                hub._upload(self, self.rfile.read(int(self.headers.get("Content-Length", 0))))

        return Handler

    # --- answers ----------------------------------------------------------------------

    def _answer(self, request: BaseHTTPRequestHandler, body: bool) -> None:
        path = urlparse(request.path).path  # quoted: a revision may hold a slash (%2F)
        if match := TREE.match(path):
            self._tree(request, unquote(match["repo"]), unquote(match["rev"]))
        elif match := API.match(path):
            revision = unquote(match["rev"]) if match["rev"] else None
            self._model_info(request, unquote(match["repo"]), revision)
        elif match := RESOLVE.match(path):
            self._file(request, unquote(match["repo"]), unquote(match["rev"]),
                       unquote(match["file"]), body)
        else:
            self._error(request, 404, "EntryNotFound", "no such endpoint")

    def _model_info(self, request, name: str, revision: str | None) -> None:
        repo = self.repos.get(name)
        if repo is None or (repo.private and request.headers.get("Authorization")
                            != f"Bearer {repo.token}"):  # the hub hides a private repo
            return self._error(request, 404 if repo is None else 401, "RepoNotFound",
                               "Repository not found")
        commit = repo.at(revision)
        if commit is None:
            return self._error(request, 404, "RevisionNotFound", "Invalid rev id")
        siblings = [{"rfilename": n, "size": len(data), "blobId": _sha(data)[:40]}
                    for n, data in sorted(repo.files.items())]
        payload = json.dumps({"id": name, "modelId": name, "sha": commit,
                              "private": repo.private,
                              "gated": "manual" if repo.token and not repo.private else False,
                              "siblings": siblings}).encode()
        self._send(request, 200, {"Content-Type": "application/json"}, payload, True)

    def _tree(self, request, name: str, revision: str) -> None:
        """`list_repo_tree(recursive=True)`, what snapshot_download lists: every file."""
        repo = self.repos.get(name)
        if repo is None or (repo.token and request.headers.get("Authorization")
                            != f"Bearer {repo.token}"):
            return self._error(request, 404 if repo is None else 401, "RepoNotFound",
                               "Repository not found")
        if repo.at(revision) is None:
            return self._error(request, 404, "RevisionNotFound", "Invalid rev id")
        self._json(request, 200, [{"type": "file", "path": n, "size": len(data),
                                   "oid": hashlib.sha1(data).hexdigest()}
                                  for n, data in sorted(repo.files.items())])

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

    # --- uploads ----------------------------------------------------------------------

    def _upload(self, request: BaseHTTPRequestHandler, data: bytes) -> None:
        path = urlparse(request.path).path
        if path == "/api/validate-yaml":  # a README.md's front matter, before any upload
            return self._validate_yaml(request, json.loads(data)["content"])
        if (match := LFS_OBJECT.match(path)) and request.command == "PUT":
            return self._store(request, match["oid"], data)
        if not self.writer or request.headers.get("Authorization") != f"Bearer {self.writer}":
            return self._error(request, 401, "Unauthorized",
                               "Invalid credentials in Authorization header")
        with self._lock:
            if path == "/api/repos/create":
                return self._create(request, json.loads(data))
            match = PREUPLOAD.match(path) or COMMIT.match(path) or LFS_BATCH.match(path)
            repo = match and self.repos.get(unquote(match["repo"]))
            if repo is None:
                return self._error(request, 404, "RepoNotFound", "Repository not found")
            if match.re is PREUPLOAD:
                return self._json(request, 200, {"files": [
                    {"path": f["path"], "uploadMode": _upload_mode(f), "shouldIgnore": False}
                    for f in json.loads(data)["files"]]})
            if match.re is LFS_BATCH:
                return self._json(request, 200, {"transfer": "basic", "objects": [
                    {"oid": o["oid"], "size": o["size"], **({} if o["oid"] in self.lfs else {
                        "actions": {"upload": {"href": self._signed(o["oid"])}}})}
                    for o in json.loads(data)["objects"]]})
            return self._commit(request, unquote(match["repo"]), repo, data)

    def _signed(self, oid: str) -> str:
        """Where an LFS object goes: a URL signed for it (the hub's are presigned storage
        URLs, PUT without the token)."""
        return f"{self.url}/lfs/{oid}?signature={_sha(f'{self.writer}:{oid}'.encode())}"

    def _store(self, request, oid: str, data: bytes) -> None:
        if f"signature={_sha(f'{self.writer}:{oid}'.encode())}" not in request.path:
            return self._error(request, 403, "SignatureDoesNotMatch", "not a signed URL")
        if _sha(data) != oid:
            return self._error(request, 400, "BadRequest", "sha256 mismatch")
        with self._lock:
            self.lfs[oid] = data
        self._json(request, 200, {})

    def _validate_yaml(self, request, content: str) -> None:
        """The card's front matter must be a YAML mapping (the hub checks more: its keys)."""
        import yaml

        front = content.split("---", 2)[1] if content.startswith("---") else ""
        try:
            valid = isinstance(yaml.safe_load(front) or {}, dict)
        except yaml.YAMLError:
            valid = False
        if not valid:
            return self._json(request, 400, {"errors": [{"message": "invalid YAML metadata"}]})
        self._json(request, 200, {"warnings": []})

    def _create(self, request, body: dict) -> None:
        name = "/".join(filter(None, (body.get("organization"), body["name"])))
        if name in self.repos:  # the hub names the repo that exists (create_repo reads it)
            return self._json(request, 409, {"error": "You already created this model repo",
                                             "url": f"{self.url}/{name}"})
        private = body.get("visibility") == "private" or bool(body.get("private"))
        self.repos[name] = Repo(files={".gitattributes": b"*.safetensors filter=lfs\n"},
                                commit=hashlib.sha1(name.encode()).hexdigest(),
                                token=self.writer if private else None, private=private)
        self._json(request, 200, {"url": f"{self.url}/{name}", "name": name})

    def _commit(self, request, name: str, repo: Repo, data: bytes) -> None:
        lines = [json.loads(line) for line in data.splitlines() if line.strip()]
        files, added = dict(repo.files), []
        for line in lines[1:]:
            value = line["value"]
            if line["key"] == "file":
                files[value["path"]] = base64.b64decode(value["content"])
            elif line["key"] == "lfsFile":
                if value["oid"] not in self.lfs:
                    return self._error(request, 422, "BadRequest",
                                       f"LFS object {value['oid']} was never uploaded")
                files[value["path"]] = self.lfs[value["oid"]]
            elif line["key"] == "deletedFile":
                files.pop(value["path"], None)
            added += [value["path"]] if line["key"] in ("file", "lfsFile") else []
        oid = hashlib.sha1(repo.commit.encode() + data).hexdigest()
        repo.files, repo.commit = files, oid
        self.commits.append(Commit(name, oid, lines[0]["value"]["summary"], added))
        self._json(request, 200, {"commitUrl": f"{self.url}/{name}/commit/{oid}",
                                  "commitOid": oid})

    def _json(self, request, status: int, body: dict | list) -> None:
        self._send(request, status, {"Content-Type": "application/json"},
                   json.dumps(body).encode(), True)

    def _error(self, request, status: int, code: str, message: str,
               extra: dict[str, str] | None = None) -> None:
        payload = json.dumps({"error": message}).encode()
        self._send(request, status, {"Content-Type": "application/json", "X-Error-Code": code,
                                     "X-Error-Message": message, **(extra or {})},
                   payload, request.command != "HEAD")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _upload_mode(file: dict) -> str:
    """How the hub takes a file: weights and anything over 10 MiB by LFS, the rest inline."""
    large = file["size"] > 10 * 2**20
    return "lfs" if large or file["path"].endswith(LFS_SUFFIXES) else "regular"


def _range_start(header: str | None) -> int:
    match = re.fullmatch(r"bytes=(\d+)-", header or "")
    return int(match.group(1)) if match else 0
