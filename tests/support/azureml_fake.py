"""Azure ML's REST API, faked at the HTTP transport: the real azure-ai-ml client code runs
(request building, serialization, its retry policy, error mapping), only the network is
replaced. It keeps a workspace's jobs in memory and answers as the service does for the
calls the azureml backend makes: PUT an anonymous environment, PUT / GET a job, POST
`.../cancel`, the MLflow `runs/get` of the job's run, and a model's registration (GET its
newest version and its container, PUT the next version; `models` keeps what was sent). A
test moves a job through Azure ML's states (`set_state`) and scripts failures (`fail`: 401,
403, 429, 5xx, ...).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlparse

from azure.core.credentials import AccessToken
from azure.core.pipeline.transport import HttpTransport
from azure.core.rest._http_response_impl import HttpResponseImpl
from azure.core.utils import case_insensitive_dict

SUBSCRIPTION = "00000000-0000-0000-0000-000000000000"
RESOURCE_GROUP = "rg-ml"
WORKSPACE = "ws-finetune"
REGION = "westeurope"
WORKSPACE_PATH = (f"/subscriptions/{SUBSCRIPTION}/resourceGroups/{RESOURCE_GROUP}/providers/"
                  f"Microsoft.MachineLearningServices/workspaces/{WORKSPACE}")
TRACKING = (f"azureml://{REGION}.api.azureml.ms/mlflow/v1.0/subscriptions/{SUBSCRIPTION}/"
            f"resourceGroups/{RESOURCE_GROUP}/providers/Microsoft.MachineLearningServices/"
            f"workspaces/{WORKSPACE}")
JOB_PATH = re.compile(r".*/workspaces/[^/]+/jobs/(?P<name>[^/]+)(?P<cancel>/cancel)?$")
MODEL_PATH = re.compile(r".*/workspaces/[^/]+/models/(?P<name>[^/]+)(?P<versions>/versions)?"
                        r"(?:/(?P<version>[^/]+))?$")
ENVIRONMENT_PATH = re.compile(r".*/workspaces/[^/]+/environments/(?P<name>[^/]+)/versions/"
                              r"(?P<version>[^/]+)$")


class StaticCredential:
    """A TokenCredential that hands out a fixed token (no Azure AD in tests)."""

    def __init__(self) -> None:
        self.scopes: list[tuple[str, ...]] = []

    def get_token(self, *scopes: str, **_: Any) -> AccessToken:
        self.scopes.append(scopes)
        return AccessToken("fake-token", int(time.time()) + 3600)


class CannedResponse(HttpResponseImpl):
    """A complete response held in memory; both azure-core response interfaces work."""

    def __init__(self, request: Any, status: int, body: Any = None,
                 headers: dict[str, str] | None = None):
        content = b"" if body is None else json.dumps(body).encode()
        all_headers = {"Content-Type": "application/json", "Content-Length": str(len(content)),
                       **(headers or {})}
        super().__init__(request=request, internal_response=None, status_code=status,
                         reason=REASONS.get(status, "Error"), content_type="application/json",
                         headers=case_insensitive_dict(all_headers),
                         stream_download_generator=None)
        self._content = content
        self._is_stream_consumed = True

    def close(self) -> None:
        self._is_closed = True  # nothing underneath to release

    def iter_bytes(self, **_: Any) -> Iterator[bytes]:
        yield self._content

    def iter_raw(self, **_: Any) -> Iterator[bytes]:
        yield self._content


REASONS = {200: "OK", 201: "Created", 202: "Accepted", 401: "Unauthorized", 403: "Forbidden",
           404: "Not Found", 409: "Conflict", 429: "Too Many Requests", 400: "Bad Request",
           500: "Internal Server Error", 503: "Service Unavailable"}


@dataclass
class Failure:
    method: str
    path: str
    """A substring of the request path (e.g. `/jobs/`, `/cancel`, `/mlflow/`)."""
    status: int
    code: str
    message: str
    headers: dict[str, str] = field(default_factory=dict)
    times: int = 1


@dataclass
class Call:
    method: str
    path: str
    query: dict[str, list[str]]
    body: Any
    authorization: str | None
    at: float = field(default_factory=time.monotonic)
    """When it came (time.monotonic())."""


class FakeAzureML(HttpTransport):
    """One workspace's jobs behind Azure ML's REST API."""

    def __init__(self) -> None:
        self.jobs: dict[str, dict[str, Any]] = {}
        self.metrics: dict[str, list[dict[str, Any]]] = {}
        self.tags: dict[str, dict[str, str]] = {}
        self.models: dict[str, dict[str, dict[str, Any]]] = {}  # name → version → as sent
        self.calls: list[Call] = []
        self.failures: list[Failure] = []
        self.lock = threading.Lock()

    # --- what a test does ---

    def fail(self, method: str, path: str, status: int, code: str = "Error",
             message: str = "", headers: dict[str, str] | None = None, times: int = 1) -> None:
        """The next `times` matching requests get this answer instead."""
        with self.lock:
            self.failures.append(Failure(method, path, status, code, message or code,
                                         dict(headers or {}), times))

    def set_state(self, name: str, state: str) -> None:
        with self.lock:
            self.jobs[name]["properties"]["status"] = state

    def state(self, name: str) -> str | None:
        job = self.jobs.get(name)
        return None if job is None else job["properties"]["status"]

    def log_metrics(self, name: str, step: int, **values: float) -> None:
        """What the trainer's MLflow tracker would have logged to the job's run."""
        with self.lock:
            run = self.metrics.setdefault(name, [])
            for key, value in values.items():
                run[:] = [m for m in run if m["key"] != key]
                run.append({"key": key, "value": value, "timestamp": int(time.time() * 1000),
                            "step": step})

    def set_tags(self, name: str, **tags: str) -> None:
        """What a worker would have tagged the job's run with (`MlflowClient.set_tag`)."""
        with self.lock:
            self.tags.setdefault(name, {}).update(tags)

    def requests_to(self, method: str, path_part: str) -> list[Call]:
        return [c for c in self.calls if c.method == method and path_part in c.path]

    # --- HttpTransport ---

    def __enter__(self) -> FakeAzureML:
        return self

    def __exit__(self, *args: Any) -> None:
        pass

    def open(self) -> None:
        pass

    def close(self) -> None:
        pass

    def send(self, request: Any, **kwargs: Any) -> CannedResponse:
        url = urlparse(request.url)
        raw = request.content if hasattr(request, "content") else request.body
        body = json.loads(raw) if raw else None
        with self.lock:
            self.calls.append(Call(request.method, url.path, parse_qs(url.query), body,
                                   request.headers.get("Authorization")))
            scripted = self._scripted(request.method, url.path)
            if scripted is not None:
                return CannedResponse(request, scripted.status, {"error": {
                    "code": scripted.code, "message": scripted.message}}, scripted.headers)
            return self._answer(request, url.path, parse_qs(url.query), body)

    def _scripted(self, method: str, path: str) -> Failure | None:
        for failure in self.failures:
            if failure.method == method and failure.path in path and failure.times > 0:
                failure.times -= 1
                return failure
        return None

    def _answer(self, request: Any, path: str, query: dict[str, list[str]],
                body: Any) -> CannedResponse:
        if request.method == "PUT" and (env := ENVIRONMENT_PATH.match(path)):
            return CannedResponse(request, 200, {
                "id": path, "name": env["version"], "type": "environments/versions",
                "properties": body["properties"]})
        if model := MODEL_PATH.match(path):
            return self._model(request, path, model, body)
        if path.endswith("/api/2.0/mlflow/runs/get") and request.method == "GET":
            run_id = query.get("run_id", [""])[0]
            if run_id not in self.jobs:
                return CannedResponse(request, 404, {"error_code": "RESOURCE_DOES_NOT_EXIST"})
            tags = [{"key": k, "value": v} for k, v in self.tags.get(run_id, {}).items()]
            return CannedResponse(request, 200, {"run": {"info": {"run_id": run_id}, "data": {
                "metrics": self.metrics.get(run_id, []), "tags": tags}}})
        match = JOB_PATH.match(path)
        if match is None:
            return _not_found(request, f"no fake for {request.method} {path}")
        name = match["name"]
        if request.method == "POST" and match["cancel"]:
            job = self.jobs.get(name)
            if job is None:
                return _not_found(request, f"job {name} not found")
            if job["properties"]["status"] not in ("Completed", "Failed", "Canceled"):
                job["properties"]["status"] = "CancelRequested"
            return CannedResponse(request, 202, None, {"Location": request.url})
        if request.method == "GET":
            job = self.jobs.get(name)
            return _not_found(request, f"job {name} not found") if job is None else (
                CannedResponse(request, 200, job))
        if request.method == "PUT":
            if name in self.jobs:
                return CannedResponse(request, 409, {"error": {
                    "code": "UserError", "message": f"a job named {name} already exists"}})
            job = {**body, "id": path, "name": name, "type": "Microsoft.MachineLearningServices/"
                   "workspaces/jobs"}
            job["properties"] = {**body["properties"], "status": "NotStarted", "services": {
                "Studio": {"jobServiceType": "Studio",
                           "endpoint": f"https://ml.azure.com/runs/{name}?wsid={WORKSPACE_PATH}"},
                "Tracking": {"jobServiceType": "Tracking", "endpoint": TRACKING}}}
            self.jobs[name] = job
            return CannedResponse(request, 201, job)
        return _not_found(request, f"no fake for {request.method} {path}")


    def _model(self, request: Any, path: str, match: re.Match, body: Any) -> CannedResponse:
        """A model's versions, as the workspace keeps them: the newest first, the container
        saying the next version, a version once registered never changed."""
        versions = self.models.setdefault(match["name"], {})
        newest = max(versions, key=int, default=None)
        if request.method == "GET" and match["version"] is None and match["versions"]:
            return CannedResponse(request, 200, {"value": [versions[newest]] if newest else []})
        if request.method == "GET" and not match["versions"]:
            if newest is None:
                return _not_found(request, f"model {match['name']} not found")
            return CannedResponse(request, 200, {"id": path, "name": match["name"], "properties": {
                "latestVersion": newest, "nextVersion": str(int(newest) + 1)}})
        if request.method == "PUT" and match["version"]:
            if match["version"] in versions:
                return CannedResponse(request, 409, {"error": {
                    "code": "UserError", "message": f"model {match['name']}:"
                    f"{match['version']} exists and cannot be changed"}})
            versions[match["version"]] = {"id": path, "name": match["version"],
                                          "type": "Microsoft.MachineLearningServices/"
                                          "workspaces/models/versions",
                                          "properties": {"flavors": {}, **body["properties"],
                                                         "provisioningState": "Succeeded"}}
            return CannedResponse(request, 201, versions[match["version"]])
        return _not_found(request, f"no fake for {request.method} {path}")


def _not_found(request: Any, message: str) -> CannedResponse:
    return CannedResponse(request, 404, {"error": {"code": "ResourceNotFound",
                                                   "message": message}})
