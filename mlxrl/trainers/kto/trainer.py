"""KTOTrainer: TRL 1.16's Kahneman-Tversky optimisation on the shared engine, from unpaired rows (prompt, completion,
label) or preference rows unpaired as TRL unpairs them (`data.unpaired`).

    trainer = KTOTrainer(model=model, processor=processor, args=KTOConfig(output_dir="out", use_peft=True),
                         train_dataset=rows)
    trainer.train()

One step: the B examples of a micro-batch run through the trunk and the streamed LM head (`head_logprobs`, never
[tokens, vocab] logits) over their completion positions only, summed per example. Before it, without a gradient
and outside the compiled step (`gradient_free_inputs`): the reference's summed log-probs of the same B completions
and, for the `kto` loss, the policy's and the reference's log-probs of the B mismatched (prompt, completion)
sequences, from which the KL term is formed (TRL computes both under no_grad: the KL term carries no gradient).
The reference is `trainers.reference.Reference`: `ref_model`, else the adapters switched off under LoRA, else a
frozen copy; `precompute_ref_log_probs` computes the whole dataset's reference log-probs (the KL sequences' too)
once before training.

The loss is `mlxrl.losses.kto_loss` (kto, apo_zero_unpaired; desirable / undesirable weights), a mean over the
micro-batch's examples; the engine normalises by the example count, so with gradient accumulation the step's
loss is the mean over its micro-batches' means (TRL's division by the accumulation steps, for equal ones). The KL
term is this process's micro-batch mean, averaged over the data-parallel processes before the clamp (TRL's).

Metrics (TRL's names): kl, rewards/chosen|rejected|margins, logps/chosen|rejected, logits/chosen|rejected (the
mean logit over the vocabulary at each label's completion tokens, exact via the mean weight row), entropy,
num_tokens.

Tests: pytest tests/test_kto.py
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np

from ...data.files import naming_rows, origins_of, rows_fingerprint
from ...losses.head import head_logprobs
from ...losses.kto import kl_term, kto_loss
from ...models.dropout import eval_mode
from .. import trl_api
from ..engine import Trainer, hidden_rows
from ..forward import with_router_aux
from ..reference import Reference
from ..trl_fields import multiple_of
from .config import KTOConfig, check_kto_config

__all__ = ["KTOTrainer"]


_IMAGES = ("pixel_values", "image_grid_thw", "vision_meta")


def _kl_arrays(arrays: dict) -> dict:
    """The mismatched KL sequences' arrays; each keeps its own example's prompt, so the batch's images too."""
    return {**{k[3:]: v for k, v in arrays.items() if k.startswith("kl_")},
            **{k: arrays[k] for k in _IMAGES if k in arrays}}


