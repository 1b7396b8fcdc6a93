"""`finetune run`'s metrics and progress ports: on the loopback only, the first free ones
from the trainer's default, held from the moment they are named until the run ends."""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

from finetune_trainer.config import TrainerConfig

LOOPBACK = "127.0.0.1"


CAN_HOLD = hasattr(socket, "SO_REUSEPORT")
"""Whether `finetune run` can hold its ports for its workers (`PortHold`): Linux, macOS."""


class PortTaken(ValueError):
    """The metrics port asked for (`finetune run --metrics-port`) is held by another process."""


class PortHold:
    """The ports of a run's endpoints, held from the moment `serving_here` names them until
    the run ends (`close`), restarts included: each by a socket bound to it (SO_REUSEPORT,
    never listening), beside which the worker's endpoint listens (`metrics.reusePort`);
    connections go to the listening socket alone. Only found free when named, a port was
    bound when the workers came up (the model fetched, checked and loaded: minutes for a
    large one), and could be taken meanwhile, by another run choosing its ports then or by
    a connection the kernel gave it as its local port: that process's /metrics was then
    never served."""

    def __init__(self, first: int, sockets: list[socket.socket]) -> None:
        self.first, self.sockets = first, sockets

    @property
    def held(self) -> bool:
        """False where the platform has no SO_REUSEPORT: the ports were free when named."""
        return bool(self.sockets)

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()


def serving_here(config: TrainerConfig, processes: int, asked: int | None = None
                 ) -> tuple[TrainerConfig, str, PortHold]:
    """The config with each worker's /metrics and /progress on this machine's loopback only
    (a laptop's run is not served to its network) from port `asked`, else the trainer's
    default, else the first ports after it that nothing holds (a second run beside the
    first keeps its endpoints); the line saying where; and the ports' hold, to keep until
    the run ends. Raises PortTaken when a port asked for is held."""
    first = asked or config.metrics.port
    tried = range(first, first + (1 if asked else 64) * processes, processes)
    with _choosing():
        hold = next((h for port in tried if (h := _hold(port, processes)) is not None), None)
    if hold is None and asked:
        raise PortTaken(f"--metrics-port {asked}: {_ports(asked, processes)} held by another "
                        "process (another run?) — pass another port, or leave the option out "
                        "to take the next free ones")
    if hold is None:
        raise PortTaken(f"no free metrics ports from {first} to {tried[-1] + processes - 1} "
                        "— pass --metrics-port with a free one")
    start = hold.first
    where = (f"metrics: http://{LOOPBACK}:{start}/metrics"
             + (f", one per process: {_ports(start, processes)}" if processes > 1 else "")
             + (f" ({_ports(first, processes)} held by another process)" if start != first
                else ""))
    metrics = config.metrics.model_copy(update={"host": LOOPBACK, "port": start,
                                                "reuse_port": hold.held})
    return config.model_copy(update={"metrics": metrics}), where, hold


def _ports(first: int, count: int) -> str:
    return f"ports {first}-{first + count - 1}" if count > 1 else f"port {first}"


def _hold(first: int, count: int) -> PortHold | None:
    """Ports `first` to `first + count - 1`, held; None when another process holds one."""
    sockets: list[socket.socket] = []
    try:
        for port in range(first, first + count):
            if not _free(port):
                raise OSError(f"port {port} held")
            if CAN_HOLD:
                sockets.append(_held(port))
    except OSError:
        for sock in sockets:
            sock.close()
        return None
    return PortHold(first, sockets)


def _free(port: int) -> bool:
    """Whether a worker's endpoint could listen on `port` (bound as its server binds, less
    SO_REUSEPORT: a port another run holds, or listens on, is not free)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def _held(port: int) -> socket.socket:
    """A socket holding `port`, or OSError when it was taken since `_free` looked.
    SO_REUSEPORT alone: no process binds the port but one of this user's with SO_REUSEPORT
    too (a worker's endpoint), a connection's local port is never chosen from a bound one,
    and another run's `_free` finds it held."""
    sock = socket.socket()
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((LOOPBACK, port))
    except OSError:
        sock.close()
        raise
    return sock


@contextlib.contextmanager
def _choosing() -> Iterator[None]:
    """One `finetune run` of this user at a time choosing its ports: two holds of one user
    on one port do not exclude each other (SO_REUSEPORT), so without this two runs could
    both find a port free and both hold it. Unlocked where the lock file cannot be made."""
    path = Path(tempfile.gettempdir()) / f"finetune-metrics-ports-{os.getuid()}.lock"
    try:
        fd: int | None = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        fd = None
    try:
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        if fd is not None:
            os.close(fd)
