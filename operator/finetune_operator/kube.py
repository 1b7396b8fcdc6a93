"""The few Kubernetes API calls the operator makes, async over the official client.

Connects as kubectl does: the in-cluster service account, else KUBECONFIG / ~/.kube/config
(which covers AKS's exec-based logins). Reads return plain dicts, exactly as the API
serves them, so the pure code (render, observe) sees what `kubectl get -o json` shows.
Every call has a timeout, and every failure (an error status, or no answer at all) is a
`KubeError` carrying the status and any Retry-After, which the handlers turn into a retry.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from finetune_operator.api import API_GROUP, PLURAL, VERSION

DEFAULT_TIMEOUT = 30.0
"""Seconds an API call may take before it counts as failed (and is retried): a hung API
server must not hold a handler, or a thread of the operator's small pool, for ever."""


class KubeError(RuntimeError):
    """An API call that failed (other than a 404 / 409 its caller expects) or got no answer."""

    def __init__(self, action: str, error: Exception):
        if isinstance(error, ApiException):
            super().__init__(f"{action}: {error.status} {error.reason}")
            self.status: int | None = error.status
            self.retry_after = _retry_after(error.headers)
        else:
            super().__init__(f"{action}: no answer from the API server "
                             f"({type(error).__name__}: {error})")
            self.status, self.retry_after = None, None


def _retry_after(headers: Any) -> float | None:
    """The seconds a 429 (or 503) asks the client to wait, from its Retry-After header."""
    value = (headers or {}).get("Retry-After")
    try:
        return max(float(value), 0.0) if value is not None else None
    except ValueError:  # an HTTP date: rare from an API server, the backoff applies instead
        return None


def connect(server: str | None = None) -> client.ApiClient:
    """An API client: to `server` when given (tests), else as kubectl would connect."""
    if server:
        configuration = client.Configuration()
        configuration.host = server
        return client.ApiClient(configuration)
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


class Kube:
    def __init__(self, api: client.ApiClient, timeout: float = DEFAULT_TIMEOUT):
        self.core = client.CoreV1Api(api)
        self.batch = client.BatchV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.timeout = timeout
        """Seconds each call may take (kopf's own calls get the same limit)."""
        self._calls = {
            "ConfigMap": (self.core.create_namespaced_config_map,
                          self.core.read_namespaced_config_map,
                          self.core.delete_namespaced_config_map),
            "Service": (self.core.create_namespaced_service,
                        self.core.read_namespaced_service,
                        self.core.delete_namespaced_service),
            "Job": (self.batch.create_namespaced_job, self.batch.read_namespaced_job,
                    self.batch.delete_namespaced_job),
        }

    async def _call(self, action: str, fn, *args, **kwargs) -> Any:
        """`fn` in a thread, within the timeout; every failure is a KubeError (with the
        status, None when no answer came)."""
        try:
            return await asyncio.to_thread(fn, *args, _request_timeout=self.timeout, **kwargs)
        except (ApiException, HTTPError) as error:
            raise KubeError(action, error) from error

    async def create(self, obj: dict[str, Any]) -> bool:
        """Create `obj`; False when it already exists (launch is idempotent)."""
        create = self._calls[obj["kind"]][0]
        try:
            await self._call(f"create {obj['kind']} {obj['metadata']['name']}", create,
                             obj["metadata"]["namespace"], obj)
        except KubeError as error:
            if error.status == 409:
                return False
            raise
        return True

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        read = self._calls[kind][1]
        try:
            response = await self._call(f"get {kind} {name}", read, name, namespace,
                                        _preload_content=False)
        except KubeError as error:
            if error.status == 404:
                return None
            raise
        return json.loads(response.data)

    async def delete(self, kind: str, namespace: str, name: str,
                     propagation: str = "Foreground") -> bool:
        """Delete; False when it was already gone."""
        delete = self._calls[kind][2]
        try:
            await self._call(f"delete {kind} {name}", delete, name, namespace,
                             propagation_policy=propagation)
        except KubeError as error:
            if error.status == 404:
                return False
            raise
        return True

    async def pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        response = await self._call("list pods", self.core.list_namespaced_pod, namespace,
                                    label_selector=selector, _preload_content=False)
        return json.loads(response.data).get("items", [])

    async def suspend_job(self, namespace: str, name: str, suspend: bool) -> None:
        await self._call(f"suspend Job {name}", self.batch.patch_namespaced_job, name, namespace,
                         {"spec": {"suspend": suspend}})

    async def patch_finetunejob_status(self, namespace: str, name: str,
                                       status: dict[str, Any]) -> None:
        """A merge patch of the status (None removes a field); nothing when the job is gone."""
        try:
            await self._call(f"patch the status of FineTuneJob {name}",
                             self.custom.patch_namespaced_custom_object_status, API_GROUP,
                             VERSION, namespace, PLURAL, name, {"status": status})
        except KubeError as error:
            if error.status != 404:
                raise

    async def delete_finetunejob(self, namespace: str, name: str) -> None:
        try:
            await self._call(f"delete FineTuneJob {name}",
                             self.custom.delete_namespaced_custom_object, API_GROUP, VERSION,
                             namespace, PLURAL, name)
        except KubeError as error:
            if error.status != 404:
                raise

    async def peering_missing(self, name: str, namespaces: tuple[str, ...]) -> list[str]:
        """Where kopf's peering object `name` does not exist: "cluster-wide" or namespaces."""
        lookups = ([("cluster-wide", self.custom.get_cluster_custom_object,
                     ("kopf.dev", "v1", "clusterkopfpeerings", name))] if not namespaces else
                   [(ns, self.custom.get_namespaced_custom_object,
                     ("kopf.dev", "v1", ns, "kopfpeerings", name)) for ns in namespaces])
        missing = []
        for where, read, args in lookups:
            try:
                await self._call(f"get the peering object {name} ({where})", read, *args)
            except KubeError as error:
                if error.status != 404:
                    raise
                missing.append(where)
        return missing
