"""The few Kubernetes API calls the operator makes, async over the official client.

Logs in as kubectl does (`configuration`): the in-cluster service account, else KUBECONFIG /
~/.kube/config (which covers AKS's exec-based logins); kopf's watch streams use the same
credentials (`connection_info`). Reads return plain dicts, exactly as the API
serves them, so the pure code (render, observe) sees what `kubectl get -o json` shows.
Every call has a timeout, and every failure (an error status, or no answer at all) is a
`KubeError` carrying the status and any Retry-After, which the handlers turn into a retry.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from typing import Any

import kopf
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError, SSLError

from finetune_operator.api import API_GROUP, PLURAL, VERSION

KUEUE_GROUP, KUEUE_VERSION = "kueue.x-k8s.io", "v1beta2"  # served since Kueue v0.15
KUEUE_JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
"""Kueue labels the Workload it makes for a batch/v1 Job with that Job's uid."""

DEFAULT_TIMEOUT = 30.0
"""Seconds an API call may take before it counts as failed (and is retried): a hung API
server must not hold a handler, or a thread of the operator's small pool, for ever."""


class KubeError(RuntimeError):
    """An API call that failed (other than a 404 / 409 its caller expects) or got no answer."""

    def __init__(self, action: str, error: Exception):
        self.namespace_terminating = False
        """The namespace is being deleted: nothing can be created in it, ever again."""
        if isinstance(error, ApiException):
            super().__init__(f"{action}: {error.status} {error.reason}")
            self.status: int | None = error.status
            self.retry_after = _retry_after(error.headers)
            self.namespace_terminating = error.status == 403 and _terminating(error.body)
        else:
            super().__init__(f"{action}: no answer from the API server "
                             f"({type(error).__name__}: {error})")
            self.status, self.retry_after = None, None


def _status(body: Any) -> dict[str, Any]:
    """The `Status` object an API server's error answer carries ({} when it carries none)."""
    try:
        status = json.loads(body)
    except (TypeError, ValueError):
        return {}
    return status if isinstance(status, dict) else {}


def _terminating(body: Any) -> bool:
    """The API server's refusal to create in a namespace being deleted (a `Status` whose
    cause is NamespaceTerminating)."""
    details = _status(body).get("details") or {}
    return any(c.get("reason") == "NamespaceTerminating" for c in details.get("causes") or [])


def timestamp(text: str | None) -> datetime | None:
    """An API server timestamp (RFC 3339 with `Z`, which Python 3.10's fromisoformat does not
    read) as an aware datetime."""
    return datetime.fromisoformat(text.replace("Z", "+00:00")) if text else None


def _retry_after(headers: Any) -> float | None:
    """The seconds a 429 (or 503) asks the client to wait, from its Retry-After header."""
    value = (headers or {}).get("Retry-After")
    try:
        return max(float(value), 0.0) if value is not None else None
    except ValueError:  # an HTTP date: rare from an API server, the backoff applies instead
        return None


class LoginError(RuntimeError):
    """No way to reach or log in to the API server: one line that says what to fix."""


def _in_cluster() -> bool:
    """In a pod: the service's address in the environment, its token mounted."""
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and os.path.exists(
        config.incluster_config.SERVICE_TOKEN_FILENAME)


def kubeconfig_path(kubeconfig: str | None = None) -> str:
    """Where kubectl would read its kubeconfig: the argument, KUBECONFIG (several files
    joined by ':' are merged), else ~/.kube/config."""
    return kubeconfig or os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")


def configuration(kubeconfig: str | None = None) -> client.Configuration:
    """Credentials as kubectl finds them: the pod's service account inside a cluster, else
    the kubeconfig's current context (tokens, client certificates, and exec plugins such
    as kubelogin on AKS, whose tokens are fetched again when they expire). Read anew on
    each call, so a rotated token is picked up."""
    configured = client.Configuration()
    if kubeconfig is None and _in_cluster():
        try:
            config.load_incluster_config(client_configuration=configured)
            return configured
        except config.ConfigException as error:
            raise LoginError(f"the pod's service account cannot be used ({error}) — check "
                             "automountServiceAccountToken on the operator's pod") from error
    path = kubeconfig_path(kubeconfig)
    try:
        config.load_kube_config(config_file=path, client_configuration=configured,
                                persist_config=False)
    except (config.ConfigException, OSError, ValueError, TypeError) as error:
        raise LoginError(f"no usable Kubernetes credentials: not inside a cluster, and the "
                         f"kubeconfig {path} cannot be used ({error}) — set KUBECONFIG to a "
                         "kubeconfig that works with kubectl") from error
    return configured


