"""The few Kubernetes API calls the operator makes: async, over aiohttp, as kopf's own.

Logs in as kubectl does (`configuration`, read by the official client's kubeconfig loader):
the in-cluster service account, else KUBECONFIG / ~/.kube/config (which covers AKS's
exec-based logins); kopf's watch streams use the same credentials (`connection_info`).
Requests and answers are plain JSON dicts, exactly as the API serves them, so the pure code
(render, observe) sees what `kubectl get -o json` shows. Every call has a timeout, and every
failure (an error status, or no answer at all) is a `KubeError` carrying the status and any
Retry-After, which the controller turns into a retry.

Why not the official client's API classes: their calls are synchronous (a thread each, and a
pool that runs dry under a burst), and building them costs ~24 MiB and a second (a pydantic
validator for each of their methods): more than the rest of the operator's own state for a
thousand jobs. One aiohttp session, with a bounded number of connections, does the same.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import json
import os
import re
import ssl
from collections.abc import AsyncIterator, Callable, Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import kopf
from kubernetes import client, config

from finetune_operator.api import (
    API_GROUP,
    API_VERSION,
    KIND,
    PLURAL,
    SWEEP_KIND,
    SWEEP_PLURAL,
    VERSION,
)


def _version() -> str:
    try:
        return importlib.metadata.version("finetune-operator")
    except importlib.metadata.PackageNotFoundError:
        return "dev"


KUEUE_GROUP, KUEUE_VERSION = "kueue.x-k8s.io", "v1beta2"  # served since Kueue v0.15
KUEUE_JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
"""Kueue labels the Workload it makes for a batch/v1 Job with that Job's uid."""

DEFAULT_TIMEOUT = 30.0
"""Seconds an API call may take before it counts as failed (and is retried): a hung API
server must not hold a reconcile for ever."""
CONNECTIONS = 16
"""Connections to the API server at once (HTTP/1.1: one request each); more requests wait
for a free one. As many as the controller's reconcilers: each TLS connection holds a
256 KiB read buffer, so a larger pool costs memory and saves little."""
COMPONENT = "finetune-operator"
"""Who the operator's events say they come from (`kubectl describe`'s From column)."""
USER_AGENT = f"{COMPONENT}/{_version()}"
"""How the operator's calls read in the API server's audit log (kopf's say `kopf/...`)."""

PATHS: dict[str, tuple[str, str]] = {  # kind: (API prefix, plural)
    "ConfigMap": ("api/v1", "configmaps"),
    "Service": ("api/v1", "services"),
    "Pod": ("api/v1", "pods"),
    "Event": ("api/v1", "events"),
    "PersistentVolumeClaim": ("api/v1", "persistentvolumeclaims"),
    "Job": ("apis/batch/v1", "jobs"),
    KIND: (f"apis/{API_GROUP}/{VERSION}", PLURAL),
    SWEEP_KIND: (f"apis/{API_GROUP}/{VERSION}", SWEEP_PLURAL),
    "Workload": (f"apis/{KUEUE_GROUP}/{KUEUE_VERSION}", "workloads"),
    "KopfPeering": ("apis/kopf.dev/v1", "kopfpeerings"),
    "ClusterKopfPeering": ("apis/kopf.dev/v1", "clusterkopfpeerings"),
    "CustomResourceDefinition": ("apis/apiextensions.k8s.io/v1", "customresourcedefinitions"),
}


def path(kind: str, namespace: str | None = None, name: str | None = None,
         subresource: str | None = None) -> str:
    """The URL path of a kind's collection, or of one object (and its subresource)."""
    prefix, plural = PATHS[kind]
    parts = [prefix, *(("namespaces", namespace) if namespace else ()), plural,
             *((name,) if name else ()), *((subresource,) if subresource else ())]
    return "/" + "/".join(parts)


class KubeError(RuntimeError):
    """An API call that failed (other than a 404 / 409 its caller expects) or got no answer."""

    def __init__(self, action: str, status: int | None = None, reason: str = "",
                 body: Any = None, headers: Any = None, cause: BaseException | None = None):
        if status is None:
            super().__init__(f"{action}: no answer from the API server "
                             f"({type(cause).__name__}: {cause})")
        else:  # with the API server's words, which say why (a namespace being deleted)
            said = _status(body).get("message")
            said = "" if not said or said.lower() == reason.lower() else f" ({said})"
            super().__init__(f"{action}: {status} {reason}{said}")
        self.status = status
        self.cause = cause
        """Why no answer came (a refused connection, TLS, a timeout); None when one did."""
        self.retry_after = _retry_after(headers) if status is not None else None
        self.message = _status(body).get("message") or reason
        """What the API server said (its Status message), else the HTTP reason."""
        self.namespace_terminating = status == 403 and _terminating(body)
        """The namespace is being deleted: nothing can be created in it, ever again."""


