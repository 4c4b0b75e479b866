"""What one decoder layer keeps for its backward, by kind of layer: the planner's per-layer model, in bytes,
from the layer's widths and the positions it runs (measured on MLX 0.32, CPU, by the slope of a run's peak
over its depth: `plan.measure` at two depths of one layer kind).

- **Attention** (Qwen2 / Qwen3 / the VL decoders, Qwen3.5's gated attention): per token, the norm inputs /
  outputs, q / k / v before and after q/k-norm and rotary, the attention output, the MLP's gate / up /
  silu / product; and ~1.25 [H, L, L] score tensors per sequence where attention materialises them (MLX's
  attention with a mask is unfused on the CPU and keeps the probabilities; the native CPU path's
  FlashAttention kernel keeps none). Qwen3.5's gated attention also keeps q_proj's gate half and the gated
  output: two more query widths per token.
- **Gated DeltaNet** (Qwen3.5's linear-attention layers): per token, about four convolution widths
  (`in_proj_qkv`'s output, the convolution's sum, its SiLU and the op's contiguous q / k / v) and six value
  widths (the rule's output, z, the gated norm's input, output and float32 gate, out_proj's input) beside
  the norms and the MLP; and the gated delta rule's saved state at each chunk start ([dk, dv] per value
  head, float32 whatever the compute dtype: `models.gated_delta`), one per 64 positions.
- **The expert layer** (mixtures of experts, `models.moe`), in the MLP's place: per token and chosen expert, the
  gathered input and the down projection's output (hidden widths) and the expert's gate / up / product
  (expert widths), per token the router's logits and float32 probabilities (expert counts), and the shared
  expert's MLP where there is one.
"""

from __future__ import annotations

import re

import mlx.nn as nn

from ..cpu import fastmath, native
from ..models.gated_delta import CHUNK, group_chunks  # the rule's chunk (one saved state each), its graph path's groups
from ..models.moe import Experts
from ..models.widened import EXPERT_STACKS, checkpoint_dtype, is_head, keepable

SAVED_PER_TOKEN = {"D": 4, "I": 5, "Q": 4, "KV": 3}
# The native CPU path's SwiGLU product is one primitive whose VJP recomputes the sigmoid: it keeps g and u
# only, where MLX's ops also keep sigmoid(g) and silu(g) (measured per layer, 2 x 768 -> 1536 I: native
# +2.0 floats per token per I, MLX's ops +4.0)
SAVED_PER_TOKEN_NATIVE = {**SAVED_PER_TOKEN, "I": 3}
SCORE_COPIES = 1.25
GATE_SAVED = 2  # gated attention: widths of H * hd more per token (measured +2.0)
LINEAR_SAVED = {"C": 4, "V": 6}  # Gated DeltaNet: per token, per convolution / value width (measured 4.0, 6.1)
# the native CPU path's convolution is one primitive writing q, k and v (no padded input, no [L, C] output to split;
# fit to the qwen3_5 rows of test_plan: -8% to +13%)
LINEAR_SAVED_NATIVE = {"C": 2, "V": 6}
# the gated delta rule's backward on the graph path: one group of chunks' intermediates, per token of the group
# and value head, float32: [c, c] and [c, d] arrays (d the mean of dk and dv; measured beyond its results at
# Hv 4 / 8 / 16, d 64 / 32 / 128: 3.5 and 25.7 of them)
DELTA_WORK = {"C": 3.5, "D": 25.7}
# the expert layer: per token and chosen expert, hidden and expert widths; per token, experts. Measured by the
# slope over depth (2 and 6 layers, 1024 tokens, full fine-tuning, no checkpointing, D 256) at k 2 / 4, I 128 /
# 256, E 8 / 32: 896 floats per token and slot at I 128 (2 D + 3 I), +3 I per slot, ~9 per expert
EXPERT_SAVED = {"D": 2, "I": 3, "E": 9}


def _mlp(intermediate: int, tokens: int, mlp_tokens: int | None, native: bool) -> float:
    k = SAVED_PER_TOKEN_NATIVE if native else SAVED_PER_TOKEN
    return (tokens if mlp_tokens is None else mlp_tokens) * k["I"] * intermediate


def layer_saved_bytes(hidden: int, intermediate: int, heads: int, head_dim: int, kv_heads: int, tokens: int,
                      scores: int, elem: int, native: bool = False, mlp_tokens: int | None = None,
                      gated: bool = False) -> float:
    """Bytes one attention layer keeps for its backward: `tokens` positions, `scores` attention-score
    elements per head (B L^2 for B rows of L), `elem` bytes per element; `native`: the native CPU kernels
    run the layer's elementwise work (`cpu.fastmath`); `mlp_tokens`: the positions whose MLP
    [tokens, intermediate] arrays exist at once (the tiled MLP, `models.tiled`: one tile per call; default
    all); `gated`: Qwen3.5's output gate."""
    k = SAVED_PER_TOKEN
    q = k["Q"] + (GATE_SAVED if gated else 0)
    per_token = k["D"] * hidden + q * heads * head_dim + k["KV"] * kv_heads * head_dim
    return (elem * (tokens * per_token + _mlp(intermediate, tokens, mlp_tokens, native))
            + elem * SCORE_COPIES * heads * scores)


