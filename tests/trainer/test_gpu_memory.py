"""The GPU's free memory against the plan's peak, before the model loads (#63): what each
rank says, from the numbers it reads."""

from __future__ import annotations

from finetune_trainer.gpu_memory import check_room, room_warning

GiB = 2**30


def test_a_plan_larger_than_what_is_free_is_said_with_the_numbers():
    said = room_warning("rank 0's GPU 0", free=int(45.2 * GiB), total=int(79.6 * GiB),
                        planned=int(47.0 * GiB))
    assert said is not None
    for part in ("45.2 GiB free of 79.6 GiB", "the plan's peak is 47.0 GiB per process",
                 "another process holds 34.4 GiB", "nvidia-smi",
                 "hyperparameters.microBatchSize", "strategy.gradientCheckpointing"):
        assert part in said


def test_memory_held_elsewhere_is_said_even_where_the_plan_fits_or_is_unknown():
    fits = room_warning("rank 1's GPU 1", free=48 * GiB, total=80 * GiB, planned=30 * GiB)
    assert fits is not None and "32.0 GiB of its 80.0 GiB is in use" in fits
    assert "the plan's peak, 30.0 GiB per process, fits in the 48.0 GiB left" in fits
    unknown = room_warning("rank 0's GPU 0", free=48 * GiB, total=80 * GiB, planned=None)
    assert unknown is not None and "plan" not in unknown


def test_an_idle_gpu_says_nothing():
    # this process's own CUDA context (about 0.5 GiB) is in use when the reading is taken
    assert room_warning("rank 0's GPU 0", free=79 * GiB, total=80 * GiB,
                        planned=60 * GiB) is None
    assert room_warning("rank 0's GPU 0", free=79 * GiB, total=80 * GiB, planned=None) is None


def test_cpu_workers_have_no_gpu_to_check():
    import torch

    assert check_room(torch.device("cpu"), 0, 10 * GiB) is None
