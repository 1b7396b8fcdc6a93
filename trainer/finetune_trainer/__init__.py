"""finetune-trainer."""
