"""The kubernetes backend: torchrun pods on this cluster (AKS GPU node pools or any other).

One FineTuneJob becomes a ConfigMap (the trainer config), a headless Service (stable DNS
for rank 0) and an Indexed Job with one pod per node: the Job controller is the engine,
the completion index is the node rank. `render` is a pure function of the job and the
operator settings; the kopf handlers create what it returns.

`workers` renders those objects (pure, offline), `states` reads the Job, its pods, their
events and Kueue's Workload into what the reconciler needs (pure), and `backend` ties them
to the Backend interface with the API calls.
"""

from finetune_operator.backends.kubernetes.backend import KubernetesBackend
from finetune_operator.backends.kubernetes.states import (
    PEER_LOSS_GRACE_SECONDS,
    creation_failure,
    final_progress,
    mount_failure,
    mounting,
    named_by_field,
    needs_creation_events,
    observe,
    output_claim_problem,
    pod_failure,
    pod_waiting,
    progress_from_record,
    queue_state,
    waiting_for_leftovers,
)
from finetune_operator.backends.kubernetes.workers import (
    BAD_INPUT_EXIT_CODE,
    COMPLETION_INDEX,
    COMPLETION_INDEX_KEY,
    SETUP_EXIT_CODE,
    STOPPED_EXIT_CODE,
    TRAINER_CONTAINER,
    mount,
    render,
    validate,
)

__all__ = [
    "BAD_INPUT_EXIT_CODE",
    "COMPLETION_INDEX",
    "COMPLETION_INDEX_KEY",
    "PEER_LOSS_GRACE_SECONDS",
    "SETUP_EXIT_CODE",
    "STOPPED_EXIT_CODE",
    "TRAINER_CONTAINER",
    "KubernetesBackend",
    "creation_failure",
    "final_progress",
    "mount",
    "mount_failure",
    "mounting",
    "named_by_field",
    "needs_creation_events",
    "observe",
    "output_claim_problem",
    "pod_failure",
    "pod_waiting",
    "progress_from_record",
    "queue_state",
    "render",
    "validate",
    "waiting_for_leftovers",
]
