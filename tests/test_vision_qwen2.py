"""Parity of the MLX Qwen2-VL / Qwen2.5-VL vision towers with transformers, on tiny random models.

Run: pytest tests/test_vision_qwen2.py
"""

# isort: off
import mlxrl  # noqa: F401  (fast BLAS before mlx.core)
import mlx.core as mx

# isort: on
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlxrl.models.qwen2_5_vl.vision import VisionConfig as Qwen25VisionConfig
from mlxrl.models.qwen2_5_vl.vision import VisionModel as Qwen25VisionModel
from mlxrl.models.qwen2_vl.vision import VisionConfig as Qwen2VisionConfig
from mlxrl.models.qwen2_vl.vision import VisionModel as Qwen2VisionModel
from mlxrl.models.qwen2_vl.vision import segment_groups, to_mx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PATCH_DIM = 3 * 2 * 14 * 14
TEXT = dict(
    vocab_size=256,
    hidden_size=48,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 4, 4]},
)
GRIDS = {
    "one_image": [(1, 12, 16)],
    "mixed": [(1, 4, 6), (1, 8, 8), (1, 6, 10)],
    "video_and_image": [(2, 4, 6), (1, 2, 2)],
    # 6x10 and 10x14 merge units: windows of 4x4 units do not tile these grids
    "uneven_windows": [(1, 12, 20), (1, 20, 28), (2, 6, 10)],
}


