"""Unset gradientCheckpointing and compile: decided once by the planner from its memory
estimate and the run's length, printed by `finetune plan`, handed to the workers."""

from __future__ import annotations

import pytest

from finetune_operator import gpu_catalog as catalog
from finetune_operator.api import FineTuneJob
from finetune_operator.planner import choose_step_settings, resolve_strategy
from finetune_operator.planner.plan import AUTO_ORDER, TOKENS_PER_PASS
from finetune_operator.planner.report import plan_with_notes, table
from finetune_operator.planner.sources import from_table
from finetune_operator.trainer_config import build_trainer_config
from tests.conftest import minimal_job

LLAMA_8B = "meta-llama/Llama-3.1-8B"  # in the planner's built-in table: no hub needed
H100_X8 = "Standard_ND96isr_H100_v5"  # 80 GB
T4 = "Standard_NC4as_T4_v3"  # 16 GB
A100_40_X8 = "Standard_ND96asr_v4"  # 40 GB


def job(method: str = "lora", *, gpu_type: str | None = H100_X8, batch: int = 1,
        seq: int = 2048, steps: int | None = 20_000, strategy: dict | None = None,
        gpus: int = 8, accumulation: int = 1, micro: int | None = None,
        packing: bool = True) -> FineTuneJob:
    hyper = {"batchSizePerDevice": batch, "gradientAccumulationSteps": accumulation}
    hyper.update({"maxSteps": steps} if steps else {"epochs": 1})
    if micro is not None:
        hyper["microBatchSize"] = micro
    resources = {"gpusPerNode": gpus}
    if gpu_type:
        resources["gpuType"] = gpu_type
    manifest = minimal_job(model={"uri": f"hf://{LLAMA_8B}"}, method={"type": method},
                           dataset={"uri": "pvc://data/train.jsonl", "maxSeqLength": seq,
                                    "packing": packing},
                           hyperparameters=hyper, resources=resources,
                           strategy={"type": "ddp", **(strategy or {})})
    return FineTuneJob.model_validate(manifest)


def settings(j: FineTuneJob, strategy: str = "ddp"):
    return choose_step_settings(j, None, strategy)


def test_checkpointing_off_when_the_activations_fit():
    chosen = settings(job(batch=1, seq=2048))
    assert chosen.gradient_checkpointing is False
    assert "gradientCheckpointing unset → off" in chosen.notes[0]
    assert "fits with 10% headroom" in chosen.notes[0]


def test_selective_then_full_as_the_activations_grow():
    levels = []
    for batch in (1, 4, 16):  # a set microBatchSize: the pass itself grows
        chosen = settings(job(batch=batch, seq=4096, micro=batch))
        assert chosen.micro_batch == batch
        levels.append("off" if not chosen.gradient_checkpointing else chosen.checkpoint_policy)
    assert levels[0] == "off"
    assert levels[-1] == "full"
    order = ["off", "selective", "full"]
    assert [order.index(level) for level in levels] == sorted(order.index(x) for x in levels)


def test_full_checkpointing_where_the_planner_cannot_tell():
    no_gpu_type = settings(job(gpu_type=None))
    assert no_gpu_type.gradient_checkpointing is True
    assert no_gpu_type.checkpoint_policy == "full"
    assert "gpuType is not set" in no_gpu_type.notes[0]


def test_no_checkpointing_on_cpu_workers():
    """CPU workers resolved an unset gradientCheckpointing to full, as an unknown GPU does:
    recomputing only slowed them, whose activations sit in plentiful host memory."""
    cpu = job(gpu_type=None, gpus=0)
    chosen = settings(cpu)
    assert chosen.gradient_checkpointing is False and chosen.compile is False
    assert chosen.notes[0] == ("gradientCheckpointing unset → off: CPU workers (recomputing "
                               "activations only slows a CPU run)")
    assert build_trainer_config(cpu).strategy.gradient_checkpointing is False
    set_on = job(gpu_type=None, gpus=0, strategy={"gradientCheckpointing": True})
    assert settings(set_on).gradient_checkpointing is True


def test_set_fields_are_kept_and_not_explained():
    chosen = settings(job(strategy={"gradientCheckpointing": True,
                                    "gradientCheckpointingPolicy": "selective",
                                    "compile": False}))
    assert (chosen.gradient_checkpointing, chosen.checkpoint_policy, chosen.compile) == (
        True, "selective", False)
    assert chosen.notes == []


@pytest.mark.parametrize(("steps", "expected"), [(20_000, True), (20, False), (None, True)])
def test_compile_when_the_run_is_long_enough_to_pay_for_it(steps, expected):
    chosen = settings(job(steps=steps))
    assert chosen.compile is expected
    assert f"compile unset → {'on' if expected else 'off'}" in chosen.notes[-1]


