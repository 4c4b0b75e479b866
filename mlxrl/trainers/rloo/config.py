"""RLOOConfig: TRL 1.16's RLOO fields (names and defaults) on GRPO's (`GRPOConfig`: the generation, reward and
batching fields the two share), and the checks of an RLOO run's settings."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import _f, refused
from ..grpo.config import GRPOConfig, check_grpo_config

__all__ = ["RLOOConfig", "check_rloo_config"]

NOT_RLOO = "TRL's RLOOConfig has no such field (it is GRPO's)"


@dataclass
class RLOOConfig(GRPOConfig):
    """TRL 1.16's RLOOConfig fields (names and defaults); GRPO's own loss fields, which TRL's RLOOConfig does not
    have, are refused in one line when set."""

    num_generations: int = _f(2, "completions sampled per prompt (the leave-one-out baseline needs >= 2)")
    beta: float = _f(0.05, "KL penalty on the reward. Each sequence's reward loses beta x its summed log-ratio to the "
                           "reference (0: no reference model is kept or run)")
    normalize_advantages: bool = _f(False, "normalise the advantages over the round (mean 0, std 1)")
    reward_clip_range: list[float] | None = _f(None, "clip the weighted reward to [min, max] before the KL penalty")
    head_mode: str = _f("differentiable", "(mlxrl) the streamed LM head with its VJP (RLOO's sequence-level ratio "
                                          "couples a sequence's tokens)", choices=("differentiable",))
    loss_type: str = refused("dapo", NOT_RLOO)
    scale_rewards: str = refused("group", NOT_RLOO)
    multi_objective_aggregation: str = refused("sum_then_normalize", NOT_RLOO)
    importance_sampling_level: str = refused("token", NOT_RLOO)
    delta: float | None = refused(None, NOT_RLOO)
    sapo_temperature_neg: float = refused(1.05, NOT_RLOO)
    sapo_temperature_pos: float = refused(1.0, NOT_RLOO)
    use_bias_correction_kl: bool = refused(True, NOT_RLOO)
    vespo_k_pos: float = refused(2.0, NOT_RLOO)
    vespo_lambda_pos: float = refused(3.0, NOT_RLOO)
    vespo_k_neg: float = refused(3.0, NOT_RLOO)
    vespo_lambda_neg: float = refused(2.0, NOT_RLOO)


def check_rloo_config(args: RLOOConfig) -> None:
    """One-line ValueErrors: GRPO's shared checks and RLOO's own."""
    check_grpo_config(args)
    clip = args.reward_clip_range
    if clip is not None and (len(clip) != 2 or not float(clip[0]) <= float(clip[1])):
        raise ValueError(f"reward_clip_range must be two numbers [min, max] with min <= max, got {list(clip)}")
