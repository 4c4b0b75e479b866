"""Qwen3.5's decoder (`qwen3_5_text`, and the language part of `qwen3_5`), Hugging Face's names and layout.

The layers follow `layer_types`: "linear_attention" layers are Gated DeltaNet, "full_attention" layers are
gated attention; both are followed by the SwiGLU MLP, each sub-block pre-normed and residual.

- **Gated DeltaNet** (`linear_attn`): `in_proj_qkv` -> a depthwise causal convolution over time (kernel
  `linear_conv_kernel_dim`, HF's `conv1d.weight` [C, 1, K] kept as it is and applied as K shifted products)
  with SiLU -> q, k [Hk, dk], v [Hv, dv]; beta = sigmoid(`in_proj_b` x), the log decay
  g = -exp(`A_log`) * softplus(`in_proj_a` x + `dt_bias`); the gated delta rule (`models.gated_delta`, q and k
  L2-normalised inside, q scaled by dk^-0.5); the gated RMSNorm per value head, rmsnorm(o) * w * silu(z) with
  z = `in_proj_z` x; `out_proj`. Packed documents (segment ids) restart both the convolution and the rule's
  state at each document; padded positions enter as zeros (transformers' `apply_mask_to_padding_states`).
- **Gated attention** (`self_attn`): `q_proj` emits each head's query and an output gate side by side; q and
  k go through per-head zero-centred RMSNorms, the first `partial_rotary_factor` of each head's dimensions
  are rotated (interleaved M-RoPE), and the attention output is multiplied by sigmoid(gate) before `o_proj`.
- **Norms** are zero-centred: x / rms(x) * (1 + weight), the weight stored as an offset from one.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from ...cpu import fastmath
from .. import checkpointing
from ..attention import attention
from ..gated_delta import gated_delta_rule
from ..language import MLP, RotaryEmbedding, TextConfig, apply_rotary


@dataclass
class Qwen35TextConfig(TextConfig):
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    layer_types: list[str] | None = None
    full_attention_interval: int = 4
    partial_rotary_factor: float | None = None
    hidden_act: str = "silu"
    extra: dict = field(default_factory=dict)

    def _resolve_rope(self):
        super()._resolve_rope()
        if self.partial_rotary_factor is None:
            self.partial_rotary_factor = float(self.rope_params.get("partial_rotary_factor", 0.25))
        if self.layer_types is None:  # transformers' default: every `full_attention_interval`-th layer attends
            n = self.full_attention_interval
            self.layer_types = ["linear_attention" if (i + 1) % n else "full_attention"
                                for i in range(self.num_hidden_layers)]
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types lists {len(self.layer_types)} layers for num_hidden_layers "
                             f"{self.num_hidden_layers}")
        unknown = set(self.layer_types) - {"linear_attention", "full_attention"}
        if unknown:
            raise ValueError(f"layer_types: unknown layer type {sorted(unknown)[0]!r}")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r}: Qwen3.5 uses silu")


def initial_value(name: str, value: mx.array) -> mx.array | None:
    """transformers' initial value of a Qwen3.5 language-model parameter where it is not N(0, std): the
    zero-centred norms' offsets 0 (the gated norm's scale stays 1), dt_bias 1, A_log = log U(0, 16)."""
    if name.endswith("linear_attn.norm.weight"):
        return mx.ones_like(value)
    if name.endswith("norm.weight"):  # input / post-attention layernorms, q / k norms, the final norm
        return mx.zeros_like(value)
    if name.endswith("dt_bias"):
        return mx.ones_like(value)
    if name.endswith("A_log"):
        return mx.log(mx.random.uniform(1e-6, 16.0, value.shape))
    return None


class ZeroCenteredRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight) (the weight initialised at zero), in float32, cast back to x's dtype."""

    def __init__(self, dims: int, eps: float = 1e-6):
        super().__init__()
        self.weight = mx.zeros((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        scale = (1.0 + self.weight.astype(mx.float32)).astype(x.dtype)
        return fastmath.rms_norm(x, scale, self.eps)


class GatedRMSNorm(nn.Module):
    """rmsnorm(x) * weight * silu(gate): the norm in float32, the gate's SiLU in float32, as transformers."""

    def __init__(self, dims: int, eps: float = 1e-6):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array, gate: mx.array) -> mx.array:
        return _gated_norm(self.eps)(x, gate, self.weight)


@functools.cache
def _gated_norm(eps: float):
    """`GatedRMSNorm` under `mx.checkpoint`: its backward keeps x, the gate and the weight, and recomputes the
    norm, the float32 casts and the gate's SiLU (which MLX's autograd would keep through the rest of the
    layer's backward)."""

    def gated_norm(x, gate, weight):
        h = fastmath.rms_norm(x, weight, eps)
        return (h.astype(mx.float32) * nn.silu(gate.astype(mx.float32))).astype(x.dtype)

    return mx.checkpoint(gated_norm)


def document_starts(segment_ids: mx.array | None, B: int, L: int) -> mx.array | None:
    """[B, L] True at the first token of each packed document (None without packing)."""
    if segment_ids is None:
        return None
    first = mx.ones((B, 1), dtype=mx.bool_)
    return mx.concatenate([first, segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)


def _taps(full: mx.array, weight: mx.array, starts: mx.array | None, L: int):
    """The causal convolution's K taps over `full` (the K - 1 inputs before x, then x): each tap's index, input
    slice [B, L, C] and weight [C], with the mask of positions whose input lies in their own document (None
    without documents)."""
    K = weight.shape[-1]
    w = weight.reshape(-1, K).astype(full.dtype)
    if starts is not None:
        # document index of each position; an input counts only for positions of its own document
        doc = mx.cumsum(starts.astype(mx.int32), axis=1)
        doc_full = mx.concatenate([mx.full((doc.shape[0], K - 1), -1, mx.int32), doc], axis=1)
    for j in range(K):
        same = None if starts is None else (doc_full[:, j:j + L] == doc)[..., None]
        yield j, full[:, j:j + L], w[:, j], same


def _conv(full: mx.array, weight: mx.array, starts: mx.array | None, L: int) -> mx.array:
    y = None
    for _, xs, wj, same in _taps(full, weight, starts, L):
        term = xs * wj if same is None else mx.where(same, xs * wj, 0)
        y = term if y is None else y + term
    return y


def causal_conv(x: mx.array, weight: mx.array, starts: mx.array | None, state: mx.array | None = None):
    """Depthwise causal convolution over time: x [B, L, C], weight [C, 1, K] (HF's layout) -> [B, L, C];
    y[t] = sum_j w[:, j] x[t - K + 1 + j]. `starts`: document starts (no position sees another document's
    inputs); `state`: the K - 1 inputs before x (decoding), else zeros. Returns (y, the last K - 1 inputs)."""
    B, L, C = x.shape
    K = weight.shape[-1]
    past = mx.zeros((B, K - 1, C), x.dtype) if state is None else state.astype(x.dtype)
    full = mx.concatenate([past, x], axis=1)  # [B, K - 1 + L, C]
    return _conv(full, weight, starts, L), full[:, L:]


CONV_BLOCK_BYTES = 16 << 20  # one float32 [B, L, channels] array of the graph convolution's backward, per block


@functools.cache
def _conv_qkv(hk: int, dk: int, hv: int, dv: int, documents: bool):
    """x [B, L, C], the conv weight, the K - 1 inputs before x (and the document starts) -> q, k [B, L, Hk, dk],
    v [B, L, Hv, dv] (the SiLU of the causal convolution, split) and the last K - 1 inputs, as one function
    whose VJP keeps its inputs alone: it recomputes the convolution c and s = sigmoid(c), then
    dc = dy s (1 + c (1 - s)), the input's gradient as the K taps' shifted products of dc accumulated one at a
    time, and each tap's weight gradient as a sum over positions. MLX's autograd of the same ops keeps the
    padded input, c, s and the SiLU through the layer's backward, and its backward of the K shifted slices
    builds a padded [B, L + K - 1, C] array per tap."""
    kd = hk * dk

    @mx.custom_function
    def conv_qkv(x, weight, state, *starts):
        B, L, _ = x.shape
        y, last = causal_conv(x, weight, starts[0] if documents else None, state)
        y = nn.silu(y)
        return (y[..., :kd].reshape(B, L, hk, dk), y[..., kd:2 * kd].reshape(B, L, hk, dk),
                y[..., 2 * kd:].reshape(B, L, hv, dv), last)

    @conv_qkv.vjp
    def conv_qkv_vjp(primals, cotangents, outputs):
        x, weight, state, *starts = primals
        B, L, C = x.shape
        K = weight.shape[-1]
        st = starts[0] if documents else None
        edge = [(0, 0), (K - 1, K - 1), (0, 0)]
        dx, d_state, dws, after = None, [], [], []
        # the convolution is depthwise: blocks of channels are independent problems, each within q's, k's or v's
        # channels (its cotangent a slice of theirs: no [L, C] concatenation), run one after another (each
        # waits for the one before), so one block's working set, CONV_BLOCK_BYTES an array, is alive at a time
        width = max(1, CONV_BLOCK_BYTES // (4 * B * (L + K - 1)))
        blocks = [(p0 + a, p0 + min(a + width, p1 - p0), dy.reshape(B, L, p1 - p0)[..., a:a + width])
                  for (p0, p1), dy in zip(((0, kd), (kd, 2 * kd), (2 * kd, C)), cotangents[:3], strict=True)
                  for a in range(0, p1 - p0, width)]
        for a, b, dy in blocks:
            ins = [x[..., a:b], state[..., a:b], dy, cotangents[3][..., a:b]]
            xa, sa, dya, dla = mx.depends(ins, after) if after else ins
            w = weight[a:b]
            full = mx.concatenate([sa.astype(x.dtype), xa], axis=1)
            c = _conv(full, w, st, L)
            sg = mx.sigmoid(c)
            dc = dya * sg * (1 + c * (1 - sg))
            d_full = mx.pad(dla.astype(dc.dtype), [(0, 0), (L, 0), (0, 0)])  # the last K - 1 inputs' cotangent
            # d_full[i] = sum_j w_j dc[i - j]: each tap a shifted window of dc padded once on both sides, so the
            # sum is elementwise over views (one fused kernel when compiled), not a padded copy per tap
            dcp = mx.pad(dc, edge)
            dw = []
            for j, xs, wj, same in _taps(full, w, st, L):
                dcj = dc if same is None else mx.where(same, dc, 0)
                src = dcp if same is None else mx.pad(dcj, edge)
                d_full = d_full + src[:, K - 1 - j:2 * (K - 1) - j + L] * wj
                dw.append((xs.astype(mx.float32) * dcj.astype(mx.float32)).sum(axis=(0, 1)))
            dws.append(mx.stack(dw, axis=-1))
            piece = d_full[:, K - 1:].astype(x.dtype)
            d_state.append(d_full[:, :K - 1].astype(state.dtype))
            if dx is None:
                dx = mx.zeros(x.shape, x.dtype)
            dx[..., a:b] = piece  # in place: each update is the previous one's only reader
            after = [piece, d_state[-1], dws[-1]]
        dweight = mx.concatenate(dws, axis=0).reshape(weight.shape).astype(weight.dtype)
        grads = [dx, dweight, mx.concatenate(d_state, axis=-1)]
        return (*grads, *(mx.zeros_like(t) for t in starts))

    return conv_qkv


def last_real_inputs(state: mx.array, x: mx.array, real: mx.array) -> mx.array:
    """The convolution's window after x [B, L, C]: the K - 1 inputs [B, K - 1, C] up to each row's last real
    position (real [B, L]; the window of `state` before x when a row has none): left padding before a prompt
    and right padding after a row's end (a finished row, a shorter turn) leave it as the real tokens left it."""
    K1, L = state.shape[1], x.shape[1]
    full = mx.concatenate([state.astype(x.dtype), x], axis=1)
    end = (real.astype(mx.int32) * mx.arange(1, L + 1, dtype=mx.int32)).max(axis=1)  # last real position + 1
    index = end[:, None] + mx.arange(K1, dtype=mx.int32)[None]
    return mx.take_along_axis(full, index[..., None], axis=1)


def conv_qkv(x: mx.array, weight: mx.array, state: mx.array, starts: mx.array | None, hk: int, dk: int, hv: int,
             dv: int):
    """q, k [B, L, Hk, dk], v [B, L, Hv, dv] (the SiLU of the causal convolution of x [B, L, C], split) and the
    last K - 1 inputs. Float32 on the CPU: the native kernel (`cpu/native/causal_conv.cpp`), whose VJP recomputes
    the convolution position by position and makes no [L, C] array but the input's gradient; else `_conv_qkv`'s
    MLX graph."""
    kernels = fastmath.kernels_for(x)
    if kernels is None:
        return _conv_qkv(hk, dk, hv, dv, starts is not None)(x, weight, state, *(() if starts is None else (starts,)))
    B, L, _ = x.shape
    marks = mx.zeros((B, L), mx.bool_) if starts is None else starts
    q, k, v, last = kernels.causal_conv_silu(x, weight.astype(x.dtype), state.astype(x.dtype), marks,
                                             [hk * dk, hk * dk, hv * dv], starts is not None)
    return q.reshape(B, L, hk, dk), k.reshape(B, L, hk, dk), v.reshape(B, L, hv, dv), last


class GatedDeltaNet(nn.Module):
    def __init__(self, config: Qwen35TextConfig):
        super().__init__()
        d = config.hidden_size
        self.hk, self.hv = config.linear_num_key_heads, config.linear_num_value_heads
        self.dk, self.dv = config.linear_key_head_dim, config.linear_value_head_dim
        key_dim, value_dim = self.hk * self.dk, self.hv * self.dv
        self.conv_dim = 2 * key_dim + value_dim
        if config.model_type == "qwen3_next":  # two fused projections, interleaved per key head (`_projections`)
            self.in_proj_qkvz = nn.Linear(d, self.conv_dim + value_dim, bias=False)
            self.in_proj_ba = nn.Linear(d, 2 * self.hv, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(d, self.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(d, value_dim, bias=False)
            self.in_proj_b = nn.Linear(d, self.hv, bias=False)
            self.in_proj_a = nn.Linear(d, self.hv, bias=False)
        self.conv1d = Conv1dWeight(self.conv_dim, config.linear_conv_kernel_dim)
        self.dt_bias = mx.ones((self.hv,))
        self.A_log = mx.zeros((self.hv,))
        self.norm = GatedRMSNorm(self.dv, eps=config.rms_norm_eps)
        self.out_proj = nn.Linear(value_dim, d, bias=False)

    def _projections(self, x: mx.array) -> tuple[mx.array, ...]:
        """(the convolution's input [B, L, 2 Hk dk + Hv dv]: every q head, then k, then v; z [B, L, Hv, dv]; the
        pre-sigmoid b and pre-softplus a [B, L, Hv]). Qwen3.5 has one projection for each; Qwen3-Next's
        `in_proj_qkvz` emits, per key head, its q, k and its Hv / Hk value heads' v and z side by side (and
        `in_proj_ba` its b then a), regrouped here as transformers' `fix_query_key_value_ordering` does."""
        B, L, _ = x.shape
        if "in_proj_qkv" in self:
            return (self.in_proj_qkv(x), self.in_proj_z(x).reshape(B, L, self.hv, self.dv), self.in_proj_b(x),
                    self.in_proj_a(x))
        r, dk, dv = self.hv // self.hk, self.dk, self.dv
        qkvz = self.in_proj_qkvz(x).reshape(B, L, self.hk, 2 * dk + 2 * r * dv)
        q, k, v, z = (qkvz[..., :dk], qkvz[..., dk:2 * dk], qkvz[..., 2 * dk:2 * dk + r * dv],
                      qkvz[..., 2 * dk + r * dv:])
        mixed = mx.concatenate([q.reshape(B, L, -1), k.reshape(B, L, -1), v.reshape(B, L, -1)], axis=-1)
        ba = self.in_proj_ba(x).reshape(B, L, self.hk, 2 * r)
        return (mixed, z.reshape(B, L, self.hv, dv), ba[..., :r].reshape(B, L, self.hv),
                ba[..., r:].reshape(B, L, self.hv))

    def __call__(self, x: mx.array, attention_mask=None, segment_ids=None, cache=None) -> mx.array:
        """x [B, L, D]. cache: a `LinearCache` (decoding), or shared_prompt's prompt pass (which keeps the
        prompts' final states, `keep_prompt_states`) or completion pass (which starts from them,
        `prompt_states`)."""
        B, L, _ = x.shape
        real = attention_mask[:, -L:] if attention_mask is not None else getattr(cache, "prompt_mask", None)
        if real is not None:  # padded positions enter as zeros
            x = x * real[..., None].astype(x.dtype)
        starts = document_starts(segment_ids, B, L)
        conv_state = state = None
        if hasattr(cache, "prompt_states"):
            conv_state, state = cache.prompt_states()
        elif hasattr(cache, "recurrent_state"):
            conv_state, state = cache.conv_state, cache.recurrent_state
        projected, z, b, a = self._projections(x)
        if conv_state is None:
            conv_state = mx.zeros((B, self.conv1d.weight.shape[-1] - 1, projected.shape[-1]), projected.dtype)
        q, k, v, new_conv = conv_qkv(projected, self.conv1d.weight, conv_state, starts, self.hk, self.dk, self.hv,
                                     self.dv)
        beta = mx.sigmoid(b)
        a = a.astype(mx.float32)
        g = -mx.exp(self.A_log.astype(mx.float32)) * nn.softplus(a + self.dt_bias.astype(mx.float32))
        if real is not None:  # a padded position neither writes nor decays the state: the final state is the
            # last real token's, for left and right padding (the real positions' outputs are unchanged)
            beta, g = beta * real[..., None].astype(beta.dtype), g * real[..., None].astype(g.dtype)
        out, final = gated_delta_rule(q, k, v, g, beta, initial_state=state, doc_starts=starts,
                                      use_qk_l2norm_in_kernel=True)
        if hasattr(cache, "keep_prompt_states"):
            cache.keep_prompt_states(projected, final, self.conv1d.weight.shape[-1])
        elif hasattr(cache, "recurrent_state"):
            if real is not None:  # the last K - 1 REAL inputs: padding after a row's end neither enters the window
                new_conv = last_real_inputs(conv_state, projected, real)  # nor pushes it out (a later turn's
            cache.conv_state, cache.recurrent_state = new_conv, final     # tokens continue from the real ones)
            cache.offset += L
        out = self.norm(out.astype(x.dtype), z)
        return self.out_proj(out.reshape(B, L, -1))


class Conv1dWeight(nn.Module):
    """Holds `conv1d.weight` [C, 1, K] under HF's name and layout (applied by `causal_conv`)."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = mx.zeros((channels, 1, kernel))


class GatedAttention(nn.Module):
    def __init__(self, config: Qwen35TextConfig):
        super().__init__()
        d, hd = config.hidden_size, config.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        self.rotary_dim = int(hd * config.partial_rotary_factor)
        self.scale = hd**-0.5
        bias = config.attention_bias
        self.q_proj = nn.Linear(d, self.n_heads * hd * 2, bias=bias)
        self.k_proj = nn.Linear(d, self.n_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(d, self.n_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(hd, eps=config.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(hd, eps=config.rms_norm_eps)

    def _rotate(self, x, cos, sin):
        r = self.rotary_dim
        if r == self.head_dim:
            return apply_rotary(x, cos, sin)
        x1, x2 = mx.split(x, [r], axis=-1)  # one split, whose gradient is one concatenation
        return mx.concatenate([apply_rotary(x1, cos, sin), x2], axis=-1)

    def __call__(self, x, cos, sin, mask, cache=None):
        B, L, _ = x.shape
        qg = self.q_proj(x).reshape(B, L, self.n_heads, 2 * self.head_dim)
        q, gate = mx.split(qg, 2, axis=-1)  # views [B, L, H, hd]; the gradient is one concatenation
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        q = self._rotate(self.q_norm(q).transpose(0, 2, 1, 3), cos, sin)
        k = self._rotate(self.k_norm(k).transpose(0, 2, 1, 3), cos, sin)
        if hasattr(cache, "attention"):  # a prompt shared by its samples (as `language.Attention`)
            out = cache.attention(q, k, v, scale=self.scale, mask=mask)
        else:
            if cache is not None:
                k, v = cache.update_and_fetch(k, v)
            out = attention(q, k, v, scale=self.scale, mask=mask)
        out = out.transpose(0, 2, 1, 3) * mx.sigmoid(gate)  # [B, L, H, hd]: the gate's view needs no copy
        return self.o_proj(out.reshape(B, L, -1))


class DecoderLayer(nn.Module):
    def __init__(self, config: Qwen35TextConfig, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(config)
        else:
            self.self_attn = GatedAttention(config)
        self.mlp = MLP(config)
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def __call__(self, x, cos, sin, mask, cache=None, *, attention_mask=None, segment_ids=None, routing=None):
        """routing: a list that an expert layer (Qwen3.5-MoE, `models.moe`) appends its routing to (the load-balancing
        loss)."""
        h = self.input_layernorm(x)
        if self.layer_type == "linear_attention":
            h = self.linear_attn(h, attention_mask, segment_ids, cache)
        else:
            h = self.self_attn(h, cos, sin, mask, cache)
        h = x + h
        if routing is not None and hasattr(self.mlp, "gate"):
            return h + self.mlp(self.post_attention_layernorm(h), routing)
        return h + self.mlp(self.post_attention_layernorm(h))


def dense_width(text: dict) -> dict:
    """The MLP width a Qwen3.5-MoE config lacks (it has no dense MLP: every layer's is replaced by
    `install_experts`), so that the decoder builds; {} for a dense config."""
    if "intermediate_size" in text or "moe_intermediate_size" not in text:
        return {}
    return {"intermediate_size": int(text["moe_intermediate_size"])}


def install_experts(lm, text: dict, config: Qwen35TextConfig):
    """The expert layer (`models.moe`) with its gated shared expert in the MLPs' place: every layer's, the top-k
    always normalised, for Qwen3.5-MoE (`qwen3_5_moe` / `qwen3_5_moe_text`); the sparse layers' by
    `decoder_sparse_step` / `mlp_only_layers`, `norm_topk_prob` (default on) for Qwen3-Next (`qwen3_next`). The
    router's loss statistics ride with the layers."""
    from .. import moe

    every = {"norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}
    if config.model_type == "qwen3_next":
        every = {"norm_topk_prob": text.get("norm_topk_prob", True)}
    cfg = moe.MoeConfig.from_dict({**text, **every})
    moe.install(lm, cfg, config.hidden_size,
                lambda d, i: MLP(dataclasses.replace(config, hidden_size=d, intermediate_size=i)))
    return cfg


class Qwen35LanguageModel(nn.Module):
    """embed_tokens -> layers (by `layer_types`) -> norm; hidden states before the LM head."""

    def __init__(self, config: Qwen35TextConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = [DecoderLayer(config, t) for t in config.layer_types]
        self.norm = ZeroCenteredRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        rotary = dataclasses.replace(config, head_dim=int(config.head_dim * config.partial_rotary_factor))
        rotary.rope_type, rotary.rope_params = config.rope_type, config.rope_params
        self.rotary_emb = RotaryEmbedding(rotary)
        self.gradient_checkpointing = False
        self.keep_attention = False
        self.checkpoint_segments = 0

    def set_checkpointing(self, on: bool, keep_attention: bool = False, segments: int = 0) -> None:
        checkpointing.check_segments(int(segments or 0), len(self.layers), bool(on), bool(keep_attention))
        self.gradient_checkpointing, self.keep_attention = bool(on), bool(keep_attention)
        self.checkpoint_segments = int(segments or 0)

    def tile_mlp(self, tokens: int) -> None:
        for layer in self.layers:
            layer.mlp.tile_tokens = int(tokens)

    # its Gated DeltaNet layers read the padding and the packed documents (`vl.QwenVLBase` passes them)
    reads_padding = True

    def __call__(self, inputs_embeds, position_ids, mask=None, cache=None, deepstack=None, *, attention_mask=None,
                 segment_ids=None, router_aux=None, token_mask=None) -> mx.array:
        """position_ids [B, L] or [3, B, L] (M-RoPE); Qwen3.5 has no DeepStack (`deepstack` must be None).
        router_aux: a list receiving Qwen3.5-MoE's load-balancing loss over token_mask's tokens (`moe.RouterStats`)."""
        if deepstack is not None:
            raise ValueError("Qwen3.5's language model takes no DeepStack features")
        cos, sin = self.rotary_emb(position_ids)
        h = inputs_embeds
        kw = {"attention_mask": attention_mask, "segment_ids": segment_ids}
        if cache is None and router_aux is not None and getattr(self, "router_stats", None) is not None:
            h = self.router_stats.run(self, h, (cos, sin), lambda layer, x, c_, s_, rl: layer(
                x, c_, s_, mask, routing=rl, **kw), token_mask, router_aux)
            return self.norm(h)
        if cache is None:
            h, = checkpointing.run_layers(self, lambda layer, x, c_, s_: (layer(x, c_, s_, mask, **kw),), (h,),
                                          (cos, sin), None, ())
            return self.norm(h)
        for layer, c in zip(self.layers, cache, strict=True):
            h = layer(h, cos, sin, mask, c, **kw)
        return self.norm(h)
