"""GRPOTrainer: TRL 1.16's group relative policy optimisation on the shared engine.

    def correct(prompts, completions, completion_ids, answer, **kwargs):      # TRL's reward signature
        return [1.0 if c[0]["content"].strip() == a else 0.0 for c, a in zip(completions, answer)]

    trainer = GRPOTrainer(model=model, processor=processor, reward_funcs=[correct],
                          args=GRPOConfig(output_dir="out", use_peft=True), train_dataset=rows)
    trainer.train()       # rows: {"prompt": str | messages, <other columns>, optional "images"}

One generation round (TRL's `_generate_and_score_completions`), on the MAIN thread with the current
weights: `generation_batch_size / num_generations` prompts are sampled (each epoch a new shuffle,
incomplete rounds dropped, as TRL's RepeatSampler), rendered (plain string as is; conversations with
the chat template; an `images` column filled into the first user message), left-padded, and
`mlxrl.generation.generate` draws G completions per prompt with the prompt prefilled ONCE and its
KV cache shared. The reward functions score the decoded completions, group-relative advantages are
computed over the whole round (`compute_advantages`), and the round is cut into
`steps_per_generation` micro-batches of `per_device_train_batch_size` completions that keep whole
groups together (so the training forward can share each prompt). Reference log-probs (beta != 0)
and old log-probs (only when TRL computes them: gradient_accumulation_steps is not a multiple of
steps_per_generation * num_iterations) come from a gradient-free forward right after generation;
otherwise the loss uses the detached current log-probs (ratio 1, TRL's on-policy shortcut).

The training forward is `shared_prompt_logprobs`: each prompt (and its images) once per group, the
G completions attending to its keys/values with the gradient flowing through them, per-token
log-probs from the streamed head at `temperature`. The loss is `mlxrl.losses.grpo_loss` (every loss
type), normalised as TRL: dapo / cispo divide the token sum by the round's completion tokens x
grad_accum / steps_per_generation; the other types are micro-batch means divided by grad_accum.

Metrics (TRL's names): reward, reward_std, rewards/<func>/mean|std, frac_reward_zero_std,
completions/mean_length|min_length|max_length|clipped_ratio (+ *_terminated_length), kl (beta != 0),
entropy, clip_ratio/low_mean|high_mean|region_mean|low_min|high_max (cispo: cispo_clip_ratio),
num_tokens (prompt + completion tokens generated), plus loss, grad_norm, learning_rate.

Tests: pytest tests/test_grpo_trainer.py
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import time
from dataclasses import dataclass
from types import SimpleNamespace

import mlx.core as mx
import numpy as np

from ..data.formats import DataError, _chatml, _fill_images, _row_images, check_prompt_rows, template_kwargs
from ..hub import MlxrlError
from ..losses.grpo import (
    IMPORTANCE_SAMPLING_LEVELS,
    LOSS_TYPES,
    TOKEN_SUM_LOSS_TYPES,
    compute_advantages,
    grpo_loss,
    grpo_token_loss,
    grpo_token_weights,
    uses_fused_head,
)
from ..losses.head import IGNORE_INDEX, fused_head_loss
from ..models.reference import adapters_disabled, frozen_copy
from .config import TrainConfig, _f
from .engine import Trainer

PROMPT_MULTIPLE = 32  # prompts are left-padded to a multiple of this

__all__ = ["GRPOConfig", "GRPOTrainer", "RewardError", "check_grpo_config", "check_reward_signature",
           "load_reward_func", "reward_values"]


@dataclass
class GRPOConfig(TrainConfig):
    """TRL 1.16's GRPOConfig fields (names and defaults). Fields TRL has that mlxrl does not support raise a
    ValueError when set to anything but their default (see `check_grpo_config`)."""

    learning_rate: float = _f(1e-6, "peak learning rate of AdamW (TRL's GRPO default)")
    head_mode: str = _f("auto", "(mlxrl) auto | fused | differentiable: how the streamed LM head runs in training. "
                                "fused: row chunks, loss and gradients in one pass (3 matmuls and one exp per logit; "
                                "token-level importance sampling only); differentiable: vocab tiles with a streamed "
                                "VJP (4 matmuls, two exps; any loss); auto: fused at token level, else differentiable")
    per_device_train_batch_size: int = _f(8, "completions per micro-batch (TRL counts completions, not prompts)")
    # model
    model_init_kwargs: str | None = _f(None, "not supported: load the model with mlxrl.load")
    trust_remote_code: bool = _f(False, "not supported (mlxrl runs no remote code)")
    router_aux_loss_coef: float | None = _f(None, "not supported (no Mixture-of-Experts models yet)")
    disable_dropout: bool = _f(False, "disable dropout (LoRA dropout included) in the model")
    cast_lm_head_to_fp32: bool = _f(False, "accepted; the streamed head always accumulates in float32")
    ref_model: str | None = _f(None, "(mlxrl) path or Hub id of a separate frozen reference model (beta > 0)")
    # data and generation
    remove_unused_columns: bool = _f(False, "must stay False: every dataset column is passed to the reward functions")
    num_generations: int = _f(8, "completions sampled per prompt (G)")
    num_generations_eval: int | None = _f(None, "not supported (no GRPO evaluation loop yet)")
    max_completion_length: int = _f(512, "maximum tokens per completion")
    ds3_gather_for_generation: bool = _f(True, "DeepSpeed only: ignored")
    shuffle_dataset: bool = _f(True, "shuffle the prompts every epoch")
    pad_to_multiple_of: str | None = _f("auto", "not supported beyond 'auto' (completions are padded to "
                                                "powers of two)")
    generation_batch_size: int | None = _f(None, "completions per generation round (default: "
                                                 "per_device_train_batch_size * steps_per_generation)")
    steps_per_generation: int | None = _f(None, "micro-batches per generation round (default: "
                                                "gradient_accumulation_steps)")
    temperature: float = _f(1.0, "sampling temperature (the training log-probs use it too)")
    top_p: float = _f(1.0, "nucleus sampling")
    top_k: int = _f(0, "top-k sampling (0: off)")
    min_p: float | None = _f(None, "min-p sampling")
    generation_kwargs: str | None = _f(None, "not supported: use temperature / top_p / top_k / min_p")
    chat_template_kwargs: str | None = _f(None, "not supported: put chat_template_kwargs in a dataset column")
    repetition_penalty: float = _f(1.0, "not supported (must be 1.0)")
    cache_implementation: str | None = _f(None, "not supported (mlx-lm KV caches)")
    use_vllm: bool = _f(False, "not supported (mlxrl's own generation engine)")
    vllm_mode: str = _f("colocate", "vLLM only (not supported)")
    vllm_model_impl: str = _f("vllm", "vLLM only (not supported)")
    vllm_enable_sleep_mode: bool = _f(False, "vLLM only (not supported)")
    vllm_structured_outputs_regex: str | None = _f(None, "vLLM only (not supported)")
    vllm_server_base_url: str | None = _f(None, "vLLM only (not supported)")
    vllm_server_host: str = _f("0.0.0.0", "vLLM only (not supported)")
    vllm_server_port: int = _f(8000, "vLLM only (not supported)")
    vllm_server_timeout: float = _f(240.0, "vLLM only (not supported)")
    vllm_group_port: int = _f(51216, "vLLM only (not supported)")
    vllm_gpu_memory_utilization: float = _f(0.3, "vLLM only (not supported)")
    vllm_max_model_length: int | None = _f(None, "vLLM only (not supported)")
    vllm_tensor_parallel_size: int = _f(1, "vLLM only (not supported)")
    vllm_importance_sampling_correction: bool = _f(True, "vLLM only: no effect without use_vllm")
    vllm_importance_sampling_mode: str = _f("sequence_mask", "vLLM only: no effect without use_vllm")
    vllm_importance_sampling_clip_max: float | None = _f(3.0, "vLLM only: no effect without use_vllm")
    vllm_importance_sampling_clip_min: float | None = _f(None, "vLLM only: no effect without use_vllm")
    vllm_importance_sampling_cap: float | None = _f(None, "vLLM only (deprecated in TRL; not supported)")
    use_transformers_continuous_batching: bool = _f(False, "not supported (mlxrl's own generation engine)")
    transformers_continuous_batching_config: str | None = _f(None, "not supported")
    use_transformers_paged: bool = _f(False, "not supported (deprecated in TRL)")
    # loss
    beta: float = _f(0.0, "KL coefficient (0: no reference model is kept or run)")
    num_iterations: int = _f(1, "optimisation passes over each generation round (mu)")
    epsilon: float = _f(0.2, "lower clip range of the ratio (and upper, unless epsilon_high)")
    delta: float | None = _f(None, "two-sided clipping: cap the unclipped ratio at delta")
    epsilon_high: float | None = _f(None, "upper clip range (DAPO recommends 0.28; cispo: the absolute cap, 5.0)")
    sapo_temperature_neg: float = _f(1.05, "SAPO gate temperature for negative advantages")
    sapo_temperature_pos: float = _f(1.0, "SAPO gate temperature for positive advantages")
    vespo_k_pos: float = _f(2.0, "VESPO only (not supported)")
    vespo_lambda_pos: float = _f(3.0, "VESPO only (not supported)")
    vespo_k_neg: float = _f(3.0, "VESPO only (not supported)")
    vespo_lambda_neg: float = _f(2.0, "VESPO only (not supported)")
    importance_sampling_level: str = _f("token", "token | sequence (GSPO)")
    reward_weights: list[float] | None = _f(None, "one weight per reward function (default 1 each)")
    multi_objective_aggregation: str = _f("sum_then_normalize", "sum_then_normalize | normalize_then_sum (GDPO)")
    scale_rewards: str = _f("group", "group | batch | none: what the advantages are divided by")
    loss_type: str = _f("dapo", f"one of {' | '.join(LOSS_TYPES)}")
    mask_truncated_completions: bool = _f(False, "exclude completions that hit max_completion_length from the loss")
    sync_ref_model: bool = _f(False, "not supported: TR-DPO style reference syncing")
    ref_model_mixup_alpha: float = _f(0.6, "only with sync_ref_model (not supported)")
    ref_model_sync_steps: int = _f(512, "only with sync_ref_model (not supported)")
    top_entropy_quantile: float = _f(1.0, "not supported (must be 1.0): high-entropy token masking")
    entropy_coef: float = _f(0.0, "not supported (must be 0): entropy bonus")
    use_adaptive_entropy: bool = _f(False, "not supported")
    entropy_coef_min: float = _f(0.0, "only with use_adaptive_entropy (not supported)")
    entropy_coef_max: float = _f(1.0, "only with use_adaptive_entropy (not supported)")
    entropy_coef_delta: float = _f(0.005, "only with use_adaptive_entropy (not supported)")
    entropy_target: float = _f(0.2, "only with use_adaptive_entropy (not supported)")
    max_tool_calling_iterations: int | None = _f(None, "not supported (no tool calling)")
    off_policy_mask_threshold: float | None = _f(None, "not supported: off-policy sequence masking")
    use_bias_correction_kl: bool = _f(True, "multiply the k3 KL by the importance ratio (TRL's default)")
    # logging
    log_completions: bool = _f(False, "not supported (completions are not logged yet)")
    log_multimodal: bool = _f(True, "only with log_completions: ignored")
    num_completions_to_print: int | None = _f(None, "not supported")
    log_unique_prompts: bool = _f(False, "not supported")
    log_completions_hub_repo: str | None = _f(None, "not supported")
    # mlxrl
    shared_prompt: bool = _f(True, "(mlxrl) training forward with each prompt once per group (False: every "
                                   "prompt+completion row separately, the baseline)")
    shared_prefill: bool = _f(True, "(mlxrl) generation with each prompt prefilled once and its KV cache shared")

    def __post_init__(self):
        # TRL maps the old boolean scale_rewards onto the strings
        if isinstance(self.scale_rewards, bool):
            self.scale_rewards = "group" if self.scale_rewards else "none"


_UNSUPPORTED = {
    "model_init_kwargs": "load the model with mlxrl.load (dtype: --dtype)",
    "trust_remote_code": "mlxrl never runs model code from the Hub",
    "router_aux_loss_coef": "mlxrl has no Mixture-of-Experts models yet",
    "remove_unused_columns": "every dataset column is passed to the reward functions",
    "num_generations_eval": "GRPO has no evaluation loop in mlxrl yet",
    "generation_kwargs": "use temperature / top_p / top_k / min_p",
    "chat_template_kwargs": "put chat_template_kwargs in a dataset column",
    "repetition_penalty": "mlxrl's sampler has no repetition penalty",
    "cache_implementation": "generation uses mlx-lm KV caches",
    "use_vllm": "mlxrl generates with its own shared-prefill engine",
    "use_transformers_continuous_batching": "mlxrl generates with its own shared-prefill engine",
    "transformers_continuous_batching_config": "mlxrl generates with its own shared-prefill engine",
    "use_transformers_paged": "mlxrl generates with its own shared-prefill engine",
    "vllm_importance_sampling_cap": "vLLM is not supported",
    "sync_ref_model": "reference syncing is not implemented (use a fixed reference)",
    "ref_model_mixup_alpha": "it only applies with sync_ref_model, which is not implemented",
    "ref_model_sync_steps": "it only applies with sync_ref_model, which is not implemented",
    "top_entropy_quantile": "high-entropy token masking is not implemented",
    "entropy_coef": "the entropy bonus is not implemented",
    "use_adaptive_entropy": "adaptive entropy control is not implemented",
    "entropy_coef_min": "it only applies with use_adaptive_entropy, which is not implemented",
    "entropy_coef_max": "it only applies with use_adaptive_entropy, which is not implemented",
    "entropy_coef_delta": "it only applies with use_adaptive_entropy, which is not implemented",
    "entropy_target": "it only applies with use_adaptive_entropy, which is not implemented",
    "max_tool_calling_iterations": "tool calling is not implemented",
    "off_policy_mask_threshold": "off-policy sequence masking is not implemented",
    "log_completions": "completions are not logged yet",
    "num_completions_to_print": "completions are not logged yet",
    "log_unique_prompts": "completions are not logged yet",
    "log_completions_hub_repo": "completions are not logged yet",
    "vespo_k_pos": "loss_type vespo is not implemented",
    "vespo_lambda_pos": "loss_type vespo is not implemented",
    "vespo_k_neg": "loss_type vespo is not implemented",
    "vespo_lambda_neg": "loss_type vespo is not implemented",
}
_VLLM_ONLY = ("vllm_mode", "vllm_model_impl", "vllm_enable_sleep_mode", "vllm_structured_outputs_regex",
              "vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout",
              "vllm_group_port", "vllm_gpu_memory_utilization", "vllm_max_model_length",
              "vllm_tensor_parallel_size")


def resolve_batching(args: GRPOConfig) -> tuple[int, int]:
    """(steps_per_generation, generation_batch_size) resolved as TRL's GRPOConfig.__post_init__ (one process)."""
    b = args.per_device_train_batch_size
    spg, gbs = args.steps_per_generation, args.generation_batch_size
    if spg is not None and gbs is not None:
        raise ValueError("set generation_batch_size or steps_per_generation, not both")
    if gbs is not None:
        if gbs % b:
            raise ValueError(f"generation_batch_size ({gbs}) must be divisible by per_device_train_batch_size ({b})")
        spg = gbs // b
    spg = spg or args.gradient_accumulation_steps
    return spg, b * spg


