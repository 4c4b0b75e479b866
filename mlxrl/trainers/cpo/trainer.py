"""CPOTrainer: contrastive preference optimisation (Xu et al. 2024) and its variants SimPO and AlphaPO, as
trl.experimental.cpo defines them, on the paired trainers' shared parts: no reference model, one forward of the
micro-batch's chosen and rejected rows.

    trainer = CPOTrainer(model=model, processor=processor, args=CPOConfig(output_dir="out", loss_type="simpo",
                         cpo_alpha=0.0), train_dataset=rows)
    trainer.train()

What TRL computes, and so what this computes (`losses.reference_free.cpo_loss`): each answer's summed completion
log-probs (sigmoid, hinge) or their mean per token (ipo, simpo); the chosen completions' mean token NLL times
cpo_alpha (TRL's labels mask the prompt); the loss of `loss_type`, alpha's reward shape where alpha != 0. The rows
are tokenised as trl.experimental tokenises them (`append_eos`).

Metrics (TRL's names): rewards/chosen|rejected|accuracies|margins, logps/chosen|rejected, logits/chosen|rejected,
nll_loss, and the paired trainers' entropy, mean_token_accuracy, num_tokens. logits/*: as ORPO's (`orpo.trainer`).

Tests: pytest tests/test_reference_free_trainers.py
"""

from __future__ import annotations

import mlx.core as mx

from ...losses.reference_free import cpo_averages, cpo_loss
from ..forward import with_router_aux
from ..paired.trainer import PairedTrainer
from .config import CPOConfig, check_cpo_config

__all__ = ["CPOTrainer"]


class CPOTrainer(PairedTrainer):
    trainer_name = "cpo"
    config_class = CPOConfig
    append_eos = True
    metric_names = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                    "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected", "nll_loss", "entropy",
                    "mean_token_accuracy", "num_tokens")

    def check_args(self, args) -> None:
        check_cpo_config(args)

    def loss(self, model, batch, normalizer):
        a = self.args
        aux = []  # an MoE model's load-balancing loss (`forward.with_router_aux`)
        out = self.paired_forward(model, batch, aux)
        b = out.b
        logps = out.means(batch) if cpo_averages(a.loss_type) else out.sums(batch)
        chosen = mx.stop_gradient(batch["seq_mask"][:b].sum(0))          # [R] the chosen completions' positions
        loss, metrics = cpo_loss(logps[:b], logps[b:], out.nll(chosen), loss_type=a.loss_type, beta=a.beta,
                                 label_smoothing=a.label_smoothing, simpo_gamma=a.simpo_gamma,
                                 cpo_alpha=a.cpo_alpha, alpha=a.alpha)
        metrics.update(self.pair_metrics(out, batch))
        return with_router_aux(loss * (b / normalizer), metrics, aux, batch)
