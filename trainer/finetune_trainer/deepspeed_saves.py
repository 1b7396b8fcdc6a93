"""DeepSpeed's checkpoints written behind training (#17), as DCP's are under ddp and fsdp.

The engine's `save_checkpoint` hands each file it writes (the module states, each rank's
ZeRO optimizer partition) to its checkpoint engine. This one copies every tensor of the
file into host memory before it returns (so the next optimizer step cannot change what is
written) and has a thread write the copies, one file after another, with torch.save as
DeepSpeed's default engine does. The loop waits for the copies only;
`Checkpointer.finish` waits for `written()` before the checkpoint is named complete.
Imported only where DeepSpeed is.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine


class BackgroundCheckpointEngine(TorchCheckpointEngine):
    """Stages each file `save` is given and writes it on one thread, in order."""

    def __init__(self, config_params=None) -> None:
        super().__init__(config_params)
        self.name = "BackgroundCheckpointEngine"
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepspeed-save")
        self._writes: list[Future] = []

    def save(self, state_dict, path: str) -> None:
        staged = staged_copy(state_dict)
        self._writes.append(self._thread.submit(super().save, staged, path))

    def preserves_storage_sharing(self) -> bool:
        """False: `save` copies the tensors itself (True makes the engine copy the module
        states first as well)."""
        return False

    def written(self) -> Future:
        """Done when every file staged so far is written; its result raises the first
        write's failure. (One thread: this runs after those writes.)"""
        writes, self._writes = self._writes, []

        def wait() -> None:
            for write in writes:
                write.result()

        return self._thread.submit(wait)


def staged_copy(item: Any) -> Any:
    """`item` with each tensor copied to host memory (DeepSpeed's
    `clone_tensors_for_torch_save`), every container keeping its type. DeepSpeed's own
    walk makes each tuple a plain one, and the module states' `param_shapes` (torch.Size)
    then broke DeepSpeed's `zero_to_fp32` on every checkpoint written behind training."""
    if torch.is_tensor(item):
        return clone_tensors_for_torch_save(item)
    if isinstance(item, dict):
        return type(item)({key: staged_copy(value) for key, value in item.items()})
    if isinstance(item, list):
        return [staged_copy(value) for value in item]
    if isinstance(item, tuple) and not isinstance(item, torch.Size):
        values = [staged_copy(value) for value in item]
        return type(item)(*values) if hasattr(item, "_fields") else type(item)(values)
    return item
