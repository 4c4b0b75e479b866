"""SFT: `SFTTrainer` (`trainer`) and `SFTConfig` (`config`)."""
