"""RewardTrainer: an outcome reward model (a sequence classifier with one label) trained on preference pairs with
the Bradley-Terry loss, as TRL 1.16's RewardTrainer trains it, on the paired trainers' shared parts.

    model, processor = mlxrl.load("Qwen/Qwen3-0.6B", num_labels=1)     # or RewardTrainer(model="Qwen/...")
    trainer = RewardTrainer(model=model, processor=processor, args=RewardConfig(output_dir="rm"),
                            train_dataset=rows)      # chosen/rejected (and prompt, margin) rows
    trainer.train()                                  # rm/: a folder AutoModelForSequenceClassification loads

What TRL computes, and so what this computes: each pair's chosen and rejected sequences tokenised whole
(`data.reward`), one forward of the micro-batch's 2B sequences through the decoder, the `score` head
(`models.score`) applied only at each sequence's scored position (its last token that is not the pad token:
transformers' rule), and `losses.reward.bradley_terry_loss` (the rows' margin, center_rewards_coefficient).
The model given as a string loads as TRL loads it (`AutoModelForSequenceClassification`, num_labels=1): a causal
LM's folder gets a fresh score head. The pad token (`pad_token`, else the tokenizer's, else EOS) is written into
the model's config, so that the saved folder scores the same position in transformers.

LoRA (`use_peft`, or TRL's `peft_config`): PEFT's SEQ_CLS task type trains the score head whole beside the
adapters (its modules_to_save) and the adapter holds it (`base_model.model.score.weight`): `PeftModel` loads it
on transformers' classifier of the base.

Metrics (TRL's names): loss, min_reward / mean_reward / max_reward, accuracy, margin, num_tokens.

Tests: pytest tests/test_reward.py
"""

from __future__ import annotations

import mlx.core as mx

from ...errors import MlxrlError
from ...losses.reward import bradley_terry_loss
from ...models import score as score_lib
from ..forward import hidden_states, with_router_aux
from ..paired.trainer import PairedTrainer
from ..tokenizer_args import apply_tokenizer_args
from ..trl_fields import multiple_of
from .config import RewardConfig, check_reward_config

__all__ = ["RewardTrainer"]


class RewardTrainer(PairedTrainer):
    trainer_name = "reward"
    config_class = RewardConfig
    metric_names = ("loss", "min_reward", "mean_reward", "max_reward", "accuracy", "margin", "num_tokens")

    def check_args(self, args) -> None:
        check_reward_config(args)

    def check_model(self, model, processor, args) -> None:
        """A sequence classifier with one label (TRL refuses any other), before anything is built; the
        processor's template and EOS set (`eos_token`, `chat_template_path`) and the pad token written into
        the model's config."""
        if not score_lib.is_classifier(model):
            raise MlxrlError("RewardTrainer: the model has no sequence-classification head: load it with "
                             "mlxrl.load(path, num_labels=1), or pass its folder or Hub id as model=")
        labels = model.score.weight.shape[0]
        if labels != 1:
            raise MlxrlError(f"RewardTrainer: the model has num_labels={labels}, but a reward model outputs one "
                             "score per sequence: load it with num_labels=1")
        apply_tokenizer_args(processor, args)  # eos_token, chat_template_path
        self._pad = self._pad_token_id(processor, args)
        score_lib.set_pad_token_id(model, self._pad)

    def tokenize_pairs(self, rows, name):
        from ...data.reward import tokenize_reward_rows

        return tokenize_reward_rows(rows, self.processor, max_length=self.args.max_length, name=name)

    @property
    def pad_token_id(self) -> int:
        return self._pad

    def _pad_token_id(self, processor, args) -> int:
        tok = processor.tokenizer
        if args.pad_token is None and getattr(tok, "pad_token_id", None) is not None:
            return int(tok.pad_token_id)
        name = args.pad_token or tok.eos_token
        if name not in tok.get_vocab():
            raise MlxrlError(f"pad_token {name!r} is not in the tokenizer's vocabulary: use a token it has (e.g. "
                             f"{tok.eos_token!r})")
        return int(tok.convert_tokens_to_ids(name))

    def pair_batches(self, examples, epoch, shuffle, batch_size, shard=False):
        from ...data.reward import make_reward_batches

        a = self.args
        return make_reward_batches(examples, batch_size, pad_token_id=self.pad_token_id, max_length=a.max_length,
                                   seq_buckets=a.seq_buckets, padding_free=a.padding_free, shuffle=shuffle,
                                   seed=self.data_seed, epoch=epoch, num_shards=self.world_size if shard else 1,
                                   shard=self.rank if shard else 0, drop_last=a.dataloader_drop_last and shard,
                                   pad_to_multiple_of=multiple_of(a))

    def rewards(self, model, batch, aux: list | None = None) -> mx.array:
        """The 2B sequences' scores [2B] (chosen rows, then rejected), float32."""
        h = hidden_states(model, batch, aux)
        picked = h.reshape(-1, h.shape[-1])[batch["score_at"]]
        return score_lib.sequence_scores(model, picked)[:, 0]

    def loss(self, model, batch, normalizer):
        aux = []  # an MoE model's load-balancing loss (`forward.with_router_aux`)
        s = self.rewards(model, batch, aux)
        b = s.shape[0] // 2
        loss, metrics = bradley_terry_loss(s[:b], s[b:], batch.get("margin"), self.args.center_rewards_coefficient)
        return with_router_aux(loss * (b / normalizer), metrics, aux, batch)
