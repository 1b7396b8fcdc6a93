"""The benchmark harness's own code paths, on CPU: the peer worker's collectives under
torchrun (the reduction that once ran a CPU tensor through NCCL), and the GPU suite's
settings resolved as users get them."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest
import yaml

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import throughput  # a script beside the tests, not a package


@pytest.mark.process
def test_the_peer_worker_sums_its_counts_over_two_ranks(tiny_model_dir, tmp_path):
    bench = replace(throughput.SUITES["cpu"].benches[0], steps=4, warmup=1, samples=64,
                    seq_len=128)
    data = tmp_path / "data.jsonl"
    throughput.write_data(data, bench)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(throughput.trainer_config(
        bench, tiny_model_dir, data, tmp_path / "out")))
    result = tmp_path / "trainer.json"
    command = throughput.torchrun(2, str(REPO / "benchmarks/hf_worker.py"), f"--config={config}",
                                  f"--result={result}", "--peer=trainer", "--warmup-steps=1")
    done = subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env=throughput.worker_env())
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(result.read_text())
    assert figures["timed_steps"] == 3
    assert figures["tokens_per_second"] > 0


def test_the_gpu_suite_runs_the_settings_users_get(tmp_path):
    """checkpointing, micro-batch and compile unset in the suite: resolved by the planner
    as for a long run on an 80 GB H100 (what `finetune plan` prints for such a job)."""
    chosen = {}
    for bench in throughput.SUITES["gpu"].benches:
        assert bench.checkpointing is None and bench.compile is None
        model = tmp_path / bench.name
        model.mkdir()
        shape = bench.shape
        (model / "config.json").write_text(json.dumps({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": shape.hidden, "intermediate_size": shape.intermediate,
            "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
            "num_key_value_heads": shape.kv_heads, "vocab_size": shape.vocab,
            "max_position_embeddings": 8192, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16"}))
        resolved = throughput.as_users_run_it(bench, model)
        chosen[bench.name] = (resolved.checkpointing, resolved.compile)
        config = throughput.trainer_config(resolved, model, tmp_path / "d.jsonl", tmp_path / "o")
        assert config["strategy"]["gradientCheckpointing"] is resolved.checkpointing
        assert config["hyperparameters"]["microBatchSize"] == resolved.micro_batch
    assert chosen["gpu-1b-full"] == (False, True)
    assert chosen["gpu-1b-qlora"][1] is False  # 4-bit layers are not compiled


def test_collectives_run_on_the_device_their_backend_serves():
    import hf_worker

    assert hf_worker.collective_device("nccl", 3) == "cuda:3"
    assert hf_worker.collective_device("gloo", 3) == "cpu"


def test_every_change_pair_is_two_trainer_configs_the_trainer_takes(tmp_path):
    """Each side of each `changes.py` pair, CPU and GPU, is a config the trainer accepts and
    the two differ: a misspelt GPU pair would otherwise be found only on a GPU, whose time is
    rare."""
    import changes

    from finetune_trainer.config import TrainerConfig

    for change in changes.CHANGES + changes.GPU_CHANGES:
        base = throughput.trainer_config(change.bench, tmp_path / "m", tmp_path / "d.jsonl",
                                         tmp_path / "o")
        sides = [changes.merged(base, change.on), changes.merged(base, change.off)]
        assert sides[0] != sides[1] or change.env_on != change.env_off, change.name
        for side in sides:
            TrainerConfig.model_validate(side)
