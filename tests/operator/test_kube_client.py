"""The operator's own API client (`finetune_operator.kube.Kube`) against a small HTTP server
that answers as an API server does: a token rotated while the operator runs, refusals with
their Status, Retry-After, a server that never answers."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import aiohttp.web
import pytest
import pytest_asyncio

from finetune_operator.kube import Kube, KubeError
from tests.support import waits
from tests.support.cluster_fixtures import controlplane

pytestmark = pytest.mark.asyncio


class Server:
    """Serves FineTuneJobs to the token it currently accepts; records what it was asked."""

    def __init__(self) -> None:
        self.token = "first"
        self.seen: list[tuple[str, str, str]] = []  # (method, path, Authorization)
        self.answers: dict[str, aiohttp.web.Response] = {}
        self.streams: dict[str, list[bytes]] = {}
        """path, or path?container=name → chunks written a while apart."""
        self.streamed: list[str] = []  # path?container=name of each stream served whole
        self.hang = False

    async def handle(self, request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        self.seen.append((request.method, request.path, request.headers.get("Authorization")))
        if self.hang:
            await asyncio.sleep(2)
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return status(401, "Unauthorized", "Unauthorized")
        if request.path in self.answers:
            answer = self.answers[request.path]
            return answer() if callable(answer) else answer
        container = f"{request.path}?container={request.query.get('container')}"
        if (stream := self.streams.get(container, self.streams.get(request.path))) is not None:
            streamed = aiohttp.web.StreamResponse(headers={"Content-Type": "text/plain"})
            await streamed.prepare(request)
            for chunk in stream:
                await streamed.write(chunk)
                await asyncio.sleep(0.1)
            await streamed.write_eof()
            self.streamed.append(container)
            return streamed
        return aiohttp.web.json_response({"kind": "FineTuneJobList", "items": []})


def status(code: int, reason: str, message: str, headers: dict | None = None,
           **extra) -> aiohttp.web.Response:
    body = {"apiVersion": "v1", "kind": "Status", "status": "Failure", "code": code,
            "reason": reason, "message": message, **extra}
    return aiohttp.web.Response(status=code, text=json.dumps(body),
                                content_type="application/json", headers=headers)


@pytest_asyncio.fixture()
async def server():
    served = Server()
    app = aiohttp.web.Application()
    app.router.add_route("*", "/{tail:.*}", served.handle)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    served.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    yield served
    await runner.cleanup()


def write_kubeconfig(path: Path, server: Server) -> None:
    path.write_text(json.dumps(controlplane.kubeconfig(server.url, "operator", server.token)))


async def test_a_token_rotated_while_running_is_read_again_after_a_401(server, tmp_path):
    kubeconfig = tmp_path / "kubeconfig"
    write_kubeconfig(kubeconfig, server)
    kube = Kube(str(kubeconfig))
    try:
        assert await kube.list("FineTuneJob", "default") == []
        server.token = "second"  # rotated: the old one is refused, the file holds the new one
        write_kubeconfig(kubeconfig, server)
        assert await kube.list("FineTuneJob", "default") == []
        assert [auth for _m, _p, auth in server.seen] == [
            "Bearer first", "Bearer first", "Bearer second"]
    finally:
        await kube.close()


async def test_refusals_carry_the_servers_words_and_what_it_asks(server, tmp_path):
    kubeconfig = tmp_path / "kubeconfig"
    write_kubeconfig(kubeconfig, server)
    jobs = "/apis/batch/v1/namespaces/gone/jobs"
    server.answers[jobs] = status(
        403, "Forbidden", 'jobs.batch "x" is forbidden: unable to create new content in '
        "namespace gone because it is being terminated",
        details={"causes": [{"reason": "NamespaceTerminating"}]})
    server.answers["/apis/batch/v1/namespaces/busy/jobs"] = status(
        429, "TooManyRequests", "too many requests", headers={"Retry-After": "3"})
    kube = Kube(str(kubeconfig))
    try:
        job = {"kind": "Job", "metadata": {"name": "x", "namespace": "gone"}}
        with pytest.raises(KubeError) as refused:
            await kube.create(job)
        assert refused.value.status == 403 and refused.value.namespace_terminating
        assert "being terminated" in refused.value.message
        with pytest.raises(KubeError) as throttled:
            await kube.create({**job, "metadata": {"name": "x", "namespace": "busy"}})
        assert throttled.value.status == 429 and throttled.value.retry_after == 3
        assert str(throttled.value).startswith("create Job x: 429")
    finally:
        await kube.close()


async def test_a_server_that_never_answers_is_a_kube_error_within_the_timeout(server, tmp_path):
    kubeconfig = tmp_path / "kubeconfig"
    write_kubeconfig(kubeconfig, server)
    server.hang = True
    kube = Kube(str(kubeconfig), timeout=0.3)
    try:
        with pytest.raises(KubeError) as failed:
            await asyncio.wait_for(kube.get("Job", "default", "x"), waits.seconds_left())
        assert failed.value.status is None
        assert "no answer from the API server" in str(failed.value)
    finally:
        await kube.close()


async def finetune_logs(kubeconfig: Path, *args: str) -> tuple[int, str, str]:
    """The real `finetune logs demo -n team ...` command: its exit code, stdout, stderr."""
    logs = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "finetune_operator.cli", "logs", "demo", "-n", "team", *args,
        "--kubeconfig", str(kubeconfig),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(logs.communicate(), waits.seconds_left())
    return logs.returncode, out.decode(), err.decode()


@pytest.mark.process
async def test_finetune_logs_streams_the_current_pod_of_a_node_rank(server, tmp_path):
    """The real `finetune logs -f` against a server answering as the API server does: the
    FineTuneJob, its pods (rank 1's restarted: the newer pod is read), the log followed."""
    kubeconfig = tmp_path / "kubeconfig"
    write_kubeconfig(kubeconfig, server)
    index = "batch.kubernetes.io/job-completion-index"

    def pod(name: str, rank: int, created: str) -> dict:
        return {"metadata": {"name": name, "creationTimestamp": created,
                             "annotations": {index: str(rank)}},
                "status": {"phase": "Running", "containerStatuses": [
                    {"name": "trainer", "state": {"running": {}}}]}}

    server.answers["/apis/finetune.dev/v1alpha1/namespaces/team/finetunejobs/demo"] = (
        aiohttp.web.json_response({"metadata": {"name": "demo"},
                                   "spec": {"backend": "kubernetes"}}))
    server.answers["/api/v1/namespaces/team/pods"] = aiohttp.web.json_response({"items": [
        pod("demo-0-a", 0, "2026-11-23T10:00:00Z"), pod("demo-1-a", 1, "2026-11-23T10:00:00Z"),
        pod("demo-1-b", 1, "2026-11-23T10:05:00Z")]})
    server.streams["/api/v1/namespaces/team/pods/demo-1-b/log"] = [
        b"step 1/4 | loss 2.0\n", b"step 2/4 | lo", b"ss 1.5\n"]
    code, out, err = await finetune_logs(kubeconfig, "--rank", "1", "-f")
    assert code == 0, err
    assert out == "step 1/4 | loss 2.0\nstep 2/4 | loss 1.5\n"
    asked = [(m, p) for m, p, _ in server.seen if p.endswith("/log")]
    assert asked == [("GET", "/api/v1/namespaces/team/pods/demo-1-b/log")]


@pytest.mark.process
async def test_finetune_logs_follows_the_models_download_into_the_trainers_log(server, tmp_path):
    """Before the trainer starts, fetch-model downloads the model (minutes for a large one):
    `finetune logs -f` shows that init container's log, then waits for the trainer and
    follows its log, as a user watching a first start wants."""
    kubeconfig = tmp_path / "kubeconfig"
    write_kubeconfig(kubeconfig, server)
    done = {"terminated": {"exitCode": 0}}
    looks = []

    def pods() -> aiohttp.web.Response:
        looks.append(len(server.streamed))
        fetched = any(s.endswith("container=fetch-model") for s in server.streamed)
        trainer = ({"running": {}} if fetched and looks.count(len(server.streamed)) > 1
                   else {"waiting": {"reason": "PodInitializing"}})
        return aiohttp.web.json_response({"items": [{
            "metadata": {"name": "demo-0-a", "creationTimestamp": "2026-11-23T10:00:00Z",
                         "annotations": {"batch.kubernetes.io/job-completion-index": "0"}},
            "status": {"phase": "Pending", "initContainerStatuses": [
                {"name": "resume-check", "state": done},
                {"name": "fetch-model", "state": done if fetched else {"running": {}}}],
                "containerStatuses": [{"name": "trainer", "state": trainer}]}}]})

    server.answers["/apis/finetune.dev/v1alpha1/namespaces/team/finetunejobs/demo"] = (
        lambda: aiohttp.web.json_response({"metadata": {"name": "demo"},
                                           "spec": {"backend": "kubernetes"}}))
    server.answers["/api/v1/namespaces/team/pods"] = pods
    log = "/api/v1/namespaces/team/pods/demo-0-a/log"
    server.streams[f"{log}?container=fetch-model"] = [b"fetching org/model: 2 files\n",
                                                      b"fetched in 3 s\n"]
    server.streams[f"{log}?container=trainer"] = [b"step 1/4 | loss 2.0\n"]
    code, out, err = await finetune_logs(kubeconfig, "-f")
    assert code == 0, err
    assert out == "fetching org/model: 2 files\nfetched in 3 s\nstep 1/4 | loss 2.0\n"
    assert "runs its init container fetch-model, before the trainer" in err
    assert server.streamed == [f"{log}?container=fetch-model", f"{log}?container=trainer"]
    assert looks == [0, 1, 1]  # once more while the trainer was on its way


def one_pod_before_its_trainer(server, phase: str, resume_check: dict) -> None:
    """The job demo in namespace team, with one pod whose trainer waits behind its
    resume-check init container in the state `resume_check`."""
    server.answers["/apis/finetune.dev/v1alpha1/namespaces/team/finetunejobs/demo"] = (
        aiohttp.web.json_response({"metadata": {"name": "demo"},
                                   "spec": {"backend": "kubernetes"}}))
    server.answers["/api/v1/namespaces/team/pods"] = aiohttp.web.json_response({"items": [{
        "metadata": {"name": "demo-0-a", "creationTimestamp": "2026-11-23T10:00:00Z",
                     "annotations": {"batch.kubernetes.io/job-completion-index": "0"}},
        "status": {"phase": phase, "initContainerStatuses": [
            {"name": "resume-check", "state": resume_check}],
            "containerStatuses": [{"name": "trainer", "state": {
                "waiting": {"reason": "PodInitializing"}}}]}}]})


@pytest.mark.process
async def test_finetune_logs_of_a_pod_that_failed_in_its_resume_check_shows_why(
        server, tmp_path):
    """The trainer never started: the log that says why is resume-check's (the refusal to
    resume other settings' checkpoints), not an error about the trainer's missing log."""
    kubeconfig = tmp_path / "kubeconfig"
    write_kubeconfig(kubeconfig, server)
    one_pod_before_its_trainer(server, "Failed", {"terminated": {"exitCode": 4}})
    log = "/api/v1/namespaces/team/pods/demo-0-a/log"
    server.streams[f"{log}?container=resume-check"] = [b"method.lora.r: 8 -> 16\n"]
    code, out, err = await finetune_logs(kubeconfig)
    assert code == 0, err
    assert out == "method.lora.r: 8 -> 16\n"
    assert "failed in its init container resume-check, before the trainer" in err
    assert server.streamed == [f"{log}?container=resume-check"]


@pytest.mark.process
async def test_finetune_logs_of_a_pod_that_cannot_start_names_the_command_that_says_why(
        server, tmp_path):
    """An init container that cannot start (an image, a Secret): no log to show; the hint
    is a command the user can paste (its namespace included: `-n team`, not the default)."""
    kubeconfig = tmp_path / "kubeconfig"
    write_kubeconfig(kubeconfig, server)
    one_pod_before_its_trainer(server, "Pending", {"waiting": {
        "reason": "CreateContainerConfigError", "message": 'secret "hf-tokn" not found'}})
    code, out, err = await finetune_logs(kubeconfig)
    assert code == 1 and out == ""
    assert err.strip() == (
        "finetune logs: pod demo-0-a has not started its trainer yet (init container "
        'resume-check waiting: CreateContainerConfigError (secret "hf-tokn" not found)) — '
        "`finetune status demo -n team` says what it waits for")
    assert not server.streamed


async def test_a_status_merge_patch_removes_what_is_gone_at_any_depth():
    """Written as the new value, an emptied launchedSpec ({}) changed nothing under RFC
    7386, and a key gone from a nested object stayed behind."""
    from finetune_operator.kube import merge_patch

    old = {"phase": "Launching", "launchedSpec": {"model": "ab12"},
           "specAtLaunch": {"kubernetes": {"image": "trainer:typo", "queueName": "q"}},
           "message": "waiting"}
    new = {"phase": "Restarting", "launchedSpec": {},
           "specAtLaunch": {"kubernetes": {"queueName": "q"}}}
    assert merge_patch(old, new) == {"phase": "Restarting", "launchedSpec": None,
                                     "specAtLaunch": {"kubernetes": {"image": None}},
                                     "message": None}
    assert merge_patch(old, old) == {}
