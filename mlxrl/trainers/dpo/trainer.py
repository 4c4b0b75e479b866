"""DPOTrainer: TRL's direct preference optimisation (and its loss variants) on the shared engine.

    trainer = DPOTrainer(model=model, processor=processor, args=DPOConfig(output_dir="out", use_peft=True),
                         train_dataset=rows)      # prompt/chosen/rejected rows, text or vision
    trainer.train()

One step: the B pairs of a micro-batch run as ONE forward of 2B sequences (`trainers.paired`: the rows,
their batches, the streamed head over the completion positions, the shared metrics). The reference
log-probs come, without a gradient and outside the compiled step, from `trainers.reference.Reference`:
a `ref_model` (object, or `DPOConfig.ref_model` as a path or Hub id), else under LoRA the same model
with its adapters off (no second copy of the weights), else a frozen copy of the initial weights (one
more copy as the policy moves: `precompute_ref_log_probs=True` avoids it by computing the whole
dataset's reference log-probs once before training and keeping nothing).

The loss is `mlxrl.losses.dpo_loss` (every TRL 1.16 loss_type, lists with loss_weights), a mean over
the micro-batch's pairs (the paired trainers' normalisation).

Metrics (TRL's names): rewards/chosen|rejected|accuracies|margins, logps/chosen|rejected,
logits/chosen|rejected (mean logit over the vocabulary, exact via the mean weight row),
entropy (completion tokens of both answers), mean_token_accuracy (chosen completion tokens),
num_tokens (the engine).

Tests: pytest tests/test_dpo_trainer.py
"""

from __future__ import annotations

import warnings

import mlx.core as mx
import numpy as np

from ...data.files import naming_rows
from ...losses.dpo import dpo_loss
from .. import trl_api
from ..forward import with_router_aux
from ..paired.trainer import PairedTrainer
from ..reference import Reference
from .config import DPOConfig, check_dpo_config

__all__ = ["DPOTrainer"]


class DPOTrainer(PairedTrainer):
    trainer_name = "dpo"
    config_class = DPOConfig
    metric_names = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                    "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected", "entropy",
                    "mean_token_accuracy", "num_tokens")

    def __init__(self, model, processor=None, args: DPOConfig | None = None, train_dataset=None, eval_dataset=None,
                 ref_model=None, **trl):
        """mlxrl's (model, processor, args, ...) or TRL's keywords (`trl_api`: model as a Hub id or folder,
        processing_class, peft_config)."""
        Reference.check_distinct(model, ref_model)
        super().__init__(model, processor, args, train_dataset, eval_dataset, **trl)
        args = self.args
        self.reference = Reference(self.model, ref_model, path=args.ref_model, dtype=args.dtype, lora=args.use_peft,
                                   precomputed=args.precompute_ref_log_probs)
        self.ref_model = self.reference.model
        if args.precompute_ref_log_probs:  # (reads the images: a bad one named by its row's file and line)
            with naming_rows(self.row_origins):
                self.precompute_ref_log_probs(self.train_examples, args.precompute_ref_batch_size or
                                              args.per_device_train_batch_size)
            if self.eval_examples:
                with naming_rows(self.eval_origins if not isinstance(self.eval_origins, dict) else None):
                    self.precompute_ref_log_probs(trl_api.all_eval_examples(self.eval_examples),
                                                  args.precompute_ref_batch_size or args.per_device_eval_batch_size)

    def check_args(self, args) -> None:
        check_dpo_config(args)
        if args.truncation_mode == "keep_end":
            warnings.warn("truncation_mode='keep_end' is deprecated in TRL 1.16 (keep_start is the default)",
                          FutureWarning, stacklevel=3)

    def gradient_free_inputs(self, arrays):
        """The reference model's summed log-probs of the batch (unless precomputed with the rows)."""
        if "ref_chosen" not in arrays:
            arrays["ref_chosen"], arrays["ref_rejected"] = self.reference_logps(arrays)
        return arrays

    # ------------------------------------------------------------------ reference log-probs
    def reference_logps(self, arrays) -> tuple[mx.array, mx.array]:
        """Reference (chosen [B], rejected [B]) summed log-probs, evaluated eagerly."""
        with self.reference.scope() as model:
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
        out = self.paired_forward(model, batch, aux)
        logps, b = out.sums(batch), out.b                                 # [2B] summed completion log-probs
        extra = {}
        if "sft" in a.loss_type and a.ld_alpha is not None:
            extra["sft_chosen_logps"] = out.sums(batch, "seq_mask")[:b]
        loss, metrics = dpo_loss(logps[:b], logps[b:], batch["ref_chosen"], batch["ref_rejected"],
                                 loss_type=a.loss_type, loss_weights=a.loss_weights, beta=a.beta,
                                 label_smoothing=a.label_smoothing, discopop_tau=a.discopop_tau,
                                 f_divergence_type=a.f_divergence_type,
                                 f_alpha_divergence_coef=a.f_alpha_divergence_coef,
                                 chosen_token_counts=batch["chosen_counts"],
                                 rejected_token_counts=batch["rejected_counts"], **extra)
        metrics.update(self.pair_metrics(out, batch))
        # dpo_loss is a mean over these b pairs; the engine sums micro-batches normalised by all pairs
        return with_router_aux(loss * (b / normalizer), metrics, aux, batch)
