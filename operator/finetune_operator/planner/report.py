"""A plan as people read it (`finetune plan`), and the plan the CLI and `finetune run`
show: the job's own strategy, with a note where the operator would resolve `auto`
differently (it never reads the hub for that)."""

from __future__ import annotations

from finetune_operator.api import FineTuneJob
from finetune_operator.gpu_catalog import VmSize
from finetune_operator.planner.plan import (
    JobPlan,
    Option,
    choose_step_settings,
    explain_strategy,
    gib,
    plan_job,
    resolve_strategy,
    with_step_settings,
)
from finetune_operator.planner.sources import ModelConfig

LABELS = {"weights": "weights", "gradients": "gradients", "optimizerStates": "optimizer states",
          "activations": "activations", "temporaryBuffers": "temporary buffers",
          "cudaContext": "CUDA context", "kvCache": "generation KV cache",
          "referenceWeights": "reference weights"}
HOST_LABELS = {"weightsWhileLoading": "weights read once",
               "offloadedTrainingState": "offloaded training state", "processes": "processes"}
VERDICTS = {"fits": "fits", "tight": "fits, with less than 10% headroom",
            "does-not-fit": "DOES NOT FIT", "unknown": "unknown"}


def plan_with_notes(job: FineTuneJob, model: ModelConfig | None,
                    machine: VmSize | None = None, offline: str | None = None,
                    unanswered: str | None = None) -> JobPlan:
    """The plan with the notes of every choice made for the job (on `machine`: this
    machine's GPUs, else the job's gpuType); `offline`: why the hub was not asked
    (`--offline`, HF_HUB_OFFLINE=1), `unanswered`: why, asked, it gave no config.json (not
    reached, refused), each said where the job's model is on the hub."""
    strategy, why = explain_strategy(job, model, machine)
    settings = choose_step_settings(job, model, strategy, machine)
    plan = plan_job(with_step_settings(job, settings), model, strategy, as_written=job,
                    machine=machine, offline=offline, unanswered=unanswered)
    notes = [*settings.notes, *plan.notes]
    if model is not None and job.spec.model.location.scheme == "hf":
        uri = job.spec.model.uri
        if offline:
            notes.insert(0, f"offline ({offline}): the hub was not asked for {uri}; its "
                            f"config.json came from the {model.source}")
        elif unanswered:
            notes.insert(0, f"the hub did not answer ({unanswered}) for {uri}; its "
                            f"config.json came from the {model.source}")
    plan = plan.model_copy(update={"step_settings": settings, "notes": notes})
    if job.spec.strategy.type == "auto":
        operator_choice = resolve_strategy(job)
        note = f"strategy auto → {strategy}: {why}"
        if operator_choice != strategy:
            note += (f"; the operator resolves auto without the hub (built-in table, else the "
                     f"simple rules) → {operator_choice}: set strategy.type: {strategy} to "
                     "get this plan")
        plan = plan.model_copy(update={"notes": [note, *plan.notes]})
    return plan


def _step_settings(job: FineTuneJob, plan: JobPlan) -> str:
    if plan.step_settings is not None:
        return plan.step_settings.label()
    checkpointing = job.spec.strategy.gradient_checkpointing is not False
    return f"checkpointing {'on' if checkpointing else 'off'}"


def _micro_batch(job: FineTuneJob, plan: JobPlan) -> int:
    if plan.step_settings is not None:
        return plan.step_settings.micro_batch
    return job.spec.hyperparameters.micro_steps()[0]


def changes_lines(option: Option | None) -> list[str]:
    """What an option of the recommendation sets otherwise than the plan above it, field by
    field (`Option.changes`); nothing when it sets nothing else."""
    if option is None or not option.changes:
        return []
    return ["  differs from this plan in: "
            + ", ".join(change.label() for change in option.changes)]


def count(n: int | None) -> str:
    """A parameter count for people: 8.03B, 41.9M."""
    if n is None:
        return "?"
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    return f"{n / 1e6:.1f}M" if n >= 1e5 else f"{n / 1e3:.1f}K"  # tiny test models: 98.3K


