"""An API server that misbehaves on purpose: the emulator (emulator.ApiServer) with faults a
test injects while the real operator runs against it.

A `Fault` picks requests by method and path (a regular expression on the whole path), by
default only the operator's own (kopf's client and the operator's own, told apart
by their User-Agent, so the simulated kubelet and the test's own calls pass untouched), and
answers them with a status (409, 429 with Retry-After, 500, ...), after a delay, or holds them
until the test lets go. A faulted request changes nothing unless `committed`: then the change
lands and only the answer is the error (a response lost on its way back).

KMock's own reactions (`kmock[...] << 500`) cannot stand in for these: its emulator stores
creates, patches and deletes before it looks for a reaction, so every faulted write would
land. The faults here are checked before the emulator sees the request.

The server also remembers the uid of every object it created (`created`), so a test can tell
an object created twice under one name, and can drop every open watch stream
(`drop_watches`).
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp.web
import attrs
import kmock

from tests.support.emulator import ApiServer

OPERATOR_AGENTS = ("kopf/", "finetune-operator/")
"""User-Agent prefixes of the operator's two API clients (kopf's and its own)."""
REASONS = {409: "Conflict", 410: "Gone", 422: "Invalid", 429: "TooManyRequests",
           500: "InternalError", 503: "ServiceUnavailable", 504: "Timeout"}
DropHow = Literal["eof", "reset", "expired"]


@dataclass(eq=False)
class Fault:
    """How some requests are answered until the fault is cleared or used up."""

    method: str
    path: str
    """A regular expression the whole request path must match."""
    status: int | None = None
    """Answer with this status (None: serve the request, after `delay` or the hold)."""
    message: str = ""
    retry_after: int | None = None
    """The Retry-After header (seconds) of the answer."""
    delay: float = 0.0
    committed: bool = False
    """Let the request change the stored objects, then answer with `status` anyway."""
    hold: bool = False
    """Keep the request waiting until `release()`."""
    times: int | None = None
    """How many requests to fault (None: until cleared)."""
    operator_only: bool = True
    hits: list[float] = field(default_factory=list)
    """When each faulted request arrived (time.monotonic())."""
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    released: asyncio.Event = field(default_factory=asyncio.Event)

    def matches(self, request: kmock.Request) -> bool:
        agent = request.headers.get("User-Agent", "")
        return (request.method.value == self.method.upper()
                and re.fullmatch(self.path, request.url.path) is not None
                and (not self.operator_only or agent.startswith(OPERATOR_AGENTS)))

    def release(self) -> None:
        self.released.set()

    def answer(self) -> aiohttp.web.Response:
        assert self.status is not None
        reason = REASONS.get(self.status, "InternalError")
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}
        details = {"retryAfterSeconds": self.retry_after} if self.retry_after is not None else {}
        return aiohttp.web.json_response(
            {"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
             "code": self.status, "reason": reason, "details": details,
             "message": self.message or f"injected {self.status} {reason}"},
            status=self.status, headers=headers)


@attrs.define(kw_only=True)
class FaultyApiServer(ApiServer):
    faults: list[Fault] = attrs.field(factory=list, init=False)
    creations: dict[tuple[str, str, str], list[str]] = attrs.field(factory=dict, init=False)
    """(plural, namespace, name) → the uid of every object created under that name."""
    watches: list[str] = attrs.field(factory=list, init=False)
    """The plural of every watch request served, in order."""
    _drops: set[asyncio.Event] = attrs.field(factory=set, init=False)
    _drop_how: DropHow = attrs.field(default="eof", init=False)

    def inject(self, fault: Fault) -> Fault:
        self.faults.append(fault)
        return fault

    def clear(self, fault: Fault) -> None:
        """Serve normally again; held requests get the fault's answer (or are served)."""
        if fault in self.faults:
            self.faults.remove(fault)
        fault.release()

    def created(self, plural: str, name: str, namespace: str = "default") -> list[str]:
        return self.creations.get((plural, namespace, name), [])

    def drop_watches(self, how: DropHow) -> int:
        """End every open watch stream: `eof` as an API server does when a watch times out,
        `reset` as a dropped connection (a load balancer, an apiserver restart), `expired` with
        the 410 Gone error a client gets when its resourceVersion is too old. Returns how many."""
        self._drop_how = how
        drops = list(self._drops)
        for drop in drops:
            drop.set()
        return len(drops)

    async def _handle(self, request: kmock.Request) -> Any:
        fault = next((f for f in self.faults if f.matches(request)), None)
        if fault is None:
            return await self._serve(request)
        fault.hits.append(time.monotonic())
        if fault.times is not None and len(fault.hits) >= fault.times:
            self.faults.remove(fault)
        if fault.delay:
            await asyncio.sleep(fault.delay)
        if fault.hold:
            fault.arrived.set()
            await fault.released.wait()
        if fault.status is None:
            return await self._serve(request)
        if fault.committed:
            await self._serve(request)
        return fault.answer()

    async def _serve(self, request: kmock.Request) -> Any:
        response = await super()._handle(request)
        if (request.action == kmock.action.CREATE and request.resource is not None
                and isinstance(request.data, dict) and getattr(response, "status", 500) < 300):
            meta = request.data.get("metadata") or {}
            namespace = request.namespace or meta.get("namespace")
            wanted = (request.resource, namespace, meta.get("name"))
            for key, stored in list(self._objects.items()):
                if key == wanted and not stored.deleted:
                    self.creations.setdefault((request.resource.plural, namespace, meta["name"]),
                                              []).append(stored.raw["metadata"]["uid"])
        return response

    async def _serve_watch(self, request: kmock.Request) -> Any:
        assert request.resource is not None
        self.watches.append(request.resource.plural)
        drop = asyncio.Event()
        self._drops.add(drop)
        stream = aiter(super()._serve_watch(request))
        dropped = asyncio.ensure_future(drop.wait())
        following: asyncio.Future | None = None
        try:
            while True:
                following = asyncio.ensure_future(anext(stream))
                await asyncio.wait({following, dropped}, return_when=asyncio.FIRST_COMPLETED)
                if not following.done():
                    break
                try:
                    event = following.result()
                except StopAsyncIteration:
                    return
                yield event
        finally:
            self._drops.discard(drop)
            for task in (following, dropped):
                if task is not None and not task.done():
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
            await stream.aclose()
        if self._drop_how == "reset":
            raw = request._raw_request
            if raw is not None and raw.transport is not None:
                raw.transport.close()
        elif self._drop_how == "expired":
            yield {"type": "ERROR", "object": {
                "apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
                "code": 410, "reason": "Expired",
                "message": "too old resource version: the watch expired"}}
