"""The operator at scale, on a real control plane: N FineTuneJobs applied by one `kubectl apply`,
handled by our operator and, beside it on the same cluster, by a do-nothing kopf operator
that only sets `status.phase` (benchmarks/floor_operator.py): the floor; and by a kopf
operator that only creates each job's three children, as ours renders them, and sets the
phase (benchmarks/floor_children_operator.py): the launcher, what any operator that launches
these jobs costs the cluster. Ours runs twice: as installed (launches paced: 20 at once,
then 10 a second, every job acknowledged at once) and with `--launch-rate 0` (every job
launched as soon as it is seen, as the launcher does). All log in as the chart's
ServiceAccount, one after the other, each on a control plane of its own, started afresh: a
burst that follows another on the same cluster pays for its predecessor's leftovers (the
garbage collector, KWOK and etcd still busy with thousands of deleted objects), which made
the third operator measured the slowest whichever it was.

    .venv/bin/python benchmarks/operator_load.py [--jobs 100,1000] [--steady 30]

Prints, for each burst size and as ratios (ours / floor, ours / launcher, for ours both
ways): seconds from
the apply until every job has a phase and (launcher and ours) until every job's workers
(its batch/v1 Job) exist, the operator's peak RSS and CPU seconds, its API
requests (from the API server's audit log) per job during the burst, by verb and resource,
and, once every job waits (the steady state: every job's pod created and looked at by the
scheduler), its API requests per second, by kind, and CPU (% of one core). Writes
benchmarks/operator_load.json. Needs Go (the control plane is built from cluster/).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
sys.path.insert(0, str(REPO / "cluster"))  # cluster/controlplane.py: what `make cluster` runs
import controlplane  # noqa: E402
from controlplane import free_port  # noqa: E402

from finetune_operator import naming  # noqa: E402


def manifests(namespace: str, count: int) -> dict:
    items = []
    for i in range(count):
        items.append({
            "apiVersion": "finetune.dev/v1alpha1", "kind": "FineTuneJob",
            "metadata": {"name": f"load-{i:04d}", "namespace": namespace},
            "spec": {"model": {"uri": "hf://Qwen/Qwen2.5-0.5B"},
                     "dataset": {"uri": "pvc://data/train.jsonl"},
                     "hyperparameters": {"maxSteps": 100},
                     "resources": {"nodes": 1, "gpusPerNode": 1},
                     "output": {"uri": f"pvc://ckpt/load-{i:04d}"}}})
    return {"apiVersion": "v1", "kind": "List", "items": items}


def proc_figures(pid: int) -> tuple[float, float]:
    """(peak RSS in MiB, CPU seconds) of a process, from /proc."""
    status = Path(f"/proc/{pid}/status").read_text()
    peak_kib = next(int(line.split()[1]) for line in status.splitlines()
                    if line.startswith("VmHWM:"))
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return peak_kib / 1024, (int(fields[11]) + int(fields[12])) / ticks


def audited(plane, user: str, since: float, until: float) -> list[dict]:
    """The audit events of `user` completed in [since, until) (epoch seconds)."""
    from datetime import datetime

    out = []
    for line in (plane.folder / "logs" / "audit.jsonl").read_text().splitlines():
        event = json.loads(line)
        if event.get("stage") != "ResponseComplete" or \
                event.get("user", {}).get("username") != user:
            continue
        when = datetime.fromisoformat(event["stageTimestamp"].replace("Z", "+00:00"))
        if since <= when.timestamp() < until:
            out.append(event)
    return out


TEARDOWN_SECONDS = 10.0
"""How long our operator watches its jobs' namespace being deleted before it is stopped."""


def by_kind(events: list[dict], jobs: int) -> dict[str, float]:
    """Requests per job by verb and resource (e.g. "patch finetunejobs/status"), most first."""
    counts: dict[str, int] = {}
    for event in events:
        ref = event.get("objectRef", {})
        what = "/".join(filter(None, (ref.get("resource"), ref.get("subresource"))))
        key = f"{event.get('verb')} {what}"
        counts[key] = counts.get(key, 0) + 1
    return {k: round(v / jobs, 2) for k, v in sorted(counts.items(), key=lambda kv: -kv[1])}


