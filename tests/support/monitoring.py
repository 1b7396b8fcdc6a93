"""What the monitoring tests share: the chart's dashboards and rules, the PromQL of every
panel with Grafana's variables filled in, and a real Prometheus server to run it on."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from tests.conftest import REPO
from tests.support import waits

CHART = REPO / "charts/finetune-operator"
RULES = CHART / "rules/finetune-alerts.yaml"
DASHBOARDS = {path.stem: path for path in sorted((CHART / "dashboards").glob("*.json"))}
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")


def dashboard(name: str) -> dict[str, Any]:
    return json.loads(DASHBOARDS[name].read_text())


def rules() -> dict[str, Any]:
    return yaml.safe_load(RULES.read_text())


def alerts() -> list[dict[str, Any]]:
    return [rule for group in rules()["groups"] for rule in group["rules"] if "alert" in rule]


def panels(board: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel but rows, including those inside collapsed rows."""
    for panel in board["panels"]:
        if panel["type"] == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def targets(board: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(panel title, target) for every query of the dashboard's panels."""
    for panel in panels(board):
        for target in panel.get("targets", []):
            yield panel["title"], target


def variable_queries(board: dict[str, Any]) -> dict[str, str]:
    """name → the PromQL of each query variable (Grafana keeps a string or an object)."""
    found = {}
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            found[variable["name"]] = query["query"] if isinstance(query, dict) else query
    return found


def substitute(expr: str, values: dict[str, str]) -> str:
    """`expr` as Grafana sends it: `$name` and `${name}` replaced by `values`, which must
    name every variable used (built-ins such as `__rate_interval` included)."""

    def value(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        if name not in values:
            raise KeyError(f"no value for ${name} in {expr!r}")
        return values[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, expr)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Prometheus:
    """/usr/bin/prometheus on a free port, scraping `targets` every second with
    honor_labels (as the chart's monitors do) and evaluating `rule_files` every second."""

    def __init__(self, where: Path, targets: dict[str, list[str]],
                 rule_files: tuple[Path, ...] = ()):
        assert PROMETHEUS, "prometheus is not on PATH"
        where.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s",
                       "evaluation_interval": "1s"},
            "rule_files": [str(path) for path in rule_files],
            "scrape_configs": [{"job_name": name, "honor_labels": True,
                                "static_configs": [{"targets": addresses}]}
                               for name, addresses in targets.items()],
        }
        (where / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = (where / "prometheus.log").open("w")
        self.process = subprocess.Popen(
            [PROMETHEUS, f"--config.file={where / 'prometheus.yml'}",
             f"--storage.tsdb.path={where / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}",
             "--storage.tsdb.retention.time=1h", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT)

    def __enter__(self) -> Prometheus:
        waited = waits.seconds_left()
        deadline = time.monotonic() + waited
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.logs()
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as response:
                    if response.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"prometheus not ready within {waited:.0f}s:\n{self.logs()}")

    def __exit__(self, *exc: object) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()

    def logs(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-3000:]

    def api(self, path: str, **params: str | list[str]) -> Any:
        query = urllib.parse.urlencode(params, doseq=True)
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}",
                                        timeout=waits.seconds_left()) as response:
                body = json.load(response)
        except urllib.error.HTTPError as error:  # 400 for a query that does not parse
            body = json.load(error)
        if body["status"] != "success":
            raise AssertionError(f"{path} {params}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The series an instant query returns now (NaN values count: a series is there)."""
        data = self.api("query", query=expr)
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def label_values(self, label: str, match: str) -> list[str]:
        return self.api(f"label/{label}/values", **{"match[]": match})

    def rules(self) -> list[dict[str, Any]]:
        return [rule for group in self.api("rules")["groups"] for rule in group["rules"]]
