"""One Azure ML workspace through azure-ai-ml's MLClient: get, create, cancel, metrics, and
registering a trained model.

Blocking (the SDK is synchronous): the backend calls these from a worker thread. Errors
leave here in three kinds the backend acts on: `Refused` (Azure ML will not run this job
as written: it counts as a failed attempt), `Throttled` (wait as long as Azure asks) and
`BackendError` (anything that may pass: outages, a missing identity or role), each with a
message that says what to fix. azure-core's retry policy retries transient answers with
exponential backoff and honours Retry-After, up to `longest_wait`; a longer wait is left
to the backend's throttle gate, so no worker thread sleeps for minutes.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

from finetune_operator.backends import BackendError
from finetune_operator.backends.azureml.jobspec import require_sdk
from finetune_operator.backends.azureml.states import AzureJob

logger = logging.getLogger("finetune_operator.azureml")
ARM_SCOPE = "https://management.azure.com/.default"
QUIET_LOGGERS = {"azure.core.pipeline.policies.http_logging_policy": logging.WARNING,
                 "azure.ai.ml.operations._job_operations": logging.WARNING,
                 "azure.identity": logging.ERROR}
"""Loggers of the Azure SDK and the level they keep: a line per HTTP call at INFO, and
DefaultAzureCredential's 15-line WARNING at every attempt without an identity, which the
job's status and event already say (AUTH_FIX) once."""
AUTH_FIX = ("give the operator an Azure identity: set the chart's azureWorkloadIdentity."
            "clientId to a user-assigned managed identity whose federated credential trusts "
            "the operator's service account, and grant it the AzureML Data Scientist role on "
            "the workspace")


@dataclass(frozen=True)
class Workspace:
    subscription_id: str
    resource_group: str
    name: str

    def __str__(self) -> str:
        return f"{self.resource_group}/{self.name}"


@dataclass(frozen=True)
class RetrySettings:
    """azure-core retries of one call: transient answers (408, 429, 5xx, broken
    connections), exponential backoff, Retry-After honoured up to `longest_wait`."""

    total: int = 3
    backoff_factor: float = 0.8
    backoff_max: float = 30.0
    longest_wait: float = 30.0
    timeout: float = 60.0


class Refused(Exception):
    """Azure ML will not run the job as written (bad compute, quota, schema)."""


class Throttled(BackendError):
    """Azure asked the operator to slow down (429) for `retry_after` seconds."""


class NotAnswering(BackendError):
    """The workspace did not answer (an outage, a hung connection) for `retry_after`."""


class RunUnreadable(Exception):
    """The job's MLflow run (its progress, a worker's reason) cannot be read now."""


def _retry_policy(settings: RetrySettings) -> Any:
    from azure.core.pipeline.policies import RetryPolicy  # azure-ai-ml: the optional `azure` extra

    class PatientRetryPolicy(RetryPolicy):
        """azure-core's policy, except that a Retry-After longer than `longest_wait` ends
        the call (the backend waits it out without holding a thread)."""

        def is_retry(self, retry_settings: Any, response: Any) -> bool:
            if not super().is_retry(retry_settings, response):
                return False
            wait = self.get_retry_after(response)
            return wait is None or wait <= settings.longest_wait

    return PatientRetryPolicy(retry_total=settings.total,
                              retry_backoff_factor=settings.backoff_factor,
                              retry_backoff_max=settings.backoff_max,
                              timeout=settings.timeout)


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_MARKER = re.compile(r"^(\d+\)|\(x\)|Details:)\s*")


def _first_line(error: BaseException, limit: int = 300, whole: bool = False) -> str:
    """An error's first line; `whole`: every line before the resolutions, on one (the SDK's
    own validation errors are coloured and spread over a numbered list and details)."""
    text = _ANSI.sub("", str(getattr(error, "message", None) or error))
    lines = []
    for line in text.splitlines():
        if line.strip().startswith("Resolutions:"):
            break
        if line := _MARKER.sub("", line.strip()).strip():
            lines.append(line)
    if not lines:
        return type(error).__name__
    return (": ".join(lines) if whole else lines[0])[:limit]


def translate(error: Exception, workspace: Workspace) -> Exception:
    """An SDK / azure-core error as the backend's kind of error."""
    from azure.core.exceptions import (  # azure-ai-ml: the optional `azure` extra
        AzureError,
        ClientAuthenticationError,
        HttpResponseError,
        ServiceRequestError,
        ServiceResponseError,
    )

    ml_exceptions = require_sdk().exceptions
    status = getattr(error, "status_code", None)
    if isinstance(error, ClientAuthenticationError) and status in (None, 401):
        return BackendError(f"Azure did not accept the operator's identity for workspace "
                            f"{workspace} ({_first_line(error)}) — {AUTH_FIX}", retry_after=300)
    if status == 403:
        return BackendError(f"the operator's identity may not use workspace {workspace} "
                            f"({_first_line(error)}) — grant it the AzureML Data Scientist "
                            "role on the workspace (az role assignment create)",
                            retry_after=300)
    if status == 429:
        response = getattr(error, "response", None)
        header = response.headers.get("Retry-After") if response is not None else None
        wait = float(header) if header and header.strip().isdigit() else 60.0
        return Throttled(f"Azure ML is throttling calls to workspace {workspace}; the "
                         f"operator waits {int(wait)}s as asked", retry_after=wait)
    if isinstance(error, (ServiceRequestError, ServiceResponseError)) or (
            status is not None and (status >= 500 or status == 408)):
        return NotAnswering(f"Azure ML workspace {workspace} is not answering "
                            f"({_first_line(error)}); retrying", retry_after=30)
    if status == 404:
        return Refused(f"Azure ML answered 404 ({_first_line(error)}) — check "
                       "spec.azureml.subscriptionId, resourceGroup and workspace, and the "
                       "compute, environment and input assets the job names")
    if isinstance(error, (HttpResponseError, ml_exceptions.MlException)):
        # the service's 4xx, or the SDK refusing the job before it is sent (its validation
        # re-raised as a plain MlException): the same on every try
        return Refused(_first_line(error, 600,
                                   whole=isinstance(error, ml_exceptions.MlException)))
    if isinstance(error, AzureError):  # anything else from the SDK's transport or parsing
        return BackendError(f"calling Azure ML workspace {workspace} failed "
                            f"({type(error).__name__}: {_first_line(error)}); retrying",
                            retry_after=30)
    return error


