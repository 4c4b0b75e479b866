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

from ...data.files import naming_rows, origins_of, rows_fingerprint
from ...data.formats import DataError, chatml, check_prompt_rows, template_kwargs
from ...data.images import fill_images, row_images
from ...errors import MlxrlError
from ...losses.fused_head import fused_head_loss
from ...losses.grpo import (
    TOKEN_SUM_LOSS_TYPES,
    compute_advantages,
    grpo_loss,
    grpo_token_loss,
    grpo_token_weights,
    uses_fused_head,
)
from ...models.dropout import eval_mode
from ...processing.tokens import IGNORE_INDEX, QWEN_STOP_TOKEN_IDS
from .. import trl_api
from ..engine import Trainer, step_seed
from ..forward import with_router_aux
from ..reference import Reference
from .config import GRPOConfig, check_grpo_config, resolve_batching
from .rewards import (
    RewardError,
    check_reward_signature,
    first_line,
    load_reward_func,
    reward_entry,
    reward_values,
)
from .rounds import GenerationRounds

PROMPT_MULTIPLE = 32  # prompts are left-padded to a multiple of this

__all__ = ["GRPOConfig", "GRPOTrainer", "RewardError", "check_grpo_config", "check_reward_signature",
           "load_reward_func", "reward_values"]


def finite_items(metrics: dict) -> dict:
    """Scalar arrays as floats, leaving out NaN ones (a reward function that applied to no completion)."""
    out = {k: v.item() for k, v in metrics.items()}
    return {k: v for k, v in out.items() if math.isfinite(v)}


def _bucket(n: int, limit: int) -> int:
    """Next power of two >= n (at least 8), capped at limit: completion widths the compiled step sees."""
    return min(max(8, 1 << max(0, math.ceil(math.log2(max(n, 1))))), max(limit, n))


# --------------------------------------------------------------------------------------- trainer

