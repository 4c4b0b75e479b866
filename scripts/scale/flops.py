"""Model FLOPs of one training step (the MFU's numerator): text trunk and head, Qwen3.5's and an MoE's own layer
kinds, the vision tower."""

from __future__ import annotations

from .checkpoints import qwen3_5_layer_types
from .common import SFT


def vision_flops(config: dict, grids) -> float:
    """Forward matmul FLOPs of the vision tower over images of grid (t, h, w) patches: patch embedding, per
    block qkv / proj / MLP and attention (within each image), the merger and the deepstack mergers."""
    v = config["vision_config"]
    d, inter, m2 = v["hidden_size"], v["intermediate_size"], v["spatial_merge_size"] ** 2
    pix = v.get("in_channels", 3) * v["temporal_patch_size"] * v["patch_size"] ** 2
    total = 0.0
    for t, h, w in grids:
        n = t * h * w
        block = 2 * n * d * 3 * d + 2 * n * d * d + 2 * 2 * n * d * inter + 2 * 2 * n * n * d
        merger = 2 * (n / m2) * (m2 * d) ** 2 + 2 * (n / m2) * (m2 * d) * v["out_hidden_size"]
        total += 2 * n * pix * d + v["depth"] * block + (1 + len(v.get("deepstack_visual_indexes", []))) * merger
    return total


def qwen3_5_forward(t: dict, seq: int) -> tuple[float, float]:
    """(trunk forward FLOPs, the LoRA adapters' in + out widths summed over the layers) of a Qwen3.5 text config.
    Gated attention layers: q_proj twice the query width (query and output gate), k / v / o, the dense attention
    square; Gated DeltaNet layers: in_proj_qkv / z / b / a, out_proj, the depthwise causal conv, and the chunked
    delta rule per value head and token: three products with the dk x dv state (6 dk dv) and the 64-token chunk's
    key / query products (2 * 64 * (2 dk + dv)), an estimate of its matmuls; the MLP on every layer."""
    d, inter, hd = t["hidden_size"], t["intermediate_size"], t["head_dim"]
    q, kv = t["num_attention_heads"] * hd, t["num_key_value_heads"] * hd
    hv, dk, dv = t["linear_num_value_heads"], t["linear_key_head_dim"], t["linear_value_head_dim"]
    key, value = t["linear_num_key_heads"] * dk, hv * dv
    mlp = 2 * seq * d * inter * 3
    attention = 2 * seq * d * (2 * q + 2 * kv) + 2 * seq * q * d + 2 * 2 * seq * seq * q + mlp
    deltanet = (2 * seq * d * (2 * key + 2 * value + 2 * hv) + 2 * seq * value * d
                + 2 * seq * (2 * key + value) * t["linear_conv_kernel_dim"]
                + seq * hv * (6 * dk * dv + 2 * 64 * (2 * dk + dv)) + mlp)
    widths_mlp = 2 * (d + inter) + (inter + d)
    widths_attention = (d + 2 * q) + 2 * (d + kv) + (q + d) + widths_mlp
    widths_deltanet = (d + 2 * key + value) + (d + value) + 2 * (d + hv) + (value + d) + widths_mlp
    types = t.get("layer_types") or qwen3_5_layer_types(t["num_hidden_layers"])
    full = sum(x == "full_attention" for x in types)
    return (full * attention + (len(types) - full) * deltanet,
            full * widths_attention + (len(types) - full) * widths_deltanet)


def moe_forward(t: dict, seq: int) -> tuple[float, float]:
    """(trunk forward FLOPs, the LoRA adapters' in + out widths summed over the layers, per token) of a Qwen3-MoE
    text config: attention as a dense layer's, the router (D x E), and per token its k experts' gate, up and down
    products (D x I each); an expert adapter runs for the k experts a token chose (its width counted k times)."""
    d, hd, e, k, inter = (t["hidden_size"], t["head_dim"], t.get("num_experts") or t["num_local_experts"],
                          t["num_experts_per_tok"], t["moe_intermediate_size"])
    q, kv = t["num_attention_heads"] * hd, t["num_key_value_heads"] * hd
    attention = 2 * seq * d * (q + 2 * kv) + 2 * seq * q * d + 2 * 2 * seq * seq * q
    layer = attention + 2 * seq * d * e + k * 2 * seq * d * inter * 3
    widths = (d + q) + 2 * (d + kv) + (q + d) + k * ((d + 2 * inter) + (inter + d))  # PEFT's fused gate_up adapter
    return t["num_hidden_layers"] * layer, t["num_hidden_layers"] * widths


def step_flops(config: dict, seq: int, trained: int, mode: str, grids=()) -> float:
    """Model FLOPs of one training step (batch 1, gradient checkpointing on): see scripts/bench_scale.py's module
    docstring."""
    t = config.get("text_config", config)
    kind = str(t.get("model_type", ""))
    # their own layer kinds: Qwen3.5's (qwen3_5_forward); an MoE's active parameters, the router and k experts
    if kind.startswith("qwen3_5") or kind == "qwen3_moe":
        trunk, widths = (moe_forward if kind == "qwen3_moe" else qwen3_5_forward)(t, seq)
        head = 2 * trained * t["hidden_size"] * t["vocab_size"]
    else:
        trunk = SFT.model_flops(config, 1, seq, 0, False) / 3  # forward
        head = SFT.model_flops(config, 1, seq, trained, False) / 3 - trunk
        d, inter, hd = t["hidden_size"], t["intermediate_size"], t.get("head_dim") or t["hidden_size"] // t[
            "num_attention_heads"]
        q, kv = t["num_attention_heads"] * hd, t["num_key_value_heads"] * hd
        widths = ((d + q) + 2 * (d + kv) + (q + d) + 2 * (d + inter) + (inter + d)) * t["num_hidden_layers"]
    if mode == "full":
        total = 3 * (trunk + head) + trunk
    else:
        adapters = 2 * seq * 16 * widths  # x -> A (r) -> B, forward, over every adapted linear (in + out widths)
        total = 2 * (trunk + head) + trunk + 4 * adapters
    if grids:
        total += vision_flops(config, grids) * (3 if mode == "full" else 1)
    return total
