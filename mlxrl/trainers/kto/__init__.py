"""KTO: `KTOTrainer` (`trainer`), `KTOConfig` (`config`)."""
