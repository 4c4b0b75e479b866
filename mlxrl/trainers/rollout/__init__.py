"""The rollout trainers' shared parts (GRPO, RLOO, Distillation): prompts, generation rounds, the micro-batches."""