def host_line(plan: JobPlan) -> str:
    """Node 0's host memory (planner.host): what its ranks hold while loading or training."""
    parts = ", ".join(f"{HOST_LABELS[k]} {gib(v)}" for k, v in plan.host_breakdown.items()
                      if v)
    capacity = f" of {gib(plan.host_memory_bytes)}" if plan.host_memory_bytes else ""
    return (f"host memory per node: {gib(plan.host_bytes or 0)}{capacity} (node 0, peak "
            f"while {plan.host_peak_phase}: {parts})")


def disk_line(plan: JobPlan) -> str:
    """The output volume at the end of the run (planner.disk)."""
    parts, lines = [], plan.disk_breakdown
    if lines.get("modelCache"):
        parts.append(f"the model's copy {gib(lines['modelCache'])}")
    parts.append(f"checkpoints {gib(lines.get('checkpoints', 0))}")
    parts.append(f"the final model {gib(lines.get('finalModel', 0))}")
    return f"output volume: {gib(plan.disk_bytes or 0)} ({', '.join(parts)})"


def table(job: FineTuneJob, plan: JobPlan) -> str:
    spec, r = job.spec, job.spec.resources
    lines = [f"{job.namespace}/{job.name}: {spec.method.type}, {plan.strategy}, "
             f"{plan.precision or spec.strategy.precision}, {r.nodes} node"
             f"{'s' if r.nodes > 1 else ''} x {r.processes()} {'GPU' if r.on_gpus else 'CPU'}"
             f" process{'es' if r.processes() > 1 else ''}, micro-batch "
             f"{_micro_batch(job, plan)} x {spec.dataset.max_seq_length} "
             f"tokens, {_step_settings(job, plan)}"]
    if plan.model_source:
        lines.append(f"model: {plan.model_source}: {count(plan.total_params)} parameters, "
                     f"{count(plan.trainable_params)} trainable")
    if plan.breakdown:
        lines.append("")
        moment = {"forwardBackward": "forward/backward", "generation": "generation"}.get(
            plan.peak_phase or "", "the optimizer step")
        lines.append(f"per {'GPU' if r.on_gpus else 'process'} (peak during {moment}):")
        for key, value in plan.breakdown.items():
            if key == "cudaContext" and not r.on_gpus:  # a CPU worker opens none
                continue
            extra = ""
            if key == "temporaryBuffers" and plan.temporary_buffers:
                parts = sorted(plan.temporary_buffers.items(), key=lambda kv: -kv[1])
                extra = "  (" + ", ".join(f"{k} {gib(v)}" for k, v in parts if v) + ")"
            lines.append(f"  {LABELS[key]:<18} {gib(value):>10}{extra}")
        capacity = f" of {gib(plan.gpu_memory_bytes)}" if plan.gpu_memory_bytes else ""
        lines.append(f"  {'total':<18} {gib(plan.per_gpu_bytes or 0):>10}{capacity}")
    if plan.host_bytes is not None:
        lines.append(host_line(plan))
    if plan.disk_bytes is not None:
        lines.append(disk_line(plan))
    lines.append("")
    lines.append(f"verdict: {VERDICTS[plan.verdict]} — {plan.reason}")
    if plan.throughput:
        t = plan.throughput
        lines.append(f"speed: ~{t.step_seconds:.2f} s per step, ~{t.tokens_per_second:,.0f} "
                     f"tokens/s on {plan.world_size} GPU{'s' if plan.world_size > 1 else ''} "
                     f"(assumed {t.assumed_mfu:.0%} utilisation; "
                     f"{t.model_flops_per_token:.3g} model FLOPs per token"
                     + (f"; sampling the completions ~{t.generation_seconds:.2f} s a round"
                        if t.generation_seconds else "") + ")")
    rec = plan.recommendation
    if rec is not None:
        lines.append(f"recommendation: {rec.why}")
        lines += changes_lines(rec.best)
        if rec.on_requested_gpu and plan.verdict == "does-not-fit":
            o = rec.on_requested_gpu
            lines.append(f"on {o.vm_size}: strategy {o.strategy}, {o.nodes} node"
                         f"{'s' if o.nodes > 1 else ''} ({gib(o.per_gpu_bytes)} per GPU)")
            lines += changes_lines(o)
    for note in plan.notes:
        lines.append(f"note: {note}")
    lines += [f"warning: {warning}" for warning in plan.warnings]
    return "\n".join(lines)
