"""RolloutConfig: the fields TRL 1.16's on-policy configs share (GRPOConfig, RLOOConfig, DistillationConfig: the
prompts, the sampling, the generation engine's and vLLM's), with their names and defaults, and their checks."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import TrainConfig, _f, check_config, refused

__all__ = ["RolloutConfig", "check_rollout_config", "NO_VLLM", "OWN_ENGINE"]

NO_VLLM = "vLLM is not used (mlxrl generates with its own shared-prefill engine)"
OWN_ENGINE = "mlxrl generates with its own shared-prefill engine"


@dataclass
class RolloutConfig(TrainConfig):
    """What a trainer that samples its own completions is configured with. Fields TRL has that mlxrl does not
    support raise a ValueError when set to anything but their default (`refused`, checked by `config.check_config`)."""

    learning_rate: float = _f(1e-6, "peak learning rate of AdamW (TRL's default for its on-policy trainers)")
    per_device_train_batch_size: int = _f(8, "completions per micro-batch (TRL counts completions, not prompts)")
    # model
    keep_frozen_dtype: bool = _f(False, "(mlxrl) as SFT's, off by default here. Generation would widen every "
                                        "kept weight once per decoded token")
    disable_dropout: bool = _f(False, "disable dropout (LoRA dropout included) in the model")
    # data and generation
    remove_unused_columns: bool = refused(False, "every dataset column is kept with its prompt")
    max_completion_length: int = _f(512, "maximum tokens per completion")
    ds3_gather_for_generation: bool = _f(True, "DeepSpeed only: ignored")
    shuffle_dataset: bool = _f(True, "shuffle the prompts every epoch")
    pad_to_multiple_of: str | None = _f("auto", "not supported beyond 'auto' (completions are padded to "
                                                "powers of two)")
    temperature: float = _f(1.0, "sampling temperature (the training log-probs use it too)")
    top_p: float = _f(1.0, "nucleus sampling")
    top_k: int = _f(0, "top-k sampling (0: off)")
    min_p: float | None = _f(None, "min-p sampling")
    generation_kwargs: str | None = refused(None, "use temperature / top_p / top_k / min_p")
    chat_template_kwargs: str | None = refused(None, "put chat_template_kwargs in a dataset column")
    repetition_penalty: float = refused(1.0, "mlxrl's sampler has no repetition penalty")
    cache_implementation: str | None = refused(None, "generation uses mlx-lm KV caches")
    use_vllm: bool = refused(False, OWN_ENGINE)
    vllm_mode: str = refused("colocate", NO_VLLM)
    vllm_model_impl: str = refused("vllm", NO_VLLM)
    vllm_enable_sleep_mode: bool = refused(False, NO_VLLM)
    vllm_structured_outputs_regex: str | None = refused(None, NO_VLLM)
    vllm_server_base_url: str | None = refused(None, NO_VLLM)
    vllm_server_host: str = refused("0.0.0.0", NO_VLLM)
    vllm_server_port: int = refused(8000, NO_VLLM)
    vllm_server_timeout: float = refused(240.0, NO_VLLM)
    vllm_group_port: int = refused(51216, NO_VLLM)
    vllm_gpu_memory_utilization: float = refused(0.3, NO_VLLM)
    vllm_max_model_length: int | None = refused(None, NO_VLLM)
    vllm_tensor_parallel_size: int = refused(1, NO_VLLM)
    max_tool_calling_iterations: int | None = _f(None, "most tool-calling turns per completion (with tools=). None: "
                                                       "as long as the model calls tools and max_completion_length "
                                                       "leaves room")
    tool_call_timeout: float = _f(60.0, "(mlxrl) seconds a tool call may run; past it the model gets an error "
                                        "result and the rollout goes on")
    # logging
    log_completions: bool = refused(False, "completions are not logged yet")
    num_completions_to_print: int | None = refused(None, "completions are not logged yet")
    log_unique_prompts: bool = refused(False, "completions are not logged yet")
    # mlxrl
    shared_prompt: bool = _f(True, "(mlxrl) training forward with each prompt once per group. False: every "
                                   "prompt+completion row separately, the baseline")
    shared_prefill: bool = _f(True, "(mlxrl) generation with each prompt prefilled once and its KV cache shared")


def check_rollout_config(args: RolloutConfig) -> None:
    """One-line ValueErrors for the sampling and generation settings every rollout trainer shares."""
    check_config(args)  # types, ranges, choices and the refused TRL fields
    if args.pad_to_multiple_of not in ("auto", None, "none", "None"):
        raise ValueError(f"pad_to_multiple_of={args.pad_to_multiple_of!r} is not supported: completions are padded "
                         "to powers of two")
    if args.max_completion_length is None or args.max_completion_length < 1:
        raise ValueError(f"max_completion_length must be >= 1, got {args.max_completion_length}")
    if args.temperature <= 0:
        raise ValueError(f"temperature must be > 0 (it divides the logits), got {args.temperature}")
    if not 0.0 < args.top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {args.top_p}")
    if args.min_p is not None and not 0.0 <= args.min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {args.min_p}")
    if args.top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0: off), got {args.top_k}")
    if args.max_tool_calling_iterations is not None and args.max_tool_calling_iterations < 0:
        raise ValueError(f"max_tool_calling_iterations must be >= 0 (None: no limit), got "
                         f"{args.max_tool_calling_iterations}")
    if not args.tool_call_timeout > 0:
        raise ValueError(f"tool_call_timeout must be > 0 seconds, got {args.tool_call_timeout}")
