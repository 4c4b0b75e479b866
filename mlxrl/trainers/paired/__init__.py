"""The chosen / rejected trainers' shared parts (`trainer.PairedTrainer`)."""
