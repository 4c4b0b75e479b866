"""Tiny random Qwen / Qwen-VL checkpoints for tests, built offline with transformers + torch.

    python scripts/tiny_checkpoints.py --arch qwen3_vl --out /tmp/tiny   # -> /tmp/tiny/qwen3_vl
    python scripts/tiny_checkpoints.py --out /tmp/tiny                   # every arch
    python scripts/tiny_checkpoints.py --arch qwen3_vl --size small --out /tmp/ck   # -> /tmp/ck/qwen3_vl-small

Each folder holds a float32 model (real vocab 151936, 2 text layers, hidden 64, 4 heads / 2 kv
heads of 16, M-RoPE sections [2, 3, 3] for VL, a 2-block vision tower), our tokenizer files and
chat template, and for VL a preprocessor_config.json with small min/max pixels so tests are fast.
Qwen3.5 (`qwen3_5_text`, and `qwen3_5` with Qwen3-VL's tower without DeepStack): Qwen3.5's 248320
vocabulary and tokenizer, 4 layers (3 Gated DeltaNet, 1 gated attention with half of each head rotated).
Qwen3-MoE (`qwen3_moe`): Qwen3's 2 layers with 8 experts (top 2) in the MLPs' place; Qwen3.5-MoE
(`qwen3_5_moe_text`, `qwen3_5_moe`): Qwen3.5's with 8 experts (top 2) and a gated shared expert.
Weights are re-drawn with a larger std than transformers' 0.02 so that logits are far from
uniform and parity tests can fail. The same seed gives the same weights.

`--size small` (qwen3_vl only, for benchmarks): a ~285M-parameter Qwen3-VL (hidden 1024, 8 text
layers, 16 heads / 8 kv heads of 128, MLP 3072, tied 151936 vocab; a 4-block vision tower of width
256), drawn with std 0.02 so activations stay in a realistic range; saved to OUT/qwen3_vl-small.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ARCHS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen2", "qwen3", "qwen3_5_text", "qwen3_5", "qwen3_moe",
         "qwen3_5_moe_text", "qwen3_5_moe", "qwen3_vl_moe")
SEED = 0
INIT_STD = 0.15
# Qwen3.5's 4 layers at 0.15 amplify float32 rounding to ~1e-4 of the logits (transformers' own float32 forward is
# as far from its float64 one): 0.1 keeps the logits far from uniform and the float32 error well below 1e-4
QWEN3_5_INIT_STD = 0.1

TOKEN_IDS = dict(bos_token_id=151643, eos_token_id=151645, pad_token_id=151643)
VL_TOKEN_IDS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                    vision_end_token_id=151653)
TEXT = dict(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
            rms_norm_eps=1e-6, **TOKEN_IDS)
SMALL_STD = 0.02
SMALL_TEXT = dict(TEXT, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128)
SMALL_VISION = dict(depth=4, hidden_size=256, intermediate_size=1024, num_heads=4, out_hidden_size=1024,
                    patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=256,
                    deepstack_visual_indexes=[1, 3], hidden_act="gelu_pytorch_tanh", in_channels=3)
# Qwen3.5's vocabulary and special ids (`tokenizer.build_qwen3_5_tokenizer`); three Gated DeltaNet layers and one
# gated attention layer (transformers' default layer_types for 4 layers)
QWEN3_5_TOKEN_IDS = dict(bos_token_id=None, eos_token_id=248046, pad_token_id=248044)
QWEN3_5_TEXT = dict(TEXT, vocab_size=248320, num_hidden_layers=4, head_dim=16, linear_num_key_heads=2,
                    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                    **QWEN3_5_TOKEN_IDS)
QWEN3_5_VL_TOKEN_IDS = dict(image_token_id=248056, video_token_id=248057, vision_start_token_id=248053,
                            vision_end_token_id=248054)
# half of each attention head rotated (8 of 16 dimensions: interleaved M-RoPE sections [2, 1, 1])
QWEN3_5_ROPE = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.5,
                "mrope_section": [2, 1, 1], "mrope_interleaved": True}
# Qwen3-MoE (Qwen3-30B-A3B's architecture): 8 experts of width 32, top 2, normalised; the load-balancing loss's
# coefficient larger than the real 0.001 so that its share of a gradient shows
QWEN3_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                 router_aux_loss_coef=0.02)
# Qwen3.5-MoE: Qwen3.5's layers, each MLP 8 experts (top 2) beside a gated shared expert
QWEN3_5_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                   router_aux_loss_coef=0.02)
TIED = {"qwen2": True, "qwen3": False, "qwen2_vl": False, "qwen2_5_vl": True, "qwen3_vl": True,
        "qwen3_5_text": True, "qwen3_5": False, "qwen3_moe": False, "qwen3_5_moe_text": False, "qwen3_5_moe": False,
        "qwen3_vl_moe": False}

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
PREPROCESSOR = {
    "qwen2_vl": dict(min_pixels=56 * 56, max_pixels=320 * 320, patch_size=14, temporal_patch_size=2,
                     merge_size=2, image_mean=CLIP_MEAN, image_std=CLIP_STD,
                     processor_class="Qwen2VLProcessor"),
    "qwen2_5_vl": dict(min_pixels=56 * 56, max_pixels=320 * 320, patch_size=14, temporal_patch_size=2,
                       merge_size=2, image_mean=CLIP_MEAN, image_std=CLIP_STD,
                       processor_class="Qwen2_5_VLProcessor"),
    "qwen3_vl": dict(min_pixels=64 * 64, max_pixels=320 * 320, patch_size=16, temporal_patch_size=2,
                     merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
                     processor_class="Qwen3VLProcessor"),
}
PREPROCESSOR["qwen3_5"] = PREPROCESSOR["qwen3_5_moe"] = PREPROCESSOR["qwen3_vl_moe"] = PREPROCESSOR["qwen3_vl"]


def _config(arch: str, size: str = "tiny"):
    import transformers as tf

    tied = TIED[arch]
    mrope = {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [2, 3, 3]}
    if size == "small":
        if arch != "qwen3_vl":
            raise ValueError("--size small is only defined for qwen3_vl")
        text = {**SMALL_TEXT, "tie_word_embeddings": tied,
                "rope_parameters": {**mrope, "mrope_section": [24, 20, 20], "mrope_interleaved": True}}
        cfg = tf.Qwen3VLConfig(text_config=text, vision_config=SMALL_VISION, tie_word_embeddings=tied,
                               **VL_TOKEN_IDS, **TOKEN_IDS)
        return cfg, tf.Qwen3VLForConditionalGeneration
    if arch == "qwen2":
        return tf.Qwen2Config(**TEXT, tie_word_embeddings=tied, rope_parameters={
            "rope_type": "default", "rope_theta": 1_000_000.0}), tf.Qwen2ForCausalLM
    if arch == "qwen3":
        return tf.Qwen3Config(**TEXT, head_dim=16, tie_word_embeddings=tied, rope_parameters={
            "rope_type": "default", "rope_theta": 1_000_000.0}), tf.Qwen3ForCausalLM
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(**TEXT, **QWEN3_MOE, head_dim=16, tie_word_embeddings=tied, rope_parameters={
            "rope_type": "default", "rope_theta": 1_000_000.0}), tf.Qwen3MoeForCausalLM
    if arch == "qwen3_5_text":
        return tf.Qwen3_5TextConfig(**QWEN3_5_TEXT, tie_word_embeddings=tied), tf.Qwen3_5ForCausalLM
    if arch == "qwen3_5_moe_text":
        return tf.Qwen3_5MoeTextConfig(**QWEN3_5_TEXT, **QWEN3_5_MOE, tie_word_embeddings=tied), \
            tf.Qwen3_5MoeForCausalLM
    if arch in ("qwen3_5", "qwen3_5_moe"):
        text = {**QWEN3_5_TEXT, "tie_word_embeddings": tied, "rope_parameters": QWEN3_5_ROPE,
                **(QWEN3_5_MOE if arch == "qwen3_5_moe" else {})}
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                      patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                      hidden_act="gelu_pytorch_tanh", in_channels=3)
        if arch == "qwen3_5_moe":
            return tf.Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=tied,
                                       **QWEN3_5_VL_TOKEN_IDS), tf.Qwen3_5MoeForConditionalGeneration
        cfg = tf.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=tied,
                               **QWEN3_5_VL_TOKEN_IDS)
        return cfg, tf.Qwen3_5ForConditionalGeneration
    if arch == "qwen2_vl":
        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
        cfg = tf.Qwen2VLConfig(text_config={**TEXT, "rope_parameters": mrope, "tie_word_embeddings": tied},
                               vision_config=vision, tie_word_embeddings=tied, **VL_TOKEN_IDS, **TOKEN_IDS)
        return cfg, tf.Qwen2VLForConditionalGeneration
    if arch == "qwen2_5_vl":
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                      fullatt_block_indexes=[1], hidden_act="silu", in_channels=3)
        cfg = tf.Qwen2_5_VLConfig(text_config={**TEXT, "rope_parameters": mrope, "tie_word_embeddings": tied},
                                  vision_config=vision, tie_word_embeddings=tied, **VL_TOKEN_IDS, **TOKEN_IDS)
        return cfg, tf.Qwen2_5_VLForConditionalGeneration
    if arch in ("qwen3_vl", "qwen3_vl_moe"):
        text = {**TEXT, "head_dim": 16, "tie_word_embeddings": tied,
                "rope_parameters": {**mrope, "mrope_interleaved": True}}
        if arch == "qwen3_vl_moe":  # experts of width 24: their checkpoint layout [E, D, 2I] is not square
            text.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, router_aux_loss_coef=0.02)
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                      patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                      deepstack_visual_indexes=[0], hidden_act="gelu_pytorch_tanh", in_channels=3)
        if arch == "qwen3_vl_moe":
            return tf.Qwen3VLMoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=tied,
                                       **VL_TOKEN_IDS, **TOKEN_IDS), tf.Qwen3VLMoeForConditionalGeneration
        cfg = tf.Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=tied,
                               **VL_TOKEN_IDS, **TOKEN_IDS)
        return cfg, tf.Qwen3VLForConditionalGeneration
    raise ValueError(f"unknown arch {arch!r}: choose from {', '.join(ARCHS)}")


def _reinit(model, seed: int, std: float) -> None:
    """Normal(0, std) for every weight and bias; norm scales (ones, or Qwen3.5's zero-centred offsets) and
    Qwen3.5's decay parameters (A_log, dt_bias) keep their initial value plus Normal(0, std)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):  # sorted: order-independent of module layout
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32) * std
            owner = name.split(".")[-2] if "." in name else ""
            is_norm = "norm" in owner or owner.startswith("ln")  # ln_q: the merger's norm
            keep = (is_norm and name.endswith("weight")) or name.endswith(("A_log", "dt_bias"))
            p.copy_(p + noise if keep else noise)