@pytest.mark.parametrize(("method", "strategy", "why"), [
    ("qlora", "ddp", "4-bit layers are not compiled"),
    ("full", "zero3", "DeepSpeed's own engine")])
def test_no_compile_where_it_is_not_supported(method, strategy, why):
    chosen = settings(job(method=method), strategy)
    assert chosen.compile is False
    assert why in chosen.notes[-1]


def test_the_workers_get_the_choice_and_the_plan_prints_it():
    j = job(batch=1, seq=2048)
    config = build_trainer_config(j)
    assert config.strategy.gradient_checkpointing is False
    assert config.strategy.compile is True
    plan = plan_with_notes(j, None)
    printed = table(j, plan)
    assert "checkpointing off, compile on" in printed.splitlines()[0]
    assert "note: gradientCheckpointing unset → off" in printed


def test_a_short_t4_job_keeps_full_checkpointing_and_no_compile():
    chosen = settings(job(gpu_type=T4, gpus=1, batch=4, seq=4096, steps=50, method="qlora"))
    assert chosen.gradient_checkpointing is True and chosen.compile is False


# --- micro-batch sized from memory --------------------------------------------------------

def test_a_step_runs_in_smaller_passes_rather_than_recompute():
    """8B LoRA, 4 x 4096 tokens: recomputing would be needed at 4 sequences a pass; one
    sequence (4096 tokens) a pass fits without it, and the step's batch is kept."""
    chosen = settings(job(batch=4, seq=4096))
    assert (chosen.gradient_checkpointing, chosen.micro_batch) == (False, 1)
    assert chosen.notes[0].startswith("gradientCheckpointing unset → off:")
    assert "per GPU at microBatchSize 1 fits with 10% headroom" in chosen.notes[0]
    assert chosen.notes[1] == ("microBatchSize unset → 1: batchSizePerDevice 4 does not fit "
                               "with checkpointing off; 4 passes of 1 do and keep the global "
                               "batch")
    assert build_trainer_config(job(batch=4, seq=4096)).hyperparameters.micro_steps() == (1, 4)


def test_passes_are_not_split_below_a_full_matmul_to_save_a_recompute():
    """8B LoRA on 40 GB A100s, 8 x 512 tokens: without recomputing, only passes smaller
    than TOKENS_PER_PASS fit; the planner recomputes selectively at 8 a pass instead."""
    chosen = settings(job(batch=8, seq=512, gpu_type=A100_40_X8, packing=False))
    assert chosen.micro_batch * 512 == TOKENS_PER_PASS
    assert (chosen.gradient_checkpointing, chosen.checkpoint_policy) == (True, "selective")
    without = settings(job(batch=8, seq=512, gpu_type=A100_40_X8, packing=False,
                           strategy={"gradientCheckpointing": False}))
    assert without.micro_batch * 512 < TOKENS_PER_PASS  # it fits, in smaller passes
    assert "fits with 10% headroom" in without.notes[0]


def test_whole_accumulation_steps_run_in_one_pass_where_they_fit():
    """2 x 1024 tokens, 8 accumulation steps: 4 sequences a pass fit without recomputing,
    so 4 passes of 4 instead of 8 of 2; not on unpacked data, where a larger pass pads."""
    packed = settings(job(batch=2, seq=1024, accumulation=8))
    assert (packed.gradient_checkpointing, packed.micro_batch) == (False, 4)
    assert packed.notes[1] == ("microBatchSize unset → 4: 4 passes of 4 a step instead of 8 "
                               "of batchSizePerDevice 2: fewer, larger passes")
    # any divisor of the step's 12 sequences, not only whole accumulation steps of 4
    assert settings(job(batch=4, seq=512, accumulation=3)).micro_batch == 6
    unpacked = settings(job(batch=2, seq=1024, accumulation=8, packing=False))
    assert unpacked.micro_batch == 2
    assert not any(note.startswith("microBatchSize") for note in unpacked.notes)


def test_a_job_that_fits_nowhere_gets_the_least_memory_there_is():
    chosen = settings(job(method="full", batch=4, seq=32768, accumulation=2))
    assert (chosen.gradient_checkpointing, chosen.checkpoint_policy) == (True, "full")
    assert chosen.micro_batch == 1
    assert "does not fit either" in chosen.notes[0]
    assert chosen.notes[1] == ("microBatchSize unset → 1: no micro-batch fits; 8 passes of 1 "
                               "need the least memory")


def test_a_set_micro_batch_is_kept_and_checkpointing_chosen_around_it():
    chosen = settings(job(batch=4, seq=4096, micro=4))
    assert chosen.micro_batch == 4 and chosen.gradient_checkpointing is True
    assert not any(note.startswith("microBatchSize") for note in chosen.notes)


