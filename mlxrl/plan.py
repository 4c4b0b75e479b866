"""Memory planner: predict a run's peak memory from config.json alone, before training starts.

    python -m mlxrl.plan --model Qwen/Qwen3-VL-2B-Instruct --use_peft --max_length 2048
    python -m mlxrl.plan --trainer dpo --per_device_train_batch_size 2 --memory_limit 8GB
    python -m mlxrl.plan --measure            # a few real steps on random weights: predicted vs measured
    python -m mlxrl.plan --measure --sweep    # plus the memory impact of max_length and LoRA rank

The trainers' own flags are accepted (`--trainer sft|dpo|grpo` picks the config class). No weights are
read: the model is built lazily from config.json (MLX arrays are not allocated until evaluated), which
gives exact parameter counts for the base, LoRA adapters and every trainable subset.

The model of one optimizer step (all sizes in bytes; s = bytes per element of the compute dtype):

* persistent: weights W, AdamW m and v (2T, T = trainable bytes), and for full-parameter DPO / GRPO
  with beta > 0 the frozen reference's copy of the trainable weights (T, once the policy moved);
* forward + backward: the gradients (T; 2T with gradient accumulation), activations, the streamed head;
* the optimizer update: AdamW (the native CPU step, or the graph path's three single-output kernels)
  updates in place with the clip scale folded in: the gradients only (T); Adafactor: gradients +
  clipped gradients (2T) + about two copies of the largest trained array.
The peak is the larger of the two phases. Activations per decoder layer, measured on MLX 0.32 (CPU):
saved tensors of ~(4D + 5I + 4 H*hd + 3 KV*hd) elements per token (norm inputs/outputs, q/k/v before
and after q/k-norm and rotary, attention output, gate/up/silu/product) plus ~1.25 [B, H, L, L] score
tensors (MLX's unfused attention with a mask keeps the probabilities); without checkpointing n_layers
of them live at once plus ~1.1 layer of backward temporaries, with checkpointing one [B, L, D] input
per layer plus ~2.9 layers (the recompute and its backward). The streamed head keeps a few
[rows, chunk] float32 tiles; a trained LM head adds ~2 [V, D] arrays (the tile gradients and their
concatenation), a frozen one a [V, D] zero gradient (what its VJP returns). SFT's fused head on the
native kernel: one [V, D] weight gradient (none when frozen) and one [chunk rows, V] tile; on the
graph path: about five [rows, V] tiles, a trained head's vocab-tile pieces next to the gradient, and a
bf16 weight's float32 copy (trained) or [chunk, D] slices (frozen). The graph path in bf16: float32
casts of each LoRA-adapted input. Images: image tokens join the decoder's sequence (never scored) and
the vision tower's saved tensors and per-image attention scores, checked on the embedded Qwen3-VL
(SFT and GRPO).

`predict(config, args, trainer)` is what the trainers call at start-up; `measure(...)` runs real steps.
Tests: pytest tests/test_plan.py
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx  # mlxrl/__init__ has loaded the fast BLAS (runtime) before this

from . import runtime

GB = 1 << 30
MB = 1 << 20
TILE_BYTES = 16 << 20  # mlxrl.losses.head.TILE_BYTES (kept here so planning imports no trainer)
ROW_TILE_BYTES = 160 << 20  # mlxrl.losses.head.ROW_TILE_BYTES: the native fused head's row chunk
GRAPH_ROW_TILE_BYTES = 48 << 20  # mlxrl.losses.head.GRAPH_ROW_TILE_BYTES: the graph fused head's row chunk

# measured coefficients (see the module docstring)
SAVED_PER_TOKEN = {"D": 4, "I": 5, "Q": 4, "KV": 3}
SCORE_COPIES = 1.25
BACKWARD_LAYERS = 1.45      # backward temporaries without checkpointing, in layers
CKPT_LAYERS = 2.75          # live layers during a checkpointed layer's recompute + backward
GRPO_CKPT_LAYERS = 2.25     # the same in GRPO's prompt-shared layer (measured with the fused head)
HEAD_TILES = 7.0            # live [rows, chunk] fp32 tiles of the streamed head (compiled step)
LORA_SAVED = 0.85           # LoRA keeps less per layer (frozen base weights need no input for a weight grad)
UPDATE_COPIES = 2.0         # copies of the largest trained array during the AdamW update
NATIVE_UPDATE = 0.0         # the same with the native in-place AdamW step
KV_STEP = 256               # mlx-lm KVCache allocation step (positions)
GEN_LOGIT_COPIES = 4.0      # [G, V] float32 arrays alive while a decoding step samples
GEN_FILTER_COPIES = 2.25    # more of them with top_k / top_p / min_p (a mask and the filtered weights)
DEFAULT_PROMPT_LENGTH = 512  # GRPO prompt tokens when --prompt_length is not given


# ---------------------------------------------------------------------------------------- config

def load_config(model: str | os.PathLike | None = None) -> dict:
    """config.json of a local folder or cached Hub id (weights are never read); None: the embedded default."""
    from .loading import DEFAULT_CONFIG, read_config

    if model is None:
        cfg = json.loads(Path(DEFAULT_CONFIG).read_text())
    else:
        from .hub import resolve_model_path

        p = Path(model).expanduser()
        cfg = read_config(p if (p / "config.json").exists() else resolve_model_path(str(model)))
    cfg.pop("preprocessor_config", None)
    return cfg


def _dtype_bytes(args) -> int:
    return runtime.compute_dtype(getattr(args, "dtype", None)).size


@dataclass
class Arch:
    """What the planner needs of a model: sizes from config.json and exact parameter bytes per group."""

    V: int
    D: int
    I: int  # noqa: E741
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    weight_bytes: int
    trainable_bytes: int
    layer_trainable_bytes: int  # the decoder layers' share (their grads replace their activations)
    largest_trainable: int
    head_trainable: bool
    lora_params: int = 0
    vision: dict | None = None
    trainable_params: int = 0  # elements
    master_params: int = 0  # trainable elements held in a non-float32 dtype (they get a float32 master copy)


def _text_config(cfg: dict) -> dict:
    return {**cfg, **cfg.get("text_config", {})}


def arch_of(cfg: dict, args, dtype_bytes: int | None = None) -> Arch:
    """Build the model lazily (no array is evaluated, so nothing is allocated), apply the trainer's
    trainable-parameter policy (LoRA / full / frozen vision / frozen embeddings) and count bytes."""
    from mlx.utils import tree_flatten

    from .models import build_model
    from .models import lora as lora_lib

    s = dtype_bytes or _dtype_bytes(args)
    model = build_model(cfg)
    if getattr(args, "use_peft", False):
        lora_lib.apply_lora(model, r=args.lora_r, alpha=args.lora_alpha, dropout=args.lora_dropout,
                            target_modules=args.lora_target_modules, use_dora=args.use_dora)
    else:
        if getattr(args, "freeze_vision_tower", False) and hasattr(model, "vision_tower"):
            model.vision_tower.freeze()
        if getattr(args, "freeze_embeddings", False):
            model.language_model.embed_tokens.freeze()
    params = tree_flatten(model.parameters())
    trainable = tree_flatten(model.trainable_parameters())
    head_w = model.lm_head_weight()
    head_trainable = any(v is head_w for _, v in trainable)
    fp = [v for _, v in params if mx.issubdtype(v.dtype, mx.floating)]
    weight_bytes = sum(v.size for v in fp) * s
    def nbytes(k, v):  # LoRA's A and B stay float32 whatever the compute dtype (DoRA's magnitude does not)
        return v.size * (4 if "lora_" in k else s)

    t_sizes = [nbytes(k, v) for k, v in trainable]
    lora_n = sum(v.size for k, v in trainable if "lora_" in k)
    in_layers = sum(nbytes(k, v) for k, v in trainable if ".layers." in k and "visual" not in k)
    n_train = sum(v.size for _, v in trainable)
    n_master = 0 if s == 4 else sum(v.size for k, v in trainable if "lora_" not in k)
    t = _text_config(cfg)
    lm = model.language_model.config
    vision = None
    if "vision_config" in cfg:
        vc = cfg["vision_config"]
        vision = {"depth": vc.get("depth", 0), "D": vc.get("hidden_size", vc.get("embed_dim", 0)),
                  "I": vc.get("intermediate_size", 4 * vc.get("hidden_size", vc.get("embed_dim", 0))),
                  "heads": vc.get("num_heads", 1), "patch": vc.get("patch_size", 14),
                  "merge": vc.get("spatial_merge_size", 2), "temporal": vc.get("temporal_patch_size", 2)}
    return Arch(V=lm.vocab_size, D=lm.hidden_size, I=lm.intermediate_size, layers=lm.num_hidden_layers,
                heads=lm.num_attention_heads, kv_heads=lm.num_key_value_heads, head_dim=lm.head_dim,
                tied=bool(t.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))),
                weight_bytes=weight_bytes, trainable_bytes=sum(t_sizes),
                layer_trainable_bytes=in_layers, largest_trainable=max(t_sizes, default=0),
                head_trainable=head_trainable, lora_params=lora_n, vision=vision, trainable_params=n_train,
                master_params=n_master)


# ---------------------------------------------------------------------------------------- the model

@dataclass
class Row:
    name: str
    bytes: int
    note: str = ""


@dataclass
class Plan:
    """A prediction: `rows` (components), `total` (predicted peak bytes of mx.get_peak_memory()),
    `limit` (bytes the run may use), `fits`, and `suggestion` (a dict of config changes or None)."""

    trainer: str
    rows: list[Row]
    total: int
    step_peak: int
    update_peak: int
    limit: int | None
    limit_source: str
    machine: int | None
    cache: int
    activations: dict = field(default_factory=dict)  # {"checkpointing": b, "no checkpointing": b}
    suggestion: dict | None = None
    suggestion_total: int | None = None
    quantized_total: int | None = None  # the same run on a 4-bit (group 64) base, when it does not fit

    @property
    def fits(self) -> bool:
        return self.limit is None or self.total <= self.limit

    def table(self) -> str:
        w = max(len(r.name) for r in self.rows) + 2
        lines = [f"mlxrl.plan ({self.trainer}): predicted peak memory", "-" * 78]
        for r in self.rows:
            lines.append(f"{r.name:<{w}}{fmt(r.bytes):>10}   {r.note}")
        lines.append("-" * 78)
        lines.append(f"{'forward + backward':<{w}}{fmt(self.step_peak):>10}")
        lines.append(f"{'optimizer update':<{w}}{fmt(self.update_peak):>10}")
        lines.append(f"{'PEAK (predicted)':<{w}}{fmt(self.total):>10}   mx.get_peak_memory() of the run")
        lines.append(f"{'MLX buffer cache':<{w}}{fmt(self.cache):>10}   freed buffers MLX keeps for reuse "
                     "(reclaimed before the limit is hit; cap it with --cache_limit)")
        if self.machine:
            lines.append(f"{'machine memory':<{w}}{fmt(self.machine):>10}")
        if self.limit is not None:
            lines.append(f"{'limit':<{w}}{fmt(self.limit):>10}   {self.limit_source}")
        verdict = "FITS" if self.fits else "DOES NOT FIT"
        if self.limit is not None:
            lines.append(f"{verdict}: {fmt(self.total)} of {fmt(self.limit)} ({self.total / self.limit:.0%})")
        if not self.fits:
            if self.suggestion:
                change = " ".join(f"--{k} {v}" for k, v in self.suggestion.items())
                lines.append(f"smallest change that fits: {change}  (predicted {fmt(self.suggestion_total)})")
            else:
                lines.append("no combination of chunk_size, checkpointing, batch, LoRA, max_length or num_generations "
                             "fits")
            if self.quantized_total is not None:
                lines.append(f"with a 4-bit base (QLoRA; not supported by mlxrl's trainers yet): predicted "
                             f"{fmt(self.quantized_total)}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def fmt(b: int | float | None) -> str:
    if b is None:
        return "-"
    return f"{b / GB:.2f} GB" if b >= GB else f"{b / MB:.1f} MB"


@dataclass
class Shape:
    """One micro-batch's forward: `tokens` run through the decoder, `scores` attention score elements per
    head ([B, L, L] for B rows of L; GRPO's shared forward: the prompts' [n_p, P, P] plus each completion's
    [C, P + C]), `rows` positions scored by the head. (The shared prompt's K/V repeated for each
    completion measured as no extra peak: they live one layer at a time, inside the backward temporaries.)"""

    tokens: int
    scores: int
    rows: int
    label: str = ""


def _layer_saved(a: Arch, sh: Shape, s: int) -> float:
    """Bytes one decoder layer keeps for backward (no checkpointing)."""
    k = SAVED_PER_TOKEN
    per_token = k["D"] * a.D + k["I"] * a.I + k["Q"] * a.heads * a.head_dim + k["KV"] * a.kv_heads * a.head_dim
    return s * sh.tokens * per_token + s * SCORE_COPIES * a.heads * sh.scores


def lora_dropout(args, trainer: str = "sft") -> float:
    """The dropout the trainer will use (DPO / GRPO's disable_dropout turns LoRA's off too)."""
    if getattr(args, "disable_dropout", False):
        return 0.0
    return float(getattr(args, "lora_dropout", 0.0) or 0.0)


def _lora_extra(a: Arch, args, n: int, s: int, trainer: str = "sft") -> float:
    """LoRA with dropout keeps each adapted layer's dropped-out input, and x A ([n, r]) per adapter; on a
    bf16 base each adapted input's float32 cast."""
    if not getattr(args, "use_peft", False):
        return 0.0
    inputs = 5 * a.D + a.heads * a.head_dim + a.I  # q, k, v, gate, up see D; o sees H*hd; down sees I
    if s != 4:  # float32 adapters on a bf16 base: x @ A casts each adapted input to float32 and keeps it
        return 4 * n * (inputs + 7 * 2 * args.lora_r)
    return s * n * ((inputs if lora_dropout(args, trainer) > 0 else 0) + 7 * 2 * args.lora_r)


