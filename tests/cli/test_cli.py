"""`finetune validate` and `finetune render` as a user runs them: a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from finetune_trainer import layout
from tests.cli.demo_tree import examples_in
from tests.conftest import EXAMPLES, REPO, SWEEP_EXAMPLES, minimal_job
from tests.support import waits

pytestmark = pytest.mark.process

FINETUNE = [sys.executable, "-m", "finetune_operator.cli"]
PUSHED = "registry.example/finetune-trainer:1.2.3"
"""A trainer image of a registry (without one, the default placeholder is a warning)."""


def finetune(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*FINETUNE, *args], input=stdin, capture_output=True, text=True,
                          cwd=REPO, timeout=waits.seconds_left())


def test_validate_examples_exit_zero(tmp_path):
    """As `make demo` validates them, once it built the tiny model examples 01 and 08 use."""
    result = finetune("validate", *map(str, examples_in(tmp_path)))
    assert result.returncode == 0, result.stderr
    assert result.stdout.count(": valid FineTuneJob") == len(EXAMPLES)
    assert result.stdout.count(": valid FineTuneSweep") == len(SWEEP_EXAMPLES) >= 1


def test_validate_refuses_a_sweep_whose_searched_value_breaks_the_template():
    sweep = yaml.safe_load(SWEEP_EXAMPLES[0].read_text())
    sweep["spec"]["searchSpace"]["resources.nodes"] = {"type": "intRange", "min": 0, "max": 2}
    result = finetune("validate", "-", stdin=yaml.safe_dump(sweep))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        '<stdin>: spec.searchSpace["resources.nodes"]: the value 0 makes '
        "spec.template.resources.nodes invalid: is 0, must be at least 1 — set a value at least 1"]


def test_validate_refuses_a_float_range_on_an_integer_field():
    """uniform 1..8 on batchSizePerDevice: its ends are whole, every draw (3.92, 4.05)
    is not, and each trial would be refused; the sweep is, before any trial runs."""
    sweep = yaml.safe_load(SWEEP_EXAMPLES[0].read_text())
    sweep["spec"]["searchSpace"]["hyperparameters.batchSizePerDevice"] = {
        "type": "uniform", "min": 1, "max": 8}
    result = finetune("validate", "-", stdin=yaml.safe_dump(sweep))
    assert result.returncode == 2, result.stdout
    assert result.stderr.strip().splitlines() == [
        '<stdin>: spec.searchSpace["hyperparameters.batchSizePerDevice"]: uniform draws '
        "fractions (e.g. 4.5), and spec.template.hyperparameters.batchSizePerDevice takes an "
        "integer — use `type: intRange` (e.g. min: 1, max: 8) or `type: choice` with the "
        "values to try"]


def test_validate_reports_one_line_per_problem_and_exits_2():
    bad = minimal_job(method={"type": "qlora"}, resources={"gpusPerNode": 0, "nodes": 0})
    result = finetune("validate", "-", stdin=yaml.safe_dump(bad))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines == ["<stdin>: spec.resources.nodes: is 0, must be at least 1 — set a value at "
                     "least 1"]
    assert result.stdout == ""


def test_validate_every_rule_problem_on_its_own_line():
    bad = minimal_job(method={"type": "qlora"}, resources={"gpusPerNode": 0},
                      strategy={"precision": "fp32"})
    result = finetune("validate", "-", stdin=yaml.safe_dump(bad))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("<stdin>: spec.method.type: qlora needs GPUs")
    assert lines[1].startswith("<stdin>: spec.strategy.precision: qlora cannot compute in fp32")
    assert all(" — " in line for line in lines)


def test_validate_multi_document_file(tmp_path):
    good = minimal_job()
    bad = minimal_job(hyperparameters={})
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hf-token"}}
    path = tmp_path / "jobs.yaml"
    path.write_text(yaml.safe_dump_all([secret, good, bad]))
    result = finetune("validate", str(path))
    assert result.returncode == 2
    assert f"{path}#2: valid FineTuneJob default/demo" in result.stdout
    assert f"{path}#1: skipped Secret" in result.stderr
    assert f"{path}#3: spec.hyperparameters: neither epochs nor maxSteps is set" in result.stderr


def test_validate_yaml_syntax_error_names_the_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("apiVersion: finetune.dev/v1alpha1\nkind: FineTuneJob\nspec:\n  model: [\n")
    result = finetune("validate", str(path))
    assert result.returncode == 2
    assert f"{path}:5:1: not valid YAML" in result.stderr
    assert "fix the syntax (indentation, quoting, colons)" in result.stderr
    path.write_text("apiVersion: finetune.dev/v1alpha1\nkind: FineTuneJob\nmetadata:\n"
                    "\tname: x\n")
    tabbed = finetune("validate", str(path))
    assert tabbed.returncode == 2
    assert tabbed.stderr.strip().endswith(  # an editor's tab, not a syntax to look up
        ":4:1: not valid YAML: found character '\\t' that cannot start any token — indent "
        "with spaces: YAML takes no tab there")


def test_validate_missing_file():
    result = finetune("validate", "does-not-exist.yaml")
    assert result.returncode == 2
    assert "does-not-exist.yaml: cannot read: No such file or directory" in result.stderr


def test_validate_file_without_jobs(tmp_path):
    path = tmp_path / "other.yaml"
    path.write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n")
    result = finetune("validate", str(path))
    assert result.returncode == 2
    assert "no FineTuneJob found" in result.stderr


def test_a_file_without_a_job_says_why_in_json_too(tmp_path):
    """`validate -o json` said `"valid": false` with no problem in it (the reason went to
    stderr as text); a kind in the wrong case is pointed at; a missing kind or apiVersion
    reads `is missing`, not `None is not FineTuneJob`."""
    path = tmp_path / "job.yaml"
    manifest = minimal_job()
    manifest["kind"] = "FinetuneJob"
    path.write_text(yaml.safe_dump(manifest))
    result = finetune("validate", "-o", "json", str(path))
    assert result.returncode == 2
    assert json.loads(result.stdout)["problems"] == [{
        "source": str(path), "field": "", "severity": "error",
        "message": f"{path}: no FineTuneJob found — check `kind: FineTuneJob`",
        "fix": "check `kind: FineTuneJob`"}]
    assert result.stderr.splitlines() == [f"{path}: skipped FinetuneJob (not a FineTuneJob; "
                                          "kinds are case-sensitive: `kind: FineTuneJob`?)"]
    # a sweep, spelled right, to a command that takes jobs: no hint at the kind it has, nor
    # a `check kind:` after it
    sweep = REPO / "examples/07-sweep-lora-lr.yaml"
    rendered = finetune("render", str(sweep))
    assert rendered.returncode == 2 and rendered.stderr.splitlines() == [
        f"{sweep}: skipped FineTuneSweep (this command takes FineTuneJobs: a sweep's trials, "
        "its spec.template with the searched values set, run on a cluster; `finetune "
        "validate` checks it, `finetune plan` sizes its largest trial)",
        f"{sweep}: no FineTuneJob found, a FineTuneSweep only — apply it to a cluster, whose "
        "operator makes its trials"]
    del manifest["kind"], manifest["apiVersion"]
    path.write_text(yaml.safe_dump(manifest))
    result = finetune("validate", str(path))
    assert result.stderr.splitlines() == [
        f"{path}: apiVersion: is missing — use `apiVersion: finetune.dev/v1alpha1`",
        f"{path}: kind: is missing — use `kind: FineTuneJob`"]


def test_warnings_keep_exit_zero(tmp_path):
    example = next(p for p in examples_in(tmp_path) if p.name == "01-tiny-cpu-lora.yaml")
    result = finetune("validate", str(example))
    assert result.returncode == 0
    assert "warning: spec.model.uri: relative paths" in result.stderr


def test_validate_before_make_demo_names_what_builds_the_examples_model(tmp_path):
    example = next(p for p in examples_in(tmp_path, demo_built=False)
                   if p.name == "01-tiny-cpu-lora.yaml")
    result = finetune("validate", str(example))
    model = tmp_path / "examples" / ".." / layout.DEMO_MODEL
    assert (f"{example}: spec.model.uri: {model} does not exist on this machine — run `make "
            "demo` first: it builds the tiny model these examples use "
            f"({layout.DEMO_MODEL})") in result.stderr.splitlines(), result.stderr


def test_validate_exits_2_for_a_relative_path_that_is_not_there(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(minimal_job(dataset={"uri": "./data/train.jsonl"})))
    result = finetune("validate", str(path))
    assert f"{path}: spec.dataset.uri: {tmp_path / 'data/train.jsonl'} does not exist" in (
        result.stderr)
    assert result.returncode == 2 and result.stdout == "", result.stdout


def test_a_key_written_twice_is_refused_as_kubectl_does(tmp_path):
    """PyYAML keeps the last of two equal keys without a word: a second learningRate (or a
    second method: block) replaced the first, and `validate` said valid where kubectl's
    YAML reader refuses the file. A merge key's values may still be overridden."""
    path = tmp_path / "job.yaml"
    text = yaml.safe_dump(minimal_job(), sort_keys=False)
    twice = "  hyperparameters:\n    learningRate: 0.1\n    learningRate: 1\n"
    path.write_text(text.replace("  hyperparameters:\n", twice, 1))
    result = finetune("validate", str(path))
    assert result.returncode == 2, result.stdout
    line = next(i for i, t in enumerate(path.read_text().splitlines(), 1) if "learningRate" in t)
    assert result.stderr.splitlines() == [
        f"{path}:{line + 1}:5: not valid YAML: found the key 'learningRate' a second time "
        f"(first on line {line}) — keep one of them"]
    from finetune_operator.manifests import read_documents

    merged = tmp_path / "merged.yaml"
    merged.write_text("common: &common {maxSteps: 5, learningRate: 0.1}\n"
                      "hyperparameters:\n  <<: *common\n  maxSteps: 7\n")
    (document,) = read_documents(str(merged))
    assert document.data["hyperparameters"] == {"maxSteps": 7, "learningRate": 0.1}