def _random_init(model):
    """std 0.1, except where it would hide a bug: norm weights near 1 (near 0 they shrink every
    branch), larger q/k/v so attention is peaked (rotary and masks then matter), and a smaller
    patch kernel so the patch signal does not swamp the attention branch in the residual."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_norm = ("norm" in name or "ln_q" in name) and name.endswith("weight")
            std = 0.3 if "attn.qkv" in name else 0.03 if "patch_embed" in name else 0.1
            p.normal_(1.0 if is_norm else 0.0, std)
    return model.eval()


def _load(ours, visual):
    weights = {k: mx.array(v.detach().numpy()) for k, v in visual.state_dict().items()}
    weights = ours.sanitize(weights)
    ours.load_weights(list(weights.items()), strict=True)
    mx.eval(ours.parameters())
    return ours


@pytest.fixture(scope="module")
def qwen2():
    vision = dict(depth=2, embed_dim=32, hidden_size=48, num_heads=2, mlp_ratio=2)
    config = transformers.Qwen2VLConfig(text_config=TEXT, vision_config=vision)
    hf = _random_init(transformers.Qwen2VLForConditionalGeneration(config))
    ours = Qwen2VisionModel(Qwen2VisionConfig.from_dict(config.vision_config.to_dict()))
    return hf, _load(ours, hf.model.visual)


@pytest.fixture(scope="module")
def qwen25():
    vision = dict(
        depth=3,
        hidden_size=32,
        intermediate_size=64,
        out_hidden_size=48,
        num_heads=2,
        window_size=112,
        fullatt_block_indexes=[1],
    )
    config = transformers.Qwen2_5_VLConfig(text_config=TEXT, vision_config=vision)
    hf = _random_init(transformers.Qwen2_5_VLForConditionalGeneration(config))
    ours = Qwen25VisionModel(Qwen25VisionConfig.from_dict(config.vision_config.to_dict()))
    return hf, _load(ours, hf.model.visual)


def _inputs(grids, seed=0):
    """Random patches plus an offset per frame, so attending across frames changes the result."""
    rng = np.random.default_rng(seed)
    frames = [(h * w, PATCH_DIM) for t, h, w in grids for _ in range(t)]
    pixels = np.concatenate([rng.standard_normal(s) + rng.standard_normal(s[1]) for s in frames])
    return pixels.astype(np.float32), np.array(grids, dtype=np.int64)


def _reference(hf, pixels, grid):
    """The image features the language model consumes, concatenated over images."""
    with torch.no_grad():
        out = hf.model.get_image_features(pixel_values=torch.from_numpy(pixels), image_grid_thw=torch.from_numpy(grid))
    return torch.cat(list(out.pooler_output)).numpy()


def _check_parity(hf, ours, grids):
    pixels, grid = _inputs(grids)
    expected = _reference(hf, pixels, grid)
    got = ours(mx.array(pixels), ours.metadata(grid))
    assert got.shape == expected.shape == (len(pixels) // 4, 48)
    diff = np.abs(np.array(got) - expected).max()
    assert diff <= 1e-4, diff
    return diff


@pytest.mark.parametrize("grids", GRIDS.values(), ids=GRIDS.keys())
def test_qwen2_vl_parity(qwen2, grids):
    _check_parity(*qwen2, grids)


@pytest.mark.parametrize("grids", GRIDS.values(), ids=GRIDS.keys())
def test_qwen2_5_vl_parity(qwen25, grids):
    _check_parity(*qwen25, grids)


def _with_segments(meta, name, ids):
    """The same metadata with segments ``name`` (and their attention layout) rebuilt from ``ids``."""
    kept = {k: v for k, v in meta.items() if not k.startswith(f"{name}_")}
    return {**kept, f"{name}_ids": mx.array(ids), **to_mx(segment_groups(np.asarray(ids), name))}


def test_parity_checks_are_sensitive(qwen25):
    """Guards the test itself: wrong segments must miss the reference by far more than 1e-4."""
    hf, ours = qwen25
    pixels, grid = _inputs(GRIDS["uneven_windows"])
    expected = _reference(hf, pixels, grid)
    meta = ours.metadata(grid)
    one_segment = _with_segments(meta, "segment", np.zeros(len(pixels), np.int32))
    no_windows = _with_segments(meta, "window_segment", np.array(meta["segment_ids"]))
    for wrong in (one_segment, no_windows):
        assert np.abs(np.array(ours(mx.array(pixels), wrong)) - expected).max() > 1e-2


def test_segment_layout_is_per_frame(qwen2):
    """Frames of 24, 64 and 60 patches: one [1, L] group per length, in length order, the gather into
    that order and the scatter back (the dense-mask equivalence is in test_vision_memory.py)."""
    _, ours = qwen2
    meta = ours.metadata(np.array(GRIDS["mixed"]))
    groups = [np.array(g) for g in meta["segment_groups"]]
    assert [g.shape for g in groups] == [(1, 24), (1, 60), (1, 64)]
    assert [g[0, 0] for g in groups] == [0, 24 + 64, 24]
    order = np.concatenate([g.reshape(-1) for g in groups])
    assert np.array_equal(np.array(meta["segment_order"]), order)
    assert np.array_equal(order[np.array(meta["segment_scatter"])], np.arange(148))
    assert not any(k.endswith(("_gather", "_valid", "_mask")) for k in meta)


@pytest.mark.parametrize("which", ["qwen2", "qwen25"])
def test_parameter_names_and_sanitize(which, request):
    hf, ours = request.getfixturevalue(which)
    hf_keys = set(hf.model.visual.state_dict())
    assert {k for k, _ in tree_flatten(ours.parameters())} == hf_keys
    weights = dict(tree_flatten(ours.parameters()))
    once = ours.sanitize(weights)
    twice = ours.sanitize(once)
    assert once.keys() == twice.keys() == hf_keys
    assert all(np.array_equal(np.array(once[k]), np.array(twice[k])) for k in once)
    # a channels-last patch kernel (mlx-vlm's layout) is brought back to HF's [E, C, T, P, P]
    hf_kernel = weights["patch_embed.proj.weight"]
    fixed = ours.sanitize({"patch_embed.proj.weight": hf_kernel.transpose(0, 2, 3, 4, 1)})
    assert np.array_equal(np.array(fixed["patch_embed.proj.weight"]), np.array(hf_kernel))


@pytest.mark.parametrize("which", ["qwen2", "qwen25"])
def test_compiled_forward(which, request):
    _, ours = request.getfixturevalue(which)
    traces = []

    def forward(pv, meta):
        traces.append(1)  # runs only while mx.compile traces
        return ours(pv, meta)

    compiled = mx.compile(forward)
    grids = GRIDS["uneven_windows"]
    for seed in (0, 1):  # same shapes, new values: the trace must be reused
        pixels, grid = _inputs(grids, seed)
        meta = ours.metadata(grid)
        eager = ours(mx.array(pixels), meta)
        got = compiled(mx.array(pixels), meta)
        assert np.abs(np.array(got) - np.array(eager)).max() <= 1e-5
    assert len(traces) == 1
