"""The loss: the output layer and the cross-entropy computed together, a chunk of tokens
at a time, over trained tokens only.

A step's logits (tokens x vocabulary, in fp32 for the softmax) are the largest tensor of
LLM fine-tuning — 8 GiB for 16k tokens of a 128k vocabulary — and autograd keeps them
and their gradient. The gradients of the hidden states and of the output weight are known
as soon as a chunk's softmax is (softmax minus one-hot), so they are computed in the
forward pass and only a chunk of logits is ever alive. Rows whose label is ignored
(prompts, padding, each sequence's last position) are dropped before the output layer and
cost nothing. The idea of Liger's fused linear cross-entropy, in plain torch matmuls, so
it runs on every device and under every strategy (the output layer stays a module of the
model: FSDP and ZeRO-3 gather its weight as usual).

Models whose causal-LM forward changes the logits after the output layer (Gemma 2/3
soft-capping, Cohere and Granite scaling) keep the plain path: `fusable` reads the
model's forward and says so.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import torch

from finetune_trainer.attention import forward_kwargs
from finetune_trainer.data import IGNORE

CHUNK_BYTES = 256 * 2**20
"""Largest fp32 logits chunk held at once."""
MIN_CHUNK_ROWS = 256


def base_causal_lm(model):
    """The transformers model under a peft wrapper (called before any strategy wraps it)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def fusable(model) -> str | None:
    """None when the loss can be taken from the output layer's input; else why not."""
    causal_lm = base_causal_lm(model)
    head = causal_lm.get_output_embeddings()
    if head is None:
        return f"{type(causal_lm).__name__} has no output layer"
    if type(head) is not torch.nn.Linear:
        return f"its output layer is a {type(head).__name__}, not a plain Linear"
    try:
        source = inspect.getsource(type(causal_lm).forward)
    except (OSError, TypeError):
        return f"the source of {type(causal_lm).__name__}.forward is not available"
    lines = [line.strip() for line in source.splitlines()]
    lines = [line for line in lines if line and not line.startswith("#")]
    heads = [i for i, line in enumerate(lines) if line.startswith("logits = self.lm_head(")]
    if len(heads) != 1 or heads[0] + 1 >= len(lines):
        return f"{type(causal_lm).__name__}.forward does not compute logits as lm_head(...)"
    after = lines[heads[0] + 1]
    if not (after.startswith("loss = None") or after.startswith("if labels is not None")):
        return f"{type(causal_lm).__name__}.forward changes the logits after lm_head ({after})"
    return None


def install(model) -> FusedLossHead:
    """Make the model's output layer able to return the summed loss (check `fusable`
    first); returns that layer."""
    head = base_causal_lm(model).get_output_embeddings()
    head.__class__ = FusedLossHead  # same parameters and hooks, one more way to run
    head.targets = None
    return head


def loss_targets(labels) -> dict[str, Any]:
    """Which flattened positions are trained and on which token, from a micro-batch's CPU
    labels (the host knows them already: no device sync to find them)."""
    shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE).flatten()
    rows = (shifted != IGNORE).nonzero().squeeze(1)
    return {"loss_rows": rows, "loss_targets": shifted[rows]}


def summed_loss(model, batch, head: FusedLossHead | None):
    """Sum of the token cross-entropies of a micro-batch (on its device)."""
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"],
              "use_cache": False, **forward_kwargs(batch)}
    if head is not None:
        with head.computing_loss(batch["loss_rows"], batch["loss_targets"]):
            return model(**inputs).logits
    logits = model(**inputs).logits
    # shift the labels, not the logits: slicing the logits would copy the largest tensor
    # of the step (batch x length x vocabulary) and its gradient
    targets = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=IGNORE)
    return torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="sum")


def answer_logps(model, batch, head: FusedLossHead | None):
    """Each answer's summed token log-probability (preference pairs: chosen at even
    indices, rejected at odd), computed for the answers' rows only where the head is
    fused."""
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"],
              "use_cache": False, **forward_kwargs(batch)}
    rows, targets, answers = batch["loss_rows"], batch["loss_targets"], batch["loss_answers"]
    if head is not None:
        with head.computing_logps(rows, targets):
            picked = model(**inputs).logits
    else:
        logits = model(**inputs).logits.flatten(0, 1).index_select(0, rows).float()
        picked = logits.log_softmax(-1).gather(1, targets[:, None]).squeeze(1)
    summed = torch.zeros(2 * batch["pairs"].shape[0], dtype=torch.float32,
                         device=picked.device)
    return summed.index_add(0, answers, picked.float())


def answer_targets(labels, answers) -> dict[str, Any]:
    """`loss_targets`, and the answer each trained position belongs to."""
    targets = loss_targets(labels)
    shifted = torch.nn.functional.pad(answers[:, 1:], (0, 1), value=-1).flatten()
    return {**targets, "loss_answers": shifted[targets["loss_rows"]]}


