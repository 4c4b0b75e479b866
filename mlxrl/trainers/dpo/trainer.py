"""DPOTrainer: TRL's direct preference optimisation (and its loss variants) on the shared engine.

    trainer = DPOTrainer(model=model, processor=processor, args=DPOConfig(output_dir="out", use_peft=True),
                         train_dataset=rows)      # prompt/chosen/rejected rows, text or vision
    trainer.train()

One step: the B pairs of a micro-batch run as ONE forward of 2B sequences (chosen rows, then
rejected rows); the streamed LM head (`head_logprobs`, never [tokens, vocab] logits) scores only
the positions that predict a completion token, and a [2B, R] 0/1 matrix sums them per sequence.
The reference log-probs come, without a gradient and outside the compiled step, from:

* LoRA (`use_peft`): the same model with its adapters switched off (`adapters_disabled`): no
  second copy of the weights (TRL does the same with PEFT's `disable_adapter`);
* `precompute_ref_log_probs=True`: computed once for the whole dataset before training, by the
  reference below; nothing is kept for it afterwards;
* `ref_model` (a model object, or `DPOConfig.ref_model`, a path or Hub id loaded with `mlxrl.load`);
* full fine-tuning without either: a frozen reference built from the initial weights (what TRL
  does, it loads the model a second time). It shares the weight arrays at first (MLX arrays are
  immutable) and costs one more copy of the weights in memory as the policy moves away from them;
  use `precompute_ref_log_probs` or LoRA to avoid it.

The loss is `mlxrl.losses.dpo_loss` (every TRL 1.16 loss_type, lists with loss_weights). It is a
mean over the pairs of the micro-batch; the engine normalises by `batch_tokens(...)[1]`, which is
the pair count here, so with gradient accumulation the step's loss is the mean over all its pairs
(TRL divides by the accumulation steps: the same thing for equal micro-batches).

Metrics (TRL's names): rewards/chosen|rejected|accuracies|margins, logps/chosen|rejected,
logits/chosen|rejected (mean logit over the vocabulary, exact via the mean weight row),
entropy (completion tokens of both answers), mean_token_accuracy (chosen completion tokens),
num_tokens (the engine).

Tests: pytest tests/test_dpo_trainer.py
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings

import mlx.core as mx
import numpy as np

from ...data.files import naming_rows, origins_of, rows_fingerprint
from ...losses.dpo import dpo_loss
from ...losses.head import head_logprobs
from ...models.dropout import eval_mode
from ...models.reference import adapters_disabled, frozen_copy
from .. import trl_api
from ..engine import Trainer, hidden_rows
from ..forward import with_router_aux
from ..trl_fields import multiple_of
from .config import DPOConfig, check_dpo_config

__all__ = ["DPOTrainer"]


# ------------------------------------------------------------------------------------ references

# --------------------------------------------------------------------------------------- trainer

class DPOTrainer(Trainer):
    trainer_name = "dpo"
    metric_names = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                    "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected", "entropy",
                    "mean_token_accuracy", "num_tokens")

    def __init__(self, model, processor=None, args: DPOConfig | None = None, train_dataset=None, eval_dataset=None,
                 ref_model=None, **trl):
        """mlxrl's (model, processor, args, ...) or TRL's keywords (`trl_api`: model as a Hub id or folder,
        processing_class, peft_config)."""
        model, processor, args, train_dataset, eval_dataset, _ = trl_api.resolve(
            self, "DPOTrainer", DPOConfig, model, processor, args, train_dataset, eval_dataset, trl)
        check_dpo_config(args)
        if train_dataset is None:
            raise ValueError("DPOTrainer needs a train_dataset (rows with prompt/chosen/rejected or chosen/rejected)")
        if ref_model is not None and ref_model is model:
            raise ValueError("model and ref_model are the same object: omit ref_model (LoRA switches the adapters "
                             "off, full fine-tuning keeps a frozen copy)")
        if args.disable_dropout and args.use_peft and args.lora_dropout:
            args = dataclasses.replace(args, lora_dropout=0.0)  # TRL's disable_dropout reaches LoRA's dropout too
        if args.truncation_mode == "keep_end":
            warnings.warn("truncation_mode='keep_end' is deprecated in TRL 1.16 (keep_start is the default)",
                          FutureWarning, stacklevel=2)
        super().__init__(model, processor, args)
        self._head_trainable = self.head_trainable
        if ref_model is None and args.ref_model:
            from ...loading import load

            ref_model, _ = load(args.ref_model, dtype=args.dtype)
        if ref_model is not None:
            ref_model.freeze()
            ref_model.eval()
        elif not args.use_peft and not args.precompute_ref_log_probs:
            ref_model = frozen_copy(model)  # TRL loads a second copy; see the module docstring for the cost
        self.ref_model = ref_model
        self.rows_fingerprint = rows_fingerprint(train_dataset)  # what a checkpoint's data position refers to
        self.row_origins = origins_of(train_dataset)
        self.train_examples = self._tokenize(train_dataset, "train")
        self.eval_examples = trl_api.eval_sets(eval_dataset, self.tokenize_eval)
        self.eval_origins = trl_api.eval_origins(eval_dataset)
        if args.precompute_ref_log_probs:  # (reads the images: a bad one named by its row's file and line)
            with naming_rows(self.row_origins):
                self.precompute_ref_log_probs(self.train_examples, args.precompute_ref_batch_size or
                                              args.per_device_train_batch_size)
            if self.eval_examples:
                with naming_rows(self.eval_origins if not isinstance(self.eval_origins, dict) else None):
                    self.precompute_ref_log_probs(trl_api.all_eval_examples(self.eval_examples),
                                                  args.precompute_ref_batch_size or args.per_device_eval_batch_size)

    # ------------------------------------------------------------------ data
    def _tokenize(self, rows, name):
        from ...data.preference import tokenize_preference

        a = self.args
        with naming_rows(origins_of(rows)):
            out = [tokenize_preference(row, self.processor, index=i, max_length=a.max_length,
                                       truncation_mode=a.truncation_mode) for i, row in enumerate(rows)]
        kept = [e for e in out if e is not None]
        if len(kept) < len(out):
            print(f"{name}: dropped {len(out) - len(kept)} of {len(out)} pairs whose prompt alone fills "
                  f"max_length={a.max_length}", flush=True)
        if not kept:
            raise ValueError(f"{name} dataset: no pair left (every prompt fills max_length={a.max_length})")
        return kept

    def _batches_of(self, examples, epoch, shuffle, batch_size, shard=False):
        from ...data.preference import make_preference_batches

        a = self.args
        return make_preference_batches(examples, batch_size, max_length=a.max_length,
                                       pad_token_id=self.processor.pad_token_id, seq_buckets=a.seq_buckets,
                                       padding_free=a.padding_free, shuffle=shuffle, seed=self.data_seed,
                                       epoch=epoch, ld_alpha=a.ld_alpha, bucket_rows=a.compile,
                                       num_shards=self.world_size if shard else 1, shard=self.rank if shard else 0,
                                       drop_last=a.dataloader_drop_last and shard,
                                       pad_to_multiple_of=multiple_of(a))

    def make_batches(self, epoch):
        return self._batches_of(self.train_examples, epoch, self.shuffles, self.args.per_device_train_batch_size,
                                shard=True)

    def batch_tokens(self, batch):
        """(real tokens of the 2B sequences, pairs): the engine's normaliser is the pair count."""
        return int(batch["num_tokens"]), int(batch["num_pairs"])

    def gradient_free_inputs(self, arrays):
        """The reference model's summed log-probs of the batch (unless precomputed with the rows)."""
        if "ref_chosen" not in arrays:
            arrays["ref_chosen"], arrays["ref_rejected"] = self.reference_logps(arrays)
        return arrays

    # ------------------------------------------------------------------ log-probs
    def sequence_logps(self, model, arrays, *, mask_key="seq_weights"):
        """Summed completion log-probs [2B] of `model` (no gradient intended: the caller's choice)."""
        h = hidden_rows(model, arrays)
        logp = head_logprobs(h, model.lm_head_weight(), arrays["targets"], chunk_size=self.args.chunk_size,
                             skip_ignored=False)
        return arrays[mask_key] @ logp

    def reference_logps(self, arrays) -> tuple[mx.array, mx.array]:
        """Reference (chosen [B], rejected [B]) summed log-probs, evaluated eagerly."""
        if self.ref_model is not None:
            ctx, model = contextlib.nullcontext(), self.ref_model
        else:  # LoRA (adapters off) or the policy itself before training (precompute, full fine-tuning)
            ctx, model = adapters_disabled(self.model), self.model
        with ctx:
            logps = mx.stop_gradient(self.sequence_logps(model, arrays))
            mx.eval(logps)
        b = logps.shape[0] // 2
        return logps[:b], logps[b:]

    def precompute_ref_log_probs(self, examples, batch_size):
        """Reference log-probs of every pair, once, stored on the examples (TRL's precompute_ref_log_probs)."""
        from ...data.batches import default_buckets
        from ...data.preference import preference_batch

        a = self.args
        longest = max(len(e) for e in examples)
        limit = max(a.max_length or longest, longest)
        buckets = a.seq_buckets or default_buckets(limit * 2 * batch_size if a.padding_free else limit, 32)
        for k in range(0, len(examples), batch_size):
            group = examples[k:k + batch_size]
            batch = preference_batch(group, pad_token_id=self.processor.pad_token_id, buckets=sorted(buckets),
                                     padding_free=a.padding_free, ld_alpha=a.ld_alpha, bucket_rows=False)
            arrays = self.to_device(batch)
            chosen, rejected = self.reference_logps(arrays)
            for e, c, r in zip(group, np.array(chosen).tolist(), np.array(rejected).tolist(), strict=True):
                e.ref_logps = (c, r)

    # ------------------------------------------------------------------ loss
    def loss(self, model, batch, normalizer):
        a = self.args
        aux = []  # an MoE model's load-balancing loss (`engine.with_router_aux`)
        h = hidden_rows(model, batch, aux)                              # [R, D]
        weight = model.lm_head_weight()
        t = batch["targets"]
        logp, ent, argmax = head_logprobs(h, weight, t, chunk_size=a.chunk_size, return_entropy=True,
                                          return_argmax=True, skip_ignored=False, weight_grad=self._head_trainable)
        logps = batch["seq_weights"] @ logp                               # [2B] summed completion log-probs
        b = logps.shape[0] // 2
        extra = {}
        if "sft" in a.loss_type and a.ld_alpha is not None:
            extra["sft_chosen_logps"] = (batch["seq_mask"] @ logp)[:b]
        loss, metrics = dpo_loss(logps[:b], logps[b:], batch["ref_chosen"], batch["ref_rejected"],
                                 loss_type=a.loss_type, loss_weights=a.loss_weights, beta=a.beta,
                                 label_smoothing=a.label_smoothing, discopop_tau=a.discopop_tau,
                                 f_divergence_type=a.f_divergence_type,
                                 f_alpha_divergence_coef=a.f_alpha_divergence_coef,
                                 chosen_token_counts=batch["chosen_counts"],
                                 rejected_token_counts=batch["rejected_counts"], **extra)
        mask = mx.stop_gradient(batch["seq_mask"])                        # [2B, R]
        scored, chosen = mask.sum(0), mask[:b].sum(0)                     # [R] 0/1
        rejected = mask[b:].sum(0)
        ent = mx.stop_gradient(ent)
        metrics["entropy"] = (ent * scored).sum() / mx.maximum(scored.sum(), 1.0)
        hit = (argmax == t).astype(mx.float32)
        metrics["mean_token_accuracy"] = (hit * chosen).sum() / mx.maximum(chosen.sum(), 1.0)
        # mean over the vocabulary of the logits = h . mean(W): exact, no [R, V] tile
        mean_logit = mx.stop_gradient(h.astype(mx.float32) @ weight.astype(mx.float32).mean(0))
        metrics["logits/chosen"] = (mean_logit * chosen).sum() / mx.maximum(chosen.sum(), 1.0)
        metrics["logits/rejected"] = (mean_logit * rejected).sum() / mx.maximum(rejected.sum(), 1.0)
        # dpo_loss is a mean over these b pairs; the engine sums micro-batches normalised by all pairs
        return with_router_aux(loss * (b / normalizer), metrics, aux, batch)

    # ------------------------------------------------------------------ evaluation
    def tokenize_eval(self, rows) -> list:
        return self._tokenize(rows, "eval")

    def evaluation_metrics(self) -> dict:
        """The evaluation pairs' loss and DPO metrics (un-prefixed; `evaluate()` adds eval_)."""
        if not self.eval_examples:
            return {}
        sums, pairs = {}, 0
        with eval_mode(self.model):
            for batch in self._batches_of(self.eval_examples, 0, False, self.args.per_device_eval_batch_size):
                arrays = self.gradient_free_inputs(self.to_device(batch))
                b = batch["num_pairs"]
                loss, metrics = self.loss(self.model, arrays, mx.array(b, dtype=mx.float32))
                for k, v in {"loss": loss, **metrics}.items():
                    sums[k] = sums.get(k, 0.0) + v.item() * b
                pairs += b
        return {k: v / max(pairs, 1) for k, v in sums.items()}
