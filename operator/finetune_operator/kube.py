"""The few Kubernetes API calls the operator makes, async over the official client.

Connects as kubectl does: the in-cluster service account, else KUBECONFIG / ~/.kube/config
(which covers AKS's exec-based logins). Reads return plain dicts, exactly as the API
serves them, so the pure code (render, observe) sees what `kubectl get -o json` shows.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from finetune_operator.api import API_GROUP, PLURAL, VERSION


class KubeError(RuntimeError):
    """An API call that failed for a reason other than 404 / 409."""

    def __init__(self, action: str, error: ApiException):
        super().__init__(f"{action}: {error.status} {error.reason}")
        self.status = error.status


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
    def __init__(self, api: client.ApiClient):
        self.core = client.CoreV1Api(api)
        self.batch = client.BatchV1Api(api)
        self.custom = client.CustomObjectsApi(api)
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
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        except ApiException as error:
            raise KubeError(action, error) from error

    async def create(self, obj: dict[str, Any]) -> bool:
        """Create `obj`; False when it already exists (launch is idempotent)."""
        create = self._calls[obj["kind"]][0]
        try:
            await asyncio.to_thread(create, obj["metadata"]["namespace"], obj)
        except ApiException as error:
            if error.status == 409:
                return False
            raise KubeError(f"create {obj['kind']} {obj['metadata']['name']}", error) from error
        return True

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        read = self._calls[kind][1]
        try:
            response = await asyncio.to_thread(read, name, namespace, _preload_content=False)
        except ApiException as error:
            if error.status == 404:
                return None
            raise KubeError(f"get {kind} {name}", error) from error
        return json.loads(response.data)

    async def delete(self, kind: str, namespace: str, name: str,
                     propagation: str = "Foreground") -> bool:
        """Delete; False when it was already gone."""
        delete = self._calls[kind][2]
        try:
            await asyncio.to_thread(delete, name, namespace, propagation_policy=propagation)
        except ApiException as error:
            if error.status == 404:
                return False
            raise KubeError(f"delete {kind} {name}", error) from error
        return True

    async def pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        response = await self._call("list pods", self.core.list_namespaced_pod, namespace,
                                    label_selector=selector, _preload_content=False)
        return json.loads(response.data).get("items", [])

    async def suspend_job(self, namespace: str, name: str, suspend: bool) -> None:
        await self._call(f"suspend Job {name}", self.batch.patch_namespaced_job, name, namespace,
                         {"spec": {"suspend": suspend}})

    async def delete_finetunejob(self, namespace: str, name: str) -> None:
        try:
            await asyncio.to_thread(self.custom.delete_namespaced_custom_object, API_GROUP,
                                    VERSION, namespace, PLURAL, name)
        except ApiException as error:
            if error.status != 404:
                raise KubeError(f"delete FineTuneJob {name}", error) from error

    async def peering_missing(self, name: str, namespaces: tuple[str, ...]) -> list[str]:
        """Where kopf's peering object `name` does not exist: "cluster-wide" or namespaces."""
        lookups = ([("cluster-wide", self.custom.get_cluster_custom_object,
                     ("kopf.dev", "v1", "clusterkopfpeerings", name))] if not namespaces else
                   [(ns, self.custom.get_namespaced_custom_object,
                     ("kopf.dev", "v1", ns, "kopfpeerings", name)) for ns in namespaces])
        missing = []
        for where, read, args in lookups:
            try:
                await asyncio.to_thread(read, *args)
            except ApiException as error:
                if error.status != 404:
                    raise KubeError(f"get the peering object {name} ({where})", error) from error
                missing.append(where)
        return missing