def build(arch: str, out_dir, seed: int = SEED, size: str = "tiny") -> Path:
    """Build ``out_dir/<arch>`` (``out_dir/<arch>-small`` for size "small"): model, tokenizer, chat
    template, VL preprocessor config; returns the folder."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import mlxrl  # noqa: F401  (loads the fast BLAS before mlx.core)
    from mlxrl.processing.processor import (
        QWEN3_5_CHAT_TEMPLATE,
        QWEN3_VL_CHAT_TEMPLATE,
        QWEN_CHAT_TEMPLATE,
        QWEN_VL_CHAT_TEMPLATE,
        ImageProcessor,
        Processor,
        build_qwen3_5_tokenizer,
        build_qwen_tokenizer,
    )

    config, model_cls = _config(arch, size)
    config.dtype = torch.float32
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    std = INIT_STD if not arch.startswith("qwen3_5") else QWEN3_5_INIT_STD
    _reinit(model, seed, SMALL_STD if size == "small" else std)
    if TIED[arch]:
        model.tie_weights()
    out = Path(out_dir) / (arch if size == "tiny" else f"{arch}-{size}")
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)

    template = {"qwen3_vl": QWEN3_VL_CHAT_TEMPLATE, "qwen3_vl_moe": QWEN3_VL_CHAT_TEMPLATE,
                "qwen2_vl": QWEN_VL_CHAT_TEMPLATE, "qwen2_5_vl": QWEN_VL_CHAT_TEMPLATE}.get(arch, QWEN_CHAT_TEMPLATE)
    tokenizer = build_qwen_tokenizer
    if arch.startswith("qwen3_5"):
        template, tokenizer = QWEN3_5_CHAT_TEMPLATE, build_qwen3_5_tokenizer
    image_processor = ImageProcessor.from_dict(PREPROCESSOR[arch]) if arch in PREPROCESSOR else None
    Processor(tokenizer(), image_processor, template).save_pretrained(out)
    return out


def hf_processor(folder):
    """transformers' Qwen2-VL processor for a tiny VL checkpoint folder (PIL image processor, no video
    processor: that one needs torchvision). Imports transformers only, so a torch process that uses it
    keeps torch's own BLAS (mlxrl loads OpenBLAS globally)."""
    import json

    from transformers import AutoTokenizer, Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    class NoVideoProcessor(Qwen2VLProcessor):
        def check_argument_for_proper_class(self, name, arg):
            if name != "video_processor":
                return super().check_argument_for_proper_class(name, arg)

    folder = Path(folder)
    tok = AutoTokenizer.from_pretrained(str(folder))
    cfg = json.loads((folder / "preprocessor_config.json").read_text())
    keys = ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std")
    return NoVideoProcessor(image_processor=Qwen2VLImageProcessorPil(**{k: cfg[k] for k in keys}), tokenizer=tok,
                            video_processor=None, chat_template=(folder / "chat_template.jinja").read_text())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", choices=[*ARCHS, "all"], default="all")
    ap.add_argument("--out", required=True, help="parent folder; each arch goes to OUT/<arch>")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--size", choices=["tiny", "small"], default="tiny", help="small: qwen3_vl only")
    args = ap.parse_args(argv)
    for arch in ARCHS if args.arch == "all" else (args.arch,):
        print(build(arch, args.out, args.seed, args.size))


if __name__ == "__main__":
    main()