def test_a_learning_rate_written_as_kubectl_takes_it_is_a_number(tmp_path):
    """`learningRate: 1e-4` is how users write it and a number to kubectl; YAML 1.1 (PyYAML)
    read it as the string '1e-4', and validate refused a manifest kubectl applies."""
    path = tmp_path / "job.yaml"
    text = yaml.safe_dump(minimal_job(), sort_keys=False)
    path.write_text(text.replace("    maxSteps: 10\n", "    maxSteps: 1e3\n    learningRate: 1e-4\n"
                                 "    warmupRatio: .5e-1\n"))
    assert finetune("validate", str(path)).returncode == 0
    result = finetune("render", "-o", "json", str(path))
    assert result.returncode == 0, result.stderr
    config_map = next(o for o in json.loads(result.stdout)["items"] if o["kind"] == "ConfigMap")
    trainer = yaml.safe_load(config_map["data"]["trainer.yaml"])["hyperparameters"]
    assert (trainer["learningRate"], trainer["maxSteps"], trainer["warmupRatio"]) == (
        1e-4, 1000, 0.05)


def test_render_kubernetes_job_yaml():
    result = finetune("render", str(REPO / "examples/02-aks-fsdp-full-8b.yaml"))
    assert result.returncode == 0, result.stderr
    objects = list(yaml.safe_load_all(result.stdout))
    config_map = next(o for o in objects if o["kind"] == "ConfigMap")
    assert config_map["metadata"]["name"] == "llama-8b-full-trainer"
    trainer = yaml.safe_load(config_map["data"]["trainer.yaml"])
    assert trainer["kind"] == "TrainerConfig"
    assert trainer["dataset"]["uri"] == "/mnt/pvc/datasets/support-chats/train.jsonl"
    assert trainer["strategy"]["type"] == "fsdp"
    assert "&id" not in result.stdout and "*id" not in result.stdout  # spelled out, no aliases