class KTOTrainer(Trainer):
    trainer_name = "kto"
    metric_names = ("loss", "kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
                    "logps/rejected", "logits/chosen", "logits/rejected", "entropy", "num_tokens")

    def __init__(self, model, processor=None, args: KTOConfig | None = None, train_dataset=None, eval_dataset=None,
                 ref_model=None, **trl):
        """mlxrl's (model, processor, args, ...) or TRL's keywords (`trl_api`: model as a Hub id or folder,
        processing_class, peft_config)."""
        model, processor, args, train_dataset, eval_dataset, _ = trl_api.resolve(
            self, "KTOTrainer", KTOConfig, model, processor, args, train_dataset, eval_dataset, trl)
        check_kto_config(args)
        if train_dataset is None:
            raise ValueError("KTOTrainer needs a train_dataset (rows with prompt/completion/label, or preference rows)")
        Reference.check_distinct(model, ref_model)
        if args.disable_dropout and args.use_peft and args.lora_dropout:
            args = dataclasses.replace(args, lora_dropout=0.0)  # TRL's disable_dropout reaches LoRA's dropout too
        super().__init__(model, processor, args)
        self._head_trainable = self.head_trainable
        self.kl = args.loss_type == "kto"
        self.reference = Reference(self.model, ref_model, path=args.ref_model, dtype=args.dtype, lora=args.use_peft,
                                   precomputed=args.precompute_ref_log_probs)
        self.ref_model = self.reference.model
        self.rows_fingerprint = rows_fingerprint(train_dataset)
        self.row_origins = origins_of(train_dataset)
        self.train_examples = self.tokenize_rows(train_dataset, "train", args.per_device_train_batch_size)
        self.eval_examples = trl_api.eval_sets(eval_dataset, self.tokenize_eval)
        self.eval_origins = trl_api.eval_origins(eval_dataset)
        if args.precompute_ref_log_probs:
            self.precompute_ref_log_probs(self.train_examples, args.precompute_ref_batch_size or
                                          args.per_device_train_batch_size)
            if self.eval_examples:
                self.precompute_ref_log_probs(trl_api.all_eval_examples(self.eval_examples),
                                              args.precompute_ref_batch_size or args.per_device_eval_batch_size)

    # ------------------------------------------------------------------ data
    def tokenize_rows(self, rows, name: str, batch_size: int) -> list:
        from ...data.unpaired import tokenize_unpaired, unpair, with_kl_completions

        with naming_rows(origins_of(rows)):
            out = tokenize_unpaired(rows, self.processor, max_length=self.args.max_length)
        total = len(unpair(rows))
        if len(out) < total:
            print(f"{name}: dropped {total - len(out)} of {total} examples whose prompt alone fills "
                  f"max_length={self.args.max_length}", flush=True)
        if not out:
            raise ValueError(f"{name} dataset: no example left (every prompt fills max_length={self.args.max_length})")
        return with_kl_completions(out, batch_size) if self.kl else out

    def tokenize_eval(self, rows) -> list:
        return self.tokenize_rows(rows, "eval", self.args.per_device_eval_batch_size)

    def example_batches(self, examples, epoch, shuffle, batch_size, shard=False):
        from ...data.unpaired import make_unpaired_batches

        a = self.args
        return make_unpaired_batches(examples, batch_size, max_length=a.max_length,
                                     pad_token_id=self.processor.pad_token_id, seq_buckets=a.seq_buckets,
                                     padding_free=a.padding_free, shuffle=shuffle,
                                     seed=self.data_seed, epoch=epoch, bucket_rows=a.compile,
                                     num_shards=self.world_size if shard else 1, shard=self.rank if shard else 0,
                                     drop_last=a.dataloader_drop_last and shard, pad_to_multiple_of=multiple_of(a))

    def make_batches(self, epoch):
        return self.example_batches(self.train_examples, epoch, self.shuffles, self.args.per_device_train_batch_size,
                                    shard=True)

    def batch_tokens(self, batch):
        """(real tokens of the B sequences, examples): the engine's normaliser is the example count."""
        return int(batch["num_tokens"]), int(batch["num_examples"])

    # ------------------------------------------------------------------ gradient-free inputs
    def completion_logps(self, model, arrays) -> mx.array:
        """Summed completion log-probs [B] of `model`, evaluated, no gradient."""
        h = hidden_rows(model, arrays)
        logp = head_logprobs(h, model.lm_head_weight(), arrays["targets"], chunk_size=self.args.chunk_size,
                             skip_ignored=False)
        out = mx.stop_gradient(arrays["seq_mask"] @ logp)
        mx.eval(out)
        return out

    def reference_logps(self, arrays) -> tuple[mx.array, mx.array | None]:
        """The reference's (completion [B], KL completion [B] or None) summed log-probs."""
        with self.reference.scope() as model:
            ref = self.completion_logps(model, arrays)
            ref_kl = self.completion_logps(model, _kl_arrays(arrays)) if self.kl else None
        return ref, ref_kl

    def gradient_free_inputs(self, arrays):
        """The reference's log-probs (unless precomputed with the rows) and the KL term (kto)."""
        if "ref_logps" not in arrays:
            arrays["ref_logps"], ref_kl = self.reference_logps(arrays)
            if ref_kl is not None:
                arrays["ref_kl_logps"] = ref_kl
        if self.kl:
            # the policy as it trains (TRL's no_grad forward in the same mode)
            policy_kl = self.completion_logps(self.model, _kl_arrays(arrays))
            if self.world_size > 1:  # TRL: each process's mean log-ratio, averaged over the processes, then clamped
                local = (policy_kl - arrays["ref_kl_logps"]).mean().item()
                mean = self.parallel.all_sum(np.array([local], np.float64))[0] / self.world_size
                arrays["kl"] = mx.array(max(float(mean), 0.0), dtype=mx.float32)
            else:
                arrays["kl"] = kl_term(policy_kl, arrays["ref_kl_logps"])
        return {k: v for k, v in arrays.items() if not k.startswith("kl_") and k != "ref_kl_logps"}

    def precompute_ref_log_probs(self, examples, batch_size):
        """Reference log-probs of every example (and its KL sequence), once, stored on the examples."""
        for k in range(0, len(examples), batch_size):
            group = examples[k:k + batch_size]
            batch = self.example_batches(group, 0, False, len(group))[0]
            ref, ref_kl = self.reference_logps(self.to_device(batch))
            kl = np.array(ref_kl).tolist() if ref_kl is not None else [None] * len(group)
            for e, r, z in zip(group, np.array(ref).tolist(), kl, strict=True):
                e.ref_logps = (r, z)

    # ------------------------------------------------------------------ loss
    def loss(self, model, batch, normalizer):
        a = self.args
        aux = []  # an MoE model's load-balancing loss (`forward.with_router_aux`)
        h = hidden_rows(model, batch, aux)                              # [R, D]
        weight = model.lm_head_weight()
        logp, ent = head_logprobs(h, weight, batch["targets"], chunk_size=a.chunk_size, return_entropy=True,
                                  skip_ignored=False, weight_grad=self._head_trainable)
        logps = batch["seq_mask"] @ logp                                # [B]
        labels = batch["labels"]
        loss, metrics = kto_loss(logps, batch["ref_logps"], labels, batch.get("kl"), loss_type=a.loss_type,
                                 beta=a.beta, desirable_weight=a.desirable_weight,
                                 undesirable_weight=a.undesirable_weight)
        mask = mx.stop_gradient(batch["seq_mask"])                      # [B, R]
        good, bad = labels @ mask, (1 - labels) @ mask                  # [R] 0/1
        scored = good + bad
        metrics["entropy"] = (mx.stop_gradient(ent) * scored).sum() / mx.maximum(scored.sum(), 1.0)
        mean_logit = mx.stop_gradient(h.astype(mx.float32) @ weight.astype(mx.float32).mean(0))
        nan = mx.array(float("nan"), mx.float32)
        metrics["logits/chosen"] = mx.where(good.sum() > 0, (mean_logit * good).sum() / mx.maximum(good.sum(), 1.0),
                                            nan)
        metrics["logits/rejected"] = mx.where(bad.sum() > 0, (mean_logit * bad).sum() / mx.maximum(bad.sum(), 1.0),
                                              nan)
        b = labels.shape[0]
        return with_router_aux(loss * (b / normalizer), metrics, aux, batch)

    # ------------------------------------------------------------------ evaluation
    def evaluation_metrics(self) -> dict:
        """The evaluation examples' loss and KTO metrics (un-prefixed; `evaluate()` adds eval_), example-weighted
        (a metric absent from a batch, NaN, is left out)."""
        if not self.eval_examples:
            return {}
        sums, counts = {}, {}
        with eval_mode(self.model):
            for batch in self.example_batches(self.eval_examples, 0, False, self.args.per_device_eval_batch_size):
                arrays = self.gradient_free_inputs(self.to_device(batch))
                b = batch["num_examples"]
                loss, metrics = self.loss(self.model, arrays, mx.array(b, dtype=mx.float32))
                for k, v in {"loss": loss, **metrics}.items():
                    v = v.item()
                    if not np.isnan(v):
                        sums[k], counts[k] = sums.get(k, 0.0) + v * b, counts.get(k, 0) + b
        return {k: v / counts[k] for k, v in sums.items()}