def test_set_checkpointing_is_kept_and_the_micro_batch_sized_around_it():
    chosen = settings(job(batch=64, seq=4096, strategy={"gradientCheckpointing": True}))
    assert chosen.gradient_checkpointing is True and chosen.checkpoint_policy == "full"
    assert 1 < chosen.micro_batch < 64 and 64 % chosen.micro_batch == 0
    assert chosen.notes[0].startswith(f"microBatchSize unset → {chosen.micro_batch}: "
                                      "batchSizePerDevice 64 does not fit with checkpointing "
                                      "full;")


def test_cpu_workers_and_unknown_gpus_keep_batch_size_per_device():
    for unknown in (job(batch=4, gpu_type=None), job(batch=4, gpu_type=None, gpus=0)):
        assert settings(unknown).micro_batch == 4


def test_the_plan_is_about_the_passes_the_workers_run():
    """`finetune plan` prints the micro-batch the workers run, and its verdict estimates
    that pass: 4 x 4096 tokens of 8B LoRA does not fit without recomputing, 1 x 4096 does."""
    j = job(batch=4, seq=4096)
    plan = plan_with_notes(j, from_table(f"hf://{LLAMA_8B}"))
    assert plan.fits is True
    printed = table(j, plan)
    assert "micro-batch 1 x 4096 tokens, checkpointing off" in printed.splitlines()[0]
    assert "note: microBatchSize unset → 1:" in printed


# --- strategy auto, judged by the step its workers run ----------------------------------

def auto_job(method: str, batch: int, **overrides) -> FineTuneJob:
    j = job(method, batch=batch, seq=4096, **overrides)
    spec = j.spec.model_copy(update={"strategy": j.spec.strategy.model_copy(
        update={"type": "auto"})})
    return j.model_copy(update={"spec": spec})


@pytest.mark.parametrize("method", ["lora", "full"])
def test_auto_picks_the_same_strategy_whatever_batch_size_per_device(method):
    """8B on 8 H100s at 4096 tokens: every batchSizePerDevice runs as the same passes
    without recomputation (one sequence under LoRA, two compiled full ones), so the
    strategy is the same. Judged by batchSizePerDevice alone, LoRA went from ddp to fsdp at
    32 sequences, and full from zero1 (then needing selective recomputation) to zero2 to
    fsdp."""
    model = from_table(f"hf://{LLAMA_8B}")
    chosen, passes = set(), set()
    for batch in (4, 16, 32):
        j = auto_job(method, batch)
        strategy = resolve_strategy(j, model)
        step = choose_step_settings(j, model, strategy)
        passes.add((step.gradient_checkpointing, step.micro_batch))
        chosen.add(strategy)
    assert chosen == {"ddp" if method == "lora" else "fsdp"}
    assert passes == {(False, 1 if method == "lora" else 2)}


def test_auto_prefers_a_compiled_strategy_over_deepspeed_at_the_same_passes():
    """8B full on 8 H100s: ZeRO-2 and FSDP both fit passes of 4096 tokens without
    recomputation; FSDP is compiled (COMPILE_SPEEDUP), DeepSpeed's engine is not. A short
    run, where compiling does not pay back, keeps AUTO_ORDER: zero2 before fsdp."""
    model = from_table(f"hf://{LLAMA_8B}")
    assert resolve_strategy(auto_job("full", 4), model) == "fsdp"
    assert resolve_strategy(auto_job("full", 4, steps=20), model) == "zero2"
    no_compile = auto_job("full", 4, strategy={"compile": False})
    assert resolve_strategy(no_compile, model) == "zero2"


def test_auto_prefers_no_recomputation_to_an_earlier_strategy():
    """A short 8B full run (no compile) on 8 H100s: ddp does not fit, zero1 fits passes
    of 4096 tokens only with selective recomputation, zero2 without: zero2 is chosen (it
    was zero1, the first that fitted at batchSizePerDevice with checkpointing)."""
    model = from_table(f"hf://{LLAMA_8B}")
    j = auto_job("full", 4, steps=20)
    strategy = resolve_strategy(j, model)
    assert strategy == "zero2"
    step = choose_step_settings(j, model, strategy)
    for earlier in AUTO_ORDER[:AUTO_ORDER.index(strategy)]:
        other = choose_step_settings(j, model, earlier)
        assert other.gradient_checkpointing, earlier  # needs recomputation (or fits no pass)
    assert step.gradient_checkpointing is False


