"""Reward modelling: `RewardTrainer` (`trainer`), `RewardConfig` (`config`)."""
