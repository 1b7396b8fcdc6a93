"""Loading through the real from_pretrained path, adapters, and clear refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from finetune_trainer.config import LoraConfig, MethodConfig, ModelSource
from finetune_trainer.model import ModelError, load_model, model_location
from tests.support import waits


def test_full_model_loads_in_fp32_without_cache(tiny_model_dir):
    model = load_model(ModelSource(uri=str(tiny_model_dir)), MethodConfig(type="full"), "bf16",
                       gradient_checkpointing=True)
    assert model.config.use_cache is False
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("loading", ["host", "meta"])
def test_lora_freezes_the_base_in_compute_dtype_and_trains_fp32_adapters(tiny_model_dir,
                                                                         loading):
    """Under every strategy (#17): a sharded base in fp32 took twice the memory; and built
    empty (FSDP's ranks before rank 0's weights arrive) with the same dtypes."""
    model = load_model(ModelSource(uri=str(tiny_model_dir)),
                       MethodConfig(type="lora", lora=LoraConfig(r=4)), "bf16", False,
                       loading=loading)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert {p.dtype for p in trainable.values()} == {torch.float32}
    assert {p.dtype for p in frozen} == {torch.bfloat16}
    # all-linear adapts every projection but not the output head
    adapted = {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n in trainable if "lora_A" in n}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                       "down_proj"}
    assert all(p.is_meta for p in frozen) == (loading == "meta")
    assert not any(p.is_meta for p in trainable.values())


@pytest.mark.parametrize("method", ["lora", "full"])
def test_a_model_built_empty_is_the_read_one_without_its_weights(tiny_model_dir, method):
    """`meta` (every FSDP rank before rank 0's weights arrive, #17): the same names, shapes
    and dtypes as a read model, tied weights tied, the very adapters a read model draws,
    and the random generator left where reading leaves it (dropout draws the same)."""
    source = ModelSource(uri=str(tiny_model_dir))
    config = MethodConfig(type=method, lora=LoraConfig(r=4) if method == "lora" else None)
    built = {}
    for loading in ("host", "meta"):
        torch.manual_seed(7)
        model = load_model(source, config, "fp32", True, loading=loading)
        built[loading] = (model, torch.get_rng_state())
    (read, read_rng), (empty, empty_rng) = built["host"], built["meta"]
    assert torch.equal(read_rng, empty_rng)
    read_params, empty_params = dict(read.named_parameters()), dict(empty.named_parameters())
    assert [(n, p.shape, p.dtype) for n, p in read_params.items()] == [
        (n, p.shape, p.dtype) for n, p in empty_params.items()]
    for name, parameter in empty_params.items():
        assert parameter.is_meta != parameter.requires_grad or method == "full"
        if not parameter.is_meta:
            assert torch.equal(parameter, read_params[name]), name
    for name, buffer in empty.named_buffers():
        assert torch.equal(buffer, dict(read.named_buffers())[name])
    assert empty.training == read.training
    assert empty.generation_config.to_dict() == read.generation_config.to_dict()


def test_tied_weights_stay_tied_built_empty(tmp_path):
    from finetune_trainer.tiny import build_tiny_llama

    corpus = ["a tied model", "the head is the embedding"]
    folder = build_tiny_llama(tmp_path / "tied", corpus)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    model = load_model(ModelSource(uri=str(folder)), MethodConfig(type="full"), "fp32", False,
                       loading="meta")
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_named_target_modules(tiny_model_dir):
    model = load_model(ModelSource(uri=str(tiny_model_dir)), MethodConfig(
        type="lora", lora=LoraConfig(target_modules=["q_proj", "v_proj"])), "fp32", False)
    assert {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, p in model.named_parameters()
            if "lora_A" in n} == {"q_proj", "v_proj"}


def test_unknown_target_module_lists_the_real_ones(tiny_model_dir):
    with pytest.raises(ModelError) as error:
        load_model(ModelSource(uri=str(tiny_model_dir)), MethodConfig(
            type="lora", lora=LoraConfig(target_modules=["q_proj", "c_attn"])), "fp32", False)
    assert error.value.where == "spec.method.lora.targetModules"
    assert "c_attn is not a linear layer of LlamaForCausalLM" in error.value.what
    assert "q_proj" in error.value.fix and "lm_head" not in error.value.fix


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_qlora_is_refused_on_cpu(tiny_model_dir):
    with pytest.raises(ModelError, match="qlora needs a CUDA GPU"):
        load_model(ModelSource(uri=str(tiny_model_dir)), MethodConfig(type="qlora"), "bf16", False)


def test_folder_without_config(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ModelError, match=r"has no config\.json"):
        model_location(ModelSource(uri=str(tmp_path)))
    with pytest.raises(ModelError, match="does not exist"):
        model_location(ModelSource(uri=str(tmp_path / "missing")))


def test_relative_location_starts_at_the_manifest_folder(tiny_model_dir):
    source = ModelSource(uri=f"./{tiny_model_dir.name}")
    assert model_location(source, base_dir=tiny_model_dir.parent) == str(tiny_model_dir)


@pytest.mark.process
def test_hub_model_without_network_says_so():
    # huggingface_hub reads HF_HUB_OFFLINE at import, so this runs in a fresh process
    code = ("from finetune_trainer.config import ModelSource\n"
            "from finetune_trainer.model import ModelError, load_tokenizer\n"
            "try:\n"
            "    load_tokenizer(ModelSource(uri='hf://finetune-operator-tests/no-such-model'))\n"
            "except ModelError as error:\n"
            "    print(error)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=waits.seconds_left())
    assert result.stdout.startswith("hf://finetune-operator-tests/no-such-model: cannot be "
                                    "loaded from the hub"), result.stdout + result.stderr
    assert "reach the hub" in result.stdout



def _train_step(model, ids):
    position_ids = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    model(input_ids=ids, position_ids=position_ids).logits.float().logsumexp(-1).sum().backward()


def _matmuls_in_backward(model, ids) -> int:
    """aten matmuls run during backward: the gradients' own, plus any recomputed forward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
                        torch.ops.aten.bmm.default):
                Count.calls += 1
            return func(*args, **(kwargs or {}))

    position_ids = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    out = model(input_ids=ids, position_ids=position_ids).logits.float().logsumexp(-1).sum()
    with Count():
        out.backward()
    return Count.calls


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_checkpointing_policies_give_the_gradients_of_no_checkpointing(tiny_model_dir, policy):
    source, method = ModelSource(uri=str(tiny_model_dir)), MethodConfig(type="full")
    ids = torch.randint(3, 100, (2, 24))
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = load_model(source, method, "fp32", checkpointing, checkpoint_policy=policy)
        model.train()
        _train_step(model, ids)
        grads.append(model.model.layers[0].mlp.down_proj.weight.grad)
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


def test_selective_checkpointing_recomputes_no_matmul(tiny_model_dir):
    """Full checkpointing reruns each layer's matmuls in backward; selective keeps their
    outputs, so backward runs exactly the matmuls of an uncheckpointed model."""
    source, method = ModelSource(uri=str(tiny_model_dir)), MethodConfig(type="full")
    ids = torch.randint(3, 100, (2, 24))
    counts = {}
    for name, checkpointing, policy in (("none", False, "full"), ("full", True, "full"),
                                        ("selective", True, "selective")):
        model = load_model(source, method, "fp32", checkpointing, checkpoint_policy=policy)
        model.train()
        counts[name] = _matmuls_in_backward(model, ids)
    assert counts["selective"] == counts["none"] < counts["full"]
