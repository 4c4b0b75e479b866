"""The chosen / rejected trainers' shared parts (DPO, ORPO, CPO): the preference rows, their batches, and one
forward of a micro-batch's 2B sequences with the streamed LM head.

A trainer on it declares its config class and its loss; everything about the data is here:

* rows: TRL's preference formats (`data.preference.tokenize_preference`: explicit or implicit prompt, strings or
  conversations, images with the prompt), truncated to `max_length`; rows whose prompt alone fills it are dropped
  with a count. `append_eos` (ORPO, CPO) selects trl.experimental's tokenisation, which appends EOS to every
  completion not ending with it;
* batches: B pairs are ONE forward of 2B sequences (chosen rows, then rejected rows), padded to length buckets or
  padding-free, sharded over the data-parallel ranks; `score_chosen_prompts` (ORPO) scores the chosen rows'
  prompt positions too, for an NLL over the whole chosen sequence;
* `paired_forward`: the hidden states at the scored positions only, `head_logprobs` over them (never
  [tokens, vocab] logits), with entropy and argmax; per-sequence sums by a [2B, R] 0/1 matrix
  (`Paired.sums`), means by the completion token counts;
* the metrics every one of them logs (entropy, mean_token_accuracy, logits/chosen|rejected: the mean logit over
  the vocabulary at the scored completion positions, exact via the mean weight row, no [R, V] tile);
* evaluation: the loss and metrics over the evaluation pairs, pair-weighted.

The engine normalises by `batch_tokens(...)[1]`, the pair count: a loss that is a mean over the micro-batch's b
pairs is scaled by b / normalizer, so that with gradient accumulation the step's loss is the mean over all its
pairs (TRL divides by the accumulation steps: the same for equal micro-batches).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import mlx.core as mx

from ...data.files import naming_rows, origins_of, rows_fingerprint
from ...losses.head import head_logprobs
from ...models.dropout import eval_mode
from .. import trl_api
from ..engine import Trainer, hidden_rows
from ..trl_fields import multiple_of

__all__ = ["Paired", "PairedTrainer"]


@dataclass
class Paired:
    """One forward of 2B sequences: per scored position the log-prob of its target, entropy and argmax; `h` and
    `weight` for metrics that need the hidden states; `b` pairs."""

    logp: mx.array       # [R]
    entropy: mx.array    # [R]
    argmax: mx.array     # [R]
    h: mx.array          # [R, D]
    weight: mx.array     # [V, D]
    b: int

    def sums(self, batch: dict, key: str = "seq_weights") -> mx.array:
        """Summed completion log-probs [2B] (chosen rows, then rejected)."""
        return batch[key] @ self.logp

    def means(self, batch: dict) -> mx.array:
        """Mean completion log-prob per token [2B] (TRL's average_log_prob)."""
        counts = mx.concatenate([batch["chosen_counts"], batch["rejected_counts"]])
        return self.sums(batch, "seq_mask") / mx.maximum(counts, 1.0)

    def nll(self, mask: mx.array) -> mx.array:
        """Mean token NLL over the positions `mask` [R] marks."""
        return -(self.logp * mask).sum() / mx.maximum(mask.sum(), 1.0)


class PairedTrainer(Trainer):
    config_class: type = None          # each trainer's config (TRL's class of the same name)
    append_eos: bool = False           # trl.experimental's tokenisation (module docstring)
    score_chosen_prompts: bool = False  # ORPO's NLL over the chosen rows' prompts too

    def __init__(self, model, processor=None, args=None, train_dataset=None, eval_dataset=None, **trl):
        """mlxrl's (model, processor, args, ...) or TRL's keywords (`trl_api`: model as a Hub id or folder,
        processing_class, peft_config)."""
        who = type(self).__name__
        model, processor, args, train_dataset, eval_dataset, _ = trl_api.resolve(
            self, who, self.config_class, model, processor, args, train_dataset, eval_dataset, trl)
        self.check_args(args)
        self.check_model(model, processor, args)
        if train_dataset is None:
            raise ValueError(f"{who} needs a train_dataset (rows with prompt/chosen/rejected or chosen/rejected)")
        if args.disable_dropout and args.use_peft and args.lora_dropout:
            args = dataclasses.replace(args, lora_dropout=0.0)  # TRL's disable_dropout reaches LoRA's dropout too
        super().__init__(model, processor, args)
        self._head_trainable = self.head_trainable
        self.rows_fingerprint = rows_fingerprint(train_dataset)  # what a checkpoint's data position refers to
        self.row_origins = origins_of(train_dataset)
        self.train_examples = self.tokenize_pairs(train_dataset, "train")
        self.eval_examples = trl_api.eval_sets(eval_dataset, self.tokenize_eval)
        self.eval_origins = trl_api.eval_origins(eval_dataset)

    def check_args(self, args) -> None:
        """The config's own checks (one-line ValueErrors), before anything is built."""

    def check_model(self, model, processor, args) -> None:
        """What the trainer needs of the model and processor (one-line errors), before anything is built."""

    # ------------------------------------------------------------------ data
    @property
    def pad_token_id(self) -> int:
        return self.processor.pad_token_id

    def tokenize_pairs(self, rows, name):
        from ...data.preference import tokenize_preference

        a = self.args
        with naming_rows(origins_of(rows)):
            out = [tokenize_preference(row, self.processor, index=i, max_length=a.max_length,
                                       truncation_mode=getattr(a, "truncation_mode", "keep_start"),
                                       append_eos=self.append_eos) for i, row in enumerate(rows)]
        kept = [e for e in out if e is not None]
        if len(kept) < len(out):
            print(f"{name}: dropped {len(out) - len(kept)} of {len(out)} pairs whose prompt alone fills "
                  f"max_length={a.max_length}", flush=True)
        if not kept:
            raise ValueError(f"{name} dataset: no pair left (every prompt fills max_length={a.max_length})")
        return kept

    def pair_batches(self, examples, epoch, shuffle, batch_size, shard=False):
        from ...data.preference import make_preference_batches

        a = self.args
        return make_preference_batches(examples, batch_size, max_length=a.max_length,
                                       pad_token_id=self.pad_token_id, seq_buckets=a.seq_buckets,
                                       padding_free=a.padding_free, shuffle=shuffle, seed=self.data_seed,
                                       epoch=epoch, ld_alpha=getattr(a, "ld_alpha", None), bucket_rows=a.compile,
                                       num_shards=self.world_size if shard else 1, shard=self.rank if shard else 0,
                                       drop_last=a.dataloader_drop_last and shard,
                                       pad_to_multiple_of=multiple_of(a),
                                       score_chosen_prompts=self.score_chosen_prompts)

    def make_batches(self, epoch):
        return self.pair_batches(self.train_examples, epoch, self.shuffles, self.args.per_device_train_batch_size,
                                shard=True)

    def batch_tokens(self, batch):
        """(real tokens of the 2B sequences, pairs): the engine's normaliser is the pair count."""
        return int(batch["num_tokens"]), int(batch["num_pairs"])

    def tokenize_eval(self, rows) -> list:
        return self.tokenize_pairs(rows, "eval")

    # ------------------------------------------------------------------ the forward
    def sequence_logps(self, model, arrays, *, mask_key="seq_weights"):
        """Summed completion log-probs [2B] of `model` (no gradient intended: the caller's choice)."""
        h = hidden_rows(model, arrays)
        logp = head_logprobs(h, model.lm_head_weight(), arrays["targets"], chunk_size=self.args.chunk_size,
                             skip_ignored=False)
        return arrays[mask_key] @ logp

    def paired_forward(self, model, batch, aux: list | None = None) -> Paired:
        """The micro-batch's 2B sequences through the trunk and the streamed head (aux: an MoE model's
        load-balancing loss, `forward.with_router_aux`)."""
        h = hidden_rows(model, batch, aux)                              # [R, D]
        weight = model.lm_head_weight()
        logp, ent, argmax = head_logprobs(h, weight, batch["targets"], chunk_size=self.args.chunk_size,
                                          return_entropy=True, return_argmax=True, skip_ignored=False,
                                          weight_grad=self._head_trainable)
        return Paired(logp, ent, argmax, h, weight, int(batch["seq_mask"].shape[0]) // 2)

    def pair_metrics(self, out: Paired, batch: dict) -> dict:
        """entropy (completion tokens of both answers), mean_token_accuracy (chosen completion tokens),
        logits/chosen|rejected (the mean logit over the vocabulary at each side's completion positions)."""
        b = out.b
        mask = mx.stop_gradient(batch["seq_mask"])                        # [2B, R]
        scored, chosen = mask.sum(0), mask[:b].sum(0)                     # [R] 0/1
        rejected = mask[b:].sum(0)
        ent = mx.stop_gradient(out.entropy)
        hit = (out.argmax == batch["targets"]).astype(mx.float32)
        # mean over the vocabulary of the logits = h . mean(W): exact, no [R, V] tile
        mean_logit = mx.stop_gradient(out.h.astype(mx.float32) @ out.weight.astype(mx.float32).mean(0))
        return {"entropy": (ent * scored).sum() / mx.maximum(scored.sum(), 1.0),
                "mean_token_accuracy": (hit * chosen).sum() / mx.maximum(chosen.sum(), 1.0),
                "logits/chosen": (mean_logit * chosen).sum() / mx.maximum(chosen.sum(), 1.0),
                "logits/rejected": (mean_logit * rejected).sum() / mx.maximum(rejected.sum(), 1.0)}

    # ------------------------------------------------------------------ evaluation
    def evaluation_metrics(self) -> dict:
        """The evaluation pairs' loss and metrics (un-prefixed; `evaluate()` adds eval_), pair-weighted."""
        if not self.eval_examples:
            return {}
        sums, pairs = {}, 0
        with eval_mode(self.model):
            for batch in self.pair_batches(self.eval_examples, 0, False, self.args.per_device_eval_batch_size):
                arrays = self.gradient_free_inputs(self.to_device(batch))
                b = batch["num_pairs"]
                loss, metrics = self.loss(self.model, arrays, mx.array(b, dtype=mx.float32))
                for k, v in {"loss": loss, **metrics}.items():
                    sums[k] = sums.get(k, 0.0) + v.item() * b
                pairs += b
        return {k: v / max(pairs, 1) for k, v in sums.items()}
