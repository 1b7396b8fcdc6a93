"""Loading a model once per node, not once per rank (#17).

Under FSDP and ZeRO-3 every rank builds the model empty and rank 0 reads the weights one
at a time, each rank keeping its shard or partition (finetune_trainer.loading). The
weights each rank ends up with are the ones a plain from_pretrained reads
(tests/support/loading_probe.py), and the node's host memory while loading stays near one
copy of the weights: measured on 2 CPU ranks over gloo the way
benchmarks/loading_memory.py measures it (every rank's resident set sampled, summed at
each moment), which also prints the figures before and after:

    .venv/bin/python benchmarks/loading_memory.py --rev 40a3546   # before
    .venv/bin/python benchmarks/loading_memory.py                 # this tree
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.support import waits
from tests.support.bench_scripts import bench_script

pytestmark = pytest.mark.process

BOUND = 1.3
"""The node's peak over one copy of the weights while loading, FSDP or ZeRO-3 (every rank
read the whole model before: 2.5-2.9x here; transformers' own ZeRO-3 loading 2.0x)."""


def _probe(out: Path, *cases: str) -> dict[str, dict]:
    """Each case's findings (tests/support/loading_probe.py), all from one torchrun."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=2", "-m", "tests.support.loading_probe", str(out), *cases]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO,
                            timeout=waits.seconds_left())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def bf16_tied_model(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model stored in bf16 (read as fp32: each weight cast as it is sent) with
    its output head tied to the embeddings (absent from the checkpoint)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("bf16-tied")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    model.to(torch.bfloat16).save_pretrained(folder)
    for path in tiny_model_dir.iterdir():  # the tokenizer's files
        if not (folder / path.name).exists():
            shutil.copy(path, folder / path.name)
    return folder


SHARDED = {  # test id → strategy, method, options of tests/support/loading_probe.py
    "fsdp-full": ("fsdp", "full"), "fsdp-lora": ("fsdp", "lora"),
    "fsdp-lora-bf16": ("fsdp", "lora", "bf16"), "fsdp-full-copied": ("fsdp", "full", "copied"),
    "fsdp-lora-copied": ("fsdp", "lora", "copied"), "zero3-full": ("zero3", "full"),
    "zero3-lora": ("zero3", "lora"), "zero3-full-copied": ("zero3", "full", "copied")}


@pytest.fixture(scope="module")
def probed(tiny_model_dir, bf16_tied_model, tmp_path_factory) -> dict[str, dict]:
    """Every case's findings, from one torchrun: the cases one after another in its two
    processes (their start and imports cost several times what a case does), FSDP's
    first. Test id → findings; the bf16 checkpoint's as bf16-tied-METHOD."""
    cases = {name: ",".join((str(tiny_model_dir), *case)) for name, case in SHARDED.items()}
    cases |= {f"bf16-tied-{method}": f"{bf16_tied_model},fsdp,{method}"
              for method in ("full", "lora")}
    order = sorted(cases, key=lambda name: "zero3" in cases[name])  # FSDP's first
    found = _probe(tmp_path_factory.mktemp("loading") / "probe.json",
                   *(cases[name] for name in order))
    return {name: found[case] for name, case in cases.items()}


@pytest.mark.parametrize("case", list(SHARDED))
def test_sharded_weights_are_what_from_pretrained_reads(probed, case):
    strategy = SHARDED[case][0]
    found = probed[case]
    assert (found["missing"], found["unexpected"], found["different"]) == ([], [], [])
    assert found["weights"] > 20
    assert found["generators_as_read"] == [True, True]  # dropout draws as it did
    # built empty (FSDP) or partitioned (ZeRO-3) on both ranks, rank 0 sending the weights
    assert found["built"] == ("empty" if strategy == "fsdp" else "partitioned")
    assert found["sent_from"] == ("CopiedWeights" if "copied" in SHARDED[case]
                                  else "CheckpointWeights")


@pytest.mark.parametrize("method", ["full", "lora"])
def test_a_bf16_checkpoint_with_tied_weights_streams_exactly(probed, method):
    found = probed[f"bf16-tied-{method}"]
    assert found["sent_from"] == "CheckpointWeights"
    assert (found["missing"], found["unexpected"], found["different"]) == ([], [], [])


@pytest.fixture(scope="module")
def peaks(tmp_path_factory) -> dict[str, dict]:
    bench = bench_script("loading_memory")
    where = tmp_path_factory.mktemp("loading-memory")
    model = bench.build_model(where / "model")
    found = {case.name: bench.measure(model, case, where) for case in bench.CASES
             if case.strategy != "ddp"}
    for case in bench.CASES:
        if case.name in found:
            print(bench.line(case, found[case.name]))
    return found


@pytest.mark.parametrize("case", ["fsdp-full", "fsdp-lora", "zero3-full", "zero3-lora"])
def test_a_node_holds_about_one_copy_of_the_weights_while_loading(peaks, case):
    """FSDP's shards fill in `setup`; ZeRO-3's partitions are in place when the model is
    loaded (its engine then adds master weights and gradient buffers: training state)."""
    figures = peaks[case]
    held = figures["summed_peak_bytes" if case.startswith("fsdp") else "loaded_peak_bytes"]
    ratio = held / figures["weight_bytes"]
    assert ratio < BOUND, (
        f"{case}: 2 ranks held {held / 2**20:,.0f} MiB at once while loading "
        f"{figures['weight_bytes'] / 2**20:,.0f} MiB of weights ({ratio:.2f}x, at most "
        f"{BOUND}x)")
