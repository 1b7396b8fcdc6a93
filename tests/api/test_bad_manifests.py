"""Bad manifests: each gets a message that names the field and says how to fix it, and
the API server (the CRD's schema or its CEL rules) refuses the same ones it can see."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import pytest

from finetune_operator.admission import admit, offline_backends
from finetune_operator.backends import check_manifest
from finetune_operator.validation import check_document
from tests.conftest import minimal_job
from tests.support.crd_schema import cel_failures, schema_errors

DELETE = object()


def edit(doc: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    for dotted, value in changes.items():
        *parents, leaf = dotted.split(".")
        node = doc
        for part in parents:
            node = node.setdefault(part, {})
        if value is DELETE:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return doc


@dataclass
class Case:
    id: str
    changes: dict[str, Any]
    path: str
    message: str
    server: str | None  # "schema", "cel", or None when only the operator can tell


GPU_LORA = {"spec.resources.gpusPerNode": 1}
FOLDER = {"spec.dataset.uri": "pvc://data/chats/"}
DPO = {"spec.objective": {"type": "dpo"}}
PREFERENCE = {"spec.dataset.format": "preference"}
PROMPTS = {"spec.dataset.format": "prompt"}
AML = {"subscriptionId": "00000000-0000-0000-0000-000000000000", "resourceGroup": "rg",
       "workspace": "ws", "compute": "gpu-cluster"}

CASES = [
    Case("wrong-api-version", {"apiVersion": "finetune.dev/v1"}, "apiVersion",
         "use `apiVersion: finetune.dev/v1alpha1`", None),
    Case("wrong-kind", {"kind": "PyTorchJob"}, "kind", "use `kind: FineTuneJob`", None),
    Case("missing-name", {"metadata.name": DELETE}, "metadata.name", "is required", None),
    # the API server refuses it in the request's path, before schema or CEL (validate said
    # `valid FineTuneJob Bad_NS/demo`)
    # pydantic's lax parsing took these; the CRD's schema (kubectl apply) does not
    Case("steps-as-a-string", {"spec.hyperparameters.maxSteps": "4"},
         "spec.hyperparameters.maxSteps", "must be an integer, got '4'", "schema"),
    Case("a-flag-as-a-number", {"spec.strategy.gradientCheckpointing": 0},
         "spec.strategy.gradientCheckpointing", "must be true or false, got 0", "schema"),
    Case("a-rate-as-a-string", {"spec.hyperparameters.learningRate": "0.01"},
         "spec.hyperparameters.learningRate", "must be a number, got '0.01'", "schema"),
    Case("namespace-not-a-label", {"metadata.namespace": "Bad_NS"}, "metadata.namespace",
         "'Bad_NS' is not a DNS-1123 label", None),
    Case("namespace-too-long", {"metadata.namespace": "a" * 64}, "metadata.namespace",
         "is not a DNS-1123 label", None),
    Case("name-uppercase", {"metadata.name": "Demo"}, "metadata.name",
         "not a DNS-1035 label", "cel"),
    Case("name-too-long", {"metadata.name": "a" * 48}, "metadata.name",
         "is 48 characters, the limit is 47", "cel"),
    Case("missing-model", {"spec.model": DELETE}, "spec.model", "is required", "schema"),
    Case("model-on-s3", {"spec.model.uri": "s3://bucket/llama"}, "spec.model.uri",
         "not a location this API understands", "schema"),
    Case("model-over-https", {"spec.model.uri": "https://example.com/model"}, "spec.model.uri",
         "https:// locations are not accepted here", "schema"),
    Case("dataset-plain-http", {"spec.dataset.uri": "http://example.com/d.jsonl"},
         "spec.dataset.uri", "use https://", "schema"),
    Case("output-to-hub", {"spec.output.uri": "hf://me/out"}, "spec.output.uri",
         "Hugging Face Hub (hf://) locations are not accepted", "schema"),
    Case("pvc-claim-uppercase", {"spec.dataset.uri": "pvc://Data/x"}, "spec.dataset.uri",
         "not a location", "schema"),
    Case("method-typo", {"spec.method": {"type": "lorra"}}, "spec.method.type",
         "use one of 'lora', 'qlora' or 'full'", "schema"),
    Case("field-typo", {"spec.methd": {"type": "lora"}}, "spec.methd",
         "did you mean `method`?", "schema"),
    # #51, item 1: Python's name of a field; the API server's strict decoding knows only the
    # camelCase one (validate said "valid", and the run used 64)
    Case("snake-case-field", {"spec.dataset.max_seq_length": 64},
         "spec.dataset.max_seq_length", "did you mean `maxSeqLength`?", "schema"),
    Case("snake-case-section", {"spec.run_policy": {"backoffLimit": 1}}, "spec.run_policy",
         "did you mean `runPolicy`?", "schema"),
    Case("qlora-on-cpu", {"spec.method": {"type": "qlora"}, "spec.resources.gpusPerNode": 0},
         "spec.method.type", "qlora needs GPUs", "cel"),
    Case("deepspeed-fp16-on-cpu", {"spec.resources.gpusPerNode": 0,
                                   "spec.strategy": {"type": "zero2", "precision": "fp16"}},
         "spec.strategy.precision", "use bf16 or fp32 on CPU workers", "cel"),
    Case("qlora-fp32", {**GPU_LORA, "spec.method": {"type": "qlora"},
                        "spec.strategy": {"precision": "fp32"}},
         "spec.strategy.precision", "use bf16", "cel"),
    Case("fp16-fsdp-full", {"spec.method": {"type": "full"},
                            "spec.strategy": {"type": "fsdp", "precision": "fp16"}},
         "spec.strategy.precision", "numerically unstable", "cel"),
    Case("cpu-offload-with-ddp", {"spec.strategy": {"type": "ddp", "offload": "cpu"}},
         "spec.strategy.offload", "use `strategy.type: zero2`, `zero3` or `fsdp`", "cel"),
    Case("nvme-offload-with-zero2", {"spec.strategy": {"type": "zero2", "offload": "nvme",
                                                       "nvmePath": "/nvme"}},
         "spec.strategy.offload", "ZeRO-Infinity", "cel"),
    Case("nvme-offload-without-path", {"spec.strategy": {"type": "zero3", "offload": "nvme"}},
         "spec.strategy.nvmePath", "is required with `offload: nvme`", "cel"),
    Case("zero-nodes", {"spec.resources.nodes": 0}, "spec.resources.nodes",
         "must be at least 1", "schema"),
    Case("negative-gpus", {"spec.resources.gpusPerNode": -1}, "spec.resources.gpusPerNode",
         "must be at least 0", "schema"),
    Case("processes-with-gpus", {"spec.resources.processesPerNode": 2},
         "spec.resources.processesPerNode", "one training process per GPU", "cel"),
    Case("azureml-without-section", {"spec.backend": "azureml"}, "spec.azureml",
         "is required by backend azureml", "cel"),
    Case("azureml-bad-subscription", {"spec.backend": "azureml", "spec.azureml": {
        **AML, "subscriptionId": "my-subscription"}}, "spec.azureml.subscriptionId",
         "is not a GUID", "schema"),
    Case("export-to-a-bucket", {"spec.output.export": [{"uri": "s3://bucket/my-adapter"}]},
         "spec.output.export[0].uri", "hf://owner/name (the Hugging Face Hub)", "schema"),
    Case("export-to-a-hub-name-the-hub-refuses", {"spec.output.export": [
        {"uri": "hf://org/my--adapter"}]}, "spec.output.export[0].uri",
         "is not a hub repository name", None),
    Case("export-to-the-hub-over-plain-http", {"spec.output.export": [
        {"uri": "hf://org/my-adapter", "plainHttp": True}]}, "spec.output.export[0].plainHttp",
         "the hub is reached at HF_ENDPOINT", None),
    Case("export-uppercase-repository", {"spec.output.export": [
        {"uri": "oci://myreg.azurecr.io/Adapters/demo:v1"}]}, "spec.output.export[0].uri",
         "names the repository 'Adapters/demo', which a registry refuses", None),
    Case("export-merged-without-merging", {"spec.output.export": [
        {"uri": "oci://myreg.azurecr.io/adapters/demo:v1", "merged": True}]},
         "spec.output.export[0].merged", "set `mergeAdapter: true`", "cel"),
    Case("export-from-azureml", {"spec.backend": "azureml", "spec.azureml": AML,
                                 "spec.output.export": [
                                     {"uri": "oci://myreg.azurecr.io/adapters/demo:v1"}]},
         "spec.output.export[0].uri", "register the model in the workspace instead", None),
    Case("register-in-azureml-from-kubernetes", {"spec.output.export": [
        {"uri": "azureml://models/support-bot"}]}, "spec.output.export[0].uri",
         "which only the azureml backend has", None),
    Case("register-a-bad-azureml-name", {"spec.backend": "azureml", "spec.azureml": AML,
                                         "spec.output.export": [
                                             {"uri": "azureml://models/-support bot"}]},
         "spec.output.export[0].uri", "is not an Azure ML model name", None),
    Case("unknown-backend", {"spec.backend": "slurm"}, "spec.backend",
         "use one of: azureml, kubernetes", None),
    Case("epochs-and-max-steps", {"spec.hyperparameters": {"epochs": 1, "maxSteps": 5}},
         "spec.hyperparameters.maxSteps", "remove `epochs` or `maxSteps`", "cel"),
    Case("no-hyperparameters", {"spec.hyperparameters": DELETE}, "spec.hyperparameters",
         "is required", "schema"),
    Case("no-length", {"spec.hyperparameters": {}}, "spec.hyperparameters",
         "set `epochs: 1`", "cel"),
    Case("zero-learning-rate", {"spec.hyperparameters.learningRate": 0},
         "spec.hyperparameters.learningRate", "greater than 0", "schema"),
    Case("eval-fraction-too-big", {"spec.dataset.evalFraction": 0.9},
         "spec.dataset.evalFraction", "at most 0.5", "schema"),
    Case("keep-no-checkpoints", {"spec.output.keepLast": 0}, "spec.output.keepLast",
         "at least 1", "schema"),
    Case("reserved-master-addr", {"spec.kubernetes": {"env": [
        {"name": "MASTER_ADDR", "value": "10.0.0.1"}]}}, "spec.kubernetes.env[0].name",
         "MASTER_ADDR is reserved", "cel"),
    Case("reserved-pet-prefix", {"spec.kubernetes": {"env": [
        {"name": "LOG_LEVEL", "value": "info"}, {"name": "PET_NNODES", "value": "4"}]}},
         "spec.kubernetes.env[1].name", "PET_NNODES is reserved", "cel"),
    Case("env-value-and-value-from", {"spec.kubernetes": {"env": [
        {"name": "X", "value": "1", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]}},
         "spec.kubernetes.env[0]", "has both value and valueFrom", "cel"),
    Case("volume-two-sources", {"spec.kubernetes": {"volumes": [
        {"name": "data", "mountPath": "/data", "emptyDir": {},
         "persistentVolumeClaim": {"claimName": "c"}}]}}, "spec.kubernetes.volumes[0]",
         "set exactly one of", "cel"),
    Case("lora-settings-on-full", {"spec.method": {"type": "full", "lora": {"r": 8}}},
         "spec.method.lora", "remove `lora`", "cel"),
    Case("merge-on-full", {"spec.method": {"type": "full"}, "spec.output.mergeAdapter": True},
         "spec.output.mergeAdapter", "no adapter to merge", "cel"),
    Case("eval-every-without-split", {"spec.hyperparameters.evalEverySteps": 50},
         "spec.hyperparameters.evalEverySteps", "set `spec.dataset.evalSplit` (e.g. "
         "validation) or `spec.dataset.evalFraction`", "cel"),
    Case("early-stopping-without-evaluations",
         {"spec.dataset.evalFraction": 0.05, "spec.hyperparameters.earlyStoppingPatience": 3},
         "spec.hyperparameters.earlyStoppingPatience", "set "
         "`spec.hyperparameters.evalEverySteps` (e.g. 100)", "cel"),
    Case("two-eval-splits", {**FOLDER, "spec.dataset.evalSplit": "validation",
                             "spec.dataset.evalFraction": 0.1},
         "spec.dataset.evalSplit", "remove evalFraction to evaluate on the validation split",
         "cel"),
    Case("evaluating-on-the-training-split", {**FOLDER, "spec.dataset.evalSplit": "train"},
         "spec.dataset.evalSplit", "is train, the split trained on", "cel"),
    Case("eval-split-of-one-file", {"spec.dataset.uri": "pvc://data/chats/train.JSONL",
                                    "spec.dataset.evalSplit": "validation"},
         "spec.dataset.evalSplit", "evaluate on a slice of that file (split: train[:95%], "
         "evalSplit: train[95%:])", "cel"),
    Case("micro-batch-not-dividing-the-step", {"spec.hyperparameters.batchSizePerDevice": 4,
                                               "spec.hyperparameters.gradientAccumulationSteps": 2,
                                               "spec.hyperparameters.microBatchSize": 3},
         "spec.hyperparameters.microBatchSize", "use a divisor (2 or 4)", "cel"),
    Case("bad-quantity", {"spec.kubernetes": {"shmSize": "lots"}}, "spec.kubernetes.shmSize",
         "not a Kubernetes quantity", "schema"),
    Case("bad-toleration-effect", {"spec.kubernetes": {"tolerations": [
        {"key": "sku", "value": "gpu", "effect": "NoRun"}]}},
         "spec.kubernetes.tolerations[0].effect", "'NoSchedule'", "schema"),
    Case("sequence-too-short", {"spec.dataset.maxSeqLength": 8}, "spec.dataset.maxSeqLength",
         "at least 16", "schema"),
    Case("spec-not-a-mapping", {"spec": "train please"}, "spec", "must be a mapping",
         "schema"),
    Case("batch-size-word", {"spec.hyperparameters.batchSizePerDevice": "four"},
         "spec.hyperparameters.batchSizePerDevice", "must be an integer", "schema"),
    Case("dpo-on-chat-data", {**DPO, "spec.dataset.format": "chat"}, "spec.dataset.format",
         "is chat, and objective dpo trains on preference data", "cel"),
    Case("dpo-on-instruction-data", {**DPO, "spec.dataset.format": "instruction"},
         "spec.dataset.format", "set `dataset.format` to preference (or auto)", "cel"),
    Case("dpo-on-text-data", {**DPO, "spec.dataset.format": "text"}, "spec.dataset.format",
         "or `objective.type: sft` for text data", "cel"),
    Case("preference-data-with-sft", {"spec.dataset.format": "preference"},
         "spec.dataset.format", "is preference, and objective sft trains on chat, instruction "
         "or text data", "cel"),
    Case("preference-data-with-explicit-sft", {**PREFERENCE, "spec.objective": {"type": "sft"}},
         "spec.dataset.format", "or `objective.type: dpo` for preference data", "cel"),
    Case("dpo-settings-with-sft", {"spec.objective": {"type": "sft", "dpo": {"beta": 0.2}}},
         "spec.objective.dpo", "is set but objective.type is sft", "cel"),
    Case("ipo-with-label-smoothing", {**PREFERENCE, "spec.objective": {
        "type": "dpo", "dpo": {"loss": "ipo", "labelSmoothing": 0.1}}},
         "spec.objective.dpo.labelSmoothing", "is not used by the ipo loss", "cel"),
    Case("objective-typo", {"spec.objective": {"type": "ppo"}}, "spec.objective.type",
         "use one of 'dpo', 'grpo' or 'sft'", "schema"),
    Case("grpo-without-rewards", {**PROMPTS, "spec.objective": {"type": "grpo"}},
         "spec.objective.grpo.rewards", "is required: objective grpo scores completions by "
         "its rewards", "cel"),
    Case("grpo-reward-typo", {**PROMPTS, "spec.objective": {
        "type": "grpo", "grpo": {"rewards": [{"name": "exact_matches"}]}}},
         "spec.objective.grpo.rewards[0].name", "'exact_matches' is not a built-in reward — "
         "did you mean exact_match? (built-ins: exact_match, format, math_equal, "
         "length_penalty; your own: module:function)", "schema"),
    Case("grpo-reward-dotted", {**PROMPTS, "spec.objective": {
        "type": "grpo", "grpo": {"rewards": [{"name": "my_rewards.score"}]}}},
         "spec.objective.grpo.rewards[0].name", "'my_rewards.score' is neither a built-in "
         "reward nor module:function — did you mean my_rewards:score?", "schema"),
    Case("grpo-format-without-pattern", {**PROMPTS, "spec.objective": {
        "type": "grpo", "grpo": {"rewards": [{"name": "format"}]}}},
         "spec.objective.grpo.rewards", "has a `format` reward without `pattern`", "cel"),
    Case("grpo-reward-twice", {**PROMPTS, "spec.objective": {
        "type": "grpo", "grpo": {"rewards": [{"name": "exact_match"},
                                             {"name": "exact_match", "weight": 2}]}}},
         "spec.objective.grpo.rewards", "names a reward more than once", "cel"),
    Case("grpo-step-of-broken-groups", {**PROMPTS, "spec.hyperparameters.batchSizePerDevice": 6,
                                        "spec.objective": {"type": "grpo", "grpo": {
                                            "numGenerations": 4,
                                            "rewards": [{"name": "exact_match"}]}}},
         "spec.hyperparameters.batchSizePerDevice", "no whole number of groups of "
         "objective.grpo.numGenerations 4", None),
    Case("grpo-stopped-early", {**PROMPTS, "spec.dataset.evalFraction": 0.1,
                                "spec.hyperparameters.evalEverySteps": 10,
                                "spec.hyperparameters.earlyStoppingPatience": 2,
                                "spec.objective": {"type": "grpo", "grpo": {
                                    "rewards": [{"name": "exact_match"}]}}},
         "spec.hyperparameters.earlyStoppingPatience", "objective grpo's evaluation has none",
         None),
    Case("grpo-on-preference-data", {**PREFERENCE, "spec.objective": {
        "type": "grpo", "grpo": {"rewards": [{"name": "exact_match"}]}}},
         "spec.dataset.format", "objective grpo trains on prompt data", "cel"),
    Case("dpo-loss-typo", {**PREFERENCE, "spec.objective": {"type": "dpo",
                                                             "dpo": {"loss": "hinge"}}},
         "spec.objective.dpo.loss", "use one of 'sigmoid', 'ipo' or 'robust'", "schema"),
    Case("label-smoothing-half", {**PREFERENCE, "spec.objective": {
        "type": "dpo", "dpo": {"labelSmoothing": 0.5}}},
         "spec.objective.dpo.labelSmoothing", "must be at most 0.49", "schema"),
    Case("beta-zero", {**PREFERENCE, "spec.objective": {"type": "dpo", "dpo": {"beta": 0}}},
         "spec.objective.dpo.beta", "must be greater than 0", "schema"),
    # Kubeflow's TrainJob and JobSet are queued by this label on the object itself; Kueue
    # knows no FineTuneJob, so the job ran unqueued (the operator queues its worker Job)
    Case("kueue-label-on-the-job", {"metadata.labels": {"kueue.x-k8s.io/queue-name": "team-a"}},
         "metadata.labels", "did you mean `spec.kubernetes.queueName: team-a`?", None),
]


INSTALLED = offline_backends()


def test_enough_distinct_cases():
    assert len({c.id for c in CASES}) == len(CASES) >= 25


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_manifest_is_refused_with_an_actionable_message(case: Case, committed_crd):
    doc = edit(minimal_job(), case.changes)
    admission = admit(doc, INSTALLED)  # what every command and the operator refuse
    job, errors = admission.job, admission.errors
    assert errors, "the manifest was accepted"
    matching = [p for p in errors if p.path == case.path]
    assert matching, f"no problem at {case.path}: {[str(p) for p in errors]}"
    text = " | ".join(str(p) for p in matching)
    assert case.message in text
    assert all(p.fix for p in errors)  # every problem says how to fix it

    if case.server == "schema":
        assert schema_errors(committed_crd, doc), "the CRD schema accepts it"
    elif case.server == "cel":
        assert job is not None, "a CEL case must pass the structural checks"
        assert schema_errors(committed_crd, doc) == []
        defaulted = job.model_dump(by_alias=True, exclude_none=True, mode="json")
        assert cel_failures(committed_crd, defaulted), "no CEL rule refuses it"


def test_the_minimal_job_is_valid(committed_crd):
    doc = minimal_job()
    job, problems = check_document(doc)
    assert job is not None and problems == []
    assert schema_errors(committed_crd, doc) == []


@pytest.mark.parametrize("changes", [
    {**DPO, **PREFERENCE},
    DPO,  # format auto: the trainer tells the layout from the columns
    {**PREFERENCE, "spec.objective": {"type": "dpo", "dpo": {"loss": "ipo", "beta": 0.5}}},
    {**PREFERENCE, "spec.objective": {"type": "dpo", "dpo": {"loss": "robust",
                                                             "labelSmoothing": 0.1}}},
    {**PREFERENCE, "spec.objective": {"type": "dpo", "dpo": {"labelSmoothing": 0.05}}},
    {"spec.objective": {"type": "sft"}, "spec.dataset.format": "chat"},
], ids=["dpo", "dpo-auto", "ipo", "robust", "conservative", "sft"])
def test_a_proper_objective_is_valid_to_both(changes, committed_crd):
    """What validate accepts the API server accepts too: its CEL rules and validate agree."""
    doc = edit(minimal_job(), changes)
    admission = admit(doc, INSTALLED)
    assert admission.job is not None and admission.errors == []
    assert schema_errors(committed_crd, doc) == []
    defaulted = admission.job.model_dump(by_alias=True, exclude_none=True, mode="json")
    assert cel_failures(committed_crd, defaulted) == []


def test_all_problems_are_reported_at_once():
    doc = edit(minimal_job(), {"spec.method": {"type": "qlora"}, "spec.resources.gpusPerNode": 0,
                               "spec.strategy": {"precision": "fp32", "offload": "nvme"}})
    _, problems = check_document(doc)
    paths = {p.path for p in problems}
    assert {"spec.method.type", "spec.strategy.precision", "spec.strategy.nvmePath"} <= paths


@pytest.mark.parametrize("spec_change", [
    {"spec.method": {"type": "qlora"}, "spec.resources.gpusPerNode": 0},  # a CEL rule's
    {"spec.hyperparameters.maxSteps": 0},                                 # the schema's
], ids=["cel", "schema"])
def test_a_namespace_that_is_no_label_hides_none_of_the_specs_problems(spec_change):
    """The API server refuses such a namespace in the request's path, before it reads the
    spec; `validate` said that alone, and the spec's problems only once it was mended."""
    doc = edit(minimal_job(), {"metadata.namespace": "Team_A", **spec_change})
    admission = admit(doc, INSTALLED)
    paths = [p.path for p in admission.errors]
    assert paths[0] == "metadata.namespace" and len(paths) > 1, paths
    assert not admission.admitted


