"""SFT's trainer side: records tokenised with loss masks, the mean token cross-entropy."""

from __future__ import annotations

from finetune_trainer.data import DataError, tokenize_records
from finetune_trainer.loss import summed_loss
from finetune_trainer.objectives.base import Objective, PreparedData


class SftObjective(Objective):
    """The loss is the sum of token cross-entropies over the micro-batch's trained tokens
    (`loss.summed_loss`: through the fused head where installed); `units` counts them."""

    def prepare(self, tokenizer, records, eval_records, fmt: str) -> PreparedData:
        data = self.config.dataset
        train = tokenize_records(records, fmt, tokenizer, data.max_seq_length)
        if not train and fmt == "chat" and not any(
                isinstance(m, dict) and m.get("role") == "assistant"
                for messages in records["messages"] for m in messages or ()):
            roles = sorted({str(m.get("role")) for messages in records["messages"]
                            for m in messages or () if isinstance(m, dict)})
            raise DataError(data.uri, "has no message with role assistant, the turns trained "
                            f"on (its roles: {', '.join(roles) or 'none'})",
                            "name the model's turns `assistant` (and the others `system` or "
                            "`user`)")
        if not train:
            raise DataError(data.uri, "has no sample with a trained token after truncation",
                            "raise spec.dataset.maxSeqLength or check the response columns")
        evaluation = tokenize_records(eval_records, fmt, tokenizer, data.max_seq_length)
        if data.eval_split is not None and not evaluation:
            raise DataError(data.uri, f"its {data.eval_split} split has no sample with a "
                            "trained token after truncation", "raise "
                            "spec.dataset.maxSeqLength or check that split's response columns")
        return PreparedData(self.arrange(train), self.arrange(evaluation))

    def summed(self, batch):
        return summed_loss(self.strategy.model, batch, self.head), None