def check_grpo_config(args: GRPOConfig) -> None:
    """One-line ValueErrors for unsupported or inconsistent settings (TRL's checks plus ours)."""
    defaults = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    for name, why in _UNSUPPORTED.items():
        if getattr(args, name) != defaults[name]:
            raise ValueError(f"{name}={getattr(args, name)!r} is not supported by mlxrl's GRPOTrainer: {why}")
    for name in _VLLM_ONLY:
        if getattr(args, name) != defaults[name]:
            raise ValueError(f"{name}={getattr(args, name)!r} is not supported by mlxrl's GRPOTrainer: vLLM is "
                             "not used")
    if args.pad_to_multiple_of not in ("auto", None, "none", "None"):
        raise ValueError(f"pad_to_multiple_of={args.pad_to_multiple_of!r} is not supported: completions are padded "
                         "to powers of two")
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
    if args.max_completion_length is None or args.max_completion_length < 1:
        raise ValueError(f"max_completion_length must be >= 1, got {args.max_completion_length}")
    if args.num_iterations < 1:
        raise ValueError(f"num_iterations must be >= 1, got {args.num_iterations}")
    if args.temperature <= 0:
        raise ValueError(f"temperature must be > 0 for GRPO (it divides the logits), got {args.temperature}")
    _, gbs = resolve_batching(args)
    if gbs % g:
        raise ValueError(f"generation_batch_size ({gbs}) must be divisible by num_generations ({g})")
    b = args.per_device_train_batch_size
    if b % g and g % b:
        raise ValueError(f"per_device_train_batch_size ({b}) must be a multiple or a divisor of num_generations ({g}): "
                         "mlxrl keeps each prompt's completions together so the training forward can share the "
                         "prompt")
    if args.beta < 0:
        raise ValueError(f"beta must be >= 0, got {args.beta}")
    if not 0.0 < args.top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {args.top_p}")
    if args.min_p is not None and not 0.0 <= args.min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {args.min_p}")
    if args.top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0: off), got {args.top_k}")
    if args.head_mode not in ("auto", "fused", "differentiable"):
        raise ValueError(f"head_mode={args.head_mode!r}: use auto, fused or differentiable")
    if args.head_mode == "fused" and args.importance_sampling_level != "token":
        raise ValueError("head_mode=fused needs importance_sampling_level='token' (a sequence-level ratio couples "
                         "the tokens of a sequence): use head_mode auto or differentiable")


