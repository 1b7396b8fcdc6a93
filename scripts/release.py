"""Publish a release's chart: packaged with its version and its images pinned, and pushed to
an OCI registry, so that `helm install oci://…/finetune-operator --version V` installs the
operator and trainer images of that same release with no values file.

    python scripts/release.py chart --version 0.2.0 \
        --to oci://ghcr.io/finetune-operator/charts --images ghcr.io/finetune-operator

What the release workflow (.github/workflows/release.yaml) runs after it pushed the images,
and what tests/install/test_release.py runs against a real registry. A version needs its
section in CHANGELOG.md (`## [0.2.0]`) first: a release says what changed.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "finetune-operator"
CHANGELOG = REPO / "CHANGELOG.md"
OPERATOR_IMAGE, TRAINER_IMAGE = "finetune-operator", "finetune-trainer"
"""The image names a release publishes under `--images` (the trainer's CPU variant as the
tag `<version>-cpu`)."""
SEMVER = re.compile(r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(-[0-9A-Za-z.-]+)?$")
_REPOSITORY_LINE = re.compile(r'^(?P<indent> *)repository: ""(?P<rest>.*)$')


class ReleaseError(Exception):
    """What stops a release, with the fix."""


def changelog_section(version: str, changelog: Path = CHANGELOG) -> str:
    """The notes of `version` in CHANGELOG.md (Keep a Changelog's `## [version]` heading)."""
    text = changelog.read_text() if changelog.exists() else ""
    match = re.search(rf"^## \[{re.escape(version)}\][^\n]*\n(.*?)(?=^## \[|\Z)", text,
                      re.MULTILINE | re.DOTALL)
    if match is None or not match.group(1).strip():
        raise ReleaseError(f"CHANGELOG.md has no section `## [{version}]`: say what changed "
                           "in this release first (Keep a Changelog's form)")
    return match.group(1).strip()


def pinned_values(values: str, images: str) -> str:
    """values.yaml with the operator's and the trainer's `repository` set to the release's
    (their tags stay empty: the chart's appVersion, which is the release's version); the
    comments, which `helm show values` prints, kept."""
    lines, found = values.splitlines(), []
    for index, line in enumerate(lines):
        match = _REPOSITORY_LINE.match(line)
        if match:
            found.append(index)
    if len(found) != 2:
        raise ReleaseError(f"{CHART}/values.yaml has {len(found)} empty `repository` values, "
                           "not the operator's and the trainer's: update release.py with it")
    for index, name in zip(found, (OPERATOR_IMAGE, TRAINER_IMAGE), strict=True):
        match = _REPOSITORY_LINE.match(lines[index])
        lines[index] = f'{match["indent"]}repository: {images}/{name}{match["rest"]}'
    pinned = "\n".join(lines) + "\n"
    parsed = yaml.safe_load(pinned)
    if (parsed["image"]["repository"], parsed["trainer"]["image"]["repository"]) != (
            f"{images}/{OPERATOR_IMAGE}", f"{images}/{TRAINER_IMAGE}"):
        raise ReleaseError("values.yaml's layout moved: image.repository and "
                           "trainer.image.repository were not the lines found")
    return pinned


def package(version: str, images: str, destination: Path, helm: str = "helm") -> Path:
    """The chart as released: its version and appVersion `version`, its images pinned."""
    with tempfile.TemporaryDirectory(prefix="finetune-release-") as work:
        chart = Path(work) / CHART.name
        shutil.copytree(CHART, chart, ignore=shutil.ignore_patterns("ci"))
        meta = yaml.safe_load((chart / "Chart.yaml").read_text())
        meta["version"], meta["appVersion"] = version, version
        (chart / "Chart.yaml").write_text(yaml.safe_dump(meta, sort_keys=False))
        (chart / "values.yaml").write_text(pinned_values((chart / "values.yaml").read_text(),
                                                         images))
        destination.mkdir(parents=True, exist_ok=True)
        _run([helm, "package", str(chart), "--destination", str(destination)])
    return destination / f"{CHART.name}-{version}.tgz"


def push(archive: Path, target: str, registry_options: list[str], helm: str = "helm") -> str:
    """`helm push`; the pushed reference with its digest."""
    said = _run([helm, "push", str(archive), target, *registry_options])
    digest = re.search(r"Digest:\s*(sha256:[0-9a-f]{64})", said)
    pushed = re.search(r"Pushed:\s*(\S+)", said)
    if digest is None or pushed is None:
        raise ReleaseError(f"helm push said no digest: {said.strip()}")
    return f"{pushed.group(1)}@{digest.group(1)}"


def _run(command: list[str]) -> str:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise ReleaseError(f"{' '.join(command[:2])} failed: "
                           f"{(result.stderr or result.stdout).strip()}")
    return result.stdout + result.stderr


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    chart = commands.add_parser("chart", help="package the chart and push it")
    chart.add_argument("--version", required=True, help="the release, e.g. 0.2.0 (SemVer)")
    chart.add_argument("--to", required=True, help="oci://registry/path the chart goes under")
    chart.add_argument("--images", required=True,
                       help="registry/path the release's images were pushed under")
    chart.add_argument("--helm", default="helm", help="the helm CLI (3.8 or newer)")
    chart.add_argument("--out", default="build/release", help="where the .tgz is kept")
    chart.add_argument("--ca-file", help="the registry's CA (a private CA)")
    chart.add_argument("--registry-config", help="Docker-style credentials (helm's default: "
                       "what `helm registry login` wrote)")
    chart.add_argument("--plain-http", action="store_true", help="a registry without TLS")
    args = parser.parse_args(argv)
    options = [*(["--ca-file", args.ca_file] if args.ca_file else []),
               *(["--registry-config", args.registry_config] if args.registry_config else []),
               *(["--plain-http"] if args.plain_http else [])]
    try:
        if not SEMVER.match(args.version):
            raise ReleaseError(f"--version {args.version} is no SemVer version (a chart's "
                               "must be): write e.g. 0.2.0 or 0.2.0-rc.1, without the v")
        if not args.to.startswith("oci://"):
            raise ReleaseError(f"--to {args.to}: write oci://registry/path")
        changelog_section(args.version)
        archive = package(args.version, args.images.rstrip("/"), REPO / args.out, args.helm)
        print(f"packaged {archive.relative_to(REPO) if archive.is_relative_to(REPO) else archive}"
              f" (images {args.images}/{OPERATOR_IMAGE}:{args.version}, "
              f"{args.images}/{TRAINER_IMAGE}:{args.version})", flush=True)
        print(f"pushed {push(archive, args.to.rstrip('/'), options, args.helm)}", flush=True)
    except ReleaseError as error:
        print(f"release: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
