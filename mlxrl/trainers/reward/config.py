"""RewardConfig: TRL 1.16's reward-modelling fields on top of the paired trainers' `PairedConfig`, and their
checks."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import _f, check_config, refused
from ..paired.config import PairedConfig

__all__ = ["RewardConfig", "check_reward_config", "SCORE_TASK"]

SCORE_TASK = "SEQ_CLS"  # PEFT's task type whose adapters train the classifier's head too (its modules_to_save)


@dataclass
class RewardConfig(PairedConfig):
    """TRL 1.16's RewardConfig fields (names and defaults); a field mlxrl does not support is refused in one line
    when set to anything but its default."""

    learning_rate: float = _f(1e-4, "peak learning rate of AdamW (TRL's RewardConfig default)")
    max_length: int | None = _f(1024, "drop the pairs whose chosen or rejected sequence has more tokens (TRL "
                                      "filters, never truncates)")
    center_rewards_coefficient: float | None = _f(None, "weight of mean((chosen + rejected)^2) in the loss. It "
                                                        "pulls the rewards towards zero mean (recommended: 0.01)")
    eos_token: str | None = _f(None, "the end-of-sequence token appended to string rows (default: the "
                                     "tokenizer's)")
    chat_template_path: str | None = _f(None, "a .jinja / .j2 chat template file, or a local tokenizer folder "
                                              "whose template (and eos token) to use")
    pad_token: str | None = _f(None, "the padding token (deprecated in TRL). The classifier scores each row's last "
                                     "token that is not it (default: the tokenizer's pad token, else EOS)")
    lora_task_type: str = _f(SCORE_TASK, "PEFT's task type. SEQ_CLS (mlxrl's default, as TRL's reward docs "
                                         "ask) also trains the score head whole (modules_to_save); "
                                         "CAUSAL_LM leaves it as loaded unless lora_modules_to_save names it",
                             choices=(SCORE_TASK, "CAUSAL_LM"))
    lora_modules_to_save: list[str] | None = _f(None, "modules trained whole beside the adapters, saved in the "
                                                      "adapter (PEFT's modules_to_save): score")
    activation_offloading: bool = refused(False, "MLX has unified memory; use gradient_checkpointing")

    def trained_whole(self) -> list[str]:
        """The modules a LoRA run trains whole beside the adapters (PEFT's modules_to_save): the score head with
        SEQ_CLS (PEFT adds it) or when named."""
        names = list(self.lora_modules_to_save or [])
        if self.lora_task_type == SCORE_TASK and "score" not in names:
            names.append("score")
        return names

    def load_options(self) -> dict:
        """`mlxrl.load`'s keywords: a sequence classifier with one label (TRL's num_labels=1)."""
        return {**super().load_options(), "num_labels": 1}


def check_reward_config(args: RewardConfig) -> None:
    """One-line ValueErrors for unsupported or inconsistent settings."""
    check_config(args)  # types, ranges, choices and the refused TRL fields
    other = [m for m in args.lora_modules_to_save or [] if m not in ("score", "classifier")]
    if other:
        raise ValueError(f"lora_modules_to_save {other}: only the classifier's head (score) can be trained whole "
                         "beside the adapters")
    if args.center_rewards_coefficient is not None and args.center_rewards_coefficient < 0:
        raise ValueError(f"center_rewards_coefficient must be >= 0, got {args.center_rewards_coefficient}")