def test_render_json_and_invalid_input():
    result = finetune("render", "-o", "json", str(REPO / "examples/04-azureml-zero3.yaml"))
    assert result.returncode == 0, result.stderr
    model = json.loads(result.stdout)["inputs"]["model"]  # the Azure ML command job
    assert model["path"].startswith("azureml://registries/") and model["type"] == "custom_model"
    bad = finetune("render", "-", stdin=yaml.safe_dump(minimal_job(backend="slurm")))
    assert bad.returncode == 2
    assert "spec.backend: 'slurm' is not an installed backend" in bad.stderr
    # the flag's wrong value is the flag's, not the manifest's (which names no backend)
    flag = finetune("render", str(REPO / "examples/01-tiny-cpu-lora.yaml"), "--backend", "slurm")
    assert flag.returncode == 2 and "spec.backend" not in flag.stderr, flag.stderr
    assert "Invalid value for --backend: 'slurm' is not an installed backend — use one of: " \
        "azureml, kubernetes" in flag.stderr


def test_help_reads_well():
    result = finetune("--help")
    assert result.returncode == 0
    assert "validate" in result.stdout and "render" in result.stdout
    sub = finetune("validate", "--help")
    assert "exits 2 when any manifest is invalid" in sub.stdout
    assert "--all-namespaces" in finetune("operator", "--help").stdout
    both = finetune("operator", "--all-namespaces", "--namespace", "ml")
    assert both.returncode == 2 and "not both" in both.stderr


