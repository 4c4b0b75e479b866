"""CPO (and SimPO, AlphaPO): `CPOTrainer` (`trainer`), `CPOConfig` (`config`)."""
