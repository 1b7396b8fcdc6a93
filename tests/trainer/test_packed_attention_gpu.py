"""Packed attention (flash varlen over each sample) computes what SDPA with transformers'
block-diagonal mask computes: the same loss and gradients on packed rows."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.gpu]


def test_packed_attention_matches_sdpa_with_the_block_mask(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    from finetune_trainer import attention
    from finetune_trainer.loss import summed_loss
    from finetune_trainer.train import Collation

    if (why := attention.why_not(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                                 torch.device("cuda"), "bf16")) is not None:
        pytest.skip(why)
    generator = torch.Generator().manual_seed(0)

    def packed_row(lengths):
        row = {"input_ids": [], "labels": [], "position_ids": []}
        for length in lengths:
            ids = torch.randint(3, 200, (length,), generator=generator).tolist()
            row["input_ids"] += ids
            row["labels"] += [-100, *ids[1:]]
            row["position_ids"] += list(range(length))
        return row

    rows = [packed_row([37, 100, 5, 60]), packed_row([200]), packed_row([1, 150])]
    results = {}
    for name in ("sdpa", "packed"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).cuda()
        model.config.use_cache = False
        if name == "packed":
            attention.install(model)
        batch = Collation(pad_id=0, bounds=name == "packed").tensors(rows)
        batch = {k: v.cuda() for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = summed_loss(model, batch, None)
        loss.backward()
        results[name] = (loss.item(), {n: p.grad.float().clone()
                                       for n, p in model.named_parameters()})
    assert results["packed"][0] == pytest.approx(results["sdpa"][0], rel=1e-2)
    for name, grad in results["sdpa"][1].items():
        other = results["packed"][1][name]
        assert torch.allclose(other, grad, rtol=5e-2, atol=5e-3 * grad.abs().max()), name
