"""ORPO: `ORPOTrainer` (`trainer`), `ORPOConfig` (`config`)."""
