"""A checkpoint remembers what it was trained with; a run with other settings is refused
before it starts, naming the fields, instead of failing to load it on every restart."""

from __future__ import annotations

import json
import os

from finetune_trainer import fingerprints, trained_with
from finetune_trainer.config import TrainerConfig
from finetune_trainer.layout import STATE_FILE


def config(**changes) -> TrainerConfig:
    base = {"job": {"name": "demo"}, "model": {"uri": "/models/tiny"},
            "dataset": {"uri": "/data/train.jsonl"}, "method": {"type": "lora",
                                                                "lora": {"r": 8}},
            "strategy": {"type": "ddp"}, "hyperparameters": {"maxSteps": 10},
            "output": {"uri": "/out"}}
    for dotted, value in changes.items():
        *parents, leaf = dotted.split(".")
        node = base
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return TrainerConfig.model_validate(base)


def checkpoint(output, step: int, settings: dict | None) -> None:
    folder = output / "checkpoints" / f"step-{step:08d}"
    folder.mkdir(parents=True)
    (folder / STATE_FILE).write_text("{}")
    if settings is not None:
        (folder / trained_with.FILE).write_text(json.dumps(settings))


def test_the_record_names_spec_fields_and_leaves_out_what_may_change():
    record = trained_with.record(config())
    assert record["method.lora.r"] == 8 and record["strategy.type"] == "ddp"
    assert record["method.lora.targetModules"] == ["all-linear"]
    unrecorded = config(**{"hyperparameters.maxSteps": 500,
                           "hyperparameters.learningRate": 1e-3,
                           "output.checkpointEverySteps": 7, "output.keepLast": 5,
                           "hyperparameters.microBatchSize": 2})  # the same steps
    assert trained_with.record(unrecorded) == record
    assert trained_with.record(config(**{"method.type": "full", "method.lora": None}))[
        "method.lora.r"] is None


def test_a_changed_rank_is_refused_naming_it_and_the_fix(tmp_path):
    checkpoint(tmp_path, 3, trained_with.record(config()))
    checkpoint(tmp_path, 6, trained_with.record(config()))
    line = trained_with.refusal(tmp_path, config(**{"method.lora.r": 16,
                                                    "strategy.precision": "fp32"}),
                                "use a new folder")
    assert line == (f"{tmp_path} holds checkpoints trained with other settings "
                    "(method.lora.r: 8 → 16; strategy.precision: bf16 → fp32; newest "
                    "step-00000006), which this job cannot resume from — use a new folder")
    assert "\n" not in line


def test_resuming_with_the_same_settings_or_no_record_is_allowed(tmp_path):
    assert trained_with.refusal(tmp_path, config(), "x") is None  # nothing there yet
    checkpoint(tmp_path, 2, trained_with.record(config()))
    assert trained_with.refusal(tmp_path, config(**{"hyperparameters.maxSteps": 99}),
                                "x") is None
    checkpoint(tmp_path, 4, None)  # written before records existed: nothing to hold against
    assert trained_with.refusal(tmp_path, config(**{"method.lora.r": 2}), "x") is None


def test_an_incomplete_newer_checkpoint_is_not_the_one_compared(tmp_path):
    checkpoint(tmp_path, 2, trained_with.record(config()))
    partial = tmp_path / "checkpoints" / "step-00000004.partial"
    partial.mkdir()
    (partial / trained_with.FILE).write_text(json.dumps(
        trained_with.record(config(**{"method.lora.r": 16}))))
    assert trained_with.refusal(tmp_path, config(), "x") is None


def test_ddp_and_fsdp_resume_on_other_workers_that_keep_the_global_batch(tmp_path):
    """A step is one global batch however the workers split it, and DCP reshards: 2
    workers of 4 sequences resume on 1 of 4 x 2 passes (`finetune run --nproc 1`) or on 4
    of 2. Another global batch would move the data position: refused."""
    for strategy in ("ddp", "fsdp"):
        where = tmp_path / strategy
        two = {"strategy.type": strategy, "workers": 2,
               "hyperparameters.batchSizePerDevice": 4}
        checkpoint(where, 3, trained_with.record(config(**two)))
        one = {**two, "workers": 1, "hyperparameters.gradientAccumulationSteps": 2}
        assert trained_with.refusal(where, config(**one), "x") is None
        four = {**two, "workers": 4, "hyperparameters.batchSizePerDevice": 2}
        assert trained_with.refusal(where, config(**four), "x") is None
        line = trained_with.refusal(where, config(**{**two, "workers": 4}), "x")
        assert f"{trained_with.GLOBAL_BATCH}: 8 → 16" in line, line