def connect(kubeconfig: str | None = None) -> client.ApiClient:
    """An API client logged in as `configuration` says."""
    return client.ApiClient(configuration(kubeconfig))


def connection_info(configured: client.Configuration) -> kopf.ConnectionInfo:
    """The same credentials in kopf's terms, for its login handler: the operator's watch
    streams and our own calls log in the same way."""
    header = (configured.get_api_key_with_prefix("BearerToken")
              or configured.get_api_key_with_prefix("authorization"))
    scheme, _, token = (header or "").rpartition(" ")
    return kopf.ConnectionInfo(
        server=configured.host,
        ca_path=configured.ssl_ca_cert,
        insecure=not configured.verify_ssl,
        username=configured.username or None,
        password=configured.password or None,
        scheme=scheme or ("Bearer" if token else None),
        token=token or None,
        certificate_path=configured.cert_file,
        private_key_path=configured.key_file,
    )


def check_access(api: client.ApiClient, namespaces: tuple[str, ...] = ()) -> None:
    """List FineTuneJobs once, where the operator will watch them, and turn every way that
    can fail (no server, TLS, 401, 403, no CRD) into a LoginError naming the fix."""
    host = api.configuration.host
    custom = client.CustomObjectsApi(api)
    # urllib3 logs each retry of a refused connection; the one line below says it all
    quiet = logging.getLogger("urllib3.connectionpool")
    level, quiet.level = quiet.level, logging.ERROR
    try:
        if namespaces:
            for namespace in namespaces:
                custom.list_namespaced_custom_object(API_GROUP, VERSION, namespace, PLURAL,
                                                     limit=1, _request_timeout=15)
        else:
            custom.list_cluster_custom_object(API_GROUP, VERSION, PLURAL, limit=1,
                                              _request_timeout=15)
    except ApiException as error:
        where = f"in namespace {', '.join(namespaces)}" if namespaces else "in all namespaces"
        fixes = {
            401: f"the API server at {host} refused the credentials (401 Unauthorized): the "
                 "token is expired or wrong — get a new one (`kubectl create token <service "
                 "account>`, or `az aks get-credentials` again)",
            403: f"the credentials may not list finetunejobs {where} (403 Forbidden) — "
                 "install the chart's RBAC, or bind its ClusterRole to this identity "
                 f"({_reason(error)})",
            404: f"the FineTuneJob CRD is not installed on {host} (404 for "
                 f"{API_GROUP}/{VERSION} {PLURAL}) — `kubectl apply -f crds/`, or install "
                 "the Helm chart",
        }
        raise LoginError(fixes.get(error.status, f"listing finetunejobs on {host} failed: "
                                   f"{error.status} {error.reason} ({_reason(error)})")
                         ) from error
    except HTTPError as error:
        # urllib3 gives up with MaxRetryError; what went wrong is its `reason`
        cause = error.reason if isinstance(getattr(error, "reason", None), Exception) else error
        fix = ("the server's certificate does not match the kubeconfig's certificate-authority"
               if isinstance(cause, SSLError) else
               "is the cluster up, and is KUBECONFIG the one you meant?")
        raise LoginError(f"cannot reach the API server at {host} ({type(cause).__name__}: "
                         f"{cause}) — {fix}") from error
    finally:
        quiet.setLevel(level)


def _reason(error: ApiException) -> str:
    return _status(error.body).get("message") or str(error.reason)


CONNECTIONS = 16
"""Calls in flight at once: the client is synchronous, so each runs in a thread of a pool of
this size, with as many pooled connections (no "connection pool is full" churn, however
many jobs reconcile at once; the rest wait their turn)."""


