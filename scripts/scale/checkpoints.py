"""The checkpoints: the shapes (random weights, real widths, depths and vocabulary), their depths under --layers,
their LoRA keys, building one in a child (`build_checkpoint`), reusing it (`checkpoint`), its YaRN variant."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from .common import ROOT, _script
from .spawn import child

LORA_KEYS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DELTANET_KEYS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")  # Qwen3.5's linear_attn.*
HEADS = dict(num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936, rms_norm_eps=1e-6,
             tie_word_embeddings=True)
SHAPES = {  # name: (kind, hidden, MLP)
    "qwen3-0.6b": ("text", 1024, 3072),
    "qwen3-1.7b": ("text", 2048, 6144),
    "qwen3-vl-2b": ("vl", 2048, 6144),
    "qwen3.5-0.8b": ("text", 1024, 3584),
    "qwen3.5-2b": ("vl", 2048, 6144),
    "qwen3-30b-a3b": ("text", 2048, 768),  # MLP: the expert width
}
DEPTH, VISION_DEPTH, DEEPSTACK = 28, 24, (5, 11, 17)
# Qwen3.5 (the Hub's Qwen3.5-0.8B / -2B text configs): 24 layers, every 4th gated attention (8 / 2 heads of 256, a
# quarter of each head rotated, interleaved M-RoPE [11, 11, 10]), the others Gated DeltaNet (16 / 16 heads of 128)
QWEN3_5 = ("qwen3.5-0.8b", "qwen3.5-2b")
QWEN3_5_DEPTH, QWEN3_5_INTERVAL = 24, 4
QWEN3_5_TEXT = dict(vocab_size=248320, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                    linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                    linear_value_head_dim=128, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, tie_word_embeddings=True,
                    hidden_act="silu", max_position_embeddings=262144)
# Qwen3-30B-A3B (the Hub's config): 48 layers, 32 / 4 heads of 128, every layer's MLP 128 experts of width 768, top 8
MOE = ("qwen3-30b-a3b",)
MOE_DEPTH = 48
QWEN3_MOE_TEXT = dict(vocab_size=151936, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                      num_experts_per_tok=8, norm_topk_prob=True, intermediate_size=6144, decoder_sparse_step=1,
                      mlp_only_layers=[], rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=40960,
                      router_aux_loss_coef=0.001, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")  # PEFT's target_parameters
QWEN3_5_ROPE = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                "mrope_section": [11, 11, 10], "mrope_interleaved": True}
VL_PREPROCESSOR = dict(min_pixels=256 * 256, max_pixels=4096 * 4096, patch_size=16, temporal_patch_size=2,
                       merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3, processor_class="Qwen3VLProcessor")



def real_depth(shape: str) -> int:
    """The shape's real text depth (--layers cuts it)."""
    return QWEN3_5_DEPTH if shape in QWEN3_5 else MOE_DEPTH if shape in MOE else DEPTH


def depths(layers: int | None, shape: str = "qwen3-0.6b") -> tuple[int, int, list[int]]:
    """(text layers, vision blocks, deepstack indexes) for a --layers override (None: the real depths); Qwen3.5's
    tower has no deepstack."""
    if shape in QWEN3_5:
        return (layers or QWEN3_5_DEPTH), min(VISION_DEPTH, layers or VISION_DEPTH), []
    if shape in MOE:
        return (layers or MOE_DEPTH), 0, []
    if not layers:
        return DEPTH, VISION_DEPTH, list(DEEPSTACK)
    vision = min(VISION_DEPTH, layers)
    return layers, vision, [i for i in DEEPSTACK if i < vision] or [vision - 1]


def qwen3_5_layer_types(n: int) -> list[str]:
    """Qwen3.5's layer pattern over n layers: every 4th "full_attention", else "linear_attention" (the Hub's
    configs; n=4 -> 3 Gated DeltaNet + 1 gated attention; under 4 layers, DeltaNet only)."""
    return ["full_attention" if (i + 1) % QWEN3_5_INTERVAL == 0 else "linear_attention" for i in range(n)]


def lora_keys(ckpt: str) -> tuple[str, ...]:
    """The LoRA target modules of a checkpoint: the seven projections, and Qwen3.5's five DeltaNet ones; a mixture of
    experts' the four attention ones (its experts are parameters: `is_moe`, EXPERT_PARAMETERS)."""
    model_type = json.loads((Path(ckpt) / "config.json").read_text())["model_type"]
    if model_type == "qwen3_moe":
        return LORA_KEYS[:4]
    return LORA_KEYS + (DELTANET_KEYS if model_type.startswith("qwen3_5") else ())


def is_moe(ckpt: str) -> bool:
    return json.loads((Path(ckpt) / "config.json").read_text())["model_type"] == "qwen3_moe"


def ckpt_name(shape: str, layers: int | None, dtype: str = "float32") -> str:
    name = shape if not layers else f"{shape}-L{layers}"
    return name if dtype == "float32" else f"{name}-bf16"


