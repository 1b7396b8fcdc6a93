"""Where a step's time goes, on the device's own timeline and without a host sync.

On a GPU every mark is a CUDA event recorded in the stream, so a phase is the time the
GPU spent between two points of the loop: "data" is the time the GPU sat waiting for the
host to hand it the next batch (zero when the host runs ahead). On CPU the work is
synchronous and perf_counter is the truth. Events are read at log steps, after the loop
has waited for the loss anyway.
"""

from __future__ import annotations

import time

import torch

PHASES = ("data", "forward_backward", "optimizer")


class Clock:
    """Timestamps on the device's timeline: CUDA events (read later) or perf_counter."""

    def __init__(self, device) -> None:
        self.cuda = getattr(device, "type", "cpu") == "cuda"
        self.origin = self.mark()

    def mark(self):
        if not self.cuda:
            return time.perf_counter()

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        if not self.cuda:
            return end - start
        end.synchronize()  # already complete at a log step: the loop read the loss
        return start.elapsed_time(end) / 1000.0

    def restart(self) -> None:
        self.origin = self.mark()

    def since_origin(self, mark) -> float:
        return self.seconds(self.origin, mark)



class StepPhases:
    """Marks at the phase boundaries of each step; summed per phase at a log step."""

    def __init__(self, device) -> None:
        self.clock = Clock(device)
        self._steps: list[list] = []

    def begin(self) -> None:
        self._steps.append([self.clock.mark()])

    def mark(self) -> None:
        """End of the next phase, in PHASES order."""
        self._steps[-1].append(self.clock.mark())

    def drain(self) -> dict[str, float]:
        """Mean seconds per step of each phase over the steps since the last drain."""
        steps, self._steps = [s for s in self._steps if len(s) == len(PHASES) + 1], []
        totals = dict.fromkeys(PHASES, 0.0)
        for marks in steps:
            for phase, start, end in zip(PHASES, marks[:-1], marks[1:], strict=True):
                totals[phase] += self.clock.seconds(start, end)
        return {phase: total / len(steps) for phase, total in totals.items()} if steps else {}
