"""What every kind of export target shares: the error an export that did not happen raises,
and how often a push that met a transient fault is tried again. A leaf of the package:
`oci` and `hub` import it, and the package's `export` imports them."""

from __future__ import annotations

from pathlib import Path


class ExportError(RuntimeError):
    """An export that did not happen: what went wrong at `target`, and what to do. The
    model folder is untouched whatever happened."""

    def __init__(self, target: str, problem: str, fix: str, *, source: bool = False) -> None:
        """`source`: `target` is the folder to export, not where it goes."""
        super().__init__(f"export {'of' if source else 'to'} {target}: {problem}; {fix}")
        self.target, self.problem, self.fix = target, problem, fix

    @classmethod
    def of_folder(cls, folder: Path, problem: str, fix: str) -> ExportError:
        """What is wrong with the folder to export, said as of it (nothing was pushed)."""
        return cls(str(folder), problem, fix, source=True)


ATTEMPTS = 4
"""Tries of a push that met a transient fault (no answer, 5xx, 429), 2, 4, 8 s apart."""


def wait_to_try_again(attempt: int, fault: object, target: str, where: str, say,
                      sleep) -> None:
    """After a transient `fault` on try `attempt`: wait 2**attempt s; after the last try,
    raise ExportError saying to check `where` (the registry, the hub)."""
    if attempt == ATTEMPTS:
        raise ExportError(target, f"{fault} ({ATTEMPTS} tries)", f"check that {where} is "
                          "up and reachable from here, then export again")
    say(f"  {fault}; trying again in {2 ** attempt} s")
    sleep(2 ** attempt)