class Kube:
    def __init__(self, api: client.ApiClient, timeout: float = DEFAULT_TIMEOUT,
                 connections: int = CONNECTIONS):
        api.configuration.connection_pool_maxsize = connections
        api.rest_client.pool_manager.connection_pool_kw["maxsize"] = connections
        self._pool = ThreadPoolExecutor(max_workers=connections, thread_name_prefix="kube")
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
            "PersistentVolumeClaim": (None, self.core.read_namespaced_persistent_volume_claim,
                                      None),  # read only: the users' own volumes
        }

    async def _call(self, action: str, fn, *args, **kwargs) -> Any:
        """`fn` in a thread of the pool, within the timeout; every failure is a KubeError
        (with the status, None when no answer came). Callers pass _preload_content=False
        where they can: the client's model objects cost far more CPU than the JSON."""
        call = functools.partial(fn, *args, _request_timeout=self.timeout, **kwargs)
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, call)
        except (ApiException, HTTPError) as error:
            raise KubeError(action, error) from error

    async def create(self, obj: dict[str, Any]) -> bool:
        """Create `obj`; False when it already exists (launch is idempotent)."""
        create = self._calls[obj["kind"]][0]
        try:
            await self._call(f"create {obj['kind']} {obj['metadata']['name']}", create,
                             obj["metadata"]["namespace"], obj, _preload_content=False)
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
                             propagation_policy=propagation, _preload_content=False)
        except KubeError as error:
            if error.status == 404:
                return False
            raise
        return True

    async def pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        response = await self._call("list pods", self.core.list_namespaced_pod, namespace,
                                    label_selector=selector, _preload_content=False)
        return json.loads(response.data).get("items", [])

    async def events(self, namespace: str, kind: str, name: str,
                     uid: str | None = None) -> list[dict[str, Any]]:
        """The events about one object (of this incarnation, when `uid` is given)."""
        selector = f"involvedObject.kind={kind},involvedObject.name={name}"
        if uid:
            selector += f",involvedObject.uid={uid}"
        response = await self._call(f"list the events of {kind} {name}",
                                    self.core.list_namespaced_event, namespace,
                                    field_selector=selector, _preload_content=False)
        return json.loads(response.data).get("items", [])

    async def suspend_job(self, namespace: str, name: str, suspend: bool) -> None:
        await self._call(f"suspend Job {name}", self.batch.patch_namespaced_job, name, namespace,
                         {"spec": {"suspend": suspend}}, _preload_content=False)

    async def kueue_workload(self, namespace: str, job_uid: str
                             ) -> dict[str, Any] | None:
        """Kueue's Workload for the batch/v1 Job with uid `job_uid`; None when there is none
        (yet), or when Kueue's API is not served here (no Kueue installed)."""
        try:
            response = await self._call(
                "list Kueue Workloads", self.custom.list_namespaced_custom_object,
                KUEUE_GROUP, KUEUE_VERSION, namespace, "workloads",
                label_selector=f"{KUEUE_JOB_UID_LABEL}={job_uid}", _preload_content=False)
        except KubeError as error:
            if error.status == 404:
                return None
            raise
        items = json.loads(response.data).get("items", [])
        return items[0] if items else None

    async def activate_kueue_workload(self, namespace: str, name: str, active: bool) -> None:
        """Kueue's own switch (`spec.active`): false evicts the workload and frees its quota,
        true puts it back in its queue."""
        await self._call(f"set Kueue Workload {name} active={active}",
                         self.custom.patch_namespaced_custom_object, KUEUE_GROUP,
                         KUEUE_VERSION, namespace, "workloads", name,
                         {"spec": {"active": active}}, _preload_content=False)

    async def patch_finetunejob_status(self, namespace: str, name: str,
                                       status: dict[str, Any]) -> dict[str, Any] | None:
        """A merge patch of the status (None removes a field); the job as patched, None when
        it is gone."""
        try:
            response = await self._call(f"patch the status of FineTuneJob {name}",
                                        self.custom.patch_namespaced_custom_object_status,
                                        API_GROUP, VERSION, namespace, PLURAL, name,
                                        {"status": status}, _preload_content=False)
        except KubeError as error:
            if error.status != 404:
                raise
            return None
        return json.loads(response.data)

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
