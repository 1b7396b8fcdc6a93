"""finetune-operator."""
