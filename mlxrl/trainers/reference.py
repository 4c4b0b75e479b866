"""A trainer's reference policy (DPO, GRPO, KTO), resolved once from what the user gave.

In order:

* a model object (`ref_model=`), or a path / Hub id in the config (`args.ref_model`, loaded with `mlxrl.load` in
  the run's dtype): frozen and in eval mode;
* LoRA (`use_peft`, or a policy that already carries LoRA / DoRA layers: TRL's PeftModel passed in) without one:
  the policy itself with its adapters switched off (`models.reference.adapters_disabled`: no second copy of the
  weights; TRL does the same with PEFT's `disable_adapter`);
* reference log-probs precomputed before training (`precomputed`): the policy before its first step, used once;
  nothing is kept;
* full fine-tuning without any of these: a frozen copy of the initial weights (`models.reference.frozen_copy`:
  what TRL does by loading the model a second time). It shares the weight arrays at first (MLX arrays are
  immutable) and costs one more copy of the weights as the policy moves away from them.

`scope()` yields the model to run for reference log-probs; the caller stops gradients and evaluates.
"""

from __future__ import annotations

import contextlib

from ..models.lora import lora_layers
from ..models.reference import adapters_disabled, frozen_copy

__all__ = ["Reference"]


class Reference:
    def __init__(self, policy, ref_model=None, *, path: str | None = None, dtype=None, lora: bool = False,
                 precomputed: bool = False, needed: bool = True):
        self.check_distinct(policy, ref_model)
        self.policy = policy
        if not needed:
            ref_model = None
        elif ref_model is None and path:
            from ..loading import load

            ref_model, _ = load(path, dtype=dtype)
        if ref_model is not None:
            ref_model.freeze()
            ref_model.eval()
        elif needed and not lora and not precomputed and not lora_layers(policy):
            ref_model = frozen_copy(policy)  # see the module docstring for its cost
        self.model = ref_model
        self.needed = needed

    @staticmethod
    def check_distinct(policy, ref_model) -> None:
        """Refuse the policy passed as its own reference (before the trainer touches either)."""
        if ref_model is not None and ref_model is policy:
            raise ValueError("model and ref_model are the same object: omit ref_model (LoRA switches the adapters "
                             "off, full fine-tuning keeps a frozen copy)")

    @contextlib.contextmanager
    def scope(self):
        """The model whose log-probs are the reference's: the separate (or frozen) model, else the policy with
        its adapters off (LoRA), or as it is (before training, for precomputed log-probs)."""
        if self.model is not None:
            yield self.model
        else:
            with adapters_disabled(self.policy) as model:
                yield model
