"""GRPO: `GRPOTrainer` (`trainer`), `GRPOConfig` (`config`), reward functions (`rewards`)."""