class GRPOTrainer(Trainer):
    trainer_name = "grpo"
    config_class = GRPOConfig
    check_args = staticmethod(check_grpo_config)
    metric_names = ("loss", "reward", "reward_std", "frac_reward_zero_std", "completions/mean_length",
                    "completions/min_length", "completions/max_length", "completions/clipped_ratio", "kl",
                    "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "num_tokens")

    def __init__(self, model, processor=None, args: GRPOConfig | None = None, train_dataset=None,
                 eval_dataset=None, reward_funcs=None, ref_model=None, **trl):
        """mlxrl's (model, processor, args, ...) or TRL's keywords (`trl_api`: model as a Hub id or folder,
        processing_class, peft_config)."""
        name = type(self).__name__
        if "reward_processing_classes" in trl and trl.pop("reward_processing_classes") is not None:
            raise MlxrlError(f"{name}(reward_processing_classes=...) is not supported by mlxrl: a reward model "
                             "is given by its folder (its own tokenizer) or as RewardModel(model, processor)")
        model, processor, args, train_dataset, eval_dataset, _ = trl_api.resolve(
            self, name, self.config_class, model, processor, args, train_dataset, eval_dataset, trl)
        self.check_args(args)
        if train_dataset is None or len(train_dataset) == 0:
            raise ValueError(f"{name} needs a train_dataset of rows with a 'prompt' column")
        if eval_dataset is not None:
            raise ValueError(f"eval_dataset is not supported by mlxrl's {name} yet")
        if reward_funcs is None:
            raise ValueError(f"{name} needs reward_funcs: a callable or a list of callables "
                             "f(prompts, completions, completion_ids, **columns) -> list[float | None]")
        funcs = reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
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
        with naming_rows(origins_of(train_dataset)):
            check_prompt_rows(train_dataset)
        names = [getattr(f, "__name__", type(f).__name__) for f in funcs]
        columns = [k for k in train_dataset[0] if k not in ("prompt", "completion", "completion_ids")]
        for f, name in zip(funcs, names, strict=True):
            check_reward_signature(f, name, columns)
        super().__init__(model, processor, args)
        self.reward_funcs = funcs
        self.reward_func_names = names
        self.rows = list(train_dataset)
        self.rows_fingerprint = rows_fingerprint(train_dataset)  # what a checkpoint's data position refers to
        self.row_origins = origins_of(train_dataset)
        self.G = args.num_generations
        # generation_batch_size counts every process's completions (TRL's); prompts_per_round is this rank's
        self.steps_per_generation, self.generation_batch_size = resolve_batching(args, self.world_size)
        self.prompts_per_round = self.generation_batch_size // self.world_size // self.G
        if self.prompts_per_round * self.world_size > len(self.rows):
            raise ValueError(f"a generation round needs {self.prompts_per_round * self.world_size} prompts "
                             f"(generation_batch_size / num_generations) but the dataset has {len(self.rows)}")
        # TRL computes old log-probs only when generation is not aligned with the optimizer step
        generate_every = self.steps_per_generation * args.num_iterations
        self.needs_old_logps = args.gradient_accumulation_steps % generate_every != 0
        self.reference = Reference(model, ref_model, path=args.ref_model, dtype=args.dtype, lora=args.use_peft,
                                   needed=args.beta != 0)
        self.ref_model = self.reference.model
        self.stop_token_ids = sorted({*QWEN_STOP_TOKEN_IDS, int(processor.eos_token_id)})
        self._pending_metrics: dict[str, list[float]] = {}
        self._round_epoch = 0  # the epoch of the round being generated (reward functions see it)
        self.generation_time = 0.0
        self._head_trainable = self.head_trainable

    def plan_shape(self) -> tuple[dict, str]:
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
        images = row_images(row)
        if isinstance(prompt, str):
            return prompt, [], prompt
        messages, ordered = fill_images(chatml(prompt), images, index)
        kw = dict(template_kwargs(row, index))
        kw["continue_final_message" if messages[-1].get("role") == "assistant" else "add_generation_prompt"] = True
        try:
            text = self.processor.apply_chat_template(messages, **kw)
        except Exception as e:  # jinja's errors for what the template cannot render
            raise DataError(f"row {index}: the chat template cannot render its prompt ({type(e).__name__}: "
                            f"{first_line(e)})") from None
        return text, ordered, messages

    def _round_indices(self, round_index: int) -> tuple[list[int], int, int]:
        """(this rank's prompts of the round, epoch, global position of its first prompt). A round
        holds prompts_per_round prompts per rank; rank r takes the r-th slice of the global round."""
        n, k = len(self.rows), self.prompts_per_round
        per_epoch = n // (k * self.world_size)
        epoch, pos = divmod(round_index, per_epoch)
        order = (np.random.default_rng((self.data_seed, epoch)).permutation(n) if self.args.shuffle_dataset
                 else np.arange(n))
        first = (pos * self.world_size + self.rank) * k
        return order[first:first + k].tolist(), epoch, self.rank * k

    def _gather(self, x: np.ndarray) -> np.ndarray:
        """Concatenate an [N, ...] float array over the ranks in rank order (identity with one)."""
        if self.world_size == 1:
            return x
        return self.parallel.all_gather(x)

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
                raise RewardError(f"reward function {name!r} raised {type(e).__name__}: {first_line(e)} (step "
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

    @property
    def _prompts_per_micro_batch(self) -> int:
        return max(1, self.args.per_device_train_batch_size // self.G)

    def _generate(self, round_index: int) -> tuple[list[dict], list, list]:
        """The round's prompts (this rank's share), rendered, and their completions: (rows, rendered,
        [(the encoded prompts, the generation)] per micro-batch of prompts)."""
        from ...generation.engine import generate

        a, G = self.args, self.G
        indices, self._round_epoch, offset = self._round_indices(round_index)
        rows = [self.rows[i] for i in indices]
        rendered = [self._render(r, i) for r, i in zip(rows, indices, strict=True)]
        prompts_per_mb = self._prompts_per_micro_batch
        chunks = []
        with eval_mode(self.model):
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
                               seed=step_seed(a.seed, offset + start, round_index),
                               shared_prefill=a.shared_prefill)
                chunks.append((enc, gen))
        return rows, rendered, chunks

    def _score(self, rows: list[dict], rendered: list, chunks: list):
        """Decode and score the round: (this rank's [N, F] rewards, completion lengths, prompt lengths, the
        round's length metrics over every rank's completions)."""
        G = self.G
        prompts_per_mb = self._prompts_per_micro_batch
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
        metrics = {}
        all_lengths = self._gather(np.array(lengths, dtype=np.float64)).astype(np.float64)
        all_truncated = self._gather(np.array(truncated, dtype=np.float64)) > 0.5
        lengths = np.array(lengths, dtype=np.float64)
        term = all_lengths[~all_truncated] if (~all_truncated).any() else np.zeros(1)
        metrics.update({"completions/mean_length": all_lengths.mean(), "completions/min_length": all_lengths.min(),
                        "completions/max_length": all_lengths.max(), "completions/clipped_ratio": all_truncated.mean(),
                        "completions/mean_terminated_length": term.mean(),
                        "completions/min_terminated_length": term.min(),
                        "completions/max_terminated_length": term.max()})
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

    def _cut(self, chunks: list, lengths: np.ndarray, prompt_lens: list) -> tuple[list[dict], list[slice]]:
        """The round's micro-batches: whole groups (b >= G: one chunk) or b-row slices of one prompt's group
        (b < G), completions padded to a bucket and prompts left-padded to a multiple (fewer compiled shapes),
        each with its share of the loss normaliser; and each one's rows of the round (where its advantages are)."""
        a, G, b = self.args, self.G, self.args.per_device_train_batch_size
        prompts_per_mb = self._prompts_per_micro_batch
        total_tokens, micro, slices, pad = 0, [], [], self.processor.pad_token_id
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
                      "num_tokens": int(sum(prompt_lens[sl]) + sum(lengths[sl]))}
                if "pixel_values" in enc:
                    mb["pixel_values"] = enc["pixel_values"]
                    mb["image_grid_thw"] = enc["image_grid_thw"].astype(np.int32)
                micro.append(mb)
                slices.append(sl)
        for mb in micro:  # TRL: the round's tokens x grad_accum / steps_per_generation, over one window
            mb["normalizer"] = max(total_tokens, 1) / self.steps_per_generation if self.token_sum_loss else 1.0
        return micro, slices

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

    def _completion_hidden(self, model, batch, aux: list | None = None):
        """aux: a list receiving an MoE model's load-balancing loss over each row's prompt + completion, as TRL
        computes it, when the batch carries the engine's weight of it (`forward.with_router_aux`)."""
        from ...generation.shared_prompt import repeated_hidden, shared_prompt_hidden

        kw = self._model_kwargs(batch)
        if aux is not None and "router_aux_scale" in batch:
            kw["router_aux"] = aux
        if self.args.shared_prompt:
            if "router_aux" in kw:
                kw["completion_mask"] = batch["completion_mask"]
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
        mask = batch["completion_mask"].astype(mx.float32)
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
                                  batch["completion_mask"], importance_sampling_level=a.importance_sampling_level,
                                  max_completion_length=a.max_completion_length,
                                  normalizer=normalizer if token_sum else None, entropy=mx.stop_gradient(entropy),
                                  **self._loss_kwargs(), **self._vespo_kwargs())
        # mean-type losses: TRL divides each micro-batch's mean by grad_accum (the normaliser sums 1 per micro-batch)
        return with_router_aux(loss if token_sum else loss / normalizer, metrics, aux, batch)

    # ------------------------------------------------------------------ the batch source
    def make_source(self):
        return GenerationRounds(self)

