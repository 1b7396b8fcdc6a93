"""One output folder, one live job: which FineTuneJob holds a folder that others name too.

Two jobs writing one folder resume each other's checkpoints or replace each other's export
(the trainer refuses another training's checkpoints, `finetune_trainer.trained_with`, but two
jobs started together race before either has written one). So the operator launches at most
one live job per folder. The backend names the folder (`Backend.output_folder`: a claim and
its path in the namespace, an Azure ML workspace's datastore path), the controller indexes
every FineTuneJob by it, and a job not launched yet is refused while another live one holds
the folder: one already launched, else the one made first (then by namespace/name, so two
made in the same second agree on which one it is).

Pure: the controller reads the index and the job; the reconciler says the refusal.
`finetune validate` warns of it before a cluster does (`shared_folder_warnings`).
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from finetune_operator.api import TERMINAL_PHASES
from finetune_operator.validation import Problem

if TYPE_CHECKING:  # the backends import this module: their names only
    from finetune_operator.api import FineTuneJob
    from finetune_operator.backends import Backend
    from finetune_operator.manifests import Document


@dataclass(frozen=True)
class OutputUser:
    """A FineTuneJob as the index of output folders keeps it."""

    namespace: str
    name: str
    created: str
    """metadata.creationTimestamp (RFC 3339, UTC: its text orders as its time)."""
    launched: bool
    """The operator has launched its workers (status.launchedSpec)."""
    phase: str | None

    @property
    def live(self) -> bool:
        return self.phase not in TERMINAL_PHASES

    def precedence(self) -> tuple[bool, str, str, str]:
        """Lower holds the folder: launched first, then the older, then by name."""
        return (not self.launched, self.created, self.namespace, self.name)

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name} ({self.phase or 'new'})"


def holder(me: OutputUser, users: Iterable[OutputUser]) -> OutputUser | None:
    """The live job that holds the folder `me` would write, where it is another: None when
    `me` may go on (it holds the folder, or has launched already: its workers own it)."""
    if me.launched:
        return None
    ahead = [user for user in users if user.live and (user.namespace, user.name) != (
        me.namespace, me.name) and user.precedence() < me.precedence()]
    return min(ahead, key=OutputUser.precedence, default=None)


def folder_key(*parts: str) -> str:
    """A folder's key from where it is (a namespace and claim, a workspace and datastore)
    and its path: `pvc://c/out/`, `pvc://c/./out` and `pvc://c/out` are one folder."""
    *where, path = parts
    return "|".join([*where, posixpath.normpath("/" + path)])


def shared_folder_warnings(jobs: Iterable[tuple[Document, FineTuneJob]],
                           backends: Mapping[str, Backend]) -> list[tuple[str, Problem]]:
    """A warning (with the manifest it is about) for each job whose output folder an earlier
    job of `jobs` writes too: on a cluster the operator launches one live job per folder and
    refuses the other (OutputInUse); run one after the other, the second resumes or refuses
    the first's."""
    first: dict[str, tuple[Document, FineTuneJob]] = {}
    warnings = []
    for doc, job in jobs:
        if (folder := _output_folder(job, doc, backends)) is None:
            continue
        if folder not in first:
            first[folder] = (doc, job)
            continue
        other_doc, other = first[folder]
        warnings.append((doc.source, Problem(
            "spec.output.uri", f"{job.spec.output.uri} is also the output folder of "
            f"FineTuneJob {other.namespace}/{other.name} ({other_doc.source}): one folder "
            "holds one job's checkpoints and model, so the operator launches only one of "
            "them and refuses the other (OutputInUse)", "give each job a folder of its own",
            severity="warning")))
    return warnings


def _output_folder(job: FineTuneJob, doc: Document, backends: Mapping[str, Backend]
                   ) -> str | None:
    """Where the job's output lands, as its backend names the folder (`output_folder`); a
    relative path (`finetune run`) by where it is on this machine."""
    location = job.spec.output.location
    if location.scheme == "relative":
        return f"here|{(doc.folder / location.raw).resolve()}"
    find = getattr(backends.get(job.spec.backend), "output_folder", None)
    return find(job) if find is not None else None
