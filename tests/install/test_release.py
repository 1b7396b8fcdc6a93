"""A release's chart as users get it: `scripts/release.py chart` packages it with its images
pinned and pushes it with the real helm CLI to a real registry (distribution, TLS from a CA
of the test's, htpasswd auth); `helm show` and `helm template` read it back from `oci://`
with no values file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO
from tests.support import registry as registries
from tests.support import waits

pytestmark = pytest.mark.process
RELEASE = REPO / "scripts" / "release.py"


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    with registries.running(tmp_path_factory.mktemp("registry")) as started:
        yield started


def helm_cli() -> Path:
    sys.path.insert(0, str(REPO / "cluster"))
    import controlplane

    return controlplane.build() / "helm"


def run(*command: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=waits.seconds_left())


def release_chart(version: str, to: str, registry, config: Path, out: Path):
    return run(sys.executable, str(RELEASE), "chart", "--version", version, "--to", to,
               "--images", "ghcr.io/finetune-operator", "--helm", str(helm_cli()),
               "--out", str(out), "--ca-file", str(registry.ca),
               "--registry-config", str(config))


def test_a_released_chart_installs_its_own_images_from_oci(registry, tmp_path):
    config = registry.docker_config(tmp_path / "docker") / "config.json"
    chart = f"oci://{registry.host}/charts/finetune-operator"
    released = release_chart("0.1.0", f"oci://{registry.host}/charts", registry, config,
                             tmp_path / "out")
    assert released.returncode == 0, released.stderr
    assert f"pushed {registry.host}/charts/finetune-operator:0.1.0@sha256:" in released.stdout
    assert registries.PASSWORD not in released.stdout + released.stderr

    access = ["--version", "0.1.0", "--ca-file", str(registry.ca),
              "--registry-config", str(config)]
    shown = run(str(helm_cli()), "show", "chart", chart, *access)
    assert shown.returncode == 0, shown.stderr
    meta = yaml.safe_load(shown.stdout)
    assert (meta["name"], meta["version"], meta["appVersion"]) == (
        "finetune-operator", "0.1.0", "0.1.0")
    values = run(str(helm_cli()), "show", "values", chart, *access)
    assert "# the operator's, from operator/Dockerfile" in values.stdout  # comments kept

    rendered = run(str(helm_cli()), "template", "finetune", chart, *access,
                   "-n", "finetune-system")  # no values file: the release's own images
    assert rendered.returncode == 0, rendered.stderr
    objects = [o for o in yaml.safe_load_all(rendered.stdout) if o]
    [deployment] = [o for o in objects if o["kind"] == "Deployment"]
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "ghcr.io/finetune-operator/finetune-operator:0.1.0"
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    assert "ghcr.io/finetune-operator/finetune-trainer:0.1.0" in env.values(), env

    manifest = json.loads(registry.oras("manifest", "fetch",
                                        f"{registry.host}/charts/finetune-operator:0.1.0").stdout)
    assert manifest["config"]["mediaType"] == "application/vnd.cncf.helm.config.v1+json"


@pytest.mark.parametrize(("version", "said"), [
    ("9.9.9", "CHANGELOG.md has no section `## [9.9.9]`"),
    ("v0.1.0", "is no SemVer version"),
])
def test_a_release_that_cannot_be_made_is_refused_before_anything_is_pushed(
        registry, tmp_path, version, said):
    config = registry.docker_config(tmp_path / "docker") / "config.json"
    refused = release_chart(version, f"oci://{registry.host}/refused", registry, config,
                            tmp_path / "out")
    assert refused.returncode == 2 and said in refused.stderr, refused.stderr
    assert not list((tmp_path / "out").glob("*.tgz"))
    assert registry.oras("repo", "tags", f"{registry.host}/refused/finetune-operator"
                         ).stdout.strip() == ""


def test_actionlint_checks_the_workflows_and_refuses_a_broken_one(tmp_path):
    """`make lint` runs actionlint (built from the Go proxy) on .github/workflows: ours pass,
    and a release workflow naming a matrix key it lacks is refused, naming it."""
    sys.path.insert(0, str(REPO / "cluster"))
    import controlplane

    linted = run(sys.executable, str(REPO / "cluster" / "controlplane.py"), "actionlint")
    assert linted.returncode == 0, linted.stdout + linted.stderr
    actionlint = controlplane.lint_tools_dir() / "actionlint"
    if not actionlint.exists():
        pytest.skip("actionlint is not built: Go is not installed")
    broken = tmp_path / "release.yaml"
    broken.write_text((REPO / ".github/workflows/release.yaml").read_text().replace(
        "${{ matrix.dockerfile }}", "${{ matrix.dockerfil }}"))
    refused = run(str(actionlint), str(broken))
    assert refused.returncode == 1 and "dockerfil" in refused.stdout, refused.stdout