def activations(a: Arch, args, sh: Shape, s: int, checkpointing: bool, trainer: str = "sft") -> float:
    """Activation bytes of the decoder during backward, INCLUDING the decoder layers' gradients:
    measured, a layer's weight gradients appear as its saved tensors are released, so the layers cost
    max(saved tensors, their gradients) rather than the sum."""
    layer = _layer_saved(a, sh, s) + _lora_extra(a, args, sh.tokens, s, trainer)
    if getattr(args, "use_peft", False):
        layer *= LORA_SAVED
    edges = 3 * s * sh.tokens * a.D  # embeddings, final norm, gathered rows
    kept = a.layers * (s * sh.tokens * a.D if checkpointing else layer)
    ckpt = GRPO_CKPT_LAYERS if trainer == "grpo" else CKPT_LAYERS
    extra = (ckpt if checkpointing else BACKWARD_LAYERS) * layer
    return max(kept, a.layer_trainable_bytes) + extra + edges


def native_cpu(args) -> bool:
    """Whether mlxrl's native CPU kernels run this configuration's math (float32 on the CPU, the
    kernels built): its AdamW step updates in place and SFT's fused head is one kernel."""
    if runtime.default_device_kind() == "gpu" or _dtype_bytes(args) != 4:
        return False
    from . import native

    return native.load() is not None


