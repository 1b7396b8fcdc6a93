"""The azureml backend: submits, watches and cancels one Azure ML command job per attempt.

Attempts are named `<job>-<uid>` then `<job>-<uid>-2`, ...: a re-reconcile computes the
same name and finds the job it submitted before (get before create), and a resume or a
gang restart submits the next name, which resumes from the newest checkpoint in the
output datastore folder. The SDK is blocking, so every call runs in a worker thread; a
throttled workspace is left alone for as long as Azure asked.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

from finetune_operator.api import FineTuneJob, Progress
from finetune_operator.backends import BackendContext, BackendError
from finetune_operator.backends.azureml import jobspec, states
from finetune_operator.backends.azureml.client import (
    AzureMLClient,
    NotAnswering,
    Refused,
    RetrySettings,
    RunUnreadable,
    Throttled,
    Workspace,
)
from finetune_operator.backends.azureml.states import AzureJob
from finetune_operator.output_folders import folder_key
from finetune_operator.reasons import ConditionType
from finetune_operator.reconcile import Failure, Observation, condition
from finetune_operator.validation import Problem
from finetune_trainer.uris import Location

logger = logging.getLogger("finetune_operator.azureml")
T = TypeVar("T")


class ThrottleGate:
    """Per workspace: no call before the time Azure's last Retry-After named, or for a
    while after it did not answer (each look at each of its jobs would otherwise hold a
    worker thread, and a reconciler, for the SDK's whole timeout)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.until: dict[Workspace, float] = {}
        self.why: dict[Workspace, str] = {}

    def wait_left(self, workspace: Workspace) -> float:
        return max(0.0, self.until.get(workspace, 0.0) - self.clock())

    def close_for(self, workspace: Workspace, seconds: float, why: str) -> None:
        if self.clock() + seconds > self.until.get(workspace, 0.0):
            self.until[workspace] = self.clock() + seconds
            self.why[workspace] = why


def workspace_of(job: FineTuneJob) -> Workspace:
    aml = job.spec.azureml
    assert aml is not None  # validation requires it for this backend
    return Workspace(aml.subscription_id, aml.resource_group, aml.workspace)


_DATASTORE_FOLDER = re.compile(
    r"azureml://(?:subscriptions/(?P<subscription>[^/]+)/resourcegroups/(?P<group>[^/]+)/"
    r"workspaces/(?P<workspace>[^/]+)/)?datastores/(?P<store>[^/]+)/paths/(?P<path>\S+)",
    re.IGNORECASE)


def output_folder(job: FineTuneJob) -> str | None:
    """The workspace, datastore and path the output is written to (the workspace the URI
    names, else the job's `spec.azureml` one). Azure's names are not case-sensitive; the
    path in the store is."""
    found = _DATASTORE_FOLDER.fullmatch(job.spec.output.uri)
    if found is None:
        return None
    azure = job.spec.azureml
    where = (found["subscription"], found["group"], found["workspace"]) if found[
        "subscription"] else (azure.subscription_id, azure.resource_group, azure.workspace
                              ) if azure else None
    if where is None:
        return None
    return folder_key("azureml", *(part.lower() for part in (*where, found["store"])),
                      found["path"])


class AzureMLBackend:
    """Jobs as Azure ML command jobs (compute clusters, or attached AKS compute)."""

    name = "azureml"
    cleanup_on_delete = True
    """A deleted FineTuneJob's Azure ML job is canceled before the FineTuneJob goes."""

    def __init__(self, context: BackendContext, retry: RetrySettings | None = None):
        self.settings = context.settings
        self._credential = context.azure_credential
        self._transport = context.azure_transport
        self.retry = retry or RetrySettings()
        self.gate = ThrottleGate()
        self._clients: dict[Workspace, AzureMLClient] = {}
        self._refused: dict[str, tuple[int, str]] = {}
        """FineTuneJob uid → the attempt Azure ML last refused to run, and why."""
        self._registrations: dict[str, list[dict[str, str]]] = {}
        """FineTuneJob uid → how its `azureml://models/` registrations went."""

    # --- offline ---

    def mount(self, location: Location) -> str:
        return jobspec.mount(location)

    def validate(self, job: FineTuneJob) -> list[Problem]:
        return jobspec.validate(job, self.settings)

    def output_folder(self, job: FineTuneJob) -> str | None:
        return output_folder(job)

    def render(self, job: FineTuneJob) -> list[dict[str, Any]]:
        return [jobspec.render(job, self.settings)]

    # --- lifecycle ---

    async def observe(self, job: FineTuneJob) -> Observation:
        try:
            current = await self._call(job, self._newest_attempt, job)
        except BackendError as error:
            return Observation(unreachable=str(error))
        refused = self._refused.get(job.metadata.uid or job.name)
        if refused is not None and (current is None or (current.ended and refused[0] > (
                jobspec.attempt_of(job, current.name) or 1))):
            # the attempt after the newest one there is was refused: that is the news, not
            # the failure that led to it (counted as a failed attempt: the budget ends it)
            return Observation(exists=True, failure=Failure(
                "worker", f"Azure ML refused the job: {refused[1]}"))
        if current is None:
            return states.observe(job, None)
        data, unread = {}, None
        if current.status in states.READ_RUN:
            try:
                data = await self._call(job, self._client(job).run_data, current, quiet=True)
            except RunUnreadable as error:
                unread = str(error)
            else:
                if data is None:  # the workspace is closed to calls for now: the gate says why
                    unread = self.gate.why.get(workspace_of(job), "no answer")
        data = data or {}
        progress = states.progress_from_metrics(data.get("metrics") or [])
        seen = states.observe(job, current, progress, states.tags_of(data), unread)
        if seen.succeeded and jobspec.workspace_models(job) and not (
                job.status and condition(job.status, ConditionType.EXPORTED)):
            seen = replace(seen, progress=(seen.progress or Progress()).model_copy(
                update={"exports": await self._registered(job)}))
        return seen

    async def _registered(self, job: FineTuneJob) -> list[dict[str, str]]:
        """The job's `azureml://models/` targets registered, once (the outcomes kept until
        the status says `Exported`): each `{uri, pushed}` or `{uri, error}`."""
        key = job.metadata.uid or job.name
        if key not in self._registrations:
            try:
                outcomes = await self._call(job, self._register, job)
            except BackendError as error:
                outcomes = [{"uri": m.uri, "error": f"{error}; {m.by_hand()}"}
                            for m in jobspec.workspace_models(job)]
            self._registrations[key] = outcomes or []
        return self._registrations[key]

    async def launch(self, job: FineTuneJob) -> None:
        await self._submit_next(job)

    async def resume(self, job: FineTuneJob) -> None:
        await self._submit_next(job)

    async def suspend(self, job: FineTuneJob) -> None:
        """Azure ML jobs cannot pause: the attempt is cancelled (workers get SIGTERM and
        checkpoint if they can) and resume submits the next one."""
        await self._cancel_newest(job)

    async def restart(self, job: FineTuneJob) -> None:
        self._refused.pop(job.metadata.uid or job.name, None)
        await self._cancel_newest(job)

    def forget(self, namespace: str, name: str) -> None:
        """Nothing to drop: `cancel` has already forgotten the job."""

    async def cancel(self, job: FineTuneJob) -> None:
        """The FineTuneJob is being deleted: cancel what runs; outputs stay in the datastore.
        A job never launched is let go even when Azure cannot be asked (no identity yet)."""
        self._refused.pop(job.metadata.uid or job.name, None)
        self._registrations.pop(job.metadata.uid or job.name, None)
        try:
            await self._cancel_newest(job)
        except BackendError:
            status = job.status
            if status is not None and (status.launched_spec or status.backend_ref):
                raise  # something may run in Azure: keep the finalizer until it is stopped
            logger.warning("%s/%s was never submitted to Azure ML; deleting without asking it",
                           job.namespace, job.name)

    # --- the steps, run in a worker thread ---

    def _newest_attempt(self, job: FineTuneJob) -> AzureJob | None:
        """The attempt the status points at, or a later one submitted since (a resume or
        restart whose result was not recorded yet)."""
        client = self._client(job)
        attempt = states.current_attempt(job)
        found = client.get(jobspec.attempt_name(job, attempt))
        while found is not None and found.ended and found.status != "Completed":
            successor = client.get(jobspec.attempt_name(job, attempt + 1))
            if successor is None:
                break
            found, attempt = successor, attempt + 1
        return found

    def _submit(self, job: FineTuneJob) -> None:
        current = self._newest_attempt(job)
        if current is not None and not current.ended:
            logger.info("found Azure ML job %s (%s)", current.name, current.status)
            return  # submitted before: nothing to do
        attempt = states.current_attempt(job)
        if current is not None:
            attempt = jobspec.attempt_of(job, current.name) or attempt
            attempt += 1
        command_job = jobspec.build_command_job(job, self.settings, attempt)
        try:
            created = self._client(job).create(command_job)
        except Refused as error:
            self._refused[job.metadata.uid or job.name] = (attempt, str(error))
            logger.warning("Azure ML refused %s: %s", command_job.name, error)
            return
        self._refused.pop(job.metadata.uid or job.name, None)
        logger.info("submitted Azure ML job %s (%s)", created.name, created.status)

    def _register(self, job: FineTuneJob) -> list[dict[str, str]]:
        description, tags = jobspec.model_description(job)
        outcomes = []
        for model in jobspec.workspace_models(job):
            try:
                version = self._client(job).register_model(model.name, model.path,
                                                           description, tags)
            except (Refused, BackendError) as error:
                outcomes.append({"uri": model.uri, "error": f"Azure ML refused the "
                                 f"registration: {error}; {model.by_hand()}"})
                continue
            logger.info("registered %s:%s from %s", model.name, version, model.path)
            outcomes.append({"uri": model.uri,
                             "pushed": f"azureml://models/{model.name}/versions/{version}"})
        return outcomes

    def _cancel(self, job: FineTuneJob) -> None:
        current = self._newest_attempt(job)
        if current is not None and not current.ended and current.status not in states.CANCELING:
            self._client(job).cancel(current.name)
            logger.info("cancelling Azure ML job %s", current.name)

    async def _submit_next(self, job: FineTuneJob) -> None:
        await self._call(job, self._submit, job)

    async def _cancel_newest(self, job: FineTuneJob) -> None:
        await self._call(job, self._cancel, job)

    # --- plumbing ---

    def _client(self, job: FineTuneJob) -> AzureMLClient:
        workspace = workspace_of(job)
        if workspace not in self._clients:
            self._clients[workspace] = AzureMLClient(workspace, self._credential_or_default(),
                                                     self._transport, self.retry)
        return self._clients[workspace]

    def _credential_or_default(self) -> Any:
        if self._credential is None:
            # azure-ai-ml: the optional `azure` extra
            from azure.identity import DefaultAzureCredential

            self._credential = DefaultAzureCredential()
        return self._credential

    async def _call(self, job: FineTuneJob, step: Callable[..., T], *args: Any,
                    quiet: bool = False) -> T | None:
        """Run one blocking step in a thread, unless Azure asked for quiet; `quiet` steps
        (progress) give None instead of an error."""
        workspace = workspace_of(job)
        wait = self.gate.wait_left(workspace)
        if wait > 0:
            if quiet:
                return None
            raise BackendError(self.gate.why[workspace], retry_after=wait)
        try:
            return await asyncio.to_thread(step, *args)
        except Throttled as error:
            self.gate.close_for(workspace, error.retry_after, f"Azure ML is throttling calls "
                                f"to workspace {workspace}; the operator waits as asked")
            if quiet:
                return None
            raise
        except NotAnswering as error:
            self.gate.close_for(workspace, error.retry_after, str(error))
            raise
        except Refused as error:  # a read refused: say so, and ask again later
            raise BackendError(f"Azure ML refused a call: {error}", retry_after=60) from error
        except jobspec.AzureSdkMissing as error:
            raise BackendError(str(error), retry_after=600) from error
