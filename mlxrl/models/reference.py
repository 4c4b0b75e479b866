"""The reference policy of DPO and GRPO: the same model with its adapters off (LoRA), or a frozen copy."""

from __future__ import annotations

import contextlib

from mlx.utils import tree_flatten, tree_unflatten

from . import lora as lora_lib

__all__ = ["adapters_disabled", "frozen_copy"]


@contextlib.contextmanager
def adapters_disabled(model):
    """Run `model` as its base: every LoRA / DoRA layer is swapped for its wrapped base Linear for
    the duration (exact: the base layer's own output, DoRA's magnitude not applied) and put back
    afterwards. Shares every weight: nothing is copied."""
    layers = lora_lib.lora_layers(model)
    model.update_modules(tree_unflatten([(p, m.linear) for p, m in layers]))
    try:
        yield model
    finally:
        model.update_modules(tree_unflatten(layers))


def frozen_copy(model):
    """A frozen, eval-mode model with the same config and (initially shared, immutable) weights."""
    from . import build_model

    ref = build_model(model.config)
    ref.load_weights(list(tree_flatten(model.parameters())), strict=True)
    ref.freeze()
    ref.eval()
    ref.name_or_path = getattr(model, "name_or_path", None)
    return ref