def test_the_plan_says_why_auto_chose_its_strategy():
    """`finetune plan` names the strategies auto weighed, their estimated steps ranked, and
    why the others lost: a user can check the choice, or overrule it knowingly."""
    model = from_table(f"hf://{LLAMA_8B}")
    note = next(n for n in plan_with_notes(auto_job("full", 4), model).notes
                if n.startswith("strategy auto"))
    assert note.startswith("strategy auto → fsdp: a full-size pass fits; the shortest "
                           "estimated step of those (fsdp "), note
    steps = note.split("(")[1].split(")")[0].split(", ")
    assert steps[0].endswith(" s compiled") and steps[1].startswith("zero2 ")
    seconds = [float(s.split()[1]) for s in steps]
    assert seconds == sorted(seconds) and seconds[0] < seconds[1]
    assert note.endswith("; nothing fits with ddp")
    # the one cause that applies, where it said three that might ("no model config, no
    # known gpuType, or CPU workers")
    for unknown, chosen, cause in [
            (auto_job("full", 4, gpu_type=None), "fsdp", "spec.resources.gpuType is not set"),
            (auto_job("full", 4, gpu_type="Standard_NX"), "fsdp",
             "gpuType 'Standard_NX' is not in the catalog"),
            (auto_job("full", 4, gpu_type=None, gpus=0), "ddp",  # 1 process: nothing to shard
             "CPU workers: the planner estimates GPU memory only")]:
        assert next(n for n in plan_with_notes(unknown, model).notes
                    if n.startswith("strategy auto")) == (
            f"strategy auto → {chosen}: the planner cannot size this job ({cause}), so the "
            "simple rules: fsdp for full fine-tuning on several devices, else ddp")


NVIDIA_SMI_ROWS = """NVIDIA H100 80GB HBM3, 81559, 81000, 9.0
NVIDIA A100-SXM4-40GB, 40960, 40000, 8.0
NVIDIA A100 80GB PCIe, 81920, 81000, 8.0
NVIDIA H100 NVL, 95830, 95000, 9.0
NVIDIA H200, 143771, 143000, 9.0
Tesla V100-SXM2-32GB, 32768, 32000, 7.0
Tesla T4, 15360, 15000, 7.5
NVIDIA GeForce RTX 4090, 24564, 12288, 8.9
NVIDIA GeForce RTX 2080 Ti, 11264, [N/A], 7.5
"""


def test_the_cards_nvidia_smi_lists_are_the_catalogs_gpus():
    cards = catalog.cards_from_nvidia_smi(NVIDIA_SMI_ROWS)
    assert len(cards) == 8  # the row without a free figure is left out
    assert [getattr(catalog.gpu_of(card), "name", None) for card in cards] == [
        "H100-80GB", "A100-40GB", "A100-80GB-PCIe", "H100-NVL-94GB", "H200-141GB",
        "V100-32GB", "T4-16GB", None]
    rtx = catalog.this_machine(cards[-1:], host_memory_bytes=64 * 1024**3)
    assert rtx.gpu.memory_bytes == 12 * 1024**3  # what is free, not the card's 24 GiB
    assert rtx.gpu.bf16  # compute capability 8.9
    assert rtx.gpu.peak_flops_16bit == min(g.peak_flops_16bit for g in catalog.GPUS)
    t4 = catalog.this_machine(cards[6:7], host_memory_bytes=64 * 1024**3)
    assert not t4.gpu.bf16 and t4.gpu.peak_flops_16bit == catalog.T4.peak_flops_16bit


def test_finetune_run_sizes_the_step_for_the_gpu_it_has():
    """8B LoRA, 4 x 4096 a step, written for H100s: run on a machine whose one H100 has 24
    GiB free (another process holds the rest), the planner sizes the step for those 24 GiB:
    passes of 1 with recomputation, where the spec's 80 GB needed none; the notes name
    the free memory."""
    spec = job(batch=4, seq=4096, gpus=1)
    row = "NVIDIA H100 80GB HBM3, 81559, 24576, 9.0"
    machine = catalog.this_machine(catalog.cards_from_nvidia_smi(row), 256 * 1024**3)
    on_spec = choose_step_settings(spec, None, "ddp")
    here = choose_step_settings(spec, None, "ddp", machine)
    assert (on_spec.gradient_checkpointing, on_spec.micro_batch) == (False, 1)
    assert here.gradient_checkpointing is True and here.micro_batch == 1
    assert "of 24.0 GiB per GPU" in here.notes[0]
    plan = plan_with_notes(spec, from_table(f"hf://{LLAMA_8B}"), machine)
    assert plan.gpu_type == "this machine" and plan.gpu_memory_bytes == 24 * 1024**3
    assert "on this machine (NVIDIA H100 80GB HBM3, 24.0 GiB)" in plan.reason
    assert plan.recommendation.on_requested_gpu is None  # more of this machine: not to be had
    from finetune_operator.local.config import plan_warnings

    full = job(method="full", batch=4, seq=4096, gpus=1)
    [warning] = plan_warnings(full, from_table(f"hf://{LLAMA_8B}"), machine)
    assert warning.startswith("warning: predicted not to fit this machine's GPUs — needs ")
    assert "more than this machine (NVIDIA H100 80GB HBM3, 24.0 GiB)" in warning