def chunk_rows(vocabulary: int) -> int:
    return max(MIN_CHUNK_ROWS, CHUNK_BYTES // (4 * vocabulary))


class LinearCrossEntropy(torch.autograd.Function):
    """sum over rows of CE(hidden @ weight.T + bias, targets); gradients made in forward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, compute_dtype, grads: bool):
        want_hidden, want_weight, want_bias = (grads and wanted
                                               for wanted in ctx.needs_input_grad[:3])
        rows = chunk_rows(weight.shape[0])
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden, grad_weight, grad_bias = _head_grads(hidden, weight, bias, want_hidden,
                                                          want_weight, want_bias)
        w, b = _in_dtype(weight, bias, compute_dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], rows):
                h = hidden[start:start + rows].to(compute_dtype)
                t = targets[start:start + rows]
                logits = _chunk_logits(h, w, b, compute_dtype)
                # log-sum-exp and softmax in the logits' own memory: no second chunk
                top = logits.max(dim=1).values
                picked = logits.gather(1, t[:, None]).squeeze(1) - top
                probs = logits.sub_(top[:, None]).exp_()
                sums = probs.sum(dim=1)
                total += (sums.log() - picked).sum()
                if not (want_hidden or want_weight or want_bias):
                    continue
                probs.div_(sums[:, None])
                probs[torch.arange(t.shape[0], device=t.device), t] -= 1.0
                grad = probs.to(compute_dtype)
                if want_hidden:
                    grad_hidden[start:start + rows] = grad @ w
                if want_weight:
                    grad_weight += (grad.T @ h).float()
                if want_bias:
                    grad_bias += probs.sum(0)
        ctx.save_for_backward(*(g for g in (grad_hidden, grad_weight, grad_bias)
                                if g is not None))
        ctx.present = (want_hidden, want_weight, want_bias)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_output):
        saved = iter(ctx.saved_tensors)
        grads = [(next(saved) * grad_output).to(dtype) if present else None
                 for present, dtype in zip(ctx.present, ctx.dtypes, strict=True)]
        return (*grads, None, None, None)


class LinearLogProbs(torch.autograd.Function):
    """Each row's log-probability of its target under softmax(hidden @ weight.T + bias),
    a chunk of rows at a time: preference losses need them per answer, and the whole
    [rows, vocabulary] fp32 logits with their log-softmax (what autograd kept before:
    16 GB of a 1B DPO step's 10k answer tokens at a 128k vocabulary) never exist. Backward
    computes each chunk's logits again (one head matmul, a few per cent of the step) to
    form d logp / d logits = one-hot - softmax, scaled by each row's incoming gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, compute_dtype):
        rows = chunk_rows(weight.shape[0])
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(out)
        w, b = _in_dtype(weight, bias, compute_dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], rows):
                logits = _chunk_logits(hidden[start:start + rows], w, b, compute_dtype)
                lse[start:start + rows] = torch.logsumexp(logits, dim=1)
                picked = logits.gather(1, targets[start:start + rows, None]).squeeze(1)
                out[start:start + rows] = picked - lse[start:start + rows]
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.compute_dtype = compute_dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        compute = ctx.compute_dtype
        rows = chunk_rows(weight.shape[0])
        grad_hidden, grad_weight, grad_bias = _head_grads(hidden, weight, bias, want_hidden,
                                                          want_weight, want_bias)
        w, b = _in_dtype(weight, bias, compute)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], rows):
                h = hidden[start:start + rows]
                g = grad_out[start:start + rows].float()
                t = targets[start:start + rows]
                # -g·softmax, then +g at the target: d(g·logp_t)/d logits, in place
                grad = _chunk_logits(h, w, b, compute).sub_(lse[start:start + rows, None])
                grad = grad.exp_().mul_(-g[:, None])
                grad[torch.arange(t.shape[0], device=t.device), t] += g
                if want_bias:
                    grad_bias += grad.sum(0)
                grad = grad.to(compute)
                if want_hidden:
                    grad_hidden[start:start + rows] = grad @ w
                if want_weight:
                    grad_weight += (grad.T @ h.to(compute)).float()
        return (None if grad_hidden is None else grad_hidden.to(hidden.dtype),
                None if grad_weight is None else grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(bias.dtype), None, None)


def _head_grads(hidden, weight, bias, want_hidden: bool, want_weight: bool, want_bias: bool):
    """The gradients a chunked head fills: the hidden states' in their dtype, the weight's
    and the bias's accumulated in fp32; None where not wanted."""
    grad_hidden = torch.empty_like(hidden) if want_hidden else None
    grad_weight = (torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
                   if want_weight else None)
    grad_bias = (torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
                 if want_bias else None)
    return grad_hidden, grad_weight, grad_bias


def _in_dtype(weight, bias, dtype):
    return weight.to(dtype), (bias.to(dtype) if bias is not None else None)


def _chunk_logits(hidden, weight, bias, compute_dtype):
    """fp32 logits of a chunk of rows, the matmul in the compute dtype."""
    h = hidden.to(compute_dtype)
    return (h @ weight.T if bias is None else torch.addmm(bias, h, weight.T)).float()


class FusedLossHead(torch.nn.Linear):
    """The model's output Linear; while `computing_loss` it returns the summed loss of
    the rows named there instead of logits."""

    targets: tuple | None = None
    per_row: bool = False
    """While `computing_logps`: each row's target log-probability, not their summed loss."""

    @contextlib.contextmanager
    def computing_loss(self, rows, targets):
        self.targets = (rows, targets)
        try:
            yield
        finally:
            self.targets = None

    @contextlib.contextmanager
    def computing_logps(self, rows, targets):
        """Return the log-probability of each row's target (preference losses need them
        per answer): logits of those rows only, through autograd."""
        self.targets, self.per_row = (rows, targets), True
        try:
            yield
        finally:
            self.targets, self.per_row = None, False

    def forward(self, hidden):
        if self.targets is None:
            return super().forward(hidden)
        rows, targets = self.targets
        device = hidden.device.type
        compute = (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
                   else self.weight.dtype)
        picked = hidden.flatten(0, 1).index_select(0, rows)
        if self.per_row:
            return LinearLogProbs.apply(picked, self.weight, self.bias, targets, compute)
        return LinearCrossEntropy.apply(picked, self.weight, self.bias, targets, compute,
                                        torch.is_grad_enabled())