def head_bytes(a: Arch, args, rows: int, s: int, trainer: str = "sft") -> float:
    """Streamed LM head: live [rows, chunk] float32 tiles (measured: about 7 with the compiled step, 16
    eager, never more than ~2x (5x eager) all the tiles' bytes), plus, when the head is trained, its
    [V, D] gradient built from the tiles' pieces and their concatenation (2 [V, D])."""
    mode = getattr(args, "head_mode", "differentiable")
    if mode == "auto":  # GRPO's: the trainer's own rule
        from .trainers.grpo import uses_fused_head

        mode = "fused" if uses_fused_head(args) else "differentiable"
    chunk_rows = min(rows, max(8, ROW_TILE_BYTES // (4 * a.V) // 8 * 8))
    if mode in ("fused", "two_phase") and trainer == "sft" and native_cpu(args):
        # SFT's nll / dft on the native kernel: the [V, D] weight gradient (when trained), one reused
        # tile, the chunk's scaled rows and d_hidden
        return (4 * a.V * a.D if a.head_trainable else 0) + 4 * chunk_rows * (a.V + a.D) + 8 * rows * a.D
    if mode in ("fused", "two_phase") and (a.head_trainable or s == 4):
        # the graph's row chunks x the full vocabulary: z and ez per chunk, about five tiles live once
        # chunks follow each other (MLX allocates at dispatch, ahead of execution); a trained head's
        # d_weight comes from vocab tiles in the VJP: its pieces (one [V, D] in the weight's dtype) next
        # to their concatenation (the gradient, counted with the trainable state); a bf16 weight is
        # cast to float32 once for the forward
        rows_g = min(rows, max(8, GRAPH_ROW_TILE_BYTES // (4 * a.V) // 8 * 8))
        chunks = -(-rows // rows_g)
        forward = min(2 + 1.5 * (chunks - 1), 5) * 4 * rows_g * a.V
        if not a.head_trainable:
            return forward
        tile = 4 * rows * min(_default_chunk(rows, a.V, a.D), a.V)
        # tied to the embedding: its gather's gradient (a [V, D] scatter) comes next to the head's
        pieces = a.V * a.D * s * (2 if a.tied else 1)
        return max(forward + (4 * a.V * a.D if s != 4 else 0), pieces + 2 * tile)
    fused = mode in ("fused", "two_phase")  # here: a frozen bf16 head, the vocab-tiled head_logprobs below
    chunk = min((None if fused else args.chunk_size) or _default_chunk(rows, a.V, a.D), a.V)
    tile = 4 * rows * chunk
    every = 4 * rows * a.V  # all tiles of one pass
    compiled = bool(getattr(args, "compile", True))
    casts = 2.5 * 4 * chunk * a.D if s != 4 else 0  # a bf16 weight's float32 [chunk, D] slices live
    if a.head_trainable:
        return 2 * a.V * a.D * s + min((0.25 if compiled else 3.5) * tile, every) + casts
    return min((HEAD_TILES if compiled else 16) * tile, (2 if compiled else 5) * every) + casts


def _default_chunk(n_rows: int, vocab: int, width: int = 0) -> int:  # mlxrl.losses.head.default_chunk_size
    cols = TILE_BYTES // (4 * max(n_rows, width, 1))
    return int(min(vocab, max(128, cols // 128 * 128)))


def vision_bytes(a: Arch, args, B: int, s: int, images: int, image_size: int | None, checkpointing: bool) -> float:
    """Vision tower activations for `images` images per example of `image_size` pixels a side
    (saved tensors as for a decoder layer, full attention within each image; a frozen tower keeps about
    two layers of temporaries). Checked against `measure` on the embedded Qwen3-VL (tests/test_plan.py)."""
    if not images or not a.vision or not image_size:
        return 0.0
    v = a.vision
    patches = (image_size // v["patch"]) ** 2  # per image, before merging
    P = B * images * patches
    per_token = 4 * v["D"] + 3 * v["I"] + 4 * v["D"]
    layer = s * P * per_token + s * SCORE_COPIES * B * images * v["heads"] * patches * patches
    trained = not (getattr(args, "use_peft", False) or getattr(args, "freeze_vision_tower", False))
    if not trained:
        return 2 * layer  # a frozen tower keeps nothing for backward: about two layers of temporaries
    return (v["depth"] + BACKWARD_LAYERS) * layer


def image_tokens(a: Arch, images: int, image_size: int | None) -> int:
    if not images or not a.vision or not image_size:
        return 0
    v = a.vision
    return images * (image_size // v["patch"]) ** 2 // (v["merge"] ** 2)


def _limit(args, machine: int | None, memory_limit=None) -> tuple[int | None, str]:
    value = memory_limit if memory_limit is not None else getattr(args, "memory_limit", None)
    if value is not None:
        return runtime._parse_bytes(value, machine), f"memory_limit {value}"
    if machine:
        return int(0.9 * machine), "90% of machine memory (no --memory_limit)"
    return None, "unknown"


def _grpo_prompt_length(args, prompt_length: int | None = None) -> int:
    """Prompt tokens of a GRPO run (TRL 1.x has no max_prompt_length; --prompt_length, default 512),
    left-padded to the trainer's multiple of 32."""
    P = int(prompt_length or getattr(args, "max_prompt_length", None) or DEFAULT_PROMPT_LENGTH)
    return -(-P // 32) * 32


def _shape(args, trainer: str, extra_tokens: int = 0, prompt_length: int | None = None) -> Shape:
    """The forward of one micro-batch (extra_tokens: image tokens per sequence)."""
    L = int(getattr(args, "max_length", None) or 1024) + extra_tokens
    B = int(args.per_device_train_batch_size)
    scored = L - extra_tokens  # image tokens are never scored
    if trainer == "dpo":
        return Shape(2 * B * L, 2 * B * L * L, 2 * B * scored, label=f"B={2 * B} (chosen + rejected) L={L}")
    if trainer == "grpo":  # b completions; whole groups when b >= G, else a slice of one prompt's group
        P = _grpo_prompt_length(args, prompt_length) + extra_tokens
        C = int(args.max_completion_length)
        n_p = max(1, B // int(args.num_generations))
        if not getattr(args, "shared_prompt", True):  # every completion row carries its own prompt
            return Shape(B * (P + C), B * (P + C) ** 2, B * C, label=f"B={B} L={P + C} (prompt not shared)")
        return Shape(n_p * P + B * C, n_p * P * P + B * C * (P + C), B * C,
                     label=f"{n_p} prompt(s) of {P} + {B} completions of {C} (prompt shared)")
    return Shape(B * L, B * L * L, B * scored, label=f"B={B} L={L}")


def predict(config: dict | str | None, args, trainer: str = "sft", *, memory_limit=None, images: int = 0,
            image_size: int | None = None, prompt_length: int | None = None, suggest: bool = True,
            _arch: Arch | None = None) -> Plan:
    """Predicted peak memory of training with `args` (an SFTConfig / DPOConfig / GRPOConfig) on the model
    of `config` (a parsed config.json, a model id / folder, or None for the embedded default).

    images / image_size: images per example and their side in pixels (VL models).
    prompt_length: GRPO prompt tokens (default 512).
    memory_limit: overrides args.memory_limit ('8GB', bytes or a fraction of memory).
    """
    cfg = config if isinstance(config, dict) else load_config(config)
    s = _dtype_bytes(args)
    a = _arch or arch_of(cfg, args, s)
    L_img = image_tokens(a, images, image_size)
    sh = _shape(args, trainer, L_img, prompt_length)
    W, T = a.weight_bytes, a.trainable_bytes
    accum = int(getattr(args, "gradient_accumulation_steps", 1) or 1)
    ckpt = bool(getattr(args, "gradient_checkpointing", False))
    act = {c: activations(a, args, sh, s, c, trainer) for c in (True, False)}
    out: list[Row] = [Row("weights", W, f"{_count(W // s)} parameters x {s} B")]
    n_train = a.trainable_params
    other = T - a.layer_trainable_bytes  # gradients outside the decoder layers (those are in activations)
    adafactor = getattr(args, "optim", "adamw_torch") == "adafactor"
    # float32 moments whatever the dtype; Adafactor: a row and a column per matrix, no first moment (~0)
    moments = 0 if adafactor else 2 * 4 * n_train
    master = 4 * a.master_params if getattr(args, "master_weights", True) else 0
    moments += master  # the float32 master copy of bf16 trainable weights (mixed precision)
    accum_sum = 4 * n_train if accum > 1 else 0  # the float32 running sum of the micro-batches' gradients
    what = "Adafactor factored v" if adafactor else "AdamW m, v (fp32)"
    if master:
        what += f" + fp32 master weights ({fmt(master)}; --master_weights false saves it)"
    out.append(Row("trainable state", moments + other + accum_sum,
                   f"{_count(n_train)} trainable: {what} + grads{' + fp32 sum (accumulation)' if accum > 1 else ''} "
                   "(the decoder layers' grads are counted with the activations)"))
    ref = 0
    needs_ref = trainer == "dpo" or (trainer == "grpo" and getattr(args, "beta", 0.0) > 0)
    if needs_ref and not getattr(args, "use_peft", False) and not getattr(args, "precompute_ref_log_probs", False):
        ref = T
        out.append(Row("reference model", ref, "frozen copy of the trained weights (full fine-tuning)"))
    out.append(Row("activations", act[ckpt], f"{sh.label}, gradient_checkpointing={'on' if ckpt else 'off'} "
                                             f"(on: {fmt(act[True])}, off: {fmt(act[False])})"))
    head = head_bytes(a, args, sh.rows, s, trainer)
    chunk = args.chunk_size or _default_chunk(sh.rows, a.V, a.D)
    out.append(Row("streamed head", head, f"{sh.rows} rows x {min(chunk, a.V)}-column fp32 tiles"
                                          f"{', [V, D] weight grad' if a.head_trainable else ''}"))
    B = int(args.per_device_train_batch_size)
    sequences = max(1, B // int(args.num_generations)) if trainer == "grpo" else (2 * B if trainer == "dpo" else B)
    img = vision_bytes(a, args, sequences, s, images, image_size, ckpt)
    if img:
        out.append(Row("images", img, f"{images} image(s)/example of {image_size}px: {L_img} tokens"))
    kv = gen_logits = 0
    if trainer == "grpo":
        G, C = int(args.num_generations), int(args.max_completion_length)
        P = _grpo_prompt_length(args, prompt_length) + L_img
        prompts = max(1, B // G)  # generated together: the micro-batch's prompts, G completions each

        def cache_len(n):  # mlx-lm's KVCache grows in steps of 256 positions
            return -(-n // KV_STEP) * KV_STEP

        kv = 2 * a.layers * a.kv_heads * a.head_dim * s * prompts * (cache_len(P) + G * cache_len(C))
        filtered = (0 < (getattr(args, "top_k", 0) or 0) < a.V or (getattr(args, "top_p", 1.0) or 1.0) < 1.0
                    or (getattr(args, "min_p", 0.0) or 0.0) > 0.0)
        gen_logits = (GEN_LOGIT_COPIES + (GEN_FILTER_COPIES if filtered else 0.0)) * 4 * prompts * G * a.V
        out.append(Row("KV cache", kv, f"generation: {prompts} prompt(s) of {P} prefilled once + G={G} "
                                       f"completions of {C} (+ {fmt(gen_logits)} of sampling logits)"))
    steady = W + moments + ref
    step = steady + other + accum_sum + act[ckpt] + head + img
    clip = T if (getattr(args, "max_grad_norm", 0) or 0) > 0 else 0
    if not adafactor:
        # AdamW (the native CPU step, or the graph's three single-output kernels) writes the new weights,
        # master and moments into the old ones' buffers, the clipping scale and a bf16 gradient's cast
        # folded in: the gradients and the next step's inputs only
        update = steady + T + NATIVE_UPDATE * a.largest_trainable
    else:  # (a bf16 parameter's update runs in float32: its copies are float32)
        largest = a.largest_trainable * (4 // s if a.master_params else 1)
        update = steady + T + clip + UPDATE_COPIES * largest
    # generation: the weights, the KV cache and the [G, V] float32 logits of a decoding step
    gen = steady + kv + gen_logits if kv else 0
    total = int(max(step, update, gen))
    machine = runtime.device_memory_bytes()
    limit, source = _limit(args, machine, memory_limit)
    cache_limit = getattr(args, "cache_limit", None)
    transient = total - steady
    cache = int(min(transient, runtime._parse_bytes(cache_limit, machine))) if cache_limit else int(transient)
    plan = Plan(trainer, out, total, int(step), int(update), limit, source, machine, cache,
                {"checkpointing": int(act[True]), "no checkpointing": int(act[False])})
    if not plan.fits and W - T > T:
        # 4 bits + a 16-bit scale and bias per 64 weights = 4.5 bits per frozen weight
        frozen = W - T
        plan.quantized_total = int(total - frozen + frozen * 4.5 / (8 * s))
    if suggest and not plan.fits:
        plan.suggestion, plan.suggestion_total = suggest_change(cfg, args, trainer, limit, images=images,
                                                                image_size=image_size, prompt_length=prompt_length)
    return plan


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


# ---------------------------------------------------------------------------------------- suggestions

def _candidates(args, trainer: str):
    """Changes in the order of how little they change the run: same result (chunk size, checkpointing,
    smaller micro-batches with more accumulation), then bf16 weights without a float32 master copy
    (stochastic rounding), a smaller adapter, LoRA instead of full fine-tuning, a shorter max_length,
    fewer generations, and last a quantised base."""
    yield {"chunk_size": 1024}
    yield {"chunk_size": 256}
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
    if _dtype_bytes(args) != 4 and not args.use_peft and getattr(args, "master_weights", True):
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
    if trainer == "grpo":
        g = int(args.num_generations)
        while g > 2:
            g //= 2
            yield {"num_generations": g}


def suggest_change(cfg: dict, args, trainer: str, limit: int | None, **kw) -> tuple[dict | None, int | None]:
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

    for change in _candidates(args, trainer):
        t = total(change)
        if t is not None and t <= limit:
            return change, t
    combined, best = {}, predict(cfg, args, trainer, memory_limit=limit, suggest=False, **kw).total
    for change in _candidates(args, trainer):
        trial = {**combined, **change}  # a later, stronger value of the same knob replaces the earlier one
        t = total(trial)
        if t is not None and t < best:
            combined, best = trial, t
            if best <= limit:
                return combined, best
    return None, None


# ---------------------------------------------------------------------------------------- measuring

class CharTokenizer:
    """One token per character (id = code point mod vocab): synthetic rows of an exact length for any
    vocabulary, without the Qwen tokenizer."""

    eos_token, pad_token_id, eos_token_id, chat_template = "\x01", 0, 1, None

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def __call__(self, text, add_special_tokens=False, **_):
        if isinstance(text, str):
            return {"input_ids": [ord(c) % self.vocab_size for c in text]}
        return {"input_ids": [self(t)["input_ids"] for t in text]}

    def decode(self, ids, skip_special_tokens=False, **_):
        return "".join(chr(int(i) + 32) for i in ids)

    def batch_decode(self, rows, **kw):
        return [self.decode(r, **kw) for r in rows]

    def convert_tokens_to_ids(self, _token):
        return -1

    def save_pretrained(self, _path):
        pass


def _text(rng, n: int, vocab: int) -> str:
    return "".join(chr(int(c)) for c in rng.integers(2, max(3, min(vocab, 20000)), size=n))


def synthetic_rows(trainer: str, args, n: int, vocab: int, seed: int = 0, prompt_length: int | None = None
                   ) -> list[dict]:
    """Rows that fill max_length exactly (SFT: text; DPO: prompt + chosen / rejected halves); GRPO: prompts
    of prompt_length tokens (default 512)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    L = int(getattr(args, "max_length", None) or 1024)
    if trainer == "dpo":
        p = L // 2
        return [{"prompt": _text(rng, p, vocab), "chosen": _text(rng, L - p - 1, vocab),
                 "rejected": _text(rng, L - p - 1, vocab)} for _ in range(n)]
    if trainer == "grpo":
        P = _grpo_prompt_length(args, prompt_length)
        return [{"prompt": _text(rng, P, vocab)} for _ in range(n)]
    return [{"text": _text(rng, L + 8, vocab)} for _ in range(n)]


def random_model(cfg: dict, dtype=None, seed: int = 0):
    from .loading import init_weights
    from .models import build_model

    mx.random.seed(seed)
    model = build_model(cfg)
    init_weights(model, cfg.get("initializer_range", 0.02))
    model.set_dtype(runtime.compute_dtype(dtype))
    mx.eval(model.parameters())
    return model


def _reward_length(prompts, completions, completion_ids, **_):
    """A reward for measuring GRPO: varies within a group, so every advantage is not zero."""
    return [float(len(set(ids))) for ids in completion_ids]


def _image_processor(cfg: dict, image_size: int):
    """A Qwen-VL image processor for `cfg`'s vision tower that keeps `image_size`-pixel squares as they are."""
    from .loading import DEFAULT_CONFIG
    from .processing import ImageProcessor

    pre = dict(json.loads(Path(DEFAULT_CONFIG).read_text())["preprocessor_config"])
    vc = cfg["vision_config"]
    pre.update(patch_size=vc.get("patch_size", 14), merge_size=vc.get("spatial_merge_size", 2),
               temporal_patch_size=vc.get("temporal_patch_size", 2), min_pixels=image_size ** 2,
               max_pixels=image_size ** 2)
    return ImageProcessor.from_dict(pre)


def image_rows(trainer: str, args, n: int, images: int, image_size: int, seed: int = 0,
               prompt_length: int | None = None) -> list[dict]:
    """Vision rows for `measure`: `images` noise pictures of `image_size` pixels a side in the user turn,
    then text of about max_length tokens (one token per ' x'); DPO: prompt + chosen / rejected halves;
    GRPO: the pictures and a prompt of prompt_length tokens. The text's length matches `_shape`, which
    counts the image tokens on top of max_length / the prompt."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    L = int(getattr(args, "max_length", None) or 1024)

    def words(k):
        return " x" * max(1, k)

    def pictures():
        return [Image.fromarray(rng.integers(0, 255, (image_size, image_size, 3), dtype=np.uint8))
                for _ in range(images)]

    def user(k):
        return {"role": "user", "content": [{"type": "image"}] * images + [{"type": "text", "text": words(k)}]}

    if trainer == "grpo":
        return [{"prompt": [user(_grpo_prompt_length(args, prompt_length) - 24)], "images": pictures()}
                for _ in range(n)]
    if trainer == "dpo":
        p = L // 2
        return [{"prompt": [user(p - 24)], "chosen": [{"role": "assistant", "content": words(L - p - 8)}],
                 "rejected": [{"role": "assistant", "content": words(L - p - 8)}], "images": pictures()}
                for _ in range(n)]
    return [{"messages": [user(L // 2 - 16), {"role": "assistant", "content": words(L - L // 2 - 8)}],
             "images": pictures()} for _ in range(n)]


def measure(config: dict | str | None, args, trainer: str = "sft", steps: int = 3,
            prompt_length: int | None = None, images: int = 0, image_size: int | None = None) -> int:
    """mx.get_peak_memory() over `steps` real optimizer steps (random weights, synthetic rows of
    max_length tokens; GRPO: prompts of prompt_length, generation included; a VL config with `images`
    of `image_size` pixels per row: the real Qwen tokenizer and image rows, max_length raised by the
    image tokens as `predict` counts them), minus what was allocated before the model was built."""
    import contextlib
    import gc
    import io
    import tempfile

    from .processing import Processor

    cfg = config if isinstance(config, dict) else load_config(config)
    gc.collect()
    mx.clear_cache()
    base = mx.get_active_memory()
    model = random_model(cfg, getattr(args, "dtype", None), getattr(args, "seed", 0))
    vocab = model.language_model.config.vocab_size
    processor = Processor(CharTokenizer(vocab))
    images = images if images and image_size and "vision_config" in cfg else 0
    text_args = args  # the rows' text follows the given max_length; the run's max_length adds the images
    if images:
        from .processing import QWEN3_VL_CHAT_TEMPLATE, QWEN_VL_CHAT_TEMPLATE, build_qwen_tokenizer

        template = QWEN3_VL_CHAT_TEMPLATE if cfg.get("model_type") == "qwen3_vl" else QWEN_VL_CHAT_TEMPLATE
        processor = Processor(build_qwen_tokenizer(template), _image_processor(cfg, image_size), template)
        extra = image_tokens(arch_of(cfg, args), images, image_size) + 32  # + vision markers and the template
        if getattr(args, "max_length", None):
            args = dataclasses.replace(args, max_length=int(args.max_length) + extra)
    with tempfile.TemporaryDirectory() as tmp:
        args = dataclasses.replace(args, output_dir=tmp, max_steps=steps, save_strategy="no", logging_steps=10**6,
                                   disable_tqdm=True)
        n = args.per_device_train_batch_size * args.gradient_accumulation_steps * steps
        kw = {}
        if trainer == "grpo":  # enough prompts for every round of `steps` steps
            n = n // int(args.num_generations) + 4 * steps * args.gradient_accumulation_steps
            kw["reward_funcs"] = [_reward_length]
        rows = (image_rows(trainer, text_args, n, images, image_size, prompt_length=prompt_length) if images
                else synthetic_rows(trainer, args, n, vocab, prompt_length=prompt_length))
        cls = _trainer_class(trainer)
        with contextlib.redirect_stdout(io.StringIO()):
            t = cls(model, processor, args, train_dataset=rows, **kw)
            t.train()
        peak = mx.get_peak_memory()
        del t, model
        gc.collect()
    mx.clear_cache()
    return int(peak - base)


def _trainer_class(trainer: str):
    if trainer == "dpo":
        from .trainers.dpo import DPOTrainer as base
    elif trainer == "grpo":
        from .trainers.grpo import GRPOTrainer as base
    else:
        from .trainers.sft import SFTTrainer as base

    class Measured(base):
        def save_final(self):  # nothing to keep
            pass

    return Measured


def config_class(trainer: str):
    if trainer == "dpo":
        from .trainers.dpo import DPOConfig

        return DPOConfig
    if trainer == "grpo":
        from .trainers.grpo import GRPOConfig

        return GRPOConfig
    from .trainers.config import SFTConfig

    return SFTConfig


def sweep(cfg: dict, args, trainer: str, lengths=None, ranks=None, prompt_length: int | None = None
          ) -> list[tuple[str, int, int]]:
    """(setting, predicted, measured) for a few sequence lengths (GRPO: max_completion_length) and LoRA ranks."""
    out = []
    key = "max_completion_length" if trainer == "grpo" else "max_length"
    L = int(getattr(args, key, None) or 256)

    def row(name, a):
        out.append((name, predict(cfg, a, trainer, suggest=False, prompt_length=prompt_length).total,
                    measure(cfg, a, trainer, prompt_length=prompt_length)))

    for length in lengths or (max(16, L // 2), L, 2 * L):
        row(f"{key}={length}", dataclasses.replace(args, **{key: length}))
    for r in ranks or (4, 16, 64):
        row(f"use_peft lora_r={r}", dataclasses.replace(args, use_peft=True, lora_r=r, lora_alpha=2 * r))
    return out


# ---------------------------------------------------------------------------------------- CLI

def _extra(parser):
    parser.add_argument("--model", default=None, help="Hub id or local folder (only config.json is read; "
                                                      "default: the embedded tiny Qwen3-VL)")
    parser.add_argument("--trainer", default="sft", choices=("sft", "dpo", "grpo"))
    parser.add_argument("--images", type=int, default=0, help="images per example (VL models)")
    parser.add_argument("--image_size", type=int, default=None, help="image side in pixels after resizing")
    parser.add_argument("--prompt_length", type=int, default=None,
                        help=f"GRPO: prompt tokens (default {DEFAULT_PROMPT_LENGTH})")
    parser.add_argument("--measure", action="store_true", help="run a few real steps on random weights and "
                                                               "print predicted vs measured peak memory")
    parser.add_argument("--sweep", action="store_true", help="with --measure: also max_length and LoRA rank")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps for --measure")


# small settings for --measure on the embedded default when the user sets nothing
MEASURE_DEFAULTS = {"sft": {"max_length": 64, "per_device_train_batch_size": 2},
                    "dpo": {"max_length": 64, "per_device_train_batch_size": 2},
                    "grpo": {"num_generations": 4, "per_device_train_batch_size": 4, "max_completion_length": 32,
                             "prompt_length": 64}}


def main(argv=None) -> int:
    from .trainers.config import build_parser, config_from_args

    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--trainer", default="sft", choices=("sft", "dpo", "grpo"))
    trainer = pre.parse_known_args(argv)[0].trainer
    try:
        cls = config_class(trainer)
    except ImportError:
        print(f"mlxrl.plan: the {trainer} trainer is not available in this version", file=sys.stderr)
        return 2
    parser = build_parser(cls, "python -m mlxrl.plan", "Predict a training run's peak memory from config.json.",
                          extra=_extra)
    ns = parser.parse_args(argv)
    if ns.measure:
        for k, v in MEASURE_DEFAULTS[trainer].items():
            if getattr(ns, k, None) is None:
                setattr(ns, k, v)
    args = config_from_args(cls, ns)
    try:
        cfg = load_config(ns.model)
    except Exception as e:  # one line, like the trainers' CLIs
        print(f"mlxrl.plan: {e}", file=sys.stderr)
        return 2
    plan = predict(cfg, args, trainer, images=ns.images, image_size=ns.image_size, prompt_length=ns.prompt_length)
    print(plan.table())
    if ns.measure:
        print(f"\nmeasuring {ns.steps} steps on random weights ({runtime.compute_dtype(args.dtype)}) ...", flush=True)
        got = measure(cfg, args, trainer, steps=ns.steps, prompt_length=ns.prompt_length)
        print(f"predicted {fmt(plan.total)}  measured {fmt(got)}  error {(plan.total - got) / got:+.1%}")
        if ns.sweep:
            print(f"\n{'setting':<24}{'predicted':>12}{'measured':>12}{'error':>9}")
            for name, p, m in sweep(cfg, args, trainer, prompt_length=ns.prompt_length):
                print(f"{name:<24}{fmt(p):>12}{fmt(m):>12}{(p - m) / m:>+9.1%}", flush=True)
    return 0 if plan.fits else 1


if __name__ == "__main__":
    sys.exit(main())