def test_a_zero_checkpoint_resumes_only_on_as_many_workers(tmp_path):
    """ZeRO partitions the optimizer state by worker, and DeepSpeed loads it on as many:
    another count would fail the load on every restart. Refused, saying how many."""
    two = {"strategy.type": "zero2", "workers": 2}
    checkpoint(tmp_path, 3, trained_with.record(config(**two)))
    line = trained_with.refusal(tmp_path, config(**{
        **two, "workers": 1, "hyperparameters.gradientAccumulationSteps": 2}),
        "use a new folder")
    assert f"({trained_with.WORKERS}: 2 → 1; newest step-00000003)" in line, line
    assert line.endswith("ZeRO checkpoints resume only on as many workers as wrote them: "
                         "run it on 2 workers again, or use a new folder"), line


def test_a_checkpoint_that_recorded_each_workers_batch_is_compared_as_such(tmp_path):
    """Written before the worker count was known to the record: its per-worker batch and
    accumulation are held against the job's, as they were."""
    checkpoint(tmp_path, 3, trained_with.record(config()))  # no workers: per-worker keys
    assert "hyperparameters.gradientAccumulationSteps" in trained_with.read(
        tmp_path / "checkpoints" / "step-00000003")
    assert trained_with.refusal(tmp_path, config(workers=2), "x") is None
    line = trained_with.refusal(tmp_path, config(**{
        "workers": 1, "hyperparameters.gradientAccumulationSteps": 2}), "x")
    assert "hyperparameters.gradientAccumulationSteps: 1 → 2" in line, line


def test_another_objective_or_its_settings_is_refused_naming_them(tmp_path):
    """The trap of #58: a DPO run's folder given to an SFT job resumed the DPO checkpoint,
    trained one step and replaced its export. What is trained is recorded, and compared."""
    dpo = {"objective.type": "dpo", "objective.dpo.beta": 0.1}
    checkpoint(tmp_path, 6, trained_with.record(config(**dpo)))
    line = trained_with.refusal(tmp_path, config(), "use a new folder")
    assert "(objective.type: dpo → sft; newest step-00000006)" in line, line
    beta = trained_with.refusal(tmp_path, config(**{**dpo, "objective.dpo.beta": 0.5}), "x")
    assert "(objective.dpo.beta: 0.1 → 0.5; newest" in beta, beta
    assert trained_with.refusal(tmp_path, config(**dpo), "x") is None
    # how the reference is taken (once before step 1, or at every batch), not what it is
    precomputed = config(**{**dpo, "objective.dpo.precomputeRefLogProbs": True})
    assert trained_with.refusal(tmp_path, precomputed, "x") is None
    assert not any("precompute" in key for key in trained_with.record(precomputed))


def data_file(folder, text: str):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "train.jsonl"
    path.write_text(text)
    return path


def recorded_with_data(output, data, **changes) -> dict:
    """The record a run on `data` writes (its digest computed as the trainer's rank 0 does)."""
    job = config(**{"dataset.uri": str(data), **changes})
    content = fingerprints.dataset(job.dataset, None, output)
    checkpoint(output, 3, trained_with.record(job, content))
    return trained_with.read(output / "checkpoints" / "step-00000003")


def test_the_data_is_known_by_its_content_not_its_name(tmp_path):
    """A file edited in place is other data under the same name: refused, with the way to
    say it is on purpose. The same bytes under another name (copied to a volume; Azure ML's
    mount path of another attempt) are the same data: they resume."""
    output = tmp_path / "out"
    first = data_file(tmp_path / "a", '{"text": "one"}\n')
    saved = recorded_with_data(output, first)
    assert saved[trained_with.DATA_CONTENT]["files"] == 1
    copy = data_file(tmp_path / "copy", first.read_text())
    assert trained_with.refusal(output, config(**{"dataset.uri": str(copy)}), "x") is None

    first.write_text('{"text": "one"}\n{"text": "two"}\n')
    line = trained_with.refusal(output, config(**{"dataset.uri": str(first)}), "a new folder")
    assert f"(dataset content: {first} (1 file, 16 bytes, sha256 " in line, line
    assert f"→ {first} (1 file, 32 bytes, sha256 " in line, line
    assert line.endswith("— a new folder; or, if the data changed on purpose, set "
                         "spec.output.resumeWithChangedData: true to train on from the "
                         "checkpoint"), line
    allowed = config(**{"dataset.uri": str(first), "output.resumeWithChangedData": True})
    assert trained_with.refusal(output, allowed, "x") is None
    content = fingerprints.dataset(allowed.dataset, None, output)
    assert [line.split(":")[0] for line in trained_with.changed_data(
        output, allowed, content)] == [trained_with.DATA_CONTENT]