class AzureMLClient:
    """The calls the backend makes to one workspace."""

    def __init__(self, workspace: Workspace, credential: Any, transport: Any = None,
                 retry: RetrySettings | None = None):
        sdk = require_sdk()
        for chatty, level in QUIET_LOGGERS.items():
            logging.getLogger(chatty).setLevel(level)
        self.workspace = workspace
        self.credential = credential
        self.transport = transport
        self.retry = retry or RetrySettings()
        extra = {"transport": transport} if transport is not None else {}
        self.ml = sdk.MLClient(credential, workspace.subscription_id,
                               workspace.resource_group, workspace.name,
                               enable_telemetry=False, retry_policy=_retry_policy(self.retry),
                               **extra)

    def _translate(self, error: Exception) -> Exception:
        return translate(error, self.workspace)

    def get(self, name: str) -> AzureJob | None:
        """The job, or None when the workspace has none by that name."""
        # azure-ai-ml: the optional `azure` extra
        from azure.core.exceptions import ResourceNotFoundError

        try:
            return self._read(self.ml.jobs.get(name))
        except ResourceNotFoundError:
            return None
        except Exception as error:
            raise self._translate(error) from error

    def create(self, command_job: Any) -> AzureJob:
        """Submit; a job that appeared meanwhile under the same name is adopted (a 409, or
        the 400 UserError "A job with this name already exists" the service answers)."""
        try:
            return self._read(self.ml.jobs.create_or_update(command_job))
        except Exception as error:
            translated = self._translate(error)
            if isinstance(translated, Refused) and (found := self.get(command_job.name)):
                return found
            raise translated from error

    def cancel(self, name: str) -> None:
        """Ask Azure ML to cancel (without waiting); a job that is gone needs nothing."""
        # azure-ai-ml: the optional `azure` extra
        from azure.core.exceptions import ResourceNotFoundError

        try:
            self.ml.jobs.begin_cancel(name, polling=False)
        except ResourceNotFoundError:
            return
        except Exception as error:
            raise self._translate(error) from error

    def register_model(self, name: str, path: str, description: str,
                       tags: dict[str, str]) -> str:
        """Register `path` (a datastore folder, nothing uploaded) as the next version of
        model `name`; returns that version."""
        from azure.ai.ml.constants import AssetTypes  # azure-ai-ml: the optional `azure` extra
        from azure.ai.ml.entities import Model

        try:
            model = self.ml.models.create_or_update(Model(
                name=name, path=path, type=AssetTypes.CUSTOM_MODEL, description=description,
                tags=tags))
        except Exception as error:
            raise self._translate(error) from error
        return str(model.version)

    def run_data(self, job: AzureJob) -> dict[str, Any]:
        """The MLflow run's data (the run id is the job name): its latest `metrics` and its
        `tags`, each a list of {key, value}. Raises RunUnreadable, saying why, when the
        tracking service cannot say: never a reason to fail the job."""
        if not job.tracking_uri:
            raise RunUnreadable("Azure ML names no tracking service for the job")
        from azure.core import PipelineClient  # azure-ai-ml: the optional `azure` extra
        from azure.core.pipeline.policies import BearerTokenCredentialPolicy
        from azure.core.rest import HttpRequest

        base = "https://" + job.tracking_uri.split("://", 1)[1].split("?", 1)[0].rstrip("/")
        policies = [BearerTokenCredentialPolicy(self.credential, ARM_SCOPE),
                    _retry_policy(self.retry)]
        extra = {"transport": self.transport} if self.transport is not None else {}
        client = PipelineClient(base, policies=policies, **extra)
        request = HttpRequest("GET", f"{base}/api/2.0/mlflow/runs/get",
                              params={"run_id": job.name})
        try:
            response = client.send_request(request)
            if response.status_code != 200:
                raise RunUnreadable(f"the tracking service answered HTTP "
                                    f"{response.status_code}")
            return dict(response.json().get("run", {}).get("data", {}))
        except RunUnreadable:
            raise
        except Exception as error:  # the tracking service, the network, the answer
            raise RunUnreadable(f"{type(error).__name__}: {_first_line(error)}") from error

    @staticmethod
    def _read(entity: Any) -> AzureJob:
        services = getattr(entity, "services", None) or {}
        tracking = services.get("Tracking")
        compute = getattr(entity, "compute", None)
        status = getattr(entity.status, "value", entity.status)  # an enum in some versions
        return AzureJob(
            name=entity.name, status=str(status or "NotStarted"),
            studio_url=getattr(entity, "studio_url", None),
            tracking_uri=getattr(tracking, "endpoint", None) if tracking else None,
            compute=compute.rsplit("/", 1)[-1] if isinstance(compute, str) else None)