def test_plan_prints_a_lone_surrogate_escaped_instead_of_crashing(tmp_path):
    """#25, item 2: "\\uD800" is a valid YAML string and no valid UTF-8."""
    manifest = minimal_job(model={"uri": "/models/\ud800x"})
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest, allow_unicode=False))
    result = finetune("plan", "--offline", str(path))
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert "/models/\\ud800x" in result.stdout


def test_a_foreign_kind_is_quoted_so_it_cannot_forge_a_line(tmp_path):
    """#25, item 3: a kind with a newline read like a real `FILE: path: problem` line."""
    path = tmp_path / "two.yaml"
    path.write_text('apiVersion: v1\nkind: "Foo\\nx.yaml: spec.model: forged \\u001b[31m"\n'
                    "---\n" + yaml.safe_dump(minimal_job(kubernetes={"image": PUSHED})))
    result = finetune("validate", str(path))
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert lines == [f"{path}#1: skipped 'Foo\\nx.yaml: spec.model: forged \\x1b[31m' "
                     "(not a FineTuneJob)"]


def test_an_empty_or_spaced_key_is_named_quoted(tmp_path):
    """#25, item 5: `FILE: : is not a known field` named nothing."""
    manifest = minimal_job()
    manifest["spec"][""] = 1
    manifest["spec"]["a b"] = 2
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))
    result = finetune("validate", str(path))
    assert result.returncode == 2
    assert f'{path}: spec[""]: is not a known field' in result.stderr
    assert f'{path}: spec["a b"]: is not a known field' in result.stderr


def test_a_control_character_is_named_with_its_line_on_one_line(tmp_path):
    """#25, item 4: YAML's reader errors had no line number and spilled onto a second,
    unprefixed line."""
    path = tmp_path / "nul.yaml"
    path.write_bytes(b"apiVersion: finetune.dev/v1alpha1\nkind: FineTuneJob\n"
                     b"metadata: {name: a\x00b}\n")
    result = finetune("validate", str(path))
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"{path}:3:19: not valid YAML: character #x0000 is not allowed — remove it (control "
        "characters other than tab and newline)"]