def test_changed_data_on_purpose_still_refuses_another_model_or_sequence_length(tmp_path):
    output = tmp_path / "out"
    data = data_file(tmp_path / "a", '{"text": "one"}\n')
    recorded_with_data(output, data)
    data.write_text('{"text": "edited"}\n')
    line = trained_with.refusal(output, config(**{
        "dataset.uri": str(data), "output.resumeWithChangedData": True,
        "model.uri": "/models/other", "dataset.maxSeqLength": 64}), "x")
    assert "model.uri: /models/tiny → /models/other" in line, line
    assert "dataset.maxSeqLength: 2048 → 64" in line and "dataset content" not in line, line
    assert "resumeWithChangedData" not in line  # it would not help


def test_a_digest_is_taken_once_per_folder_while_the_files_stay_as_they_were(tmp_path):
    """Every worker of every restart asks; the files are read once: the digest is kept with
    their sizes and times and read back while those hold (and taken again once they move)."""
    output, data = tmp_path / "out", data_file(tmp_path / "a", '{"text": "one"}\n')
    source = config(**{"dataset.uri": str(data)}).dataset
    first = fingerprints.dataset(source, None, output)
    assert (output / fingerprints.CACHE).is_file()
    stat = data.stat()
    data.write_text('{"text": "owt"}\n')  # the same size, its time put back: not read again
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert fingerprints.dataset(source, None, output) == first
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert fingerprints.dataset(source, None, output)["sha256"] != first["sha256"]
    assert fingerprints.dataset(source, None, None)["sha256"] != first["sha256"]


def test_a_folder_is_known_by_its_files_names_and_hub_data_by_its_uri(tmp_path):
    folder = tmp_path / "data"
    data_file(folder, '{"text": "one"}\n')
    (folder / "validation.jsonl").write_text('{"text": "two"}\n')
    source = config(**{"dataset.uri": str(folder)}).dataset
    both = fingerprints.dataset(source, None, None)
    assert (both["files"], both["bytes"]) == (2, 32)
    (folder / "validation.jsonl").rename(folder / "test.jsonl")  # another split now
    assert fingerprints.dataset(source, None, None)["sha256"] != both["sha256"]
    hub = config(**{"dataset.uri": "hf://org/chats"})
    assert fingerprints.dataset(hub.dataset, None, None) is None
    assert trained_with.record(hub)["dataset.uri"] == "hf://org/chats"
    missing = config(**{"dataset.uri": str(tmp_path / "nowhere.jsonl")}).dataset
    assert fingerprints.dataset(missing, None, None) is None  # the reader says why, later


def test_an_export_with_no_checkpoint_is_never_replaced_by_a_run_from_step_0(tmp_path):
    """Checkpoints moved away (or never there: another tool's export), final/ kept: a run
    there would start at step 0 and write its own final/ over that model at its end."""
    assert trained_with.refusal(tmp_path, config(), "x") is None
    (tmp_path / "final").mkdir()
    line = trained_with.refusal(tmp_path, config(), "use a new folder")
    assert line == (f"{tmp_path} holds an exported model (final/) and no checkpoint it could "
                    "resume from: this run would start at step 0 and replace it — use a new "
                    "folder")
    checkpoint(tmp_path, 6, trained_with.record(config()))
    assert trained_with.refusal(tmp_path, config(), "x") is None  # its own: it may go on


def test_the_job_that_wrote_it_is_named_when_it_is_another(tmp_path):
    checkpoint(tmp_path, 2, trained_with.record(config(**{
        "job.name": "dpo-demo", "job.namespace": "ml", "job.manifest": "/w/dpo.yaml"})))
    line = trained_with.refusal(tmp_path, config(**{"method.lora.r": 4}), "x")
    assert "newest step-00000002, written by FineTuneJob ml/dpo-demo from /w/dpo.yaml)" in (
        line), line
    # another job with the same settings resumes: the identity is recorded, not compared
    assert trained_with.refusal(tmp_path, config(), "x") is None


def test_azure_ml_locations_are_recorded_as_placeholders_not_mount_paths():
    """Each Azure ML job mounts its inputs under a path of its own: a restart (a new Azure
    ML job) would otherwise find every checkpoint's model 'changed'."""
    from finetune_trainer.__main__ import bind_locations

    given = config(**{"model.uri": "${{inputs.model}}", "dataset.uri": "${{inputs.dataset}}",
                      "output.uri": "${{outputs.output}}"})
    first, second = (bind_locations(given, [f"inputs.model=/mnt/{n}/model",
                                            f"inputs.dataset=/mnt/{n}/data",
                                            f"outputs.output=/mnt/{n}/out"]) for n in "ab")
    assert first.model.uri == "/mnt/a/model"
    assert trained_with.record(first) == trained_with.record(second)
    assert trained_with.record(first)["model.uri"] == "${{inputs.model}}"