class RewardError(MlxrlError, ValueError):
    """A reward function that cannot be imported or called, or returns what is not a reward: one line
    naming it (and the completion where one is at fault)."""


def load_reward_func(spec: str):
    """'module:function' (or 'path/to/file.py:function') -> the callable; a module that cannot be found or
    fails while importing (a syntax error, an exception at its top level) is one line naming it."""
    if not isinstance(spec, str) or ":" not in spec:
        raise RewardError(f"reward function {spec!r}: expected module:function")
    mod_name, _, fn_name = spec.rpartition(":")
    try:
        if mod_name.endswith(".py"):
            if not os.path.isfile(mod_name):
                raise RewardError(f"reward function {spec!r}: no such file {mod_name!r}")
            loader = importlib.util.spec_from_file_location(f"_reward_{abs(hash(mod_name))}", mod_name)
            if loader is None:
                raise ImportError(mod_name)
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(mod_name)
    except RewardError:
        raise
    except ImportError as e:
        raise RewardError(f"reward function {spec!r}: cannot import {mod_name!r} ({e})") from e
    except SyntaxError as e:
        raise RewardError(f"reward function {spec!r}: {e.filename or mod_name} line {e.lineno}: syntax error "
                         f"({e.msg})") from e
    except Exception as e:  # the module's own code failed while importing
        raise RewardError(f"reward function {spec!r}: importing {mod_name!r} raised {type(e).__name__}: "
                         f"{_first_line(e)}") from e
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise RewardError(f"reward function {spec!r}: {mod_name!r} has no callable {fn_name!r}")
    return fn


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0]