def launch_requests(events: list[dict], jobs: int) -> float | None:
    """API requests per job up to its launch: its status patches until the first one after
    its batch/v1 Job's create (the launch's own; later ones report how its pods fare), the
    creates of its children, kopf's own patches of it, and the events posted (an event is
    created by generateName, so the audit log names no job: counted as an average). None for
    an operator that launches nothing."""
    by_name: dict[str, list[dict]] = {}
    for event in events:
        by_name.setdefault(event.get("objectRef", {}).get("name") or "", []).append(event)
    per_job = []
    for name, about in by_name.items():
        mine = sorted(about + by_name.get(naming.trainer_config_map(name), []),
                      key=lambda e: e["stageTimestamp"])
        created = [e["stageTimestamp"] for e in mine if e.get("verb") == "create"
                   and e["objectRef"].get("resource") == "jobs"]
        if not created:
            continue
        status = [e["stageTimestamp"] for e in mine if e.get("verb") == "patch"
                  and e["objectRef"].get("subresource") == "status"]
        launch_patch = min((t for t in status if t >= created[0]), default=None)
        per_job.append(sum(1 for e in mine if e.get("verb") == "create"
                           or (e.get("verb") == "patch"
                               and not e["objectRef"].get("subresource")))
                       + sum(1 for t in status if launch_patch is None or t <= launch_patch))
    if not per_job:
        return None
    posted = sum(1 for e in events if e.get("objectRef", {}).get("resource") == "events")
    return round(sum(per_job) / len(per_job) + posted / jobs, 2)


