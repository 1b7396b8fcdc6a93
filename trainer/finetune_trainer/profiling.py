"""Where a step's time goes: torch.profiler over a few steps, on request.

`FINETUNE_PROFILE=DIR` records steps 6 to 8 (`FINETUNE_PROFILE_STEPS=6:3`: the first
step and how many), after the warm-up, and writes per rank the operators and kernels
by their own time (`rank<R>-top.txt`, the figure a speed-up is chosen by) and a trace
for chrome://tracing or Perfetto (`rank<R>-trace.json.gz`). Off by default: a profiled
step runs slower.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch.profiler as tp

ROWS = 40


def top_table(profile, device_type: str, rows: int = ROWS) -> str:
    sort = "self_device_time_total" if device_type == "cuda" else "self_cpu_time_total"
    return profile.key_averages().table(sort_by=sort, row_limit=rows)


class StepProfiler:
    """Call `step()` after every training step; it profiles the chosen window only."""

    def __init__(self, folder: Path, rank: int, device_type: str, first: int = 6,
                 count: int = 3) -> None:

        if first < 2 or count < 1:
            raise ValueError(f"FINETUNE_PROFILE_STEPS={first}:{count}: the first profiled "
                             "step must be 2 or later (one step warms the profiler up) and "
                             "the count at least 1")
        folder.mkdir(parents=True, exist_ok=True)
        self.folder, self.rank, self.device_type = folder, rank, device_type
        activities = [tp.ProfilerActivity.CPU]
        if device_type == "cuda":
            activities.append(tp.ProfilerActivity.CUDA)
        self.profile = tp.profile(
            activities=activities, record_shapes=True,
            schedule=tp.schedule(wait=first - 2, warmup=1, active=count, repeat=1),
            on_trace_ready=self._write)
        self.profile.start()
        self.written: Path | None = None

    @classmethod
    def from_environment(cls, rank: int, device_type: str) -> StepProfiler | None:
        folder = os.environ.get("FINETUNE_PROFILE")
        if not folder:
            return None
        first, _, count = os.environ.get("FINETUNE_PROFILE_STEPS", "6:3").partition(":")
        return cls(Path(folder), rank, device_type, int(first), int(count or 3))

    def step(self) -> None:
        self.profile.step()

    def stop(self) -> None:
        self.profile.stop()

    def _write(self, profile) -> None:
        table = top_table(profile, self.device_type)
        self.written = self.folder / f"rank{self.rank}-top.txt"
        self.written.write_text(table + "\n")
        profile.export_chrome_trace(str(self.folder / f"rank{self.rank}-trace.json.gz"))
