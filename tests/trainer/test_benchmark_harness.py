"""The benchmark harness's own code paths, on CPU: the peer worker's collectives under
torchrun (the reduction that once ran a CPU tensor through NCCL), and the GPU suite's
settings resolved as users get them."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import throughput  # a script beside the tests, not a package

from tests.support import waits


def peer_figures(bench, model_dir: Path, data: Path, where: Path, peer: str) -> dict:
    """A peer's worker (benchmarks/hf_worker.py) on 2 ranks over `data`: its figures."""
    config = where / "config.yaml"
    config.write_text(yaml.safe_dump(throughput.trainer_config(bench, model_dir, data,
                                                               where / "out")))
    result = where / f"{peer}.json"
    command = throughput.torchrun(2, str(REPO / "benchmarks/hf_worker.py"), f"--config={config}",
                                  f"--result={result}", f"--peer={peer}", "--warmup-steps=1")
    done = subprocess.run(command, capture_output=True, text=True, timeout=waits.seconds_left(),
                          env=throughput.worker_env())
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(result.read_text())


@pytest.mark.process
def test_the_peer_worker_sums_its_counts_over_two_ranks(tiny_model_dir, tmp_path):
    bench = replace(throughput.SUITES["cpu"].benches[0], steps=4, warmup=1, samples=64,
                    seq_len=128)
    data = tmp_path / "data.jsonl"
    throughput.write_data(data, bench)
    figures = peer_figures(bench, tiny_model_dir, data, tmp_path, "trainer")
    assert figures["timed_steps"] == 3
    assert figures["tokens_per_second"] > 0


@pytest.mark.process
def test_the_dpo_peer_counts_the_trained_answers_once(tiny_model_dir, tmp_path):
    """DPOTrainer's reference forward goes through the same module with the same labels:
    only the trained forward counts, so a step's tokens are its pairs' answer tokens, as
    ours counts them (every pair alike here, so the count is known without the order)."""
    from transformers import AutoTokenizer

    from finetune_trainer.data import pair_tokens

    bench = replace(throughput.SUITES["cpu-dpo"].benches[0], steps=4, warmup=1, batch=2,
                    seq_len=128)
    record = {"prompt": "what does the model learn\n", "chosen": "a short answer",
              "rejected": "the network and its layers"}
    data = tmp_path / "pairs.jsonl"
    data.write_text((json.dumps(record) + "\n") * 16)
    figures = peer_figures(bench, tiny_model_dir, data, tmp_path, "dpo")
    _, chosen, rejected = pair_tokens(record, AutoTokenizer.from_pretrained(tiny_model_dir))
    assert figures["timed_steps"] == 3
    assert figures["tokens_per_step"] == 2 * 2 * (len(chosen) + len(rejected))


def test_the_dpo_suites_train_preference_pairs_whole(tmp_path):
    """Each DPO configuration is a config the trainer takes (objective dpo on preference
    data), its pairs fit maxSeqLength on both sides (neither truncates, so both train on
    the same answer tokens) with a long tail of lengths, and it runs beside the DPO peer
    alone."""
    import statistics

    from finetune_trainer.config import TrainerConfig
    from finetune_trainer.data import read_records, tokenize_pairs
    from finetune_trainer.tiny import build_tokenizer, corpus_from_jsonl

    benches = [b for name in ("cpu-dpo", "gpu-dpo") for b in throughput.SUITES[name].benches]
    for bench in benches:
        small = replace(bench, samples=300)
        data = tmp_path / f"{bench.name}.jsonl"
        throughput.write_data(data, small)
        config = TrainerConfig.model_validate(throughput.trainer_config(
            bench, tmp_path / "m", data, tmp_path / "o"))
        assert config.objective.settings().beta == throughput.DPO["beta"]
        tokenizer = build_tokenizer(corpus_from_jsonl(data)[:2000], vocab_size=1024)  # as
        pairs = tokenize_pairs(read_records(config.dataset, tmp_path), tokenizer,  # build_model
                               bench.seq_len)
        assert pairs.truncated == 0 and len(pairs.samples) == 300
        lengths = [len(s["input_ids"]) for s in pairs.samples]  # both sides of a pair
        assert max(lengths) > 4 * statistics.median(lengths)  # a long tail
        assert throughput.sides_of(bench, tuple(throughput.PEERS)) == ("trl_dpo",)
    assert throughput.sides_of(throughput.SUITES["cpu"].benches[0],
                               tuple(throughput.PEERS)) == ("hf_trainer", "trl_sft", "trl_liger")


