"""ORPOTrainer: odds-ratio preference optimisation (Hong et al. 2024) as trl.experimental.orpo defines it, on the
paired trainers' shared parts: no reference model, one forward of the micro-batch's chosen and rejected rows.

    trainer = ORPOTrainer(model=model, processor=processor, args=ORPOConfig(output_dir="out", use_peft=True),
                          train_dataset=rows)      # prompt/chosen/rejected rows, text or vision
    trainer.train()

What TRL computes, and so what this computes (`losses.reference_free.orpo_loss`): each answer's mean completion
log-prob per token; the NLL of the chosen rows over every token after the first, prompt included (TRL's labels are
the whole chosen input); loss = NLL - beta * mean(log sigmoid(log odds ratio)). The rows are tokenised as
trl.experimental tokenises them (`append_eos`: an EOS after a chat template's closing newline).

Metrics (TRL's names): rewards/chosen|rejected|accuracies|margins, logps/chosen|rejected, logits/chosen|rejected,
nll_loss, log_odds_ratio, log_odds_chosen, and the paired trainers' entropy, mean_token_accuracy, num_tokens.
logits/* are the mean logit at the scored completion positions; TRL's is the mean over its padded [B, L, V]
logits tensor, padding included, which depends on its batch's padding and is not reproduced.

Tests: pytest tests/test_reference_free_trainers.py
"""

from __future__ import annotations

from ...losses.reference_free import orpo_loss
from ..forward import with_router_aux
from ..paired.trainer import PairedTrainer
from .config import ORPOConfig, check_orpo_config

__all__ = ["ORPOTrainer"]


class ORPOTrainer(PairedTrainer):
    trainer_name = "orpo"
    config_class = ORPOConfig
    append_eos = True
    score_chosen_prompts = True
    metric_names = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                    "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected", "nll_loss",
                    "log_odds_ratio", "log_odds_chosen", "entropy", "mean_token_accuracy", "num_tokens")

    def check_args(self, args) -> None:
        check_orpo_config(args)

    @property
    def pad_token_id(self) -> int:
        return self.processor.pad_token_id if self.args.padding_value is None else int(self.args.padding_value)

    def loss(self, model, batch, normalizer):
        aux = []  # an MoE model's load-balancing loss (`forward.with_router_aux`)
        out = self.paired_forward(model, batch, aux)
        means, b = out.means(batch), out.b
        loss, metrics = orpo_loss(means[:b], means[b:], out.nll(batch["nll_mask"]), beta=self.args.beta)
        metrics.update(self.pair_metrics(out, batch))
        return with_router_aux(loss * (b / normalizer), metrics, aux, batch)
