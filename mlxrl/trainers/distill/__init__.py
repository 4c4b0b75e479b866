"""Distillation: TRL 1.16's on-policy DistillationTrainer (config, teacher, trainer)."""
