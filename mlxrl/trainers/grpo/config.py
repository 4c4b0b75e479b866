"""GRPOConfig: TRL 1.16's GRPO fields (names and defaults), and the checks of a GRPO run's settings."""

from __future__ import annotations

from dataclasses import dataclass

from ...losses.grpo import IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES, SEQUENCE_COUPLED_LOSS_TYPES
from ..config import _f, refused
from ..rollout.config import OWN_ENGINE, RolloutConfig, check_rollout_config

__all__ = ["GRPOConfig", "check_grpo_config", "resolve_batching"]


@dataclass
class GRPOConfig(RolloutConfig):
    """TRL 1.16's GRPOConfig fields (names and defaults): the on-policy fields it shares with RLOO and Distillation
    (`rollout.config.RolloutConfig`) and GRPO's own. Fields TRL has that mlxrl does not support raise a ValueError
    when set to anything but their default (`refused`, checked by `config.check_config`)."""

    learning_rate: float = _f(1e-6, "peak learning rate of AdamW (TRL's GRPO default)")
    head_mode: str = _f("auto", "(mlxrl) auto | fused | differentiable: how the streamed LM head runs in training. "
                                "In fused mode: row chunks, loss and gradients in one pass (3 matmuls and one exp per "
                                "logit; token-level importance sampling only); in differentiable mode: vocab tiles "
                                "with a streamed VJP (4 matmuls, two exps; any loss); auto: fused at token level, else "
                                "differentiable",
                        choices=("auto", "fused", "differentiable"))
    cast_lm_head_to_fp32: bool = _f(False, "accepted; the streamed head always accumulates in float32")
    ref_model: str | None = _f(None, "(mlxrl) path or Hub id of a separate frozen reference model (beta > 0)")
    remove_unused_columns: bool = refused(False, "every dataset column is passed to the reward functions")
    dataloader_drop_last: bool = refused(False, "a generation round always takes whole groups of prompts")
    num_generations: int = _f(8, "completions sampled per prompt (G)")
    num_generations_eval: int | None = refused(None, "GRPO has no evaluation loop in mlxrl yet")
    generation_batch_size: int | None = _f(None, "completions per generation round, all processes together. As "
                                                 "TRL counts them; default: per_device_train_batch_size x "
                                                 "processes x steps_per_generation")
    steps_per_generation: int | None = _f(None, "micro-batches per generation round (default: "
                                                "gradient_accumulation_steps)")
    vllm_importance_sampling_correction: bool = _f(True, "vLLM only: no effect without use_vllm")
    vllm_importance_sampling_mode: str = _f("sequence_mask", "vLLM only: no effect without use_vllm")
    vllm_importance_sampling_clip_max: float | None = _f(3.0, "vLLM only: no effect without use_vllm")
    vllm_importance_sampling_clip_min: float | None = _f(None, "vLLM only: no effect without use_vllm")
    vllm_importance_sampling_cap: float | None = refused(None, "vLLM is not supported")
    use_transformers_continuous_batching: bool = refused(False, OWN_ENGINE)
    transformers_continuous_batching_config: str | None = refused(None, OWN_ENGINE)
    use_transformers_paged: bool = refused(False, OWN_ENGINE)
    # loss
    beta: float = _f(0.0, "KL coefficient (0: no reference model is kept or run)")
    num_iterations: int = _f(1, "optimisation passes over each generation round (mu)")
    epsilon: float = _f(0.2, "lower clip range of the ratio (and upper, unless epsilon_high)")
    delta: float | None = _f(None, "two-sided clipping: cap the unclipped ratio at delta")
    epsilon_high: float | None = _f(None, "upper clip range (DAPO recommends 0.28; cispo: the absolute cap, 5.0)")
    sapo_temperature_neg: float = _f(1.05, "SAPO gate temperature for negative advantages")
    sapo_temperature_pos: float = _f(1.0, "SAPO gate temperature for positive advantages")
    vespo_k_pos: float = _f(2.0, "vespo: the Gamma weight's power for advantages >= 0 (down-weights ratios < 1)")
    vespo_lambda_pos: float = _f(3.0, "vespo: the Gamma weight's decay for advantages >= 0 (down-weights ratios > 1)")
    vespo_k_neg: float = _f(3.0, "vespo: the Gamma weight's power for negative advantages")
    vespo_lambda_neg: float = _f(2.0, "vespo: the Gamma weight's decay for negative advantages")
    importance_sampling_level: str = _f("token", "token | sequence (GSPO)")
    reward_weights: list[float] | None = _f(None, "one weight per reward function (default 1 each)")
    multi_objective_aggregation: str = _f("sum_then_normalize", "sum_then_normalize | normalize_then_sum (GDPO)")
    scale_rewards: str = _f("group", "group | batch | none: what the advantages are divided by")
    loss_type: str = _f("dapo", f"one of {' | '.join(LOSS_TYPES)}")
    mask_truncated_completions: bool = _f(False, "exclude completions that hit max_completion_length from the loss")
    sync_ref_model: bool = refused(False, "reference syncing is not implemented (use a fixed reference)")
    ref_model_mixup_alpha: float = refused(0.6, "it only applies with sync_ref_model, which is not implemented")
    ref_model_sync_steps: int = refused(512, "it only applies with sync_ref_model, which is not implemented")
    top_entropy_quantile: float = refused(1.0, "high-entropy token masking is not implemented")
    entropy_coef: float = refused(0.0, "the entropy bonus is not implemented")
    use_adaptive_entropy: bool = refused(False, "adaptive entropy control is not implemented")
    entropy_coef_min: float = refused(0.0, "it only applies with use_adaptive_entropy, which is not implemented")
    entropy_coef_max: float = refused(1.0, "it only applies with use_adaptive_entropy, which is not implemented")
    entropy_coef_delta: float = refused(0.005, "it only applies with use_adaptive_entropy, which is not implemented")
    entropy_target: float = refused(0.2, "it only applies with use_adaptive_entropy, which is not implemented")
    off_policy_mask_threshold: float | None = refused(None, "off-policy sequence masking is not implemented")
    use_bias_correction_kl: bool = _f(True, "multiply the k3 KL by the importance ratio (TRL's default)")
    # logging
    log_multimodal: bool = _f(True, "only with log_completions: ignored")
    log_completions_hub_repo: str | None = refused(None, "completions are not logged yet")

    def __post_init__(self):
        super().__post_init__()
        # TRL maps the old boolean scale_rewards onto the strings
        if isinstance(self.scale_rewards, bool):
            self.scale_rewards = "group" if self.scale_rewards else "none"


