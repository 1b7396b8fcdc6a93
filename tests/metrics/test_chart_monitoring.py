"""The chart's monitoring objects, rendered by the real Helm engine: the PodMonitor that
finds every trainer process, the operator's ServiceMonitor, the PrometheusRule that is the
rules file, the dashboards' ConfigMaps, and the dashboards themselves."""

from __future__ import annotations

import json
import re

import helm_python as helm
import pytest

from finetune_operator.backends.kubernetes.workers import render as render_workers
from finetune_operator.settings import OperatorSettings
from finetune_operator.validation import parse_job
from tests.conftest import minimal_job
from tests.install.test_chart import by_kind, render
from tests.support.monitoring import (
    CHART,
    DASHBOARDS,
    dashboard,
    panels,
    rules,
    targets,
    variable_queries,
)

RELEASE = {"release": "kube-prometheus-stack"}
MONITORING = {
    "metrics": {"serviceMonitor": {"enabled": True, "labels": RELEASE},
                "podMonitor": {"enabled": True, "interval": "10s", "labels": RELEASE}},
    "prometheusRule": {"enabled": True, "labels": RELEASE},
    "grafana": {"dashboards": {"enabled": True,
                               "annotations": {"grafana_folder": "Fine-tuning"}}},
}
MONITORING_KINDS = ("PodMonitor", "ServiceMonitor", "PrometheusRule")


def dashboard_config_maps(objects) -> list[dict]:
    return [o for o in by_kind(objects, "ConfigMap")
            if "grafana_dashboard" in o["metadata"]["labels"]]


def test_monitoring_is_off_by_default():
    objects = render()
    assert not [o for o in objects if o["kind"] in MONITORING_KINDS]
    assert not dashboard_config_maps(objects)


def test_every_object_carries_the_labels_a_prometheus_selects_on():
    objects = render(MONITORING)
    for kind in MONITORING_KINDS:
        (found,) = by_kind(objects, kind)
        assert found["metadata"]["labels"]["release"] == "kube-prometheus-stack", kind
        assert found["metadata"]["namespace"] == "finetune-system", kind


def worker_pod(**resources) -> dict:
    job = parse_job(minimal_job(resources={"nodes": 2, **resources}))
    (workers,) = [o for o in render_workers(job, OperatorSettings()) if o["kind"] == "Job"]
    return workers["spec"]["template"]


@pytest.mark.parametrize("resources", [{"gpusPerNode": 8}, {"gpusPerNode": 1},
                                       {"gpusPerNode": 0, "processesPerNode": 2}],
                         ids=["8-gpus", "1-gpu", "2-cpu-processes"])
