"""The mixture-of-experts layer of Qwen's MoE models (Qwen3-MoE, Qwen3-VL-MoE, Qwen3.5-MoE, Qwen3-Next), with
transformers' parameter names and routing, and its load-balancing loss.

Parameters (transformers 5.x's in-memory names, what PEFT's `target_parameters` name):
`mlp.gate.weight` [E, D] (the router), `mlp.experts.gate_up_proj` [E, 2I, D] (each expert's gate rows, then its
up rows), `mlp.experts.down_proj` [E, D, I]; Qwen3.5-MoE and Qwen3-Next add a dense `mlp.shared_expert` (a SwiGLU
MLP) whose output is scaled by `sigmoid(mlp.shared_expert_gate(x))` [1, D]. Checkpoints on the Hub (and
transformers' saves) hold one tensor per expert (`mlp.experts.N.gate_proj.weight`, ...); `fuse_experts` stacks
them on load and `split_experts` writes them back on save; mlx-lm's conversions (`mlp.switch_mlp.gate_proj`,
`up_proj`, `down_proj`, each [E, ...], quantized or not) are read too.

Routing, as transformers computes it: the router's logits in the compute dtype, their softmax in float32, the
top k probabilities per token (`norm_topk_prob`: divided by their sum), cast back to the compute dtype. Every
token reaches its k experts (dropless: no capacity, nothing dropped).

The experts as gathered matmuls (`gathered`: MLX's `gather_mm`, or on float32 CPU arrays the native kernel's
one GEMM per expert): the N x k (token, expert) pairs are sorted by expert, each pair's row multiplies its
expert's matrix, and the outputs are put back in token order and summed with the routing weights. Nothing is
[tokens, experts, ...] and no loop runs over experts, so the step compiles whatever
the routing. MLX differentiates `gather_mm` for both operands, so full fine-tuning and LoRA (whose per-expert
factors are gathered the same way, `models.lora_experts`) share this path.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..cpu import fastmath, native
from . import checkpointing


@dataclass
class MoeConfig:
    """The MoE fields of a config.json (transformers' names and defaults for Qwen3-MoE)."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0  # Qwen3.5-MoE, Qwen3-Next: a gated dense expert beside the routed ones
    router_aux_loss_coef: float = 0.001
    output_router_logits: bool = False

    @classmethod
    def from_dict(cls, d: dict) -> MoeConfig:
        return cls(
            # config.json's name; transformers' to_dict() writes its alias num_local_experts
            num_experts=int(d["num_experts"] if "num_experts" in d else d["num_local_experts"]),
            num_experts_per_tok=int(d["num_experts_per_tok"]),
            moe_intermediate_size=int(d["moe_intermediate_size"]),
            norm_topk_prob=bool(d.get("norm_topk_prob", False)),
            decoder_sparse_step=int(d.get("decoder_sparse_step", 1) or 1),
            mlp_only_layers=tuple(int(i) for i in (d.get("mlp_only_layers") or ())),
            shared_expert_intermediate_size=int(d.get("shared_expert_intermediate_size") or 0),
            router_aux_loss_coef=float(d.get("router_aux_loss_coef", 0.001) or 0.0),
            output_router_logits=bool(d.get("output_router_logits", False)),
        )

    def sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` has the expert layer (transformers' rule) rather than a dense MLP."""
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)


def route(logits: mx.array, k: int, norm_topk_prob: bool) -> tuple[mx.array, mx.array, mx.array]:
    """(weights [N, k] in logits' dtype, expert indices [N, k] uint32, the float32 probabilities [N, E]) of router
    logits [N, E]: the top k of the float32 softmax (in no particular order within a row), divided by their sum
    with norm_topk_prob."""
    probs = mx.softmax(logits.astype(mx.float32), axis=-1)
    indices = mx.stop_gradient(mx.argpartition(-probs, kth=k - 1, axis=-1)[..., :k])
    weights = mx.take_along_axis(probs, indices, axis=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return weights.astype(logits.dtype), indices.astype(mx.uint32), probs


def sort_by_expert(indices: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """For expert indices [N, k]: (the token of each (token, slot) pair in expert order [N k], the experts in
    that order [N k], the permutation that puts expert order back into (token, slot) order [N k])."""
    flat = indices.reshape(-1)
    order = mx.argsort(flat)
    return order // indices.shape[-1], flat[order], mx.argsort(order)


def gathered(x: mx.array, weight: mx.array, experts: mx.array) -> mx.array:
    """x [M, in] rows sorted by expert times their expert's weight [E, out, in] transposed: [M, out]. On float32
    CPU arrays the native kernel runs one BLAS GEMM per expert over its rows (`cpu/native/experts.cpp`; MLX's CPU
    gather_mm runs a product per row); elsewhere MLX's `gather_mm` (Metal's and CUDA's gathered kernels)."""
    if x.dtype == weight.dtype == mx.float32 and fastmath.kernels_for(x) is not None:
        return native.load().expert_matmul(x, weight, experts)
    if fastmath.on_cpu() and (x.dtype != mx.float32 or weight.dtype != mx.float32):
        # MLX's CPU gather_mm takes float32 only: a bfloat16 run on the CPU multiplies in float32
        return gathered(x.astype(mx.float32), weight.astype(mx.float32), experts).astype(x.dtype)
    return mx.gather_mm(x[:, None, :], weight.swapaxes(-1, -2), rhs_indices=experts, sorted_indices=True)[:, 0]


class Experts(nn.Module):
    """E SwiGLU experts as two fused parameters (transformers' `Qwen3MoeExperts`)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = mx.zeros((num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = mx.zeros((num_experts, hidden_size, intermediate_size))

    @property
    def num_experts(self) -> int:
        return self.down_proj.shape[0]

    def project(self, name: str, x: mx.array, experts: mx.array) -> mx.array:
        """x [M, in] (rows sorted by expert) through parameter `name` of each row's expert: [M, out]. The one place
        the weights are read, which LoRA on the experts (`models.lora_experts.LoRAExperts`) overrides."""
        return gathered(x, self[name], experts)

    def __call__(self, x: mx.array, weights: mx.array, indices: mx.array) -> mx.array:
        """x [N, D], the routing's weights and indices [N, k] -> the weighted sum of each token's experts [N, D]."""
        n, k = indices.shape
        tokens, experts, unsort = sort_by_expert(indices)
        gate, up = mx.split(self.project("gate_up_proj", x[tokens], experts), 2, axis=-1)
        y = self.project("down_proj", fastmath.silu_mul(gate, up), experts)
        y = y[unsort].reshape(n, k, -1)
        return (y * weights[..., None]).sum(axis=1)


class Router(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int):
        super().__init__()
        self.weight = mx.zeros((num_experts, hidden_size))

    def __call__(self, x: mx.array) -> mx.array:
        return x @ self.weight.T


class SparseMoeBlock(nn.Module):
    """The expert layer in a decoder layer's MLP place: router -> top-k -> experts (+ the gated shared expert)."""

    def __init__(self, config: MoeConfig, hidden_size: int, mlp_class=None):
        """mlp_class(hidden, intermediate): the dense MLP of the shared expert (Qwen3.5-MoE, Qwen3-Next)."""
        super().__init__()
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.gate = Router(config.num_experts, hidden_size)
        self.experts = Experts(config.num_experts, hidden_size, config.moe_intermediate_size)
        if config.shared_expert_intermediate_size:
            self.shared_expert = mlp_class(hidden_size, config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
        self.tile_tokens = 0  # accepted for `tile_mlp`; the experts' rows are gathered, not tiled

    def __call__(self, x: mx.array, routing: list | None = None) -> mx.array:
        """x [..., D] -> [..., D]. routing: a list that receives this layer's routing, (the router's float32
        probabilities [N, E], the chosen experts [N, k]), for the load-balancing loss (`RouterStats.layer_sums`)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.gate(x)
        weights, indices, probs = route(logits, self.top_k, self.norm_topk_prob)
        if routing is not None:
            routing.append((probs, indices))
        y = self.experts(x, weights, indices)
        if "shared_expert" in self:
            y = y + mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y.reshape(shape)


class RouterStats:
    """The load-balancing loss (the Switch Transformer's, as transformers' `load_balancing_loss_func` computes it)
    of a decoder whose layers include expert layers, accumulated while the layers run.

    loss = E x sum_e f_e P_e, f_e the share of the expert layers' top-k slots that chose expert e and P_e the mean
    router probability of e, each over every expert layer's tokens (those with token_mask 1: transformers' attention
    mask), in float32; differentiable through P (the choice f counts). Its two [E] sums ride through the layers in
    the carry of `checkpointing.run_layers` beside the hidden state, so a checkpointed layer's recomputation
    recomputes its router too and no [tokens, E] array of any layer outlives it."""

    def __init__(self, num_experts: int, top_k: int, sparse_layers: int):
        self.num_experts, self.top_k, self.sparse_layers = num_experts, top_k, sparse_layers

    def layer_sums(self, probs: mx.array, chosen: mx.array, token_mask: mx.array) -> tuple[mx.array, mx.array]:
        """(top-k slots per expert [E], router probability per expert [E]) over the tokens of a layer's routing
        (`SparseMoeBlock`'s float32 probabilities [N, E] and chosen experts [N, k]) weighted by token_mask [N, 1]."""
        hits = (chosen[..., None] == mx.arange(self.num_experts)).astype(mx.float32).sum(axis=1)  # [N, E]
        return (hits * token_mask).sum(axis=0), (probs * token_mask).sum(axis=0)

    def run(self, lm, h, args: tuple, call, token_mask, out: list, add=None, feats=()) -> mx.array:
        """lm's layers over h as its forward runs them (`run_layers` with the same args, `call(layer, x, *args,
        routing)` one layer), appending the loss to `out`; returns the last layer's output."""
        B, L = h.shape[:2]
        weight = (mx.ones((B * L, 1), mx.float32) if token_mask is None
                  else token_mask.reshape(-1, 1).astype(mx.float32))

        def layer_fn(layer, x, tokens, probs, *rest):
            *layer_args, w = rest
            routing = []
            y = call(layer, x, *layer_args, routing)
            for one in routing:
                t, p = self.layer_sums(*one, w)
                tokens, probs = tokens + t, probs + p
            return y, tokens, probs

        after = None if add is None else (lambda c, f: (add((c[0],), f)[0], *c[1:]))
        zeros = mx.zeros((self.num_experts,), mx.float32)
        h, tokens, probs = checkpointing.run_layers(lm, layer_fn, (h, zeros, zeros), (*args, weight), after, feats)
        out.append(self.loss(tokens, probs, weight.sum() * self.sparse_layers))
        return h

    def loss(self, tokens: mx.array, probs: mx.array, rows) -> mx.array:
        """E x sum_e f_e P_e from the summed slots and probabilities per expert over `rows` (tokens x layers)."""
        return ((tokens / rows) * (probs / rows)).sum() * self.num_experts


def install(lm, config: MoeConfig, hidden_size: int, mlp_class) -> None:
    """Put the expert layer in the MLP place of lm's sparse layers (`MoeConfig.sparse`) and give lm the
    `RouterStats` its forward uses for the load-balancing loss."""
    sparse = [i for i in range(len(lm.layers)) if config.sparse(i)]
    for i in sparse:
        lm.layers[i].mlp = SparseMoeBlock(config, hidden_size, mlp_class)
    lm.router_stats = RouterStats(config.num_experts, config.num_experts_per_tok, len(sparse)) if sparse else None


def readable_config(config: dict) -> dict:
    """A config.json to write for an MoE model that mlx-lm reads too: transformers 5 writes `num_local_experts`
    and nests `rope_theta` in `rope_parameters`, which mlx-lm's MoE models require at the top level as
    `num_experts` and `rope_theta` (as the Hub's checkpoints have them); transformers reads both spellings.
    Other configs are returned as they are."""
    for c in (config, config.get("text_config")):
        if not isinstance(c, dict) or "num_local_experts" not in c:
            continue
        c.setdefault("num_experts", c["num_local_experts"])
        theta = (c.get("rope_parameters") or {}).get("rope_theta")
        if theta is not None:
            c.setdefault("rope_theta", theta)
    return config


def fuse_experts(weights: dict) -> dict:
    """Checkpoint tensors with one key per expert (`...mlp.experts.N.gate_proj.weight` / `up_proj` / `down_proj`,
    the Hub's and transformers' saved layout) or mlx-lm's switch layout (`...mlp.switch_mlp.gate_proj.weight`
    [E, I, D], `up_proj`, `down_proj`) as the fused parameters `...mlp.experts.gate_up_proj` and
    `...mlp.experts.down_proj`; a quantized switch layout's packed weights, scales and biases as the
    `QuantizedStack`s' `...experts.gate_up_proj.weight` / `.scales` / `.biases`. Other keys pass through, already
    fused ones too."""
    out, parts_of = {}, {}  # (layer prefix, projection, tensor) -> {expert: [out, in]} or {None: [E, out, in]}
    for key, value in weights.items():
        m = re.fullmatch(r"(.*)\.(?:experts\.(\d+)|switch_mlp)\.(gate_proj|up_proj|down_proj)\."
                         r"(weight|scales|biases)", key)
        if m is None or (m.group(2) is not None and m.group(4) != "weight"):
            out[key] = value
            continue
        base, expert, name, tensor = m.groups()
        parts_of.setdefault((base, name, tensor), {})[None if expert is None else int(expert)] = value

    def stacked(base, name, tensor):
        entry = parts_of.pop((base, name, tensor))
        return entry[None] if None in entry else mx.stack([entry[e] for e in sorted(entry)])

    # a quantized checkpoint's scales and biases are fused as its packed weights are (per row: gate rows, up rows)
    quantized = {b for b, _, t in parts_of if t == "scales"}  # `QuantizedStack`s: weight / scales / biases each
    for base, tensor in sorted({(b, t) for b, _, t in parts_of}):
        suffix = f".{tensor}" if base in quantized else ""
        # gate rows, then up rows, per expert: transformers' converter concatenates them so
        out[f"{base}.experts.gate_up_proj{suffix}"] = mx.concatenate(
            [stacked(base, "gate_proj", tensor), stacked(base, "up_proj", tensor)], axis=1)
        out[f"{base}.experts.down_proj{suffix}"] = stacked(base, "down_proj", tensor)
    return out


def split_experts(weights: dict) -> dict:
    """The fused float expert parameters as one key per expert (`...experts.N.gate_proj.weight`, `up_proj`,
    `down_proj`): the layout of the Hub's checkpoints, which transformers and mlx-lm load; quantized stacks in
    mlx-lm's switch layout (`...mlp.switch_mlp.gate_proj.weight` / `scales` / `biases`). Other keys pass."""
    out = {}
    for key, value in weights.items():
        m = re.fullmatch(r"(.*)\.experts\.(gate_up_proj|down_proj)\.(weight|scales|biases)", key)
        if m is not None:  # a quantized stack: mlx-lm's switch layout (what it and `mlxrl.load` read)
            base, name, tensor = m.groups()
            if name == "down_proj":
                out[f"{base}.switch_mlp.down_proj.{tensor}"] = value
            else:
                gate, up = mx.split(value, 2, axis=1)
                out[f"{base}.switch_mlp.gate_proj.{tensor}"], out[f"{base}.switch_mlp.up_proj.{tensor}"] = gate, up
        elif key.endswith(".experts.gate_up_proj"):
            base = key[: -len("gate_up_proj")]
            gate, up = mx.split(value, 2, axis=1)
            for e in range(value.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = gate[e]
                out[f"{base}{e}.up_proj.weight"] = up[e]
        elif key.endswith(".experts.down_proj"):
            base = key[: -len("down_proj")]
            for e in range(value.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = value[e]
        else:
            out[key] = value
    return out
