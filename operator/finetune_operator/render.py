"""FineTuneJob → the objects its backend creates. Pure: no API calls.

`finetune render` prints these; the operator creates them.
"""

from __future__ import annotations

from typing import Any

from finetune_operator.api import FineTuneJob
from finetune_operator.backends import kubernetes
from finetune_operator.settings import OperatorSettings
from finetune_operator.trainer_config import build_trainer_config
from finetune_operator.validation import Problem


def backend_problems(job: FineTuneJob) -> list[Problem]:
    """What the job's backend refuses (the operator reports these as Validated=False)."""
    if job.spec.backend == "kubernetes":
        return kubernetes.validate(job)
    return []


def render(job: FineTuneJob, settings: OperatorSettings | None = None) -> list[dict[str, Any]]:
    """The objects the job's backend would create, in creation order."""
    settings = settings or OperatorSettings.from_env()
    if job.spec.backend == "kubernetes":
        return kubernetes.render(job, settings)
    # Azure ML passes the trainer config to its workers as a job input: until that backend
    # lands, the contract document is what `render` can show for it.
    return [build_trainer_config(job).to_dict()]
