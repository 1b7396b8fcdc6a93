"""The chart's roles for people (`rbac.aggregateToDefaultRoles`, #58), on the real API server:
a RoleBinding to the built-in `edit`, `admin` or `view` ClusterRole is all a user needs to
write or read FineTuneJobs in a namespace, once Kubernetes' controller-manager has
aggregated the chart's rules into them; with the value off it is not.

Installed with the helm CLI as users install it (no operator pod: replicas 0), under a
release of its own, and asked with `kubectl auth can-i --as`."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from tests.conftest import REPO
from tests.support import waits

CHART = REPO / "charts" / "finetune-operator"
RELEASE = "user-roles"
NAMESPACE = "ml-users"
"""Where the users are bound; the release goes in a namespace of its own."""
USERS = {"edit": "alice", "admin": "carol", "view": "bob"}
"""The built-in ClusterRole each user is bound to, in NAMESPACE only."""
JOBS, SWEEPS = "finetunejobs.finetune.dev", "finetunesweeps.finetune.dev"


def helm(plane, *args: str) -> None:
    done = subprocess.run([str(plane.bin / "helm"), "--kubeconfig", str(plane.admin_kubeconfig),
                           *args], capture_output=True, text=True, timeout=waits.seconds_left())
    assert done.returncode == 0, (args, done.stdout[-2000:], done.stderr[-2000:])


def can(plane, user: str, verb: str, resource: str, namespace: str = NAMESPACE,
        subresource: str | None = None) -> bool:
    """`kubectl auth can-i` as `user` (impersonated by the admin)."""
    extra = [f"--subresource={subresource}"] if subresource else []
    done = plane.kubectl_run("auth", "can-i", verb, resource, "-n", namespace, "--as", user,
                             *extra, check=False)
    assert done.stdout.strip() in ("yes", "no"), done.stderr
    return done.stdout.strip() == "yes"


def settled(plane, user: str, verb: str, resource: str, expected: bool) -> bool:
    """The answer once the controller-manager has aggregated the roles (and the API server's
    RBAC cache taken them in): well within a second here; the test's time before a wrong
    answer."""
    deadline = time.monotonic() + waits.seconds_left()
    while (answer := can(plane, user, verb, resource)) != expected:
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return answer


@pytest.fixture(scope="module")
def plane(control_plane):
    """The session's control plane, with the users bound, and with any ClusterRole of
    another installation that aggregates finetune.dev rules into the built-in roles (the
    `installation` fixture's) put aside while this module runs: they would grant what this
    release is checked to grant, or not."""
    kubectl = control_plane.kubectl_run
    roles = json.loads(kubectl("get", "clusterroles", "-o", "json").stdout)["items"]
    aside = [r for r in roles if "aggregationRule" not in r  # edit and view are labelled too
             and any((r["metadata"].get("labels") or {}).get(
                 f"rbac.authorization.k8s.io/aggregate-to-{built_in}") == "true"
                 for built_in in USERS)
             and any("finetune.dev" in rule.get("apiGroups", []) for rule in r.get("rules") or [])]
    for role in aside:
        kubectl("delete", "clusterrole", role["metadata"]["name"])
    kubectl("create", "namespace", NAMESPACE)
    for role, user in USERS.items():
        kubectl("create", "rolebinding", f"{user}-{role}", f"--clusterrole={role}",
                f"--user={user}", "-n", NAMESPACE)
    try:
        yield control_plane
    finally:
        kubectl("delete", "namespace", NAMESPACE, f"{RELEASE}-system", "--wait=false",
                check=False)
        for role in aside:
            meta = role["metadata"]
            for key in ("resourceVersion", "uid", "creationTimestamp", "managedFields"):
                meta.pop(key, None)
            kubectl("create", "-f", "-", input=json.dumps(role), check=False)


def test_edit_admin_and_view_grant_finetunejobs_by_default_and_not_with_the_value_off(plane):
    values = CHART / "ci" / "images-values.yaml"
    base = ["-n", f"{RELEASE}-system", "-f", str(values), "--set", "replicas=0"]
    # the CRDs too (Helm leaves those already there): kubectl asks about a resource it knows
    helm(plane, "install", RELEASE, str(CHART), "--create-namespace", *base)
    plane.kubectl_run("wait", "--for=condition=Established", f"crd/{JOBS}", f"crd/{SWEEPS}")
    plane.kubectl_run("api-resources", "--api-group=finetune.dev")  # kubectl's discovery afresh
    try:
        assert settled(plane, "alice", "create", JOBS, True)
        for verb in ("get", "list", "watch", "update", "patch", "delete"):
            assert can(plane, "alice", verb, JOBS), verb
        assert can(plane, "alice", "create", SWEEPS) and can(plane, "alice", "delete", SWEEPS)
        assert can(plane, "carol", "create", JOBS) and can(plane, "carol", "list", SWEEPS)
        for verb in ("get", "list", "watch"):
            assert can(plane, "bob", verb, JOBS) and can(plane, "bob", verb, SWEEPS), verb
        assert can(plane, "bob", "get", JOBS, subresource="status")
        for verb in ("create", "patch", "delete"):
            assert not can(plane, "bob", verb, JOBS), verb
        # the status is the operator's; and a RoleBinding reaches its own namespace only
        assert not can(plane, "alice", "patch", JOBS, subresource="status")
        assert not can(plane, "alice", "create", JOBS, namespace="default")

        helm(plane, "upgrade", RELEASE, str(CHART), *base, "--reuse-values",
             "--set", "rbac.aggregateToDefaultRoles=false")
        assert not settled(plane, "alice", "create", JOBS, False)
        assert not can(plane, "carol", "create", JOBS)
        assert not can(plane, "bob", "list", JOBS)
    finally:
        helm(plane, "uninstall", RELEASE, "-n", f"{RELEASE}-system", "--wait")
