"""#62: what a backend says of a manifest before anything runs (`BackendRules`: its spec
section, its rules, where its logs are) is its own, found through the
`finetune_operator.backend_rules` entry points; the core modules name no backend."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from finetune_operator.backends import RULES_ENTRY_POINT_GROUP, installed_rules
from tests.conftest import REPO, minimal_job
from tests.support import plugins, waits


@pytest.mark.unit
def test_each_shipped_backend_says_where_its_logs_are():
    rules = installed_rules()
    assert rules["kubernetes"].logs_hint is None  # in the job's pods: `finetune logs` reads them
    job = {"spec": {"backend": "azureml", "azureml": {"resourceGroup": "rg", "workspace": "ws"}},
           "status": {"backendRef": {"name": "demo-1", "url": "https://ml.azure.com/runs/demo-1"}}}
    assert rules["azureml"].logs_hint(job) == (
        "Azure ML job demo-1: az ml job stream --name demo-1 --resource-group rg "
        "--workspace-name ws\n  or in Studio: https://ml.azure.com/runs/demo-1")
    assert rules["azureml"].logs_hint({"spec": job["spec"]}) == (
        "the Azure ML job is not submitted yet: nothing to read")


PLUGIN = '''
"""A backend of a user's own: its rules of a manifest, and where its logs are."""
from finetune_operator.backends import BackendRules
from finetune_operator.validation import CelRule, Problem, Rule


def at_most_four_nodes(job):
    if job.spec.backend == "slurm" and job.spec.resources.nodes > 4:
        yield Problem("spec.resources.nodes", "is more than the 4 nodes slurm gives a job",
                      "ask for 4 nodes or fewer")


BACKEND_RULES = BackendRules(
    rules=(Rule("at_most_four_nodes", at_most_four_nodes, (CelRule(
        "spec", "self.backend != 'slurm' || self.resources.nodes <= 4",
        "backend slurm runs a job on 4 nodes at most"),)),),
    logs_hint=lambda job: "sacct -j " + job["status"]["backendRef"]["name"])
'''

CHECK = '''
import json, sys
from finetune_operator.backends import check_manifest, installed_rules

too_many, two, elsewhere = json.loads(sys.stdin.read())
_, problems = check_manifest(too_many)
_, fine = check_manifest(two)
_, elsewhere = check_manifest(elsewhere)
clients = sorted(m for m in sys.modules if m in ("kopf", "kubernetes", "aiohttp")
                 or m.endswith((".kubernetes.backend", ".azureml.backend")))
from finetune_operator import crd
cel = [r["rule"] for r in crd.openapi_schema()["properties"]["spec"]["x-kubernetes-validations"]]
print(json.dumps({
    "problems": [str(p) for p in problems if p.severity == "error"],
    "fine": [str(p) for p in fine + elsewhere if p.severity == "error"],
    "clients": clients,
    "cel": [rule for rule in cel if "slurm" in rule],
    "logs": installed_rules()["slurm"].logs_hint({"status": {"backendRef": {"name": "7"}}})}))
'''


@pytest.mark.process
def test_a_new_backend_says_its_rules_through_one_entry_point(tmp_path):
    """Installed as a user installs one (a distribution declaring the entry point): its rules
    are checked on its jobs only, its CEL rule is in the CRD, its logs hint is there, and
    checking a manifest loaded no backend's client (a GPU box has none)."""
    plugins.install(tmp_path, "slurm_rules", PLUGIN, RULES_ENTRY_POINT_GROUP,
                    "slurm = slurm_rules:BACKEND_RULES")
    jobs = [minimal_job(backend="slurm", resources={"nodes": 8}),
            minimal_job(backend="slurm", resources={"nodes": 2}),
            minimal_job(resources={"nodes": 8})]
    result = subprocess.run([sys.executable, "-c", CHECK], input=json.dumps(jobs),
                            capture_output=True, text=True, cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": f"{tmp_path}:{REPO}"},
                            timeout=waits.seconds_left())
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.splitlines()[-1])
    assert seen["problems"] == ["spec.resources.nodes: is more than the 4 nodes slurm gives a "
                                "job — ask for 4 nodes or fewer"]
    assert seen["fine"] == []
    assert seen["clients"] == []
    assert seen["cel"] == ["self.backend != 'slurm' || self.resources.nodes <= 4"]
    assert seen["logs"] == "sacct -j 7"