def test_the_pod_monitor_selects_the_workers_and_every_process_port_they_name(resources):
    (monitor,) = by_kind(render(MONITORING), "PodMonitor")
    spec = monitor["spec"]
    pod = worker_pod(**resources)
    labels = pod["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    for expression in spec["selector"]["matchExpressions"]:
        assert expression["operator"] == "Exists" and expression["key"] in labels
    scraped = {endpoint["port"] for endpoint in spec["podMetricsEndpoints"]}
    assert scraped == {"metrics", *(f"metrics-{k}" for k in range(1, 8))}
    named = {port["name"] for container in pod["spec"]["containers"]
             for port in container.get("ports", []) if port["name"].startswith("metrics")}
    assert "metrics" in named and named <= scraped
    for endpoint in spec["podMetricsEndpoints"]:
        # the trainer's `job` and `namespace` labels name the FineTuneJob: they must win
        assert endpoint["honorLabels"] is True
        assert endpoint["interval"] == "10s" and endpoint["path"] == "/metrics"


@pytest.mark.parametrize(("watch", "selector"), [
    ([], {"any": True}),
    (["ml-team", "research"], {"matchNames": ["ml-team", "research"]}),
], ids=["cluster-wide", "namespaced"])
def test_the_pod_monitor_looks_where_the_operator_does(watch, selector):
    (monitor,) = by_kind(render({**MONITORING, "watchNamespaces": watch}), "PodMonitor")
    assert monitor["spec"]["namespaceSelector"] == selector


def test_the_service_monitor_scrapes_the_operator_with_its_labels():
    objects = render(MONITORING)
    (monitor,) = by_kind(objects, "ServiceMonitor")
    (service,) = by_kind(objects, "Service")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= (
        service["metadata"]["labels"].items())
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "metrics" == service["spec"]["ports"][0]["name"]
    # the per-job series carry the job's own `namespace`
    assert endpoint["honorLabels"] is True


def test_the_prometheus_rule_is_the_rules_file_promtool_tests():
    (rule,) = by_kind(render(MONITORING), "PrometheusRule")
    assert rule["spec"] == {"groups": rules()["groups"]}


@pytest.mark.parametrize(("grafana", "label", "namespace", "annotations"), [
    ({}, ("grafana_dashboard", "1"), "finetune-system", {"grafana_folder": "Fine-tuning"}),
    ({"namespace": "monitoring", "label": "grafana.io/dashboard", "labelValue": "finetune",
      "annotations": {}}, ("grafana.io/dashboard", "finetune"), "monitoring", None),
], ids=["kube-prometheus-stack", "custom"])
def test_one_config_map_per_dashboard_for_grafanas_sidecar(grafana, label, namespace,
                                                           annotations):
    values = {"grafana": {"dashboards": {**MONITORING["grafana"]["dashboards"], **grafana}}}
    key, value = label
    maps = [o for o in by_kind(render(values), "ConfigMap")
            if o["metadata"]["labels"].get(key) == value]
    assert sorted(m["metadata"]["name"] for m in maps) == [
        "ft-finetune-operator-dashboard-job", "ft-finetune-operator-dashboard-operator"]
    assert len(maps) == len(DASHBOARDS)
    for config_map in maps:
        assert config_map["metadata"]["namespace"] == namespace
        assert config_map["metadata"].get("annotations") == annotations
        ((name, text),) = config_map["data"].items()
        assert json.loads(text) == dashboard(name.removesuffix(".json"))


@pytest.mark.parametrize(("values", "message"), [
    ({"metrics": {"podMonitor": {"interval": "often"}}}, "interval"),
    ({"metrics": {"podMonitor": {"honorLabels": False}}}, "honorLabels"),
    ({"prometheusRule": {"labels": {"release": 1}}}, "release"),
    ({"grafana": {"dashboards": {"label": "not a label"}}}, "label"),
    ({"grafana": {"dashboards": {"folder": "x"}}}, "folder"),
])
def test_the_schema_refuses_bad_monitoring_values(values, message):
    chart = helm.Chart.load(str(CHART))
    with pytest.raises(helm.HelmError, match=message):
        chart.validate_schema(values)


# --- the dashboards ---------------------------------------------------------------------

GRAFANA_BUILTINS = {"__rate_interval", "__interval", "__range", "__data", "__value",
                    "__url_time_range"}
TRAINER_METRIC = re.compile(r"\b(finetune_(?!operator_)\w+)(\{[^}]*\})?")
OPERATOR_JOB_METRIC = re.compile(r"\b(finetune_operator_job_\w+)(\{[^}]*\})?")
DCGM_METRIC = re.compile(r"\b(DCGM_\w+)(\{[^}]*\})?")


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_a_dashboard_grafana_loads_with_a_datasource_to_choose(name):
    board = dashboard(name)
    assert board["uid"] == name and board["schemaVersion"] == 39 and board["id"] is None
    (datasource,) = [v for v in board["templating"]["list"] if v["name"] == "datasource"]
    assert datasource["type"] == "datasource" and datasource["query"] == "prometheus"
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    titles = [panel["title"] for panel in panels(board)]
    assert len(titles) == len(set(titles)), "tests name panels by title"
    cells: set[tuple[int, int]] = set()
    for panel in board["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        mine = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"])
                for y in range(grid["y"], grid["y"] + grid["h"])}
        assert not cells & mine, f"{panel['title']} overlaps another panel"
        cells |= mine
    for panel in panels(board):
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"] and panel.get("description"), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"] and target["expr"].strip()
    defined = {v["name"] for v in board["templating"]["list"]} | GRAFANA_BUILTINS
    used = set(re.findall(r"\$\{?(\w+)", json.dumps(board)))
    assert used <= defined, f"undefined variables: {used - defined}"


def test_the_job_dashboard_picks_a_namespace_then_a_job():
    assert variable_queries(dashboard("finetune-job")) == {
        "namespace": "label_values(finetune_step, namespace)",
        "job": 'label_values(finetune_step{namespace="$namespace"}, job)',
    }


def test_every_job_panel_shows_the_chosen_job_only():
    for title, target in targets(dashboard("finetune-job")):
        expr = target["expr"]
        for pattern, wanted in ((TRAINER_METRIC, ('namespace="$namespace"', 'job="$job"')),
                                (OPERATOR_JOB_METRIC,
                                 ('namespace="$namespace"', 'finetunejob="$job"')),
                                (DCGM_METRIC, ('namespace="$namespace"', 'pod=~"$job-[0-9]+-.*"'))):
            for metric, selector in pattern.findall(expr):
                for matcher in wanted:
                    assert matcher in selector, f"{title}: {metric}{selector} lacks {matcher}"


def test_the_operator_dashboard_filters_on_the_chosen_backends():
    board = dashboard("finetune-operator")
    assert variable_queries(board) == {
        "backend": "label_values(finetune_operator_jobs, backend)"}
    (backend,) = [v for v in board["templating"]["list"] if v["name"] == "backend"]
    assert backend["includeAll"] and backend["allValue"] == ".*"
    for title, target in targets(board):
        for metric, selector in re.findall(r"\b(finetune_operator_\w+)(\{[^}]*\})?",
                                           target["expr"]):
            if metric.startswith(("finetune_operator_workqueue_",
                                  "finetune_operator_launches_")):
                continue  # one queue and one pace for every backend: no backend label
            assert 'backend=~"$backend"' in selector, f"{title}: {metric}{selector}"

