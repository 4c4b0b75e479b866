"""RLOO: TRL 1.16's REINFORCE leave-one-out trainer on GRPO's rollout machinery."""
