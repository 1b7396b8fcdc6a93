"""The fused output layer + cross-entropy against the plain path: same loss, same
gradients (hidden states, head weight, bias), in several chunks, fp32 and bf16."""

from __future__ import annotations

import pytest
import torch

from finetune_trainer import loss
from finetune_trainer.data import IGNORE


def _plain(head: torch.nn.Linear, hidden, labels):
    targets = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE)
    return torch.nn.functional.cross_entropy(head(hidden).flatten(0, 1).float(),
                                             targets.flatten(), ignore_index=IGNORE,
                                             reduction="sum")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_loss_and_gradients_match_the_plain_path(monkeypatch, bias, dtype):
    monkeypatch.setattr(loss, "MIN_CHUNK_ROWS", 8)
    monkeypatch.setattr(loss, "CHUNK_BYTES", 8 * 4 * 50)  # 8 rows a chunk: 5 chunks
    torch.manual_seed(0)
    plain = torch.nn.Linear(32, 50, bias=bias)
    fused = torch.nn.Linear(32, 50, bias=bias)
    fused.load_state_dict(plain.state_dict())
    fused.__class__ = loss.FusedLossHead
    labels = torch.randint(0, 50, (3, 17))
    labels[0, :5] = IGNORE  # a prompt
    labels[2, 10:] = IGNORE  # padding
    hidden = torch.randn(3, 17, 32, requires_grad=True)
    hidden_plain = hidden.detach().clone().requires_grad_()
    targets = loss.loss_targets(labels)
    assert targets["loss_rows"].numel() == int((labels[:, 1:] != IGNORE).sum())

    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        with fused.computing_loss(targets["loss_rows"], targets["loss_targets"]):
            ours = fused(hidden)
        reference = _plain(plain, hidden_plain, labels)
    (ours * 0.5).backward()
    (reference * 0.5).backward()

    close = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2,
                                                                         "atol": 5e-2}
    assert ours.shape == () and ours.item() == pytest.approx(reference.item(), rel=1e-5)
    assert torch.allclose(hidden.grad, hidden_plain.grad, **close)
    assert torch.allclose(fused.weight.grad, plain.weight.grad, **close)
    if bias:
        assert torch.allclose(fused.bias.grad, plain.bias.grad, **close)
    assert fused.targets is None  # back to an ordinary Linear
    assert fused(hidden).shape == (3, 17, 50)


def test_no_gradients_are_made_without_autograd():
    head = torch.nn.Linear(8, 20)
    head.__class__ = loss.FusedLossHead
    head.weight.requires_grad_(False)  # a LoRA base: frozen head
    labels = torch.randint(0, 20, (2, 6))
    targets = loss.loss_targets(labels)
    hidden = torch.randn(2, 6, 8)
    with torch.no_grad(), head.computing_loss(targets["loss_rows"], targets["loss_targets"]):
        value = head(hidden)
    assert not value.requires_grad
    assert float(value) == pytest.approx(float(_plain(head, hidden, labels)), rel=1e-5)


def _tiny(model_type: str, **extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, vocab_size=64, hidden_size=32,
                                  intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                  **extra)
    return AutoModelForCausalLM.from_config(config)


def test_models_that_change_logits_after_the_head_keep_the_plain_path():
    assert loss.fusable(_tiny("llama")) is None
    assert loss.fusable(_tiny("qwen2")) is None
    reason = loss.fusable(_tiny("gemma2"))
    assert reason is not None and "changes the logits" in reason
    assert "changes the logits" in loss.fusable(_tiny("granite"))


def test_a_whole_model_gives_the_same_loss_fused_and_plain():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(_tiny("llama"), LoraConfig(r=2, target_modules="all-linear"))
    ids = torch.randint(0, 64, (2, 9))
    batch = {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(9).expand(2, -1)}
    reference = loss.summed_loss(model, batch, None)
    head = loss.install(model)
    batch.update(loss.loss_targets(batch["labels"]))
    assert float(loss.summed_loss(model, batch, head)) == pytest.approx(float(reference),
                                                                         rel=1e-5)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_answer_logps_and_gradients_match_the_plain_path(monkeypatch, bias, dtype):
    """Preference pairs (`computing_logps`): each trained row's target log-probability,
    computed on those rows only, a chunk of rows at a time (here 3: four chunks, the last
    short), with the gradients of the plain log-softmax."""
    monkeypatch.setattr(loss, "MIN_CHUNK_ROWS", 3)
    monkeypatch.setattr(loss, "CHUNK_BYTES", 3 * 4 * 50)
    torch.manual_seed(0)
    plain = torch.nn.Linear(32, 50, bias=bias)
    fused = torch.nn.Linear(32, 50, bias=bias)
    fused.load_state_dict(plain.state_dict())
    fused.__class__ = loss.FusedLossHead
    labels = torch.randint(0, 50, (2, 9))
    labels[:, :4] = IGNORE  # prompts
    answers = torch.where(labels == IGNORE, -1, torch.tensor([[0], [2]]))
    targets = loss.answer_targets(labels, answers)
    hidden = torch.randn(2, 9, 32, requires_grad=True)
    hidden_plain = hidden.detach().clone().requires_grad_()

    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        with fused.computing_logps(targets["loss_rows"], targets["loss_targets"]):
            ours = fused(hidden)
        logits = plain(hidden_plain).flatten(0, 1).float()
    reference = logits.log_softmax(-1)[targets["loss_rows"], targets["loss_targets"]]
    weights = torch.linspace(-1, 1, ours.numel())
    (ours * weights).sum().backward()
    (reference * weights).sum().backward()

    close = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2,
                                                                         "atol": 5e-2}
    assert ours.shape == (10,) and ours.dtype == torch.float32  # 5 trained rows a sequence
    assert torch.allclose(ours, reference, **close)
    assert targets["loss_answers"].tolist() == [0] * 5 + [2] * 5
    assert torch.allclose(hidden.grad, hidden_plain.grad, **close)
    assert torch.allclose(fused.weight.grad, plain.weight.grad, **close)
    if bias:
        assert torch.allclose(fused.bias.grad, plain.bias.grad, **close)
    assert fused.targets is None and not fused.per_row  # back to an ordinary Linear
    assert fused(hidden).shape == (2, 9, 50)