def wait_healthy(process: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + 90
    while True:
        if process.poll() is not None:
            raise SystemExit(f"the operator exited:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1):
                return
        if time.monotonic() > deadline:
            raise SystemExit(f"the operator did not get ready:\n{log.read_text()[-3000:]}")
        time.sleep(0.3)


def phased(plane, namespace: str) -> int:
    listed = plane.kubectl_run("get", "finetunejobs", "-n", namespace, "-o",
                               "jsonpath={range .items[*]}{.status.phase}{'\\n'}{end}")
    return sum(1 for line in listed.stdout.splitlines() if line.strip())


def launched(plane, namespace: str) -> int:
    """How many batch/v1 Jobs the namespace holds, read cheaply (one item and the count of
    the rest)."""
    answer = json.loads(plane.kubectl_run(
        "get", "--raw", f"/apis/batch/v1/namespaces/{namespace}/jobs?limit=1").stdout)
    return len(answer.get("items") or []) + int(
        (answer.get("metadata") or {}).get("remainingItemCount") or 0)


def pods_looked_at(plane, namespace: str) -> int:
    """Pods the scheduler has looked at (a PodScheduled condition: scheduled, or pending
    with its reason): until every job's pod is there, the cluster is still launching."""
    listed = plane.kubectl_run(
        "get", "pods", "-n", namespace, "-o", "jsonpath={range .items[*]}"
        "{.status.conditions[?(@.type=='PodScheduled')].status}{'\\n'}{end}")
    return sum(1 for line in listed.stdout.splitlines() if line.strip())


def settle(plane, namespace: str, jobs: int, started: float) -> None:
    """Wait until every job's pod exists and was looked at by the scheduler (the Job
    controller creates them at its own pace, well after the Jobs), and the status patches
    that follow have landed: what comes after is the steady state of N waiting jobs."""
    while pods_looked_at(plane, namespace) < jobs:
        if time.time() - started > 1800:
            raise SystemExit("not every pod was created and scheduled after 30 minutes")
        time.sleep(2)
    time.sleep(5)


def run_one(name: str, command: Callable[[int], list[str]], jobs: int, steady: float,
            folder: Path) -> dict:
    """One operator (`command`, given its health port) through one burst of `jobs`, on a
    control plane of its own."""
    plane = controlplane.ControlPlane(folder / f"plane-{name}")
    plane.start()
    try:
        installed = plane.install()
        return _measure(plane, installed, name, command, jobs, steady, folder)
    finally:
        plane.stop()


def _measure(plane, installed, name: str, command: Callable[[int], list[str]], jobs: int,
             steady: float, folder: Path) -> dict:
    namespace = f"load-{name}"
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG")}
    env.update(installed.operator_env, KUBECONFIG=str(installed.operator_kubeconfig),
               HF_HUB_OFFLINE="1")
    plane.kubectl_run("create", "namespace", namespace)
    health = free_port()
    log = folder / f"{name}.log"
    with log.open("w") as out:
        process = subprocess.Popen(command(health), env=env, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    user = f"system:serviceaccount:finetune-system:{installed.service_account}"
    try:
        wait_healthy(process, health, log)
        time.sleep(2)
        _, cpu_before = proc_figures(process.pid)
        started = time.time()
        plane.kubectl_run("apply", "--server-side", "-f", "-",
                          input=json.dumps(manifests(namespace, jobs)))
        applied = time.time() - started
        while (done := phased(plane, namespace)) < jobs:
            if process.poll() is not None:
                raise SystemExit(f"{name} exited:\n{log.read_text()[-3000:]}")
            if time.time() - started > 1800:
                raise SystemExit(f"{name}: only {done}/{jobs} have a phase after 30 minutes")
            time.sleep(1)
        seconds = time.time() - started
        workers_seconds = None
        if not name.startswith("floor"):
            while launched(plane, namespace) < jobs:
                if time.time() - started > 1800:
                    raise SystemExit(f"{name}: not every job launched after 30 minutes")
                time.sleep(1)
            workers_seconds = time.time() - started
        peak, cpu = proc_figures(process.pid)
        burst = audited(plane, user, started, time.time())
        if name.startswith("floor"):
            time.sleep(2)  # the last status patches land
        else:
            settle(plane, namespace, jobs, started)
        _, cpu_quiet = proc_figures(process.pid)
        quiet_from = time.time()
        time.sleep(steady)
        quiet_until = time.time()
        _, cpu_after = proc_figures(process.pid)
        idle = audited(plane, user, quiet_from, quiet_until)
        creates = [e for e in burst if e.get("verb") == "create"
                   and e.get("objectRef", {}).get("resource") in ("jobs", "services",
                                                                  "configmaps")]
        figures = {"seconds_to_all_phased": round(seconds, 1),
                "seconds_to_all_launched": round(workers_seconds, 1)
                if workers_seconds is not None else None,
                "apply_seconds": round(applied, 1),
                "peak_rss_mib": round(peak, 1),
                "cpu_seconds_burst": round(cpu - cpu_before, 1),
                "cpu_seconds_until_settled": None if name.startswith("floor")
                else round(cpu_quiet - cpu_before, 1),
                "api_requests_per_job": round(len(burst) / jobs, 1),
                "api_requests_to_launch_a_job": launch_requests(burst, jobs),
                "child_creates_refused_409": sum(1 for e in creates if e.get(
                    "responseStatus", {}).get("code") == 409),
                "api_requests_by_kind": by_kind(burst, jobs),
                "steady_api_requests_per_s": round(len(idle) / steady, 1),
                "steady_api_requests_per_s_by_kind": by_kind(idle, steady),
                "steady_cpu_percent": round(100 * (cpu_after - cpu_quiet)
                                            / (quiet_until - quiet_from), 1)}
    finally:
        # ours sees its jobs' namespace go for a while (a reconcile must not relaunch anything
        # into it: counted below); the floors' planes are simply stopped. Not waited for: a
        # fresh control plane's namespace controller takes minutes to empty it
        if not name.startswith(("floor", "launcher")):
            plane.kubectl_run("delete", "namespace", namespace, "--wait=false", check=False)
            time.sleep(TEARDOWN_SECONDS)
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
    # the whole run, teardown included: a job's reconcile that failed (a deleted job's worker
    # must not relaunch anything into its terminating namespace). kopf's own retries of
    # events it cannot post there are not counted.
    errors = [line for line in log.read_text().splitlines()
              if " ERROR kopf.objects" in line or " ERROR finetune_operator" in line]
    figures["errors_logged"] = len(errors)
    for line in errors[:3]:
        print(f"{name} logged: {line[:300]}")
    return figures


KEYS = (("seconds_to_all_phased", "seconds until every job has a phase"),
        ("seconds_to_all_launched", "seconds until every job's workers exist"),
        ("peak_rss_mib", "operator peak RSS (MiB)"),
        ("cpu_seconds_burst", "operator CPU s until all launched"),
        ("cpu_seconds_until_settled", "... until every pod was scheduled"),
        ("api_requests_per_job", "API requests per job"),
        ("api_requests_to_launch_a_job", "API requests to launch a job"),
        ("steady_api_requests_per_s", "steady API requests/s"),
        ("steady_cpu_percent", "steady operator CPU (% of a core)"))


def ratios(of: dict, to: dict) -> dict[str, float | None]:
    return {k: round(of[k] / to[k], 2) if of[k] is not None and to[k] else None
            for k, _ in KEYS}


def report(jobs: int, floor: dict, launcher: dict, ours: dict, unpaced: dict) -> dict:
    def figure(value: float | None, width: int) -> str:
        return f"{'-' if value is None else value:>{width}}"

    def cell(ratio: float | None, width: int) -> str:
        return f"{(f'{ratio:.2f}x' if ratio is not None else '-'):>{width}}"

    sides = (floor, launcher, ours, unpaced)
    print(f"\n{jobs} FineTuneJobs applied at once (kubectl apply took "
          + " / ".join(f"{side['apply_seconds']} s" for side in sides)
          + "); ours: launches paced (the default), and with --launch-rate 0")
    print(f"{'':36}{'floor':>9}{'launcher':>10}{'ours':>9}{'unpaced':>9}{'ours/floor':>12}"
          f"{'ours/launcher':>15}{'unpaced/floor':>15}{'unpaced/launcher':>18}")
    columns = [ratios(ours, floor), ratios(ours, launcher), ratios(unpaced, floor),
               ratios(unpaced, launcher)]
    for key, label in KEYS:
        print(f"{label:36}" + "".join(figure(side[key], w) for side, w in
                                      zip(sides, (9, 10, 9, 9), strict=True))
              + "".join(cell(column[key], w) for column, w in
                        zip(columns, (12, 15, 15, 18), strict=True)))
    for label, side in (("ours", ours), ("unpaced", unpaced)):
        print(f"{label}: child creates refused with 409 (a second launch): "
              f"{side['child_creates_refused_409']}; failed reconciles logged, teardown "
              f"included: {side['errors_logged']}; API requests per job: " + ", ".join(
                  f"{k} {v:g}" for k, v in side["api_requests_by_kind"].items()))
    print("our API requests/s with every job waiting: " + (", ".join(
        f"{k} {v:g}" for k, v in ours["steady_api_requests_per_s_by_kind"].items()) or "none"))
    return {"jobs": jobs, "floor": floor, "launcher": launcher, "ours": ours,
            "ours_unpaced": unpaced, "ratios": columns[0], "ratios_to_launcher": columns[1],
            "unpaced_ratios": columns[2], "unpaced_ratios_to_launcher": columns[3]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", default="100,1000",
                        help="burst sizes, comma-separated; each runs the floor, the launcher, "
                        "then ours paced and unpaced")
    parser.add_argument("--steady", type=float, default=30.0,
                        help="seconds of the idle queue measured after the burst")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "operator_load.json")
    args = parser.parse_args(argv)
    sizes = [int(n) for n in args.jobs.split(",") if n.strip()]
    controlplane.build()
    results = []
    metrics = free_port()

    def kopf_run(script: str) -> Callable[[int], list[str]]:
        return lambda port: [
            str(BIN / "python"), "-m", "kopf", "run", "--standalone", "--all-namespaces",
            "--quiet", "--liveness", f"http://127.0.0.1:{port}/healthz",
            str(REPO / "benchmarks" / script)]

    with tempfile.TemporaryDirectory(prefix="operator-load-") as tmp:
        folder = Path(tmp)
        for jobs in sizes:
            floor = run_one(f"floor-{jobs}", kopf_run("floor_operator.py"), jobs,
                            args.steady, folder)
            launcher = run_one(f"launcher-{jobs}", kopf_run("floor_children_operator.py"),
                               jobs, args.steady, folder)
            def finetune_operator(*extra: str) -> Callable[[int], list[str]]:
                return lambda port: [
                    str(BIN / "finetune"), "operator", "--log-level", "warning",
                    "--metrics-port", str(metrics), "--health-port", str(port), *extra]

            ours = run_one(f"ours-{jobs}", finetune_operator(), jobs, args.steady, folder)
            unpaced = run_one(f"unpaced-{jobs}", finetune_operator("--launch-rate", "0"), jobs,
                              args.steady, folder)
            results.append(report(jobs, floor, launcher, ours, unpaced))
    args.out.write_text(json.dumps({"runs": results}, indent=2) + "\n")
    print(f"wrote {os.path.relpath(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