_WEBHOOK = re.compile(r'failed calling webhook "([^"]+)"')


def webhook_hint(error: BaseException) -> str:
    """What to do when an admission webhook that does not answer made the API server refuse
    a call (its words: `failed calling webhook "NAME": ...`); "" for any other refusal."""
    match = _WEBHOOK.search(str(error))
    if match is None:
        return ""
    return (f" — the admission webhook {match[1]} does not answer, and the API server refuses "
            "what it must admit until it does: start its server (for Kueue's, its controller "
            "manager: kubectl -n kueue-system get pods) or delete its webhook configuration "
            "(kubectl get mutatingwebhookconfigurations,validatingwebhookconfigurations)")


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


def merge_patch(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """The JSON merge patch (RFC 7386) from `old` to `new`: None removes a field, at any
    depth. (Written as `new`'s value, an emptied object ({}) changed nothing, and a key gone
    from a nested object stayed: a status's launchedSpec could not be cleared.)"""
    patch: dict[str, Any] = {}
    for key, value in new.items():
        before = old.get(key)
        if before == value:
            continue
        if isinstance(value, dict) and isinstance(before, dict) and value:
            patch[key] = merge_patch(before, value)
        else:
            patch[key] = None if value == {} else value
    patch.update({k: None for k in old if k not in new})
    return patch


def slim(body: Any) -> dict[str, Any]:
    """What a reconcile reads of a FineTuneJob or FineTuneSweep: its spec and status, and the
    metadata that names it. managedFields and kubectl's last-applied copy stay out of the
    watch caches: they make up most of an object's size."""
    meta = body.get("metadata") or {}
    kept = {k: meta[k] for k in ("name", "namespace", "uid", "generation", "resourceVersion",
                                 "creationTimestamp", "deletionTimestamp", "labels",
                                 "ownerReferences")
            if meta.get(k) is not None}
    annotations = {k: v for k, v in (meta.get("annotations") or {}).items()
                   if k != "kubectl.kubernetes.io/last-applied-configuration"}
    if annotations:
        kept["annotations"] = annotations
    return {"apiVersion": body.get("apiVersion"), "kind": body.get("kind"), "metadata": kept,
            "spec": body.get("spec"), "status": body.get("status")}


def newer(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """`a` is a later version of the object than `b` (resourceVersions are etcd revisions,
    compared as numbers where both are)."""
    try:
        return int(a["metadata"]["resourceVersion"]) > int(b["metadata"]["resourceVersion"])
    except (KeyError, TypeError, ValueError):
        return False


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


def default_namespace(kubeconfig: str | None = None) -> str:
    """The namespace kubectl would use: the current context's, the pod's own inside a
    cluster, else `default`."""
    if kubeconfig is None and _in_cluster():
        try:
            return Path(config.incluster_config.SERVICE_TOKEN_FILENAME).with_name(
                "namespace").read_text().strip() or "default"
        except OSError:
            return "default"
    try:
        _, current = config.list_kube_config_contexts(config_file=kubeconfig_path(kubeconfig))
    except (config.ConfigException, OSError, ValueError, TypeError):
        return "default"  # the login that follows says what is wrong with the kubeconfig
    return (current or {}).get("context", {}).get("namespace") or "default"


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
    where = kubeconfig_path(kubeconfig)
    try:
        config.load_kube_config(config_file=where, client_configuration=configured,
                                persist_config=False)
    except (config.ConfigException, OSError, ValueError, TypeError) as error:
        raise LoginError(f"no usable Kubernetes credentials: not inside a cluster, and the "
                         f"kubeconfig {where} cannot be used ({error}) — set KUBECONFIG to a "
                         "kubeconfig that works with kubectl") from error
    return configured


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




def _tls(configured: client.Configuration) -> ssl.SSLContext | bool:
    """TLS as the kubeconfig says: its CA, a client certificate if any, or no check at all
    (`insecure-skip-tls-verify`); False for a plain-HTTP server."""
    if not configured.host.startswith("https:"):
        return False
    context = ssl.create_default_context(cafile=configured.ssl_ca_cert or None)
    if configured.cert_file:
        context.load_cert_chain(configured.cert_file, configured.key_file or None)
    if not configured.verify_ssl:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


def _authorization(configured: client.Configuration) -> dict[str, str]:
    """The Authorization header: a bearer token (an exec plugin's is fetched again here once
    it expires), else basic auth, else none (client certificates)."""
    token = (configured.get_api_key_with_prefix("BearerToken")
             or configured.get_api_key_with_prefix("authorization"))
    if token:
        return {"Authorization": token if " " in token else f"Bearer {token}"}
    if configured.username:
        return {"Authorization": aiohttp.BasicAuth(configured.username,
                                                   configured.password or "").encode()}
    return {}


class Kube:
    """The operator's API client: one aiohttp session per event loop, logged in lazily (so
    an offline `finetune render` never needs credentials) and again after a 401 (a rotated
    service-account token)."""

    def __init__(self, kubeconfig: str | None = None, *, timeout: float = DEFAULT_TIMEOUT,
                 connections: int = CONNECTIONS,
                 login: Callable[[], client.Configuration] | None = None):
        self._login = login or functools.partial(configuration, kubeconfig)
        self.timeout = timeout
        """Seconds each call may take (kopf's own calls get the same limit)."""
        self.connections = connections
        self._configured: client.Configuration | None = None
        self._auth_header: dict[str, str] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None

    @property
    def configured(self) -> client.Configuration:
        """The credentials in use (raises LoginError when there are none)."""
        if self._configured is None:
            self._configured = self._login()
        return self._configured

    def _headers(self, merge_patch: bool) -> dict[str, str]:
        # worked out once per login: an expired token (an exec plugin's, a rotated service
        # account's) answers 401, and the call logs in again
        if self._auth_header is None:
            self._auth_header = _authorization(self.configured)
        headers = {"Accept": "application/json", **self._auth_header}
        if merge_patch:
            headers["Content-Type"] = "application/merge-patch+json"
        return headers

    def _connection(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._session_loop is not loop:
            connector = aiohttp.TCPConnector(limit=self.connections,
                                             ssl=_tls(self.configured))
            self._session = aiohttp.ClientSession(
                base_url=self.configured.host.rstrip("/"), connector=connector,
                json_serialize=json.dumps, headers={"User-Agent": USER_AGENT})
            self._session_loop = loop
        return self._session

    async def _relogin(self) -> None:
        """Read the credentials anew (the old session's TLS material may be stale too)."""
        self._configured = self._auth_header = None
        if self._session is not None:
            await self._session.close()
        self._session = None

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

    async def request(self, action: str, method: str, url: str, *, body: Any = None,
                      params: dict[str, Any] | None = None, merge_patch: bool = False,
                      answer: bool = True) -> Any:
        """One call: the answer's JSON (None when empty, or not wanted: `answer` False
        spares decoding what the caller ignores); every failure is a KubeError."""
        for attempt in (1, 2):
            session = self._connection()
            try:
                async with session.request(
                        method, url, json=body, params=params,
                        headers=self._headers(merge_patch),
                        proxy=self.configured.proxy or None,
                        server_hostname=getattr(self.configured, "tls_server_name", None),
                        timeout=aiohttp.ClientTimeout(total=self.timeout)) as response:
                    data = await response.read()
                    if response.status == 401 and attempt == 1:
                        await self._relogin()
                        continue
                    if response.status >= 400:
                        raise KubeError(action, response.status, response.reason or "", data,
                                        response.headers)
                    return json.loads(data) if data and answer else None
            except (aiohttp.ClientError, TimeoutError, ssl.SSLError, OSError) as error:
                raise KubeError(action, cause=error) from error
        raise AssertionError("unreachable")  # the second attempt returns or raises

    # --- what the operator asks --------------------------------------------------------------

    async def create(self, obj: dict[str, Any]) -> bool:
        """Create `obj`; False when it already exists (launch is idempotent)."""
        meta = obj["metadata"]
        try:
            await self.request(f"create {obj['kind']} {meta['name']}", "POST",
                               path(obj["kind"], meta["namespace"]), body=obj, answer=False)
        except KubeError as error:
            if error.status == 409:
                return False
            raise
        return True

    async def get(self, kind: str, namespace: str | None, name: str
                  ) -> dict[str, Any] | None:
        try:
            return await self.request(f"get {kind} {name}", "GET", path(kind, namespace, name))
        except KubeError as error:
            if error.status == 404:
                return None
            raise

    async def delete(self, kind: str, namespace: str, name: str,
                     propagation: str = "Foreground") -> bool:
        """Delete; False when it was already gone."""
        try:
            await self.request(f"delete {kind} {name}", "DELETE", path(kind, namespace, name),
                               body={"propagationPolicy": propagation}, answer=False)
        except KubeError as error:
            if error.status == 404:
                return False
            raise
        return True

    async def patch(self, kind: str, namespace: str, name: str, body: dict[str, Any]) -> None:
        """A merge patch of `body` into the object."""
        await self.request(f"patch {kind} {name}", "PATCH", path(kind, namespace, name),
                           body=body, merge_patch=True, answer=False)

    async def list(self, kind: str, namespace: str | None = None, *,
                   labels: str | None = None, fields: str | None = None,
                   limit: int | None = None, action: str | None = None
                   ) -> list[dict[str, Any]]:
        params = {k: v for k, v in (("labelSelector", labels), ("fieldSelector", fields),
                                    ("limit", limit)) if v is not None}
        answer = await self.request(action or f"list {PATHS[kind][1]}", "GET",
                                    path(kind, namespace), params=params)
        return (answer or {}).get("items") or []

    async def pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        return await self.list("Pod", namespace, labels=selector)

    async def events(self, namespace: str, kind: str, name: str,
                     uid: str | None = None) -> list[dict[str, Any]]:
        """The events about one object (of this incarnation, when `uid` is given)."""
        selector = f"involvedObject.kind={kind},involvedObject.name={name}"
        if uid:
            selector += f",involvedObject.uid={uid}"
        return await self.list("Event", namespace, fields=selector,
                               action=f"list the events of {kind} {name}")

    async def pod_log(self, namespace: str, pod: str, container: str, follow: bool = False
                      ) -> AsyncIterator[bytes]:
        """A container's log as the kubelet serves it, in chunks; with `follow`, until the
        container ends (no time limit but the connection's own)."""
        url = path("Pod", namespace, pod, "log")
        params = {"container": container, **({"follow": "true"} if follow else {})}
        session = self._connection()
        try:
            async with session.get(
                    url, params=params, headers=self._headers(False),
                    proxy=self.configured.proxy or None,
                    server_hostname=getattr(self.configured, "tls_server_name", None),
                    timeout=aiohttp.ClientTimeout(total=None if follow else self.timeout,
                                                  connect=self.timeout)) as response:
                if response.status >= 400:
                    raise KubeError(f"read the log of pod {pod}", response.status,
                                    response.reason or "", await response.read(),
                                    response.headers)
                async for chunk in response.content.iter_any():
                    yield chunk
        except (aiohttp.ClientError, TimeoutError, ssl.SSLError, OSError) as error:
            raise KubeError(f"read the log of pod {pod}", cause=error) from error

    async def post_event(self, about: dict[str, Any], type_: str, reason: str,
                         message: str) -> None:
        """An event on `about` (a FineTuneJob or FineTuneSweep), as `kubectl describe`
        lists them."""
        meta = about.get("metadata") or {}
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        event = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{meta.get('name')}.",
                         "namespace": meta.get("namespace")},
            "involvedObject": {"apiVersion": API_VERSION, "kind": about.get("kind") or KIND,
                               "name": meta.get("name"), "namespace": meta.get("namespace"),
                               "uid": meta.get("uid")},
            "type": type_, "reason": reason, "message": message[:1024],
            "source": {"component": COMPONENT}, "reportingComponent": COMPONENT,
            "reportingInstance": os.environ.get("HOSTNAME") or COMPONENT,
            "firstTimestamp": now, "lastTimestamp": now, "count": 1}
        await self.request(f"post the {reason} event of {meta.get('name')}", "POST",
                           path("Event", meta.get("namespace")), body=event, answer=False)

    async def suspend_job(self, namespace: str, name: str, suspend: bool) -> None:
        await self.request(f"suspend Job {name}", "PATCH", path("Job", namespace, name),
                           body={"spec": {"suspend": suspend}}, merge_patch=True)

    async def kueue_workload(self, namespace: str, job_uid: str
                             ) -> dict[str, Any] | None:
        """Kueue's Workload for the batch/v1 Job with uid `job_uid`; None when there is none
        (yet), or when Kueue's API is not served here (no Kueue installed)."""
        try:
            items = await self.list("Workload", namespace, action="list Kueue Workloads",
                                    labels=f"{KUEUE_JOB_UID_LABEL}={job_uid}")
        except KubeError as error:
            if error.status == 404:
                return None
            raise
        return items[0] if items else None

    async def activate_kueue_workload(self, namespace: str, name: str, active: bool) -> None:
        """Kueue's own switch (`spec.active`): false evicts the workload and frees its quota,
        true puts it back in its queue."""
        await self.request(f"set Kueue Workload {name} active={active}", "PATCH",
                           path("Workload", namespace, name),
                           body={"spec": {"active": active}}, merge_patch=True)

    async def patch_finetunejob_status(self, namespace: str, name: str,
                                       status: dict[str, Any]) -> dict[str, Any] | None:
        return await self.patch_status(KIND, namespace, name, status)

    async def patch_status(self, kind: str, namespace: str, name: str,
                           status: dict[str, Any]) -> dict[str, Any] | None:
        """A merge patch of the status (None removes a field); the object as patched, None
        when it is gone."""
        try:
            return await self.request(f"patch the status of {kind} {name}", "PATCH",
                                      path(kind, namespace, name, "status"),
                                      body={"status": status}, merge_patch=True)
        except KubeError as error:
            if error.status != 404:
                raise
            return None

    async def delete_finetunejob(self, namespace: str, name: str) -> None:
        try:
            await self.request(f"delete FineTuneJob {name}", "DELETE",
                               path(KIND, namespace, name))
        except KubeError as error:
            if error.status != 404:
                raise

    async def peering_missing(self, name: str, namespaces: tuple[str, ...]) -> list[str]:
        """Where kopf's peering object `name` does not exist: "cluster-wide" or namespaces."""
        lookups = ([("cluster-wide", path("ClusterKopfPeering", None, name))] if not namespaces
                   else [(ns, path("KopfPeering", ns, name)) for ns in namespaces])
        missing = []
        for where, url in lookups:
            try:
                await self.request(f"get the peering object {name} ({where})", "GET", url)
            except KubeError as error:
                if error.status != 404:
                    raise
                missing.append(where)
        return missing


EXPIRED_TOKEN = ("the token is expired or wrong — get a new one (`kubectl create token "
                 "<service account>`, or `az aks get-credentials` again)")
"""What a 401 means and how to get past it, for the operator and for `finetune status`."""
UNREACHABLE = "is the cluster up, and is KUBECONFIG the one you meant?"


NEEDED_ACCESS: tuple[tuple[str, str, str], ...] = (
    *(("finetune.dev", resource, verb) for resource in ("finetunejobs", "finetunesweeps")
      for verb in ("list", "watch")),
    ("finetune.dev", "finetunejobs/status", "patch"),
    ("finetune.dev", "finetunesweeps/status", "patch"),
    ("finetune.dev", "finetunejobs", "create"),  # a sweep's trials
    *(("batch" if resource == "jobs" else "", resource, verb)
      for resource in ("jobs", "services", "configmaps")
      for verb in ("list", "watch", "create", "delete")),
    ("", "configmaps", "get"),  # a relaunch brings the trainer config up to date
    ("", "configmaps", "patch"),
    *(("", "pods", verb) for verb in ("list", "watch")),
    ("", "events", "create"),
)
"""(group, resource, verb) the operator cannot work without, in each namespace it watches:
what its watches and launches need (the chart's Role grants them, and more that is
optional: claims, Kueue workloads, the Job controller's events). With any missing, kopf
retried the forbidden watch for ever and stopped answering, SIGTERM included."""


OPTIONAL_ACCESS: dict[tuple[str, str, str], str] = {
    ("batch", "jobs", "patch"): "spec.runPolicy.suspend cannot suspend or resume a job",
    ("", "persistentvolumeclaims", "get"):
        "a multi-node job is launched without checking that its output claim is "
        "ReadWriteMany",
    ("", "events", "list"): "a job whose pods the Job controller cannot create (a quota, an "
                            "admission webhook) does not say why",
    (KUEUE_GROUP, "workloads", "list"): "a job queued by Kueue is not followed",
    (KUEUE_GROUP, "workloads", "patch"): "a job queued by Kueue cannot be suspended",
    ("finetune.dev", "finetunejobs", "patch"):
        "an Azure ML job gets no finalizer: deleting its FineTuneJob leaves it running",
}
"""(group, resource, verb) the chart grants beyond NEEDED_ACCESS, and what goes without each:
the operator starts without them, warning once per missing right."""


async def denied_access(kube: Kube, namespaces: tuple[str, ...] = (),
                        wanted: Iterable[tuple[str, str, str]] = NEEDED_ACCESS,
                        ) -> list[tuple[str, str, str, str | None]]:
    """(group, resource, verb, namespace) of `wanted` the credentials lack, by the API
    server's own SelfSubjectAccessReview (any authenticated user may ask it)."""
    async def allowed(group: str, resource: str, verb: str, namespace: str | None) -> bool:
        name, _, subresource = resource.partition("/")
        attributes = {"group": group, "resource": name, "verb": verb}
        if subresource:
            attributes["subresource"] = subresource
        if namespace:
            attributes["namespace"] = namespace
        try:
            review = await kube.request(
                f"review access to {verb} {resource}", "POST",
                "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
                body={"apiVersion": "authorization.k8s.io/v1",
                      "kind": "SelfSubjectAccessReview",
                      "spec": {"resourceAttributes": attributes}})
        except KubeError as error:
            if error.status is not None:  # a server that does not let us ask: no answer
                return True
            raise
        status = (review or {}).get("status")
        # an API server always answers `allowed`; a stand-in that only stores the object
        # (an emulator) answers nothing, which is no refusal either
        return not isinstance(status, dict) or "allowed" not in status or bool(
            status["allowed"])

    asked = [(*needed, namespace) for namespace in namespaces or (None,)
             for needed in wanted]
    answers = await asyncio.gather(*(allowed(*a) for a in asked))
    return [a for a, ok in zip(asked, answers, strict=True) if not ok]


async def check_access(kube: Kube, namespaces: tuple[str, ...] = ()) -> list[str]:
    """List FineTuneJobs once, where the operator will watch them, and review the rest of
    what it needs (NEEDED_ACCESS); turn every way that can fail (no server, TLS, 401, 403,
    no CRD, a Role missing a rule) into a LoginError naming the fix. Returns a warning for
    each OPTIONAL_ACCESS right it lacks."""
    host = kube.configured.host
    where = f"in namespace {', '.join(namespaces)}" if namespaces else "in all namespaces"
    saved, kube.timeout = kube.timeout, 15.0
    try:
        for namespace in namespaces or (None,):
            await kube.list(KIND, namespace, limit=1)
        denied = await denied_access(kube, namespaces)
        if denied:
            missing = sorted({f"{verb} {resource}" for _g, resource, verb, _n in denied})
            spaces = sorted({n for *_r, n in denied if n})
            within = f"in namespace {', '.join(spaces)}" if spaces else "in all namespaces"
            raise LoginError(
                f"the credentials may not {', '.join(missing)} {within} (the API server's "
                "access review) — install the chart's RBAC, or bind its ClusterRole to this "
                "identity; the operator watches and launches with all of these")
        lacking = await denied_access(kube, namespaces, OPTIONAL_ACCESS)
        return [f"the credentials may not {verb} {resource}"
                f"{f' in namespace {ns}' if ns else ''}: {OPTIONAL_ACCESS[group, resource, verb]}"
                " (the chart's RBAC grants it)" for group, resource, verb, ns in lacking]
    except KubeError as error:
        fixes = {
            401: f"the API server at {host} refused the credentials (401 Unauthorized): "
                 f"{EXPIRED_TOKEN}",
            403: f"the credentials may not list finetunejobs {where} (403 Forbidden) — "
                 "install the chart's RBAC, or bind its ClusterRole to this identity "
                 f"({error.message})",
            404: f"the FineTuneJob CRD is not installed on {host} (404 for "
                 f"{API_GROUP}/{VERSION} {PLURAL}) — `kubectl apply -f crds/`, or install "
                 "the Helm chart",
        }
        if error.status is None:
            cause = error.cause
            fix = ("the server's certificate does not match the kubeconfig's "
                   "certificate-authority" if isinstance(
                       cause, ssl.SSLError | aiohttp.ClientSSLError) else UNREACHABLE)
            raise LoginError(f"cannot reach the API server at {host} "
                             f"({type(cause).__name__}: {cause}) — {fix}") from error
        raise LoginError(fixes.get(error.status, f"listing finetunejobs on {host} failed: "
                                   f"{error.status} ({error.message})")) from error
    finally:
        kube.timeout = saved
