"""RoPE scaling (config.json's rope_scaling / rope_parameters) against transformers: the same tiny Qwen3 and
Qwen2 checkpoints with YaRN (Qwen's long-context setting) and linear position interpolation, logits over a row
four times the original context (<= 1e-4), and the frequencies against transformers' own ROPE_INIT_FUNCTIONS;
the rope types mlxrl does not implement are refused in one line."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers

import mlxrl
from mlxrl.models.language import TextConfig, rope_frequencies

HF_CLASS = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
ORIGINAL = 64  # the original context: the row below is four times longer
SCALINGS = {
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "yarn mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": ORIGINAL,
                    "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2},
    "yarn attention_factor": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
                              "attention_factor": 1.3, "truncate": False},
    "linear": {"rope_type": "linear", "factor": 4.0},
}


def scaled_copy(folder, tmp_path, scaling: dict):
    """The tiny checkpoint with `scaling` in its (text model's) rope parameters (transformers 5's
    rope_parameters; the rope_theta and M-RoPE's sections kept) and a context of 4 x ORIGINAL."""
    out = tmp_path / "scaled"
    shutil.copytree(folder, out)
    config = json.loads((out / "config.json").read_text())
    text = config.get("text_config", config)
    rope = {**(text.get("rope_parameters") or {}), **(text.pop("rope_scaling", None) or {})}
    text["rope_parameters"] = {"rope_theta": text.get("rope_theta", 10000.0), **rope, **scaling}
    text["max_position_embeddings"] = 4 * ORIGINAL
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("arch,name", [("qwen3", name) for name in SCALINGS] + [("qwen2", "yarn")])
def test_logits_match_transformers(tiny_checkpoint, tmp_path, arch, name):
    folder = scaled_copy(tiny_checkpoint(arch), tmp_path, SCALINGS[name])
    ref = getattr(transformers, HF_CLASS[arch]).from_pretrained(str(folder), dtype=torch.float32).eval()
    model, _ = mlxrl.load(folder, dtype="float32")
    ids = np.random.default_rng(0).integers(0, 1000, (1, 4 * ORIGINAL))
    with torch.no_grad():
        expected = ref(input_ids=torch.tensor(ids)).logits.numpy()
    ours = np.array(model(input_ids=mx.array(ids, mx.int32)))
    assert np.abs(expected).max() > 0.1
    assert np.abs(ours - expected).max() <= 1e-4, np.abs(ours - expected).max()
    # the scaling is really applied: the unscaled model differs on the long row
    plain, _ = mlxrl.load(tiny_checkpoint(arch), dtype="float32")
    assert np.abs(np.array(plain(input_ids=mx.array(ids, mx.int32))) - expected).max() > 1e-3


def test_yarn_on_interleaved_mrope_matches_transformers(tiny_checkpoint, tmp_path):
    """Qwen3-VL's text model (interleaved M-RoPE) with YaRN: the same logits as transformers on a long text row."""
    out = scaled_copy(tiny_checkpoint("qwen3_vl"), tmp_path, SCALINGS["yarn"])
    ref = transformers.Qwen3VLForConditionalGeneration.from_pretrained(str(out), dtype=torch.float32).eval()
    assert ref.config.text_config.rope_parameters["rope_type"] == "yarn"
    model, _ = mlxrl.load(out, dtype="float32")
    assert model.language_model.rotary_emb.multimodal and model.language_model.rotary_emb._scale > 1
    ids = np.random.default_rng(1).integers(0, 1000, (1, 4 * ORIGINAL))
    with torch.no_grad():
        expected = ref(input_ids=torch.tensor(ids)).logits.numpy()
    ours = np.array(model(input_ids=mx.array(ids, mx.int32)))
    assert np.abs(ours - expected).max() <= 1e-4, np.abs(ours - expected).max()


@pytest.mark.parametrize("name", list(SCALINGS))
def test_frequencies_match_transformers(name):
    """inv_freq and the attention factor against transformers' ROPE_INIT_FUNCTIONS on a Qwen3 config of
    real widths (head_dim 128, theta 1e6, Qwen3's YaRN setting scaled to its 40960 positions)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = dict(SCALINGS[name])
    if "original_max_position_embeddings" in scaling:
        scaling["original_max_position_embeddings"] = 32768
    hf = transformers.Qwen3Config(head_dim=128, max_position_embeddings=131072,
                                  rope_parameters={"rope_theta": 1e6, **scaling})
    inv_freq, factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf, "cpu")
    ours = TextConfig.from_dict(dict(hidden_size=1024, num_hidden_layers=1, intermediate_size=8, vocab_size=8,
                                     num_attention_heads=16, head_dim=128, max_position_embeddings=131072,
                                     rope_parameters={"rope_theta": 1e6, **scaling}))
    got, scale = rope_frequencies(ours)
    np.testing.assert_allclose(np.array(got), inv_freq.numpy(), rtol=1e-6)
    assert scale == pytest.approx(factor, rel=1e-7)


@pytest.mark.parametrize("kind", ["dynamic", "llama3", "longrope"])
def test_other_rope_types_refused(kind):
    with pytest.raises(NotImplementedError, match=f"rope type '{kind}' is not supported yet .* yarn"):
        TextConfig.from_dict(dict(hidden_size=64, num_hidden_layers=1, intermediate_size=8, vocab_size=8,
                                  num_attention_heads=4, rope_scaling={"rope_type": kind, "factor": 2.0}))
