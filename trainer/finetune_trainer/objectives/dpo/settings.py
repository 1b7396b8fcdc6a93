"""`spec.objective.dpo`: DPO's settings (torch-free: the CRD and the operator read them)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from finetune_trainer.api_model import ApiModel

DpoLoss = Literal["sigmoid", "ipo", "robust"]


class DpoConfig(ApiModel):
    """Direct Preference Optimization (Rafailov et al., 2023), as TRL's DPOConfig names it."""

    beta: float = Field(default=0.1, gt=0, le=100)
    """How far the trained model may move from the reference (the model before training):
    small values let it move further. For `ipo`, the regularisation strength (tau)."""
    loss: DpoLoss = "sigmoid"
    """`sigmoid`: the DPO loss, -log sigmoid(beta x margin); with `labelSmoothing`,
    conservative DPO (cDPO). `ipo`: IPO's squared loss on the per-token mean log-ratio
    margin. `robust`: robust DPO, unbiased under the `labelSmoothing` fraction of flipped
    labels. Without label smoothing, TRL's `loss_type`s of these names (TRL 1.16's
    `sigmoid` ignores its `label_smoothing`)."""
    label_smoothing: float = Field(default=0.0, ge=0.0, le=0.49)
    """The fraction of pairs assumed to be labelled the wrong way round (`sigmoid`:
    conservative DPO; `robust`), at most 0.49 (0.5 would say a label means nothing).
    0: trust every label."""
    precompute_ref_log_probs: bool = False
    """With adapters (`lora`, `qlora`): take the reference's log-probabilities of every
    pair once, before the first step (a forward pass of the base over the data, kept in the
    output folder), instead of a forward of the base beside the policy at every batch. A
    step then does a quarter to a third less work; the pass costs about one epoch's
    reference forwards, so it pays beyond one epoch. TRL's `precompute_ref_log_probs`. Full
    weights always take them once: their reference is gone after the first step."""

    not_trained_with: ClassVar[frozenset[str]] = frozenset({"precompute_ref_log_probs"})
    """Settings a resume may change: how the reference is taken, not what it is."""