def linear_layer_saved_bytes(hidden: int, intermediate: int, conv_dim: int, value_dim: int, state: int, tokens: int,
                             elem: int, native: bool = False, mlp_tokens: int | None = None) -> float:
    """Bytes one Gated DeltaNet layer keeps for its backward: `conv_dim` the convolution's channels
    (q, k and v: 2 Hk dk + Hv dv), `value_dim` Hv dv, `state` Hv dk dv (one chunk start's state, float32);
    the rest as `layer_saved_bytes`."""
    saved = LINEAR_SAVED_NATIVE if native else LINEAR_SAVED
    per_token = SAVED_PER_TOKEN["D"] * hidden + saved["C"] * conv_dim + saved["V"] * value_dim
    chunks = -(-tokens // CHUNK)
    return elem * (tokens * per_token + _mlp(intermediate, tokens, mlp_tokens, native)) + 4 * chunks * state


def lora_saved_bytes(hidden: int, intermediate: int, mixer_inputs: int, adapters: int, tokens: int, rank: int,
                     elem: int, dropout: bool, mlp_tokens: int | None = None) -> float:
    """What LoRA adds to a layer: with `dropout` (a dropped copy: the graph path) each adapted layer's
    dropped-out input, and x A ([n, r]) per adapter; on a bf16 base (`elem` != 4) each adapted input's
    float32 cast (the float32 adapters' x @ A) instead. `mixer_inputs`: the widths of the attention (or
    DeltaNet) projections' inputs together (attention: q, k, v see D, o sees H hd), `adapters` their count;
    the MLP's gate and up see D, down sees I. `mlp_tokens`: the positions the MLP's three adapters hold at
    once (as `layer_saved_bytes`)."""
    mlp_tokens = tokens if mlp_tokens is None else mlp_tokens
    mlp = 2 * hidden + intermediate
    if elem != 4:
        return 4 * (tokens * (mixer_inputs + adapters * 2 * rank) + mlp_tokens * (mlp + 3 * 2 * rank))
    dropped = (tokens * mixer_inputs + mlp_tokens * mlp) if dropout else 0
    return elem * (dropped + (tokens * adapters + mlp_tokens * 3) * 2 * rank)


def expert_saved_bytes(hidden: int, moe: dict, tokens: int, elem: int, native: bool = False) -> float:
    """Bytes one expert layer keeps for its backward in place of a dense MLP's (`moe`: the top `k` of `E` experts
    of width `I`, a `shared` expert's width or 0), for `tokens` positions."""
    k = EXPERT_SAVED
    per_token = moe["k"] * (k["D"] * hidden + k["I"] * moe["I"]) + k["E"] * moe["E"]
    return elem * (tokens * per_token + (_mlp(moe["shared"], tokens, None, native) if moe["shared"] else 0))


# LoRA on the experts: per token and chosen expert, each adapted input's dropped copy (D, I) and each adapted
# output's sum with the base (2 I, D); the [rows, r] products are small
EXPERT_LORA_SAVED = {"D": 2, "I": 3}


def expert_lora_bytes(hidden: int, moe: dict, tokens: int, elem: int) -> float:
    """What LoRA on both expert parameters adds to an expert layer (`models.lora_experts`)."""
    k = EXPERT_LORA_SAVED
    return elem * tokens * moe["k"] * (k["D"] * hidden + k["I"] * moe["I"])


def delta_rule_work_bytes(tokens: int, linear: dict) -> float:
    """The gated delta rule's working set in its backward on the graph path (`models.gated_delta`): one
    group's float32 intermediates (the op's own sizing, `gated_delta.group_chunks`: a share of what it holds,
    so it grows with the length up to a cap). `linear`: a DeltaNet layer's value heads and widths (key heads
    counted as many). (A batch of several long rows runs a group of each side by side: counted as one, a lower
    bound.)"""
    h, dk, dv = linear["heads"], linear["dk"], linear["dv"]
    group = min(tokens, group_chunks(1, tokens, h, h, dk, dv) * CHUNK)
    d = (linear["dk"] + linear["dv"]) / 2
    return 4 * group * linear["heads"] * (DELTA_WORK["C"] * CHUNK + DELTA_WORK["D"] * d)


def kept_saving(model: nn.Module, cfg: dict, keeps: bool, element_bytes: int) -> int:
    """What keeping bfloat16 weights takes off the planner's weights (`plan.model`): 2 bytes a kept weight,
    less one layer's widened float32 copy (a checkpointed layer's recomputation and backward hold it; the
    embedding and the head are widened a block of rows at a time, and an MoE layer's expert stacks one expert
    at a time on the native CPU path, whole elsewhere). Counted on the lazily built model, before LoRA wraps
    it; 0 where the rule does not keep them (`keeps`: `keeps_checkpoint_dtype` of the run)."""
    if element_bytes != 4 or checkpoint_dtype(cfg) != "bfloat16" or not keeps:
        return 0
    whole_stacks = not (fastmath.on_cpu() and native.load() is not None)
    layers: dict[str, int] = {}
    total = 0
    for path, m in model.named_modules():
        if isinstance(m, Experts):
            size = sum(m[n].size for n in EXPERT_STACKS)
        elif keepable(path, m):
            size = m.weight.size
        else:
            continue
        total += size
        if is_head(path) or (isinstance(m, Experts) and not whole_stacks):
            continue
        layer = re.match(r"(.*?\.(?:layers|blocks)\.\d+)\.", path)
        key = layer.group(1) if layer else path
        layers[key] = layers.get(key, 0) + size
    return 2 * total - 4 * max(layers.values(), default=0)