def processes() -> int:
    """The data-parallel processes of this run (`mlx.launch`'s ranks; 1 without)."""
    import mlx.core as mx

    return mx.distributed.init().size()


def resolve_batching(args: GRPOConfig, world_size: int | None = None) -> tuple[int, int]:
    """(steps_per_generation, generation_batch_size) resolved as TRL's GRPOConfig.__post_init__: the generation
    batch counts the completions of every process (`world_size`, default: this run's), so each process generates
    generation_batch_size / world_size of them a round."""
    b, w = args.per_device_train_batch_size, processes() if world_size is None else world_size
    spg, gbs = args.steps_per_generation, args.generation_batch_size
    if spg is not None and gbs is not None:
        raise ValueError("set generation_batch_size or steps_per_generation, not both")
    if gbs is not None:
        if gbs % (b * w):
            raise ValueError(f"generation_batch_size ({gbs}) must be divisible by the global batch size "
                             f"(per_device_train_batch_size {b} x {w} process{'es' if w > 1 else ''} = {b * w})")
        spg = gbs // (b * w)
    spg = spg or args.gradient_accumulation_steps
    return spg, b * w * spg


def check_grpo_config(args: GRPOConfig) -> None:
    """One-line ValueErrors for unsupported or inconsistent settings (TRL's checks plus ours)."""
    check_rollout_config(args)  # the sampling settings, the types, ranges, choices and refused TRL fields
    if args.loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type {args.loss_type!r} is not supported; valid: {', '.join(LOSS_TYPES)}")
    if args.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"importance_sampling_level must be token or sequence, got {args.importance_sampling_level!r}")
    if args.scale_rewards not in ("group", "batch", "none"):
        raise ValueError(f"scale_rewards must be group, batch or none, got {args.scale_rewards!r}")
    if args.multi_objective_aggregation not in ("sum_then_normalize", "normalize_then_sum"):
        raise ValueError("multi_objective_aggregation must be sum_then_normalize or normalize_then_sum, got "
                         f"{args.multi_objective_aggregation!r}")
    g = args.num_generations
    if g is None or g < 2:
        raise ValueError(f"num_generations must be >= 2 (group-relative advantages need a group), got {g}")
    if args.num_iterations < 1:
        raise ValueError(f"num_iterations must be >= 1, got {args.num_iterations}")
    w = processes()
    spg, gbs = resolve_batching(args, w)
    if gbs % g:
        raise ValueError(f"generation_batch_size ({gbs}) must be divisible by num_generations ({g})")
    if (gbs // w) % g:  # TRL spreads a prompt's completions over the processes; mlxrl keeps them on one
        raise ValueError(f"generation_batch_size ({gbs}) over {w} processes gives each {gbs // w} completions a "
                         f"round, not a multiple of num_generations ({g}): mlxrl generates and scores a prompt's "
                         f"completions on one process; make generation_batch_size a multiple of {g * w}")
    b = args.per_device_train_batch_size
    if b % g and g % b:
        raise ValueError(f"per_device_train_batch_size ({b}) must be a multiple or a divisor of num_generations ({g}): "
                         "mlxrl keeps each prompt's completions together so the training forward can share the "
                         "prompt")
    if args.beta < 0:
        raise ValueError(f"beta must be >= 0, got {args.beta}")
    if args.head_mode == "fused" and args.importance_sampling_level != "token":
        raise ValueError("head_mode=fused needs importance_sampling_level='token' (a sequence-level ratio couples "
                         "the tokens of a sequence): use head_mode auto or differentiable")
    if args.head_mode == "fused" and args.loss_type in SEQUENCE_COUPLED_LOSS_TYPES:
        raise ValueError(f"head_mode=fused cannot train loss_type={args.loss_type} (each token is weighed by its "
                         "whole sequence's ratio): use head_mode auto or differentiable")