def build_checkpoint(s: dict) -> dict:
    """Child: build and save one checkpoint (float32, or bfloat16 as the Hub's Qwen checkpoints are; safetensors, our
    tokenizer / chat template / VL processor)."""
    import torch
    import transformers as tf

    tiny = _script("tiny_checkpoints")
    sys.path.insert(0, str(ROOT))
    from mlxrl.processing.processor import (
        QWEN3_5_CHAT_TEMPLATE,
        QWEN3_VL_CHAT_TEMPLATE,
        QWEN_CHAT_TEMPLATE,
        ImageProcessor,
        Processor,
        build_qwen3_5_tokenizer,
        build_qwen_tokenizer,
    )

    torch.set_num_threads(2)
    kind, hidden, mlp = SHAPES[s["shape"]]
    layers, vision_depth, deepstack = depths(s["layers"], s["shape"])
    text = dict(HEADS, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers, **tiny.TOKEN_IDS)
    tokenizer = build_qwen_tokenizer
    if s["shape"] in MOE:
        text = dict(QWEN3_MOE_TEXT, hidden_size=hidden, moe_intermediate_size=mlp, num_hidden_layers=layers,
                    **tiny.TOKEN_IDS)
        config, cls, image_processor = tf.Qwen3MoeConfig(**text), tf.Qwen3MoeForCausalLM, None
        template = QWEN_CHAT_TEMPLATE
    elif s["shape"] in QWEN3_5:
        tokenizer, template = build_qwen3_5_tokenizer, QWEN3_5_CHAT_TEMPLATE
        text = dict(QWEN3_5_TEXT, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                    layer_types=qwen3_5_layer_types(layers), rope_parameters=QWEN3_5_ROPE, **tiny.QWEN3_5_TOKEN_IDS)
        if kind == "text":  # the text-only form (mlx-lm's conversions): Qwen3_5ForCausalLM
            config, cls, image_processor = tf.Qwen3_5TextConfig(**text), tf.Qwen3_5ForCausalLM, None
        else:  # Qwen3-VL's tower without DeepStack
            vision = dict(depth=vision_depth, hidden_size=1024, intermediate_size=4096, num_heads=16,
                          out_hidden_size=hidden, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                          num_position_embeddings=2304, hidden_act="gelu_pytorch_tanh", in_channels=3)
            config = tf.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True,
                                      **tiny.QWEN3_5_VL_TOKEN_IDS)
            cls, image_processor = tf.Qwen3_5ForConditionalGeneration, ImageProcessor.from_dict(VL_PREPROCESSOR)
    elif kind == "text":
        config = tf.Qwen3Config(**text, max_position_embeddings=40960,
                                rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
        cls, template, image_processor = tf.Qwen3ForCausalLM, QWEN_CHAT_TEMPLATE, None
    else:
        rope = {"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [24, 20, 20],
                "mrope_interleaved": True}
        text.update(max_position_embeddings=262144, rope_parameters=rope)
        vision = dict(depth=vision_depth, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2048,
                      patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                      deepstack_visual_indexes=deepstack, hidden_act="gelu_pytorch_tanh", in_channels=3)
        config = tf.Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True,
                                  **tiny.VL_TOKEN_IDS, **tiny.TOKEN_IDS)
        cls, template = tf.Qwen3VLForConditionalGeneration, QWEN3_VL_CHAT_TEMPLATE
        image_processor = ImageProcessor.from_dict(VL_PREPROCESSOR)
    config.dtype = torch.float32
    torch.manual_seed(0)
    model = cls(config).to(torch.float32).eval()  # transformers' init: Normal(0, 0.02), norms 1
    model.tie_weights()
    out = Path(s["out"])
    out.mkdir(parents=True, exist_ok=True)
    if s.get("dtype") == "bfloat16":  # the weights rounded once; every side loads them in its compute dtype
        model = model.to(torch.bfloat16)
        model.config.dtype = torch.bfloat16
    model.save_pretrained(out)  # safetensors
    if s["shape"] in MOE:  # the Hub's names, which mlx-lm reads (transformers 5 writes num_local_experts and
        # rope_parameters)
        saved = json.loads((out / "config.json").read_text())
        saved.update(num_experts=saved["num_local_experts"], rope_theta=saved["rope_parameters"]["rope_theta"])
        (out / "config.json").write_text(json.dumps(saved, indent=2))
    Processor(tokenizer(), image_processor, template).save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    (out / "bench_scale.json").write_text(json.dumps({"shape": s["shape"], "layers": s["layers"], "params": params,
                                                      "dtype": s.get("dtype", "float32")}))
    return {"params": params}


def checkpoint(root: Path, shape: str, layers: int | None, env, dtype: str = "float32") -> Path:
    folder = root / ckpt_name(shape, layers, dtype)
    marker = folder / "bench_scale.json"
    if marker.exists() and (folder / "config.json").exists():
        got = json.loads(marker.read_text())
        if got.get("shape") == shape and got.get("layers") == layers and got.get("dtype", "float32") == dtype:
            return folder
    t0 = time.perf_counter()
    r = child("build", {"shape": shape, "layers": layers, "out": str(folder), "dtype": dtype}, env)
    if "error" in r:
        sys.exit(f"building {folder} failed: {r['error']}")
    print(f"built {folder} ({r['params'] / 1e6:.0f}M parameters) in {time.perf_counter() - t0:.0f} s", flush=True)
    return folder


def yarn_variant(folder: Path, factor: float) -> Path:
    """The checkpoint with Qwen's YaRN setting (`factor` over the original 32768 positions: 4 gives Qwen3's
    131072) and that context as max_position_embeddings: config.json rewritten (rope_parameters, which
    transformers 5 and ours read alike), every other file linked."""
    out = folder.parent / f"{folder.name}-yarn{factor:g}"
    out.mkdir(exist_ok=True)
    for f in folder.iterdir():
        if f.name != "config.json" and not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    config = json.loads((folder / "config.json").read_text())
    text = config.get("text_config", config)
    theta = (text.get("rope_parameters") or {}).get("rope_theta", text.get("rope_theta", 1e6))
    text["rope_parameters"] = {**(text.get("rope_parameters") or {}), "rope_theta": theta, "rope_type": "yarn",
                               "factor": factor, "original_max_position_embeddings": 32768}
    text.pop("rope_scaling", None)
    text["max_position_embeddings"] = int(factor * 32768)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
