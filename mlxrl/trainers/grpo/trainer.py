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
`mlxrl.generation.engine.generate` draws G completions per prompt with the prompt prefilled ONCE and its
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

import dataclasses
import inspect
import math
import time
from types import SimpleNamespace

import mlx.core as mx
import numpy as np

from ...data.images import row_images
from ...errors import MlxrlError, first_line
from ...losses.fused_head import fused_head_loss
from ...losses.grpo import (
    TOKEN_SUM_LOSS_TYPES,
    compute_advantages,
    grpo_loss,
    grpo_token_loss,
    grpo_token_weights,
    uses_fused_head,
)
from ...processing.tokens import IGNORE_INDEX
from .. import trl_api
from ..forward import with_router_aux
from ..reference import Reference
from ..rollout.trainer import RolloutTrainer
from .config import GRPOConfig, check_grpo_config, resolve_batching
from .rewards import (
    RewardError,
    check_reward_signature,
    load_reward_func,
    reward_entry,
    reward_values,
)

__all__ = ["GRPOConfig", "GRPOTrainer", "RewardError", "check_grpo_config", "check_reward_signature",
           "load_reward_func", "reward_values"]


def finite_items(metrics: dict) -> dict:
    """Scalar arrays as floats, leaving out NaN ones (a reward function that applied to no completion)."""
    out = {k: v.item() for k, v in metrics.items()}
    return {k: v for k, v in out.items() if math.isfinite(v)}


# --------------------------------------------------------------------------------------- trainer

