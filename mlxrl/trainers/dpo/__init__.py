"""DPO: `DPOTrainer` (`trainer`) and `DPOConfig` (`config`)."""
