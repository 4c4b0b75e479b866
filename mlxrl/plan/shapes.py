"""One micro-batch's forward as the planner counts it (`Shape`): the positions its decoder runs, the
attention-score elements it keeps, the rows its head scores, for SFT, DPO (chosen + rejected) and GRPO (the
prompts once and their completions, or every row with its prompt); and which path runs the math
(`native_cpu`)."""

from __future__ import annotations

from dataclasses import dataclass

from .. import runtime
from ..cpu import native_kernels
from ..data.preference import row_bucket
from ..registry import scores_sequences, sequences_per_row, shape_of
from .report import dtype_bytes

DEFAULT_PROMPT_LENGTH = 512  # GRPO prompt tokens when --prompt_length is not given


@dataclass
class Shape:
    """One micro-batch's forward: `tokens` run through the decoder, `scores` attention score elements per
    head ([B, L, L] for B rows of L; GRPO's shared forward: the prompts' [n_p, P, P] plus each completion's
    [C, P + C]), `rows` positions scored by the head, `calls` the positions of each MLP call in a layer (the
    shared forward's prompt and completion passes). (The shared prompt's K/V repeated for each completion
    measured as no extra peak: they live one layer at a time, inside the backward temporaries.)"""

    tokens: int
    scores: int
    rows: int
    label: str = ""
    calls: tuple[int, ...] = ()  # positions per MLP call in a layer (default: all `tokens` in one)

def native_cpu(args) -> bool:
    """Whether mlxrl's native CPU kernels run this configuration's math (float32 on the CPU, the
    kernels built): its AdamW step updates in place and SFT's fused head is one kernel."""
    if runtime.default_device_kind() == "gpu" or dtype_bytes(args) != 4:
        return False
    return native_kernels()

def grpo_prompt_length(args, prompt_length: int | None = None) -> int:
    """Prompt tokens of a GRPO run (TRL 1.x has no max_prompt_length; --prompt_length, default 512),
    left-padded to the trainer's multiple of 32."""
    P = int(prompt_length or getattr(args, "max_prompt_length", None) or DEFAULT_PROMPT_LENGTH)
    return -(-P // 32) * 32

def causal_scores(args, L: int) -> int:
    """Attention-score elements per head of one SFT / DPO row of L tokens, in the units of
    `layer_saved_bytes` (SCORE_COPIES of them per element). Right-padded rows attend with "causal"
    (`data.batches.right_padded`); on the native CPU path that is the FlashAttention kernel
    (`fastmath.scaled_dot_product_attention`), which keeps no score array, forward or backward (its
    per-core block buffers are a few MB): 0. Packed or padding-free rows (a segment mask) and the graph
    path keep the [L, L] square (the graph path only until it tiles: `plan.model._layer_saved` swaps the
    square for the tiled attention's working set, `models.attention.tiled_working_bytes`)."""
    if getattr(args, "packing", False) or getattr(args, "padding_free", False) or not native_cpu(args):
        return L * L
    return 0

def forward_shape(args, trainer: str, extra_tokens: int = 0, prompt_length: int | None = None) -> Shape:
    """The forward of one micro-batch (extra_tokens: image tokens per sequence). prompt_length: GRPO's
    prompt tokens (default 512); DPO's prompt tokens per pair, which the head does not score (default 0:
    every token scored, an upper bound)."""
    L = int(getattr(args, "max_length", None) or 1024) + extra_tokens
    B = int(args.per_device_train_batch_size)
    # SFT trains every token of a row, image tokens included (TRL's collator keeps them as labels); DPO's
    # and GRPO's images belong to the prompt, which is not scored
    scored = L if shape_of(trainer) == "rows" else L - extra_tokens
    if shape_of(trainer) == "pairs":  # only the completions are scored: the prompt's tokens skip the head
        scored = max(1, scored - int(prompt_length or 0))
        n = sequences_per_row(trainer) * B
        if scores_sequences(trainer):  # a reward model scores one position per sequence
            scored = 1
        what = " (chosen + rejected)" if n == 2 * B else ""
        return Shape(n * L, n * causal_scores(args, L), n if scored == 1 else row_bucket(n * scored),
                     label=f"B={n}{what} L={L}" + (f", {scored} scored" if prompt_length else ""))
    if shape_of(trainer) == "groups":  # b completions; whole groups when b >= G, else a slice of one prompt's group
        P = grpo_prompt_length(args, prompt_length) + extra_tokens
        C = int(args.max_completion_length)
        n_p = max(1, B // int(args.num_generations))
        if not getattr(args, "shared_prompt", True):  # every completion row carries its own prompt
            return Shape(B * (P + C), B * (P + C) ** 2, B * C, label=f"B={B} L={P + C} (prompt not shared)")
        # the native CPU path's shared forward runs both attentions through the FlashAttention kernel
        # (shared_prompt: key windows, two calls merged by log-sum-exp): no score array
        scores = 0 if native_cpu(args) else n_p * P * P + B * C * (P + C)
        return Shape(n_p * P + B * C, scores, B * C,
                     label=f"{n_p} prompt(s) of {P} + {B} completions of {C} (prompt shared)", calls=(n_p * P, B * C))
    return Shape(B * L, B * causal_scores(args, L), B * scored, label=f"B={B} L={L}")

