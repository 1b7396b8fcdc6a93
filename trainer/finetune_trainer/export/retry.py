"""What every kind of export target shares: the error an export that did not happen raises,
how often a push that met a transient fault is tried again, and why a request got no answer
(a host name that does not resolve is no transient fault). A leaf of the package: `oci` and
`hub` import it, and the package's `export` imports them."""

from __future__ import annotations

import socket
from collections.abc import Iterator
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


_NO_SUCH_NAME = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


def _causes(error: BaseException) -> Iterator[BaseException]:
    """`error` and what it was raised from, outermost first (requests wraps urllib3's, which
    wraps the socket's; httpx wraps httpcore's)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def unresolved(error: BaseException) -> bool:
    """Whether a request failed because its host name does not resolve: it will not in
    the seconds between tries (a lookup that failed for now, EAI_AGAIN, may)."""
    return any(isinstance(cause, socket.gaierror) and cause.errno in _NO_SUCH_NAME
               for cause in _causes(error))


def no_answer(error: BaseException) -> str:
    """Why a request got no answer, in a few words: the socket's reason where one is in
    the chain, else the error's kind (the HTTP clients' own text runs to a paragraph)."""
    for cause in _causes(error):
        if isinstance(cause, ConnectionRefusedError):
            return "connection refused"
        if isinstance(cause, ConnectionResetError):
            return "connection reset"
        if isinstance(cause, TimeoutError):
            return "timed out"
        if isinstance(cause, socket.gaierror):
            return "name lookup failed"
    return type(error).__name__