class GRPOTrainer(RolloutTrainer):
    trainer_name = "grpo"
    config_class = GRPOConfig
    check_args = staticmethod(check_grpo_config)
    metric_names = ("loss", "reward", "reward_std", "frac_reward_zero_std", "completions/mean_length",
                    "completions/min_length", "completions/max_length", "completions/clipped_ratio", "kl",
                    "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "num_tokens")

    def __init__(self, model, processor=None, args: GRPOConfig | None = None, train_dataset=None,
                 eval_dataset=None, reward_funcs=None, ref_model=None, tools=None, environment_factory=None,
                 rollout_func=None, **trl):
        """mlxrl's (model, processor, args, ...) or TRL's keywords (`trl_api`: model as a Hub id or folder,
        processing_class, peft_config)."""
        name = type(self).__name__
        if "reward_processing_classes" in trl and trl.pop("reward_processing_classes") is not None:
            raise MlxrlError(f"{name}(reward_processing_classes=...) is not supported by mlxrl: a reward model "
                             "is given by its folder (its own tokenizer) or as RewardModel(model, processor)")
        model, processor, args, train_dataset, eval_dataset, _ = trl_api.resolve(
            self, name, self.config_class, model, processor, args, train_dataset, eval_dataset, trl)
        self.check_args(args)
        if reward_funcs is None and environment_factory is None:
            raise ValueError(f"{name} needs reward_funcs: a callable or a list of callables "
                             "f(prompts, completions, completion_ids, **columns) -> list[float | None]")
        funcs = [] if reward_funcs is None else (
            list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs])
        funcs = [reward_entry(f) for f in funcs]
        for f in funcs:
            if not callable(f):
                raise ValueError(f"reward function {f!r} is not callable: give a function, a reward model's folder "
                                 "or a model mlxrl.load(path, num_labels=1) returned")
        if args.reward_weights is not None and len(args.reward_weights) != len(funcs):
            raise ValueError(f"reward_weights has {len(args.reward_weights)} weights for {len(funcs)} reward functions")
        Reference.check_distinct(model, ref_model)
        if args.disable_dropout and args.use_peft and args.lora_dropout:
            args = dataclasses.replace(args, lora_dropout=0.0)
        names = [getattr(f, "__name__", type(f).__name__) for f in funcs]
        if train_dataset is not None and len(train_dataset) and rollout_func is None:  # its fields come later
            columns = [k for k in train_dataset[0] if k not in ("prompt", "completion", "completion_ids")]
            columns += ["environments"] if environment_factory is not None else []
            for f, fname in zip(funcs, names, strict=True):
                check_reward_signature(f, fname, columns)
        self.G = args.num_generations
        self._init_rollout(name, model, processor, args, train_dataset, eval_dataset, tools=tools,
                           environment_factory=environment_factory)
        if self.environments is not None:  # an environment's get_reward: one more reward source, weight 1 (TRL's)
            for env_name, f in self.environments.reward_funcs(self.problems.note):
                funcs, names = [*funcs, f], [*names, env_name]
                if self.args.reward_weights is not None:
                    self.args = dataclasses.replace(self.args, reward_weights=[*self.args.reward_weights, 1.0])
            if not funcs:
                raise ValueError("No reward source provided. Pass `reward_funcs`, or an `environment_factory` "
                                 "whose environment defines `get_reward`")
        self.reward_funcs = funcs
        self.reward_func_names = names
        if rollout_func is not None:
            if not callable(rollout_func):
                raise ValueError("rollout_func must be a callable rollout_func(prompts, trainer) -> dict")
            if tools or environment_factory is not None:
                raise MlxrlError(f"{name}(rollout_func=...) with tools or environment_factory is not supported by "
                                 "mlxrl: the rollout function generates the whole episode itself")
            if any(row_images(r) for r in self.rows):
                raise MlxrlError(f"{name}(rollout_func=...) with image rows: TRL's rollout functions take no images")
        self.rollout_func = rollout_func
        # TRL computes old log-probs only when generation is not aligned with the optimizer step
        generate_every = self.steps_per_generation * args.num_iterations
        self.needs_old_logps = args.gradient_accumulation_steps % generate_every != 0
        self.reference = Reference(model, ref_model, path=args.ref_model, dtype=args.dtype, lora=args.use_peft,
                                   needed=args.beta != 0)
        self.ref_model = self.reference.model
        self._pending_metrics: dict[str, list[float]] = {}

    def batching(self) -> tuple[int, int]:
        return resolve_batching(self.args, self.world_size)

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
            if self._round_environments is not None:
                kwargs["environments"] = self._round_environments
            try:
                values = f(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
                if inspect.isawaitable(values):
                    import asyncio

                    values = asyncio.run(values)
            except Exception as e:
                raise RewardError(f"reward function {name!r} raised {type(e).__name__}: {first_line(e)} (step "
                                 f"{self.global_step + 1}; MLXRL_DEBUG=1 shows the traceback)") from e
            out[:, k] = reward_values(values, name, len(prompts))
        self.problems.report()  # an environment's get_reward that raised
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

    def _logps_no_grad(self, model, arrays):
        from ...generation.shared_prompt import shared_prompt_logprobs

        out = shared_prompt_logprobs(model, arrays["prompt_ids"], arrays["prompt_mask"], arrays["completion_ids"],
                                     arrays["completion_mask"], temperature=self.args.temperature,
                                     chunk_size=self.args.chunk_size, **self._model_kwargs(arrays))
        out = mx.stop_gradient(out)
        mx.eval(out)
        return np.array(out)

    def generate_round(self, round_index: int) -> tuple[list[dict], dict]:
        """One round: generate G completions per prompt, score them (rewards, advantages over the whole
        round and every rank), cut the round into steps_per_generation micro-batches (numpy dicts), and add
        the gradient-free old / reference log-probs with the weights that generated it."""
        t0 = time.perf_counter()
        rows, rendered, chunks = self._generate(round_index)
        t_gen = time.perf_counter() - t0
        rewards, lengths, prompt_lens, metrics = self._score(rows, rendered, chunks)
        micro, slices = self._cut(chunks, lengths, prompt_lens)
        self._add_logps(micro)
        advantages, reward_metrics = self.round_advantages(rewards, micro)
        for mb, sl in zip(micro, slices, strict=True):
            mb["advantages"] = advantages[sl].astype(np.float32)
        metrics = {**reward_metrics, **metrics}
        self.generation_time += t_gen
        metrics["generation_seconds"] = t_gen
        metrics["scoring_seconds"] = time.perf_counter() - t0 - t_gen
        return micro, metrics

    def _score(self, rows: list[dict], rendered: list, chunks: list):
        """Decode and score the round: (this rank's [N, F] rewards, completion lengths, prompt lengths, the
        round's length metrics over every rank's completions)."""
        G = self.G
        prompts_per_mb = self._prompts_per_micro_batch
        prompts, completions, completion_ids, columns = [], [], [], {}
        keys = [k for k in rows[0] if k not in ("prompt", "completion", "completion_ids")]
        for c, (_, gen) in enumerate(chunks):
            ids, mask = np.array(gen.completion_ids), np.array(gen.completion_mask)
            for r in range(ids.shape[0]):
                j = c * prompts_per_mb + r // G
                seq = ids[r][mask[r] > 0].tolist()
                conv = not isinstance(rows[j]["prompt"], str)
                prompts.append(rendered[j][2] if self._completion_prompts is None
                               else self._completion_prompts[c * prompts_per_mb * G + r])
                if getattr(gen, "messages", None):  # the tool loop's turns: assistant, tool, ..., assistant
                    completions.append(gen.messages[r])
                else:
                    text = self.processor.batch_decode([seq], skip_special_tokens=True)[0]
                    completions.append([{"role": "assistant", "content": text}] if conv else text)
                completion_ids.append(seq)
                for k in keys:
                    columns.setdefault(k, []).append(rows[j][k])
        for k, v in (getattr(self, "_round_extra", None) or {}).items():  # rollout_func's own fields
            columns[k] = v
        rewards = self.score(prompts, completions, completion_ids, columns)
        lengths, prompt_lens = self._lengths(chunks)
        metrics = self._length_metrics(chunks, lengths)
        for name, values in self._pending_metrics.items():
            metrics[name] = float(np.mean(values))
        self._pending_metrics.clear()
        return rewards, lengths, prompt_lens, metrics

    def round_advantages(self, rewards: np.ndarray, micro: list[dict]) -> tuple[np.ndarray, dict]:
        """(this rank's advantages [N], the round's reward metrics) from this rank's [N, F] rewards: group-relative
        over the whole round (every rank's groups: "batch" scaling is over all of them)."""
        a = self.args
        n_local = len(rewards)
        advantages, metrics = compute_advantages(mx.array(self._gather(rewards)), self.G,
                                                 reward_weights=a.reward_weights, scale_rewards=a.scale_rewards,
                                                 multi_objective_aggregation=a.multi_objective_aggregation,
                                                 reward_names=self.reward_func_names)
        return np.array(advantages)[self.rank * n_local:(self.rank + 1) * n_local], finite_items(metrics)

    @property
    def token_sum_loss(self) -> bool:
        """Whether the loss is a token sum over the round (dapo, cispo) rather than a mean per micro-batch."""
        return self.args.loss_type in TOKEN_SUM_LOSS_TYPES

    def _add_logps(self, micro: list[dict]) -> None:
        """Reference and old log-probs: gradient-free, right after generation, with the weights that generated."""
        a = self.args
        if self.needs_old_logps or a.beta != 0:
            for mb in micro:
                arrays = self.to_device(mb)
                if self.needs_old_logps:
                    mb["old_logps"] = self._logps_no_grad(self.model, arrays)
                if a.beta != 0:
                    mb["ref_logps"] = self.reference_logps(arrays)

    def reference_logps(self, arrays) -> np.ndarray:
        with self.reference.scope() as model:
            return self._logps_no_grad(model, arrays)

    # ------------------------------------------------------------------ engine hooks
    def policy_logps(self, model, batch, return_entropy=True, aux: list | None = None):
        from ...generation.shared_prompt import completion_logprobs

        a = self.args
        return completion_logprobs(model, self._completion_hidden(model, batch, aux), batch["completion_ids"],
                                   batch["completion_mask"], temperature=a.temperature,
                                   return_entropy=return_entropy, chunk_size=a.chunk_size,
                                   skip_ignored=not a.compile)

    def _loss_kwargs(self):
        a = self.args
        return dict(loss_type=a.loss_type, beta=a.beta, epsilon=a.epsilon, epsilon_high=a.epsilon_high, delta=a.delta,
                    use_bias_correction_kl=a.use_bias_correction_kl, sapo_temperature_pos=a.sapo_temperature_pos,
                    sapo_temperature_neg=a.sapo_temperature_neg)

    def _vespo_kwargs(self):
        a = self.args
        return dict(vespo_k_pos=a.vespo_k_pos, vespo_lambda_pos=a.vespo_lambda_pos, vespo_k_neg=a.vespo_k_neg,
                    vespo_lambda_neg=a.vespo_lambda_neg)

    def _fused_loss(self, model, batch, normalizer):
        """Token-level GRPO through the fused head: loss and its gradients in one pass over row chunks
        (`fused_head_loss` with `grpo_token_loss` / `grpo_token_weights`); log-probs and entropy come out
        of the same pass for the metrics."""
        a = self.args
        aux = []  # an MoE model's load-balancing loss (`forward.with_router_aux`)
        hidden = self._completion_hidden(model, batch, aux)
        n, C, D = hidden.shape
        mask = self.loss_mask(batch).astype(mx.float32)
        targets = mx.where(mask > 0, batch["completion_ids"], IGNORE_INDEX).reshape(-1)
        token_sum = self.token_sum_loss
        weights = grpo_token_weights(mask, a.loss_type, max_completion_length=a.max_completion_length,
                                     normalizer=normalizer if token_sum else None)
        if not token_sum:
            weights = weights / normalizer  # TRL divides each micro-batch's mean by grad_accum
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
        return with_router_aux(loss, metrics, aux, batch)

    def loss(self, model, batch, normalizer):
        a = self.args
        if uses_fused_head(a.head_mode, a.importance_sampling_level, a.loss_type):
            return self._fused_loss(model, batch, normalizer)
        aux = []  # an MoE model's load-balancing loss (`forward.with_router_aux`)
        logps, entropy = self.policy_logps(model, batch, aux=aux)
        token_sum = self.token_sum_loss
        loss, metrics = grpo_loss(logps, batch.get("old_logps"), batch.get("ref_logps"), batch["advantages"],
                                  self.loss_mask(batch), importance_sampling_level=a.importance_sampling_level,
                                  max_completion_length=a.max_completion_length,
                                  normalizer=normalizer if token_sum else None, entropy=mx.stop_gradient(entropy),
                                  **self._loss_kwargs(), **self._vespo_kwargs())
        # mean-type losses: TRL divides each micro-batch's mean by grad_accum (the normaliser sums 1 per micro-batch)
        return with_router_aux(loss if token_sum else loss / normalizer, metrics, aux, batch)