@pytest.mark.process
def test_grpo_runs_beside_grpotrainer_each_counting_the_completions_trained(tmp_path):
    """The GRPO configuration end to end on CPU (both sides, 2 processes each): each side's
    tokens per step are the completion tokens it trained on, at most the step's completions
    x maxCompletionLength; the peer's count from its forward equals GRPOTrainer's own logged
    `completions/mean_length` x completions (the reference and sampling forwards, without
    grad, not counted)."""
    bench = replace(throughput.SUITES["cpu-grpo"].benches[0], steps=4, warmup=1, samples=64)
    grpo = {**throughput.GRPO, **bench.extra["grpo"]}
    assert grpo["maxCompletionLength"] < bench.seq_len  # prompts within the rest
    row = throughput.compare(bench, tmp_path, repeats=1, peers=("trl_grpo",))
    most = bench.batch * bench.processes * grpo["maxCompletionLength"]
    ours, peer = row["ours"], row["trl_grpo"]
    assert 0 < ours["tokens_per_step"] <= most
    assert 0 < peer["tokens_per_step"] <= most
    assert peer["tokens_per_step"] == pytest.approx(peer["logged_tokens_per_step"], rel=1e-6)
    assert peer["timed_steps"] == 3
    assert row["trl_grpo_tokens_per_second_ratio"] > 0
    config = yaml.safe_load((tmp_path / f"{bench.name}.yaml").read_text())
    assert config["objective"]["grpo"]["numGenerations"] == grpo["numGenerations"]
    assert config["dataset"]["format"] == "prompt"


def test_the_gpu_suite_runs_the_settings_users_get(tmp_path):
    """checkpointing, micro-batch and compile unset in the suite: resolved by the planner
    as for a long run on an 80 GB H100 (what `finetune plan` prints for such a job)."""
    chosen = {}
    for bench in [b for name in ("gpu", "gpu-dpo", "gpu-grpo")
                  for b in throughput.SUITES[name].benches]:
        assert bench.checkpointing is None
        assert bench.compile is (False if bench.name.endswith("-eager") else None)
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


def test_the_peers_attention_is_counted_over_the_documents_they_attend():
    """MFU's attention term on a peer's forward, as ours counts it: the documents of a
    padding-free row (positions restart), else each padded row's own tokens."""
    import hf_worker
    import torch

    packed = torch.tensor([[0, 1, 2, 0, 1]])
    assert hf_worker.attended(packed, None, None) == 6 + 3
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    assert hf_worker.attended(None, mask, None) == 6 + 3
    labels = torch.zeros(2, 4)
    assert hf_worker.attended(None, None, labels) == 2 * 10


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


@pytest.mark.process
def test_the_generation_benchmark_samples_each_side_beside_dynamic(tmp_path):
    """benchmarks/generation.py on CPU, as a user runs it: each side timed over the same
    completions, `merged` against `dynamic`, and both sampling the same model (greedy
    tokens alike: fp32, the merge moves the logits by rounding alone)."""
    out = tmp_path / "generation.json"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks/generation.py"),
                           "--calls", "1", "--new-tokens", "8", "--out", str(out)],
                          capture_output=True, text=True, cwd=REPO,
                          timeout=waits.seconds_left())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    assert [r["side"] for r in rows] == ["dynamic", "merged"]
    assert rows[0]["ratio"] == 1.0 and rows[1]["ratio"] > 0
    assert all(r["tokens_per_second"] > 0 for r in rows)
    assert rows[1]["greedy_agreement"] >= 0.75, rows[1]
    assert "merged" in done.stdout and "greedy same" in done.stdout
    refused = subprocess.run([sys.executable, str(REPO / "benchmarks/generation.py"),
                              "--sides", "dynamic,static"], capture_output=True, text=True,
                             cwd=REPO, timeout=waits.seconds_left())
    assert refused.returncode == 2 and "GPUs only" in refused.stderr


@pytest.mark.process
def test_the_startup_benchmark_times_each_side_to_its_first_step_and_end(tmp_path):
    """benchmarks/startup.py, one round: `finetune run` and torchrun alone on the config it
    wrote, each run to the end (6 steps). (The third side, the preflight process `finetune
    run` ran before 11-29, adds a run as long as these two for a figure of the past: left to
    the benchmark.)"""
    out = tmp_path / "startup.json"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks/startup.py"), "--rounds", "1",
                           "--sides", "torchrun alone", "--out", str(out)],
                          capture_output=True, text=True, cwd=REPO, timeout=waits.seconds_left())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    sides = json.loads(out.read_text())["sides"]
    assert list(sides) == ["finetune run", "torchrun alone"]  # `finetune run` always
    for figures in sides.values():
        assert 0 < figures["seconds_to_first_step"] <= figures["seconds_to_done"]
    assert sides["finetune run"]["ratio_to_finetune_run"] == 1.0
    assert sides["torchrun alone"]["ratio_to_finetune_run"] == round(
        sides["torchrun alone"]["seconds_to_done"] / sides["finetune run"]["seconds_to_done"], 2)
    assert done.stderr == "", done.stderr  # the tiny model built quietly, no library noise
