"""SFTTrainer: TRL's supervised fine-tuning on the shared engine.

    trainer = SFTTrainer(model=model, processor=processor, args=SFTConfig(...), train_dataset=rows)
    trainer.train()

Rows are TRL dataset rows (language modelling, prompt-completion, conversational, vision
conversational). The loss is TRL's: -sum log p(label) / (trained tokens of the whole accumulated
batch), through the streamed LM head (no [tokens, vocab] logits).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ...data.batches import quarter_octave, right_padded
from ...data.files import naming_rows, origins_of, rows_fingerprint
from ...errors import ConfigError
from ...losses.fused_head import fused_head_loss, fused_value_and_grad
from ...losses.head import head_logprobs
from ...losses.sft import check_has_labels, sft_loss, token_metrics
from ...models.dropout import eval_mode
from ...processing.tokens import IGNORE_INDEX
from .. import eval_metrics, trl_api
from ..engine import Trainer, hidden_rows
from ..forward import with_router_aux
from ..tokenizer_args import apply_tokenizer_args
from ..trl_api import format_rows
from ..trl_fields import multiple_of
from .config import SFTConfig


def shift_targets(labels: np.ndarray, segment_ids: np.ndarray | None) -> np.ndarray:
    """targets[b, i] = labels[b, i + 1]: what position i predicts. The last position and the last
    token of each packed document predict nothing (the next token belongs to another document)."""
    t = np.full_like(labels, IGNORE_INDEX)
    t[:, :-1] = labels[:, 1:]
    if segment_ids is not None:
        boundary = np.zeros_like(labels, dtype=bool)
        boundary[:, :-1] = segment_ids[:, 1:] != segment_ids[:, :-1]
        t[boundary] = IGNORE_INDEX
    return t


class SFTTrainer(Trainer):
    trainer_name = "sft"
    metric_names = ("loss", "mean_token_accuracy", "entropy", "num_tokens")

    def __init__(self, model, processor=None, args: SFTConfig | None = None, train_dataset=None, eval_dataset=None,
                 **trl):
        """mlxrl's (model, processor, args, ...) or TRL's keywords (`trl_api`: model as a Hub id or folder,
        processing_class, peft_config, formatting_func)."""
        model, processor, args, train_dataset, eval_dataset, extra = trl_api.resolve(
            self, "SFTTrainer", SFTConfig, model, processor, args, train_dataset, eval_dataset, trl,
            accepted=("formatting_func", "compute_metrics", "preprocess_logits_for_metrics"))
        self.compute_metrics = extra["compute_metrics"]
        self.preprocess_logits_for_metrics = extra["preprocess_logits_for_metrics"]
        super().__init__(model, processor, args)
        if self.router_aux_coef and args.head_mode == "two_phase":
            raise ConfigError("head_mode two_phase differentiates the trunk alone, without an MoE model's router "
                              "loss: use head_mode fused, or set router_aux_loss_coef 0")
        if train_dataset is None:
            raise ValueError("SFTTrainer needs a train_dataset (a list of rows or a datasets.Dataset)")
        if extra["formatting_func"] is not None:  # TRL: each row becomes the text the function makes of it
            train_dataset = format_rows(train_dataset, extra["formatting_func"])
            eval_dataset = trl_api.eval_sets(eval_dataset, lambda rows: format_rows(rows, extra["formatting_func"]))
        self._head_trainable = self.head_trainable
        apply_tokenizer_args(self.processor, args)  # eos_token, chat_template_path: before any row is tokenised
        self.rows_fingerprint = rows_fingerprint(train_dataset)  # what a checkpoint's data position refers to
        self.row_origins = origins_of(train_dataset)
        self.train_examples = self._tokenize(train_dataset)
        if args.shuffle_dataset:  # TRL shuffles before packing: which examples share a packed row changes
            order = np.random.default_rng(self.data_seed).permutation(len(self.train_examples))
            self.train_examples = [self.train_examples[i] for i in order]
        self.eval_examples = trl_api.eval_sets(eval_dataset, self._tokenize)
        self.eval_origins = trl_api.eval_origins(eval_dataset)
        # max_length None (TRL: no truncation): the batches' longest row is the longest example's
        self.row_length = args.max_length or max(
            len(e) for e in self.train_examples + trl_api.all_eval_examples(self.eval_examples))

    # ------------------------------------------------------------------ data
    def _tokenize(self, rows):
        from ...data import tokenize_example

        a = self.args
        with naming_rows(origins_of(rows)):
            return [tokenize_example(row, self.processor, index=i, max_length=a.max_length,
                                     truncation_mode=a.truncation_mode, completion_only_loss=a.completion_only_loss,
                                     assistant_only_loss=a.assistant_only_loss, dataset_text_field=a.dataset_text_field)
                    for i, row in enumerate(rows)]

    def _batches_of(self, examples, epoch, shuffle, batch_size, lazy=False, shard=False, train=True):
        """One epoch of prepared batches; lazy: callables that collate (decoding the images) and
        prepare a batch when the engine's data worker calls them. train=False: the evaluation set's
        (eval_packing; every batch kept)."""
        from ...data import make_batches

        a = self.args
        packing = a.packing if train or a.eval_packing is None else a.eval_packing
        plans = make_batches(examples, batch_size, packing=packing, packing_strategy=a.packing_strategy,
                             padding_free=a.padding_free, max_length=self.row_length,
                             pad_token_id=self.processor.pad_token_id, seq_buckets=a.seq_buckets,
                             shuffle=shuffle, seed=self.data_seed, epoch=epoch, lazy=True,
                             num_shards=self.world_size if shard else 1, shard=self.rank if shard else 0,
                             drop_last=a.dataloader_drop_last and train, pad_to_multiple_of=multiple_of(a))
        batches = [lambda plan=plan: self.prepare(plan()) for plan in plans]
        return batches if lazy else [make() for make in batches]

    def make_batches(self, epoch):
        return self._batches_of(self.train_examples, epoch, self.shuffles, self.args.per_device_train_batch_size,
                                lazy=True, shard=True)

    def prepare(self, batch) -> dict:
        """Batch -> the numpy arrays of one step: the trained rows (padded to a bucket so the
        compiled step sees few shapes) and their targets."""
        seg = batch.segment_ids
        targets = shift_targets(np.asarray(batch.labels), None if seg is None else np.asarray(seg))
        check_has_labels(targets, batch.example_ids)
        flat = targets.reshape(-1)
        rows = np.flatnonzero(flat != IGNORE_INDEX)
        # a compiled step sees few shapes when the row count is bucketed; eager needs no padding
        n_rows = quarter_octave(rows.size) if self.args.compile else rows.size
        padded_rows = np.zeros(n_rows, np.int32)
        padded_rows[: rows.size] = rows
        padded_targets = np.full(n_rows, IGNORE_INDEX, np.int32)
        padded_targets[: rows.size] = flat[rows]
        out = {"input_ids": np.asarray(batch.input_ids, np.int32),
               "rows": padded_rows, "targets": padded_targets,
               "num_tokens": int(np.asarray(batch.attention_mask).sum()), "trained_tokens": int(rows.size),
               "example_ids": list(batch.example_ids),
               # the real tokens, whose routing an MoE model's load-balancing loss averages
               "token_mask": np.asarray(batch.attention_mask, np.int32)}
        if seg is not None or not right_padded(batch.attention_mask):  # else causal attention is exact
            out["attention_mask"] = np.asarray(batch.attention_mask, np.int32)
        if seg is not None:
            out["segment_ids"] = np.asarray(seg, np.int32)
        if self.args.neftune_noise_alpha:  # TRL pads to the longest row: NEFTune's L
            longest = int(np.asarray(batch.attention_mask).sum(axis=1).max())
            width = self.model.language_model.config.hidden_size
            out["neftune_scale"] = np.array(self.args.neftune_noise_alpha / np.sqrt(longest * width), np.float32)
        if batch.pixel_values is not None:
            out["pixel_values"] = np.asarray(batch.pixel_values, np.float32)
            out["image_grid_thw"] = np.asarray(batch.image_grid_thw, np.int32)
        return out

    def batch_tokens(self, batch):
        """(real tokens, trained tokens): the loss is normalised by the trained tokens of the global batch."""
        return int(batch["num_tokens"]), int(batch["trained_tokens"])

    # ------------------------------------------------------------------ loss
    def loss(self, model, batch, normalizer):
        aux = []  # an MoE model's load-balancing loss (`engine.with_router_aux`)
        h = hidden_rows(model, batch, aux)
        t = batch["targets"]
        if self.args.head_mode == "differentiable":  # the general vocab-tiled head (4 matmuls)
            logp, ent, argmax = head_logprobs(h, model.lm_head_weight(), t, chunk_size=self.args.chunk_size,
                                              return_entropy=True, return_argmax=True, skip_ignored=False,
                                              weight_grad=self._head_trainable)
            return with_router_aux(*sft_loss(logp, t, loss_type=self.args.loss_type, num_items=normalizer,
                                             entropy=ent, argmax=argmax), aux, batch)
        # fused: loss, d_hidden and d_weight in one pass over row chunks (3 matmuls, as naive)
        loss, _, ent, argmax = fused_head_loss(h, model.lm_head_weight(), t, loss_type=self.args.loss_type,
                                               num_items=normalizer, skip_ignored=False,
                                               weight_grad=self._head_trainable)
        return with_router_aux(loss, token_metrics(t, ent, argmax), aux, batch)

    @property
    def compilable(self) -> bool:
        return self.args.head_mode != "two_phase"  # its head is evaluated chunk by chunk

    def step_function(self):
        if self.args.head_mode != "two_phase":
            return super().step_function()
        model, args = self.model, self.args

        def step(batch, normalizer):
            params = model.trainable_parameters()

            def trunk(p):
                model.update(p)
                return hidden_rows(model, batch)

            def head_weight(p):
                model.update(p)
                return model.lm_head_weight()

            loss, grads, (_, ent, argmax) = fused_value_and_grad(
                trunk, params, batch["targets"], head_weight=head_weight, loss_type=args.loss_type,
                num_items=normalizer, weight_grad=self._head_trainable)
            return loss, token_metrics(batch["targets"], ent, argmax), grads

        return step

    # ------------------------------------------------------------------ evaluation
    def tokenize_eval(self, rows) -> list:
        return self._tokenize(rows)

    def evaluation_metrics(self) -> dict:
        """The evaluation set's loss (un-prefixed; `evaluate()` names it eval_loss), and TRL's
        `compute_metrics` of its logits and labels when one was given (`eval_metrics`)."""
        if not self.eval_examples:
            return {}
        total, items, predictions, labels = 0.0, 0, [], []
        with eval_mode(self.model):
            for make in self._batches_of(self.eval_examples, 0, False, self.args.per_device_eval_batch_size,
                                         lazy=True, train=False):
                b = make()
                arrays = self.to_device(b)
                loss, _ = self.loss(self.model, arrays, mx.array(b["trained_tokens"], dtype=mx.float32))
                # transformers' evaluation loop: each batch's mean loss weighted by its rows (find_batch_size)
                total += loss.item() * b["input_ids"].shape[0]
                items += b["input_ids"].shape[0]
                if self.compute_metrics is not None:
                    labels.append(eval_metrics.labels_of(b))
                    logits = eval_metrics.batch_logits(self.model, arrays)
                    predictions.append(eval_metrics.preprocess(self.preprocess_logits_for_metrics, logits,
                                                               labels[-1]))
        out = {"loss": total / max(items, 1)}
        if self.compute_metrics is not None:
            out.update(eval_metrics.compute(self.compute_metrics, predictions, labels))
        return out