REWARD_KWARGS = ("trainer_state", "log_metric", "log_extra")  # what TRL passes besides the dataset columns


def check_reward_signature(fn, name: str, columns) -> None:
    """Refuse, before training, a reward function that cannot take TRL's call: prompts, completions,
    completion_ids, every dataset column and trainer_state / log_metric / log_extra as keywords."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins and C callables: find out at the call
    keys = ["prompts", "completions", "completion_ids", *columns, *REWARD_KWARGS]
    try:
        sig.bind(**dict.fromkeys(keys))
    except TypeError as e:
        raise RewardError(f"reward function {name!r} cannot be called as TRL calls it ({e}): give it the signature "
                         "f(prompts, completions, completion_ids, **kwargs)") from None


def reward_values(values, name: str, n: int) -> np.ndarray:
    """A reward function's return value -> [n] float32 with NaN for None (TRL: the reward does not apply
    to that completion). One line naming the function (and the completion) for anything else: not a list,
    the wrong length, a value that is not a number, NaN or infinity."""
    if hasattr(values, "tolist") and not isinstance(values, (list, tuple)):  # numpy / mlx / torch arrays
        if getattr(values, "ndim", 1) != 1:
            raise RewardError(f"reward function {name!r} returned an array of shape {tuple(values.shape)}; expected "
                             f"a list of {n} rewards, one per completion")
        values = values.tolist()
    if values is None or isinstance(values, (str, bytes, dict, numbers.Number)) or not hasattr(values, "__iter__"):
        raise RewardError(f"reward function {name!r} returned {type(values).__name__} {_short(values)}; expected a "
                         f"list of {n} rewards, one per completion (None where a reward does not apply)")
    values = list(values)
    if len(values) != n:
        raise RewardError(f"reward function {name!r} returned {len(values)} rewards for {n} completions (one per "
                         "completion expected)")
    out = np.full(n, np.nan, dtype=np.float64)
    for i, v in enumerate(values):
        if v is None:
            continue
        if hasattr(v, "item") and getattr(v, "size", 1) == 1 and not isinstance(v, numbers.Number):
            v = v.item()  # a 0-d array or one-element tensor
        if not isinstance(v, numbers.Real):
            raise RewardError(f"reward function {name!r} returned {type(v).__name__} {_short(v)} for completion {i}; "
                             "rewards must be numbers (or None where a reward does not apply)")
        if not math.isfinite(float(v)):
            raise RewardError(f"reward function {name!r} returned {float(v)} for completion {i}; rewards must be "
                             "finite (return None where a reward does not apply)")
        out[i] = float(v)
    return out.astype(np.float32)


def _short(value, n: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= n else text[:n - 3] + "..."


def _bucket(n: int, limit: int) -> int:
    """Next power of two >= n (at least 8), capped at limit: completion widths the compiled step sees."""
    return min(max(8, 1 << max(0, math.ceil(math.log2(max(n, 1))))), max(limit, n))


# --------------------------------------------------------------------------------------- trainer

class GRPOTrainer(Trainer):
    planner_kind = "grpo"
    metric_names = ("loss", "reward", "reward_std", "frac_reward_zero_std", "completions/mean_length",
                    "completions/min_length", "completions/max_length", "completions/clipped_ratio", "kl",
                    "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "num_tokens")

    def __init__(self, model, processor=None, args: GRPOConfig | None = None, train_dataset=None,
                 eval_dataset=None, reward_funcs=None, ref_model=None, processing_class=None):
        args = args or GRPOConfig()
        check_grpo_config(args)
        processor = processor if processor is not None else processing_class
        if processor is None:
            raise ValueError("GRPOTrainer needs the processor (the second value mlxrl.load returns)")
        if train_dataset is None or len(train_dataset) == 0:
            raise ValueError("GRPOTrainer needs a train_dataset of rows with a 'prompt' column")
        if eval_dataset is not None:
            raise ValueError("eval_dataset is not supported by mlxrl's GRPOTrainer yet")
        if reward_funcs is None:
            raise ValueError("GRPOTrainer needs reward_funcs: a callable or a list of callables "
                             "f(prompts, completions, completion_ids, **columns) -> list[float | None]")
        funcs = reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        funcs = [load_reward_func(f) if isinstance(f, str) else f for f in funcs]
        for f in funcs:
            if not callable(f):
                raise ValueError(f"reward function {f!r} is not callable (reward models are not supported yet)")
        if args.reward_weights is not None and len(args.reward_weights) != len(funcs):
            raise ValueError(f"reward_weights has {len(args.reward_weights)} weights for {len(funcs)} reward functions")
        if ref_model is not None and ref_model is model:
            raise ValueError("model and ref_model are the same object: omit ref_model (LoRA switches the adapters "
                             "off, full fine-tuning keeps a frozen copy)")
        if args.disable_dropout and args.use_peft and args.lora_dropout:
            args = dataclasses.replace(args, lora_dropout=0.0)
        check_prompt_rows(train_dataset)
        names = [getattr(f, "__name__", type(f).__name__) for f in funcs]
        columns = [k for k in train_dataset[0] if k not in ("prompt", "completion", "completion_ids")]
        for f, name in zip(funcs, names, strict=True):
            check_reward_signature(f, name, columns)
        super().__init__(model, processor, args)
        self.reward_funcs = funcs
        self.reward_func_names = names
        self.rows = list(train_dataset)
        self.G = args.num_generations
        self.steps_per_generation, self.generation_batch_size = resolve_batching(args)
        self.prompts_per_round = self.generation_batch_size // self.G
        if self.prompts_per_round * self.world_size > len(self.rows):
            raise ValueError(f"a generation round needs {self.prompts_per_round * self.world_size} prompts "
                             f"(generation_batch_size / num_generations x ranks) but the dataset has {len(self.rows)}")
        # TRL computes old log-probs only when generation is not aligned with the optimizer step
        generate_every = self.steps_per_generation * args.num_iterations
        self.needs_old_logps = args.gradient_accumulation_steps % generate_every != 0
        if ref_model is None and args.ref_model and args.beta != 0:
            from ..loading import load

            ref_model, _ = load(args.ref_model, dtype=args.dtype)
        if ref_model is not None:
            ref_model.freeze()
            ref_model.eval()
        elif args.beta != 0 and not args.use_peft:
            ref_model = frozen_copy(model)  # TRL loads a second copy of the model
        self.ref_model = ref_model if args.beta != 0 else None
        self.stop_token_ids = sorted({151645, 151643, int(processor.eos_token_id)})
        self._pending_metrics: dict[str, list[float]] = {}
        self._round_epoch = 0  # the epoch of the round being generated (reward functions see it)
        self.generation_time = 0.0
        self._head_trainable = self.head_trainable

    def _plan_shape(self) -> tuple[dict, str]:
        """The planner's prompt length: the longest of the first 64 prompts, rendered and tokenised
        (an image counts as its one placeholder token: image tokens are not counted)."""
        n = 0
        for i, row in enumerate(self.rows[:64]):
            text = self._render(row, i)[0]
            n = max(n, len(self.processor.tokenizer(text, add_special_tokens=False)["input_ids"]))
        return {"prompt_length": n}, f"prompts of {n} tokens and every completion at max_completion_length"

    # ------------------------------------------------------------------ prompts
    def _render(self, row: dict, index: int) -> tuple[str, list, object]:
        """(prompt text, images, the prompt as reward functions see it); the row was checked by
        `check_prompt_rows`, and what the chat template still cannot render is one line naming it."""
        check_prompt_rows([row], first_index=index)
        prompt = row["prompt"]
        images = _row_images(row)
        if isinstance(prompt, str):
            return prompt, [], prompt
        messages, ordered = _fill_images(_chatml(prompt), images, index)
        kw = dict(template_kwargs(row, index))
        kw["continue_final_message" if messages[-1].get("role") == "assistant" else "add_generation_prompt"] = True
        try:
            text = self.processor.apply_chat_template(messages, **kw)
        except Exception as e:  # jinja's errors for what the template cannot render
            raise DataError(f"row {index}: the chat template cannot render its prompt ({type(e).__name__}: "
                            f"{_first_line(e)})") from None
        return text, ordered, messages

    def _round_indices(self, round_index: int) -> tuple[list[int], int, int]:
        """(this rank's prompts of the round, epoch, global position of its first prompt). A round
        holds prompts_per_round prompts per rank; rank r takes the r-th slice of the global round."""
        n, k = len(self.rows), self.prompts_per_round
        per_epoch = n // (k * self.world_size)
        epoch, pos = divmod(round_index, per_epoch)
        order = (np.random.default_rng((self.args.seed, epoch)).permutation(n) if self.args.shuffle_dataset
                 else np.arange(n))
        first = (pos * self.world_size + self.rank) * k
        return order[first:first + k].tolist(), epoch, self.rank * k

    def _gather(self, x: np.ndarray) -> np.ndarray:
        """Concatenate an [N, ...] float array over the ranks in rank order (identity with one)."""
        if self.world_size == 1:
            return x
        return np.array(mx.distributed.all_gather(mx.array(x.astype(np.float32)), group=self.world))

    # ------------------------------------------------------------------ rewards
    def _log_metric(self, name, value):
        self._pending_metrics.setdefault(name, []).append(float(value))

    def score(self, prompts, completions, completion_ids, columns: dict) -> np.ndarray:
        """[N, F] rewards (NaN where a function returned None), TRL's calling convention. A function that
        raises or returns something that is not one number or None per completion stops training with one
        line naming it (`reward_values`); so does a round where no function scored any completion."""
        state = SimpleNamespace(global_step=self.global_step, epoch=self._round_epoch,
                                max_steps=getattr(self, "total_steps", None))
        out = np.zeros((len(prompts), len(self.reward_funcs)), dtype=np.float32)
        for k, (f, name) in enumerate(zip(self.reward_funcs, self.reward_func_names, strict=True)):
            kwargs = dict(columns, trainer_state=state, log_metric=self._log_metric, log_extra=lambda *a, **k: None)
            try:
                values = f(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
                if inspect.isawaitable(values):
                    import asyncio

                    values = asyncio.run(values)
            except Exception as e:
                raise RewardError(f"reward function {name!r} raised {type(e).__name__}: {_first_line(e)} (step "
                                 f"{self.global_step + 1}; MLXRL_DEBUG=1 shows the traceback)") from e
            out[:, k] = reward_values(values, name, len(prompts))
        unscorable = np.isnan(out).all(axis=1)
        if unscorable.all():
            raise RewardError(f"every reward function ({', '.join(self.reward_func_names)}) returned None for every "
                             "completion of a generation round: nothing to learn from; return a number where a "
                             "reward applies")
        if unscorable.any():
            i = int(np.flatnonzero(unscorable)[0])
            print(f"warning: every reward function returned None for completion {i} ({completions[i]!r}); "
                  "it gets advantage 0", flush=True)
        return out

    # ------------------------------------------------------------------ generation round
    def _model_kwargs(self, batch):
        if "pixel_values" not in batch:
            return {}
        return {"pixel_values": batch["pixel_values"], "image_grid_thw": batch["image_grid_thw"],
                "vision_meta": batch.get("vision_meta")}

    def _logps_no_grad(self, model, arrays):
        from ..shared_prompt import shared_prompt_logprobs

        out = shared_prompt_logprobs(model, arrays["prompt_ids"], arrays["prompt_mask"], arrays["completion_ids"],
                                     arrays["completion_mask"], temperature=self.args.temperature,
                                     chunk_size=self.args.chunk_size, **self._model_kwargs(arrays))
        out = mx.stop_gradient(out)
        mx.eval(out)
        return np.array(out)

    def generate_round(self, round_index: int) -> tuple[list[dict], dict]:
        """Generate, score and cut one round into steps_per_generation micro-batches (numpy dicts)."""
        from ..generation import generate

        a, G = self.args, self.G
        t0 = time.perf_counter()
        indices, self._round_epoch, offset = self._round_indices(round_index)
        rows = [self.rows[i] for i in indices]
        rendered = [self._render(r, i) for r, i in zip(rows, indices, strict=True)]
        b = a.per_device_train_batch_size
        prompts_per_mb = max(1, b // G)
        self.model.eval()
        chunks = []
        try:
            for start in range(0, len(rows), prompts_per_mb):
                part = rendered[start:start + prompts_per_mb]
                images = [im for _, im, _ in part]
                enc = self.processor(text=[t for t, _, _ in part], images=images if any(images) else None,
                                     padding_side="left", return_tensors="np")
                gen = generate(self.model, mx.array(enc["input_ids"].astype(np.int32)),
                               mx.array(enc["attention_mask"].astype(np.int32)),
                               pixel_values=mx.array(enc["pixel_values"]) if "pixel_values" in enc else None,
                               image_grid_thw=mx.array(enc["image_grid_thw"].astype(np.int32))
                               if "image_grid_thw" in enc else None,
                               num_generations=G, max_tokens=a.max_completion_length, temperature=a.temperature,
                               top_p=a.top_p, top_k=a.top_k, min_p=a.min_p or 0.0,
                               stop_token_ids=self.stop_token_ids, pad_token_id=self.processor.pad_token_id,
                               seed=(a.seed * 1_000_003 + round_index * 7919 + offset + start) % (2**31 - 1),
                               shared_prefill=a.shared_prefill)
                chunks.append((enc, gen))
        finally:
            self.model.train()
        t_gen = time.perf_counter() - t0

        # decode and score the whole round (advantages need every group; "batch" scaling the whole round)
        prompts, completions, completion_ids, columns = [], [], [], {}
        keys = [k for k in rows[0] if k not in ("prompt", "completion", "completion_ids")]
        lengths, truncated, prompt_lens = [], [], []
        for c, (enc, gen) in enumerate(chunks):
            ids, mask = np.array(gen.completion_ids), np.array(gen.completion_mask)
            for r in range(ids.shape[0]):
                j = c * prompts_per_mb + r // G
                seq = ids[r][mask[r] > 0].tolist()
                text = self.processor.batch_decode([seq], skip_special_tokens=True)[0]
                conv = not isinstance(rows[j]["prompt"], str)
                prompts.append(rendered[j][2])
                completions.append([{"role": "assistant", "content": text}] if conv else text)
                completion_ids.append(seq)
                for k in keys:
                    columns.setdefault(k, []).append(rows[j][k])
            lengths.extend(mask.sum(1).tolist())
            truncated.extend(np.array(gen.truncated).tolist())
            prompt_lens.extend(np.repeat(enc["attention_mask"].sum(1), G).tolist())
        rewards = self.score(prompts, completions, completion_ids, columns)
        # data parallel: advantages and reward statistics over the whole round (every rank's groups)
        n_local = len(rewards)
        rewards = self._gather(rewards)
        advantages, metrics = compute_advantages(mx.array(rewards), G, reward_weights=a.reward_weights,
                                                 scale_rewards=a.scale_rewards,
                                                 multi_objective_aggregation=a.multi_objective_aggregation,
                                                 reward_names=self.reward_func_names)
        metrics = {k: v.item() for k, v in metrics.items()}
        metrics = {k: v for k, v in metrics.items() if math.isfinite(v)}  # a function that applied to no completion
        advantages = np.array(advantages)[self.rank * n_local:(self.rank + 1) * n_local]
        all_lengths = self._gather(np.array(lengths, dtype=np.float64)).astype(np.float64)
        all_truncated = self._gather(np.array(truncated, dtype=np.float64)) > 0.5
        lengths, truncated = np.array(lengths, dtype=np.float64), np.array(truncated, dtype=bool)
        term = all_lengths[~all_truncated] if (~all_truncated).any() else np.zeros(1)
        metrics.update({"completions/mean_length": all_lengths.mean(), "completions/min_length": all_lengths.min(),
                        "completions/max_length": all_lengths.max(), "completions/clipped_ratio": all_truncated.mean(),
                        "completions/mean_terminated_length": term.mean(),
                        "completions/min_terminated_length": term.min(),
                        "completions/max_terminated_length": term.max()})
        for name, values in self._pending_metrics.items():
            metrics[name] = float(np.mean(values))
        self._pending_metrics.clear()

        # micro-batches: whole groups (b >= G: one chunk) or b-row slices of one prompt's group (b < G)
        total_tokens, micro, pad = 0, [], self.processor.pad_token_id
        for c, (enc, gen) in enumerate(chunks):
            ids, mask = np.array(gen.completion_ids), np.array(gen.completion_mask)
            if a.mask_truncated_completions:
                mask = mask * ~np.array(gen.truncated)[:, None]
            width = _bucket(ids.shape[1], a.max_completion_length)
            ids = np.pad(ids, ((0, 0), (0, width - ids.shape[1])), constant_values=pad)
            mask = np.pad(mask, ((0, 0), (0, width - mask.shape[1])))
            total_tokens += int(mask.sum())
            p_ids, p_mask = enc["input_ids"], enc["attention_mask"]
            extra = (-p_ids.shape[1]) % PROMPT_MULTIPLE  # left padding to a multiple: fewer compiled shapes
            p_ids = np.pad(p_ids, ((0, 0), (extra, 0)), constant_values=pad).astype(np.int32)
            p_mask = np.pad(p_mask, ((0, 0), (extra, 0))).astype(np.int32)
            base, step = c * prompts_per_mb * G, min(b, ids.shape[0])
            for s in range(0, ids.shape[0], step):
                sl = slice(base + s, base + s + step)
                mb = {"prompt_ids": p_ids, "prompt_mask": p_mask,
                      "completion_ids": ids[s:s + step].astype(np.int32),
                      "completion_mask": mask[s:s + step].astype(np.int32),
                      "advantages": advantages[sl].astype(np.float32),
                      "num_tokens": int(sum(prompt_lens[sl]) + sum(lengths[sl]))}
                if "pixel_values" in enc:
                    mb["pixel_values"] = enc["pixel_values"]
                    mb["image_grid_thw"] = enc["image_grid_thw"].astype(np.int32)
                micro.append(mb)
        for mb in micro:  # TRL: the round's tokens x grad_accum / steps_per_generation, over one window
            mb["num_items"] = (max(total_tokens, 1) / self.steps_per_generation if a.loss_type in TOKEN_SUM_LOSS_TYPES
                               else 1.0)
        # reference and old log-probs: gradient-free, right after generation, with the weights that generated
        if self.needs_old_logps or a.beta != 0:
            for mb in micro:
                arrays = self._arrays(mb)
                if self.needs_old_logps:
                    mb["old_logps"] = self._logps_no_grad(self.model, arrays)
                if a.beta != 0:
                    mb["ref_logps"] = self.reference_logps(arrays)
        self.generation_time += t_gen
        metrics["generation_seconds"] = t_gen
        metrics["scoring_seconds"] = time.perf_counter() - t0 - t_gen
        return micro, metrics

    def reference_logps(self, arrays) -> np.ndarray:
        if self.ref_model is not None:
            ctx, model = contextlib.nullcontext(), self.ref_model
        else:  # LoRA: the same model with its adapters off
            ctx, model = adapters_disabled(self.model), self.model
        with ctx:
            return self._logps_no_grad(model, arrays)

    # ------------------------------------------------------------------ engine hooks
    def _arrays(self, batch):
        arrays = Trainer.to_device(self, batch)
        if "image_grid_thw" in batch:
            arrays["vision_meta"] = self.model.vision_metadata(batch["image_grid_thw"])
        return arrays

    def to_device(self, batch):
        return self._arrays(batch)

    def batch_tokens(self, batch):
        return int(batch["num_tokens"]), float(batch["num_items"])

    def policy_logps(self, model, batch, return_entropy=True):
        from ..shared_prompt import completion_logprobs

        a = self.args
        return completion_logprobs(model, self._completion_hidden(model, batch), batch["completion_ids"],
                                   batch["completion_mask"], temperature=a.temperature,
                                   return_entropy=return_entropy, chunk_size=a.chunk_size,
                                   skip_ignored=not a.compile)

    def _completion_hidden(self, model, batch):
        from ..shared_prompt import repeated_hidden, shared_prompt_hidden

        kw = self._model_kwargs(batch)
        if self.args.shared_prompt:
            return shared_prompt_hidden(model, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"],
                                        **kw)
        kw.pop("vision_meta", None)
        return repeated_hidden(model, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"],
                               batch["completion_mask"], **kw)

    def _loss_kwargs(self):
        a = self.args
        return dict(loss_type=a.loss_type, beta=a.beta, epsilon=a.epsilon, epsilon_high=a.epsilon_high, delta=a.delta,
                    use_bias_correction_kl=a.use_bias_correction_kl, sapo_temperature_pos=a.sapo_temperature_pos,
                    sapo_temperature_neg=a.sapo_temperature_neg)

    def _fused_loss(self, model, batch, num_items):
        """Token-level GRPO through the fused head: loss and its gradients in one pass over row chunks
        (`fused_head_loss` with `grpo_token_loss` / `grpo_token_weights`); log-probs and entropy come out
        of the same pass for the metrics."""
        a = self.args
        hidden = self._completion_hidden(model, batch)
        n, C, D = hidden.shape
        mask = batch["completion_mask"].astype(mx.float32)
        targets = mx.where(mask > 0, batch["completion_ids"], IGNORE_INDEX).reshape(-1)
        token_sum = a.loss_type in TOKEN_SUM_LOSS_TYPES
        weights = grpo_token_weights(mask, a.loss_type, max_completion_length=a.max_completion_length,
                                     normalizer=num_items if token_sum else None)
        if not token_sum:
            weights = weights / num_items  # TRL divides each micro-batch's mean by grad_accum
        old, ref = batch.get("old_logps"), batch.get("ref_logps")
        zeros = mx.zeros((n, C), mx.float32)
        adv = mx.broadcast_to(batch["advantages"].astype(mx.float32).reshape(n, -1), (n, C))
        token_args = [(zeros if x is None else x.astype(mx.float32)).reshape(-1) for x in (old, ref, adv)]
        kw = self._loss_kwargs()
        token_loss = grpo_token_loss(on_policy=old is None, **kw)
        loss, logp, ent, _ = fused_head_loss(hidden.reshape(-1, D), model.lm_head_weight(), targets,
                                             loss_type=token_loss, token_weights=weights.reshape(-1),
                                             token_args=token_args, temperature=a.temperature,
                                             skip_ignored=not a.compile, weight_grad=self._head_trainable)
        logp = mx.stop_gradient(logp.reshape(n, C))
        _, metrics = grpo_loss(logp, old, ref, batch["advantages"], mask, max_completion_length=a.max_completion_length,
                               entropy=ent.reshape(n, C), **kw)
        return loss, metrics

    def loss(self, model, batch, num_items):
        a = self.args
        if uses_fused_head(a):
            return self._fused_loss(model, batch, num_items)
        logps, entropy = self.policy_logps(model, batch)
        token_sum = a.loss_type in TOKEN_SUM_LOSS_TYPES
        loss, metrics = grpo_loss(logps, batch.get("old_logps"), batch.get("ref_logps"), batch["advantages"],
                                  batch["completion_mask"], importance_sampling_level=a.importance_sampling_level,
                                  max_completion_length=a.max_completion_length,
                                  normalizer=num_items if token_sum else None, entropy=mx.stop_gradient(entropy),
                                  **self._loss_kwargs())
        # mean-type losses: TRL divides each micro-batch's mean by grad_accum (num_items sums 1 per micro-batch)
        return (loss if token_sum else loss / num_items), metrics

    # ------------------------------------------------------------------ the batch source
    def make_source(self):
        return GenerationRounds(self)


class GenerationRounds:
    """GRPO's batch source: generation rounds, each generated, scored and cut into steps_per_generation
    micro-batches on the training thread with the current weights when the loop reaches it, then
    trained on num_iterations times. An epoch is every prompt once (incomplete rounds dropped); a
    step may take micro-batches of two epochs (nothing is dropped at an epoch's end)."""

    drops_remainder = False

    def __init__(self, trainer: GRPOTrainer):
        a = trainer.args
        self.trainer = trainer
        self.steps_per_generation = trainer.steps_per_generation
        self.generate_every = trainer.steps_per_generation * a.num_iterations
        rounds_per_epoch = len(trainer.rows) // (trainer.prompts_per_round * trainer.world_size)
        self.length = rounds_per_epoch * self.generate_every
        self.round: list[dict] | None = None  # the micro-batches of the round being trained on
        self.uses: list[int] = []  # how often each was trained on
        self.position = 0  # the global micro-batch the next item is
        self._metrics: list[dict] = []

    def epoch_length(self, epoch: int) -> int:
        return self.length

    @contextlib.contextmanager
    def open(self, epoch: int, position: int, accum: int):
        yield self._stream(epoch * self.length + position)

    def _stream(self, micro: int):
        while True:
            if micro % self.generate_every == 0 or self.round is None:
                self.round, metrics = self.trainer.generate_round(micro // self.generate_every)
                self.uses = [0] * len(self.round)
                self._metrics.append(metrics)
            k = micro % self.steps_per_generation
            # num_tokens (TRL): tokens generated, counted once however often the round is reused
            item = self.round[k] if self.uses[k] == 0 else {**self.round[k], "num_tokens": 0}
            self.uses[k] += 1
            micro += 1
            self.position = micro  # before the yield: a checkpoint taken now holds this item's round
            yield item

    def pop_metrics(self) -> list[dict]:
        out, self._metrics = self._metrics, []
        return out

    def state_dict(self) -> dict[str, np.ndarray]:
        """Mid-round, the round being trained on: it was generated (and scored, and its old/reference
        log-probs computed) with earlier weights, so regenerating it on resume would train on other
        completions."""
        if self.round is None or self.position % self.generate_every == 0:
            return {}
        out = {f"uses.{i}": np.array(u) for i, u in enumerate(self.uses)}
        out.update({f"round.{i}.{k}": np.asarray(v) for i, mb in enumerate(self.round) for k, v in mb.items()})
        return out

    def load_state_dict(self, arrays: dict[str, np.ndarray]) -> None:
        n = len([k for k in arrays if k.startswith("uses.")])
        self.uses = [int(arrays[f"uses.{i}"]) for i in range(n)]
        self.round = [{} for _ in range(n)]
        for key, v in arrays.items():
            if key.startswith("round."):
                _, i, name = key.split(".", 2)
                self.round[int(i)][name] = v.item() if v.ndim == 0 else v
