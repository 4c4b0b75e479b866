"""RLOOTrainer: TRL 1.16's REINFORCE leave-one-out trainer, on GRPO's rollout machinery (`GRPOTrainer`: prompts,
shared-prefill generation, reward functions and reward models, VL prompts, the shared-prompt training forward,
rounds, checkpoints).

    trainer = RLOOTrainer(model=model, processor=processor, reward_funcs=[correct],
                          args=RLOOConfig(output_dir="out", use_peft=True), train_dataset=rows)
    trainer.train()

What differs from GRPO, as TRL's RLOOTrainer computes it: right after a round is generated, the old log-probs are
always computed (the loss's ratio is taken against them) and, with beta != 0, the reference's; each completion's
KL to the reference, sum_t (logp_old - logp_ref), is subtracted from its reward times beta before the advantages;
the advantages take the leave-one-out baseline (the mean of the other completions of the prompt), optionally
normalised over the round (`losses.rloo.rloo_advantages`). The loss is per sequence, the ratio of summed
log-probs clipped to [1 - epsilon, 1 + epsilon_high] (`losses.rloo.rloo_loss`), a mean over the micro-batch's
completions, divided by grad_accum as TRL's Trainer divides it.

Metrics (TRL's names): reward, reward_std, rewards/<func>/mean|std, frac_reward_zero_std, kl (beta != 0: the mean
per-token log-ratio over the round), completions/*, entropy, clip_ratio/low_mean|low_min|high_mean|high_max|
region_mean, num_tokens, plus loss, grad_norm, learning_rate.

Tests: pytest tests/test_rloo.py
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ...errors import MlxrlError
from ...losses.rloo import rloo_advantages, rloo_loss
from ..forward import with_router_aux
from ..grpo.trainer import GRPOTrainer, finite_items
from .config import RLOOConfig, check_rloo_config

__all__ = ["RLOOConfig", "RLOOTrainer"]


class RLOOTrainer(GRPOTrainer):
    trainer_name = "rloo"
    config_class = RLOOConfig
    check_args = staticmethod(check_rloo_config)
    def __init__(self, *a, **kw):
        for name in ("tools", "environment_factory", "rollout_func"):
            if kw.get(name) is not None:
                raise MlxrlError(f"RLOOTrainer({name}=...): TRL's RLOOTrainer has no {name}; GRPOTrainer takes it")
        super().__init__(*a, **kw)
        self.needs_old_logps = True  # TRL's RLOO always takes its ratio against the generating weights' log-probs

    @property
    def token_sum_loss(self) -> bool:
        return False

    def round_advantages(self, rewards: np.ndarray, micro: list[dict]) -> tuple[np.ndarray, dict]:
        """Leave-one-out advantages over the whole round (every rank's groups), the KL penalty folded into the
        rewards first (`losses.rloo`)."""
        a = self.args
        n_local = len(rewards)
        kl = None
        extra = {}
        if a.beta != 0:
            per_token = [(mb["old_logps"] - mb["ref_logps"]) * mb["completion_mask"] for mb in micro]
            kl = self._gather(np.concatenate([t.sum(axis=1) for t in per_token]).astype(np.float32))
            totals = self._gather(np.array([[sum(float(t.sum()) for t in per_token),
                                             sum(float(mb["completion_mask"].sum()) for mb in micro)]]))
            extra["kl"] = float(totals[:, 0].sum() / max(totals[:, 1].sum(), 1.0))
        advantages, metrics = rloo_advantages(mx.array(self._gather(rewards)), self.G,
                                              reward_weights=a.reward_weights,
                                              kl=None if kl is None else mx.array(kl), beta=a.beta,
                                              reward_clip_range=a.reward_clip_range,
                                              normalize_advantages=a.normalize_advantages,
                                              reward_names=self.reward_func_names)
        return np.array(advantages)[self.rank * n_local:(self.rank + 1) * n_local], {**finite_items(metrics),
                                                                                      **extra}

    def loss(self, model, batch, normalizer):
        a = self.args
        aux = []  # an MoE model's load-balancing loss (`forward.with_router_aux`)
        logps, entropy = self.policy_logps(model, batch, aux=aux)
        loss, metrics = rloo_loss(logps, batch.get("old_logps"), batch["advantages"], batch["completion_mask"],
                                  epsilon=a.epsilon, epsilon_high=a.epsilon_high, entropy=entropy)
        return with_router_aux(loss / normalizer, metrics, aux, batch)
