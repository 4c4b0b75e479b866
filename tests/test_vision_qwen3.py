"""Parity of mlxrl's Qwen3-VL vision tower with transformers' on a tiny random checkpoint.

python -m pytest tests/test_vision_qwen3.py
"""

from __future__ import annotations

import numpy as np
import pytest

# isort: off
import mlxrl  # noqa: F401  (fast BLAS before mlx.core)
import mlx.core as mx
import mlx.nn as nn

# isort: on

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from mlxrl.models.qwen3_vl.vision import VisionConfig, VisionModel  # noqa: E402

TOL = 1e-4
PATCH_DIM = 3 * 2 * 16 * 16
VISION = dict(
    depth=3,
    hidden_size=32,
    num_heads=2,
    intermediate_size=64,
    out_hidden_size=64,
    num_position_embeddings=64,  # an 8 x 8 learned grid
    deepstack_visual_indexes=[0, 1],
)


@pytest.fixture(scope="module")
def towers():
    cfg = transformers.Qwen3VLConfig(
        text_config=dict(
            hidden_size=64,
            head_dim=16,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            num_hidden_layers=2,
            vocab_size=512,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        ),
        vision_config=VISION,
    )
    torch.manual_seed(0)
    hf = transformers.Qwen3VLForConditionalGeneration(cfg).eval().model.visual
    with torch.no_grad():
        # default init is ~0.02: too small to tell a wrong op from a right one
        for name, p in hf.named_parameters():
            base = 1.0 if "norm" in name and name.endswith("weight") else 0.0  # LayerNorm scales ~1
            p.copy_(base + 0.1 * torch.randn_like(p))
    ours = VisionModel(VisionConfig.from_dict(hf.config.to_dict()))
    weights = {k: mx.array(v.detach().numpy()) for k, v in hf.state_dict().items()}
    ours.load_weights(list(ours.sanitize(weights).items()), strict=True)
    mx.eval(ours.parameters())
    return hf, ours


def _inputs(grids, seed=0):
    grid = np.array(grids, dtype=np.int64)
    n = int(grid.prod(-1).sum())
    px = np.random.default_rng(seed).standard_normal((n, PATCH_DIM)).astype(np.float32)
    return grid, px


def _hf(hf, grid, px):
    with torch.no_grad():
        out = hf(torch.from_numpy(px), grid_thw=torch.from_numpy(grid))
    return out.pooler_output.numpy(), [d.numpy() for d in out.deepstack_features]


def _max_diffs(ours_out, ref):
    merged, deep = ours_out
    ref_merged, ref_deep = ref
    assert merged.shape == ref_merged.shape and len(deep) == len(ref_deep)
    diffs = [float(np.abs(np.array(merged) - ref_merged).max())]
    for d, r in zip(deep, ref_deep, strict=True):
        assert d.shape == r.shape
        diffs.append(float(np.abs(np.array(d) - r).max()))
    return diffs


GRIDS = {
    "one_square": [(1, 8, 8)],
    "one_nonsquare_large": [(1, 12, 10)],
    "mixed": [(1, 4, 6), (1, 8, 8), (1, 12, 10), (1, 2, 2), (1, 16, 4)],
    "video_and_image": [(2, 4, 6), (1, 6, 4)],  # frames attend only within themselves
}


@pytest.mark.parametrize("name", list(GRIDS))
def test_matches_transformers(towers, name):
    hf, ours = towers
    grid, px = _inputs(GRIDS[name])
    ref = _hf(hf, grid, px)
    assert np.abs(ref[0]).mean() > 0.1  # outputs are not trivially small
    diffs = _max_diffs(ours(mx.array(px), ours.metadata(grid)), ref)
    assert max(diffs) <= TOL, diffs


def test_compiled_forward_matches(towers):
    hf, ours = towers
    fwd = mx.compile(lambda px, meta: ours(px, meta), inputs=ours.state)
    for grids in (GRIDS["mixed"], GRIDS["video_and_image"], GRIDS["mixed"]):  # recompiles, then reuses
        grid, px = _inputs(grids, seed=1)
        diffs = _max_diffs(fwd(mx.array(px), ours.metadata(grid)), _hf(hf, grid, px))
        assert max(diffs) <= TOL, diffs


def test_metadata_is_per_frame(towers):
    _, ours = towers
    meta = ours.metadata(mx.array([[2, 2, 4], [1, 4, 2]]))
    seg = np.array(meta["segment_ids"])
    assert seg.tolist() == [0] * 8 + [1] * 8 + [2] * 8
    assert np.allclose(np.array(meta["pos_w"]).sum(-1), 1.0)
    assert meta["cos"].dtype == mx.float32 and meta["pos_idx"].dtype == mx.int32


def test_gradients_match(towers):
    """The interpolated position embedding is a gather, so pos_embed.weight gets HF's gradient."""
    hf, ours = towers
    grid, px = _inputs([(1, 4, 6), (1, 12, 10)], seed=2)
    rng = np.random.default_rng(3)
    n_out = int(grid.prod(-1).sum()) // 4
    probes = [rng.standard_normal((n_out, 64)).astype(np.float32) for _ in range(3)]

    def loss_fn(model):
        merged, deep = model(mx.array(px), model.metadata(grid))
        return sum((o * mx.array(p)).sum() for o, p in zip([merged, *deep], probes, strict=True))

    _, grads = nn.value_and_grad(ours, loss_fn)(ours)
    hf.zero_grad()
    out = hf(torch.from_numpy(px), grid_thw=torch.from_numpy(grid))
    outs = [out.pooler_output, *out.deepstack_features]
    sum((o * torch.from_numpy(p)).sum() for o, p in zip(outs, probes, strict=True)).backward()
    for name in ("pos_embed.weight", "patch_embed.proj.weight", "blocks.0.attn.qkv.weight"):
        ref = dict(hf.named_parameters())[name].grad.numpy()
        got = grads
        for part in name.split("."):
            got = got[int(part)] if part.isdigit() else got[part]
        assert np.abs(ref).max() > 0
        scale = max(1.0, float(np.abs(ref).max()))
        assert np.abs(np.array(got) - ref).max() <= TOL * scale, name


def test_sanitize_idempotent_and_channels_last(towers):
    _, ours = towers
    weights = dict(ours.parameters()["patch_embed"]["proj"], pos=mx.zeros((2, 3)))
    weights = {"patch_embed.proj.weight": weights["weight"], "pos_embed.weight": weights["pos"]}
    once = ours.sanitize(weights)
    assert ours.sanitize(once).keys() == weights.keys()
    assert all(mx.array_equal(once[k], weights[k]) for k in weights)
    channels_last = weights["patch_embed.proj.weight"].transpose(0, 2, 3, 4, 1)  # [E, T, P, P, C]
    back = ours.sanitize({"patch_embed.proj.weight": channels_last})["patch_embed.proj.weight"]
    assert mx.array_equal(back, weights["patch_embed.proj.weight"])


def test_config_from_dict_ignores_unknown_keys():
    cfg = VisionConfig.from_dict(
        {**VISION, "model_type": "qwen3_vl_vision", "rope_parameters": {"rope_theta": 5.0}}
    )
    assert cfg.depth == 3 and cfg.rope_theta == 5.0 and cfg.deepstack_visual_indexes == [0, 1]