def test_non_mapping_document():
    _, problems = check_document(["not", "a", "job"])
    assert problems[0].path == "(document)"


def test_warnings_do_not_fail_a_manifest():
    doc = edit(minimal_job(), {"spec.dataset.uri": "./data/train.jsonl",
                               "spec.azureml": AML})
    job, problems = check_manifest(doc)
    assert job is not None
    assert {p.severity for p in problems} == {"warning"}
    assert {p.path for p in problems} == {"spec.dataset.uri", "spec.azureml"}


def test_a_kueue_label_naming_the_jobs_own_queue_is_harmless():
    doc = edit(minimal_job(), {"metadata.labels": {"kueue.x-k8s.io/queue-name": "team-a"},
                               "spec.kubernetes": {"queueName": "team-a"}})
    assert admit(doc, INSTALLED).errors == []


def test_a_kueue_label_on_a_job_of_another_queue_or_backend_says_what_queues_it():
    other = edit(minimal_job(), {"metadata.labels": {"kueue.x-k8s.io/queue-name": "team-a"},
                                 "spec.kubernetes": {"queueName": "team-b"}})
    (problem,) = admit(other, INSTALLED).errors
    assert problem.path == "metadata.labels"
    assert "spec.kubernetes.queueName is team-b" in problem.message
    azureml = edit(minimal_job(), {"metadata.labels": {"kueue.x-k8s.io/queue-name": "team-a"},
                                   "spec.backend": "azureml", "spec.azureml": AML})
    problem = next(p for p in check_manifest(azureml)[1] if p.path == "metadata.labels")
    assert problem.severity == "error" and "Azure ML" in problem.fix
    # Kueue's older spelling, an annotation: the same
    annotated = edit(minimal_job(), {"metadata.annotations": {
        "kueue.x-k8s.io/queue-name": "team-a"}})
    (problem,) = check_manifest(annotated)[1]
    assert problem.path == "metadata.annotations"
    assert problem.fix == "did you mean `spec.kubernetes.queueName: team-a`?"


@pytest.mark.parametrize(("gpu_type", "meant"), [
    ("Standard_ND96asr_v5", "Standard_ND96asr_v4"),
    ("standard_nd96sr_v4", "Standard_ND96asr_v4"),
    ("STANDARD_NC24ADS_A100_V5", "Standard_NC24ads_A100_v4"),
    ("A100-80G", "A100-80GB"),
])
def test_a_near_miss_gpu_type_gets_the_name_it_likely_meant(gpu_type, meant):
    doc = edit(minimal_job(), {"spec.resources": {"gpusPerNode": 1, "gpuType": gpu_type}})
    (problem,) = [p for p in admit(doc, INSTALLED).problems if p.path.startswith("spec.res")]
    assert (problem.path, problem.severity) == ("spec.resources.gpuType", "warning")
    assert problem.fix.startswith(f"did you mean {meant}")
    assert problem.fix.endswith("(`finetune plan --list-gpus` lists the catalog)")
    far = edit(minimal_job(), {"spec.resources": {"gpusPerNode": 1, "gpuType": "MI300X"}})
    (problem,) = [p for p in admit(far, INSTALLED).problems if p.path.startswith("spec.res")]
    assert problem.fix.startswith("use an Azure VM size")