def test_plan_warns_of_a_max_seq_length_beyond_the_models_context(tmp_path):
    """A model made for 1,024 positions asked to train on 4,096-token samples: it trains
    (HF's and TRL's trainers only warn too), and `finetune plan` says which field to lower."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 1000, "hidden_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
        "max_position_embeddings": 1024}))
    manifest = minimal_job(model={"uri": str(model)})
    manifest["spec"]["dataset"]["maxSeqLength"] = 4096
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))
    result = finetune("plan", "--offline", str(path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == (
        "warning: spec.dataset.maxSeqLength: 4096 is longer than the model's context "
        "(max_position_embeddings 1024 in its config.json): a sample longer than 1024 "
        "tokens trains at positions the model was not made for — set maxSeqLength to 1024 "
        "or less, or use a model with a longer context")
    manifest["spec"]["dataset"]["maxSeqLength"] = 1024
    path.write_text(yaml.safe_dump(manifest))
    assert "warning:" not in finetune("plan", "--offline", str(path)).stdout


def test_a_sweeps_bad_range_reads_as_its_own_words_with_an_explain_that_works(tmp_path):
    """pydantic's `Value error, ` prefix leaked into the line, and the explain path named
    the FineTuneJob kind and a map key, which `kubectl explain` takes neither of."""
    sweep = yaml.safe_load((REPO / "examples/07-sweep-lora-lr.yaml").read_text())
    sweep["spec"]["searchSpace"]["hyperparameters.learningRate"].update(min=5e-4, max=1e-5)
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep))
    result = finetune("validate", str(path))
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert line.startswith(f'{path}: spec.searchSpace["hyperparameters.learningRate"]: '
                           "logUniform needs min < max"), line
    assert line.endswith("see `kubectl explain ftsweep.spec.searchSpace`"), line


def test_the_cli_reference_is_the_commands_own_help():
    """docs/cli-reference.md is generated from each command's --help (`make crds`): an option
    added or reworded without regenerating it fails here."""
    import subprocess
    import sys

    from click.testing import CliRunner

    from finetune_operator import clidoc
    from finetune_operator.cli import main as finetune

    # the same whether or not a command ran before in this process (click remembers the
    # help option on the command: CI once saw `-h, --help` where `make crds` wrote `--help`)
    fresh = subprocess.run([sys.executable, "-m", "finetune_operator.clidoc", "--check"],
                           capture_output=True, text=True, timeout=waits.seconds_left())
    assert fresh.returncode == 0, fresh.stderr
    CliRunner().invoke(finetune, ["validate", "--help"])
    assert clidoc.CLI_REFERENCE.read_text() == clidoc.render_markdown(finetune), (
        "docs/cli-reference.md is stale: run `make crds`")


def test_a_kueue_label_on_the_job_is_refused_by_validate_and_render_alike(tmp_path):
    """The Kubeflow habit (TrainJob, JobSet): the queue label on the object itself. Kueue
    never saw a FineTuneJob's, and the job ran unqueued; both commands now say where the
    queue goes, as the operator does (they all ask `admission.admit`)."""
    manifest = minimal_job()
    manifest["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team-a"}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))
    for command in ("validate", "render"):
        result = finetune(command, str(path))
        assert result.returncode == 2, (command, result.stderr)
        assert (f"{path}: metadata.labels: kueue.x-k8s.io/queue-name: Kueue reads it only "
                "on the kinds it integrates (Job, JobSet, TrainJob, ...), not here: the "
                "workers would start without waiting in queue team-a — did you mean "
                "`spec.kubernetes.queueName: team-a`?") in result.stderr.splitlines(), (
            command, result.stderr)


def test_validate_warns_of_two_jobs_writing_one_output_folder(tmp_path):
    """#58: the operator launches one live job per output folder and refuses the other;
    a file that holds two such jobs is said to at once (a warning: each job is valid)."""
    first = minimal_job(output={"uri": "pvc://ckpt/runs/a"})
    second = minimal_job(output={"uri": "pvc://ckpt/runs/a/"})
    second["metadata"]["name"] = "again"
    elsewhere = minimal_job(output={"uri": "pvc://ckpt/runs/b"})
    elsewhere["metadata"]["name"] = "other"
    path = tmp_path / "jobs.yaml"
    path.write_text(yaml.safe_dump_all([first, second, elsewhere]))
    result = finetune("validate", str(path))
    assert result.returncode == 0, result.stderr
    assert [line for line in result.stderr.splitlines() if "spec.output.uri" in line] == [
        f"{path}#2: warning: spec.output.uri: pvc://ckpt/runs/a/ is also the output folder of "
        f"FineTuneJob default/demo ({path}#1): one folder holds one job's checkpoints and "
        "model, so the operator launches only one of them and refuses the other (OutputInUse) "
        "— give each job a folder of its own"]
    assert result.stdout.count(": valid FineTuneJob") == 3


@pytest.mark.parametrize(("example", "field"), [
    ("02-aks-fsdp-full-8b.yaml", "spec.kubernetes.image"),
    ("04-azureml-zero3.yaml", "spec.azureml.environment")])
def test_render_warns_of_the_placeholder_trainer_image_and_names_the_setting(example, field):
    """`finetune-trainer:0.1.0` is in no registry: rendered without a word, its workers
    would never start."""
    import os

    path = str(REPO / "examples" / example)
    env = {k: v for k, v in os.environ.items() if k != "FINETUNE_TRAINER_IMAGE"}
    placeholder = subprocess.run([*FINETUNE, "render", path], capture_output=True, text=True,
                                 cwd=REPO, timeout=waits.seconds_left(), env=env)
    assert placeholder.returncode == 0, placeholder.stderr
    (line,) = [line for line in placeholder.stderr.splitlines() if "FINETUNE_TRAINER_IMAGE" in line]
    assert line.startswith(f"{path}: warning: {field}: ") and "finetune-trainer:0.1.0" in line
    assert "trainer.image.repository" in line
    assert "finetune-trainer:0.1.0" in placeholder.stdout
    pushed = subprocess.run([*FINETUNE, "render", path], capture_output=True, text=True,
                            cwd=REPO, timeout=waits.seconds_left(),
                            env={**env, "FINETUNE_TRAINER_IMAGE": "acr.io/finetune-trainer:1"})
    assert pushed.returncode == 0 and "FINETUNE_TRAINER_IMAGE" not in pushed.stderr
    assert "acr.io/finetune-trainer:1" in pushed.stdout
