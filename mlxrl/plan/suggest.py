"""The smallest change that makes a run fit: candidates ranked by how little they change the run."""

from __future__ import annotations

import dataclasses

from ..models.checkpointing import best_segments
from ..registry import shape_of
from .report import dtype_bytes


def _candidates(args, trainer: str, layers: int = 0):
    """Changes in the order of how little they change the run: same result (chunk size, the attention
    recomputed, the MLP in tiles, checkpointing, smaller micro-batches with more accumulation, the layers
    checkpointed in nested segments: one more forward), then 8-bit AdamW moments (full fine-tuning), bf16
    weights without a float32 master copy (stochastic rounding), a smaller adapter, LoRA instead of full
    fine-tuning, a shorter max_length, fewer generations, and last a 4-bit base (QLoRA)."""
    yield {"chunk_size": 1024}
    yield {"chunk_size": 256}
    if getattr(args, "keep_attention", False):
        yield {"keep_attention": False}
    if getattr(args, "tiled_mlp", None) is False:
        yield {"tiled_mlp": True}
    if not args.gradient_checkpointing:
        yield {"gradient_checkpointing": True}
    b = int(args.per_device_train_batch_size)
    accum = int(args.gradient_accumulation_steps or 1)
    while b > 1:
        b //= 2
        same = {"per_device_train_batch_size": b,
                "gradient_accumulation_steps": accum * (args.per_device_train_batch_size // b)}
        yield same
        if not args.gradient_checkpointing:
            yield {**same, "gradient_checkpointing": True}
    segments = best_segments(layers)  # the fewest layer inputs kept, then the fewest layers recomputed
    if segments and getattr(args, "checkpoint_segments", 0) != segments:
        change = {"checkpoint_segments": segments}
        if not args.gradient_checkpointing:
            change["gradient_checkpointing"] = True
        if getattr(args, "keep_attention", False):
            change["keep_attention"] = False
        yield change
    if not args.use_peft and getattr(args, "optim", "adamw_torch") in ("adamw_torch", "adamw_torch_fused"):
        yield {"optim": "adamw_8bit"}  # a quarter of AdamW's moments
    if dtype_bytes(args) != 4 and not args.use_peft and getattr(args, "master_weights", True):
        yield {"master_weights": False}
    if args.use_peft:
        r = int(args.lora_r)
        while r > 4:
            r //= 2
            yield {"lora_r": r}
    else:
        yield {"use_peft": True}
        yield {"use_peft": True, "gradient_checkpointing": True}
    L = getattr(args, "max_length", None)
    if L:
        while L > 64:
            L //= 2
            yield {"max_length": L}
    if shape_of(trainer) == "groups":
        g = int(args.num_generations)
        while g > 2:
            g //= 2
            yield {"num_generations": g}
    if not (getattr(args, "load_in_4bit", False) or getattr(args, "load_in_8bit", False)):
        yield {"load_in_4bit": True, "use_peft": True}  # a frozen 4-bit base under LoRA adapters (QLoRA)


LENGTH_STEP = 256  # a suggested max_length is a multiple of this (above it)


def _longest_max_length(total, fits: int, fails: int, limit: int, t: int) -> tuple[dict, int]:
    """The longest max_length predicted within `limit` between `fits` and `fails` (the candidates halve
    max_length: the first that fits can be half of what the memory allows), a multiple of LENGTH_STEP
    above `fits`. The peak grows with the length, so a bisection over the multiples finds it."""
    best, k_lo, k_hi = fits, fits // LENGTH_STEP, -(-fails // LENGTH_STEP)  # k_lo * STEP fits, k_hi * STEP not
    while k_hi - k_lo > 1:
        k = (k_lo + k_hi) // 2  # k * STEP > best: every k tried is above k_lo, whose multiple is <= fits
        tk = total({"max_length": k * LENGTH_STEP})
        if tk is not None and tk <= limit:
            k_lo, best, t = k, k * LENGTH_STEP, tk
        else:
            k_hi = k
    return {"max_length": best}, t


def suggest_change(predict, cfg: dict, args, trainer: str, limit: int | None, **kw) -> tuple[dict | None, int | None]:
    """The first candidate change (least disruptive first) whose predicted peak is within `limit`; when no
    single change is enough, candidates are combined greedily in the same order (each kept if it helps)."""
    if limit is None:
        return None, None

    def total(change):
        try:
            return predict(cfg, dataclasses.replace(args, **change), trainer, memory_limit=limit, suggest=False,
                           **kw).total
        except ValueError:
            return None

    longer = getattr(args, "max_length", None)  # the last max_length that did not fit
    layers = int({**cfg, **cfg.get("text_config", {})}.get("num_hidden_layers", 0) or 0)
    for change in _candidates(args, trainer, layers):
        t = total(change)
        if set(change) == {"max_length"}:
            if t is not None and t <= limit:
                return _longest_max_length(total, change["max_length"], longer, limit, t)
            longer = change["max_length"]
        elif t is not None and t <= limit:
            return change, t
    combined, best = {}, predict(cfg, args, trainer, memory_limit=limit, suggest=False, **kw).total
    for change in _candidates(args, trainer, layers):
        trial = {**combined, **change}  # a later, stronger value of the same knob replaces the earlier one
        t = total(trial)
        if t is not None and t < best:
            combined, best = trial, t
            if best <= limit:
                return combined, best
    return None, None
