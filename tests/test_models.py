"""Every architecture against transformers on the same tiny checkpoint (float32, <= 1e-4), Qwen3.5's Gated
DeltaNet layers included: text only, one image, several images of different sizes with left and right padding; the
vectorised M-RoPE index against transformers' get_rope_index; compiled forward; save -> transformers
-> same logits; sanitize idempotent."""

import json

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers
from mlx.utils import tree_flatten
from PIL import Image, ImageDraw

import mlxrl
from mlxrl.loading import load_model, read_weights
from mlxrl.models.vl import mrope_positions

VL = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe", "qwen3_vl_moe"]
TEXT = ["qwen2", "qwen3", "qwen3_5_text", "qwen3_moe", "qwen3_5_moe_text"]
HF_CLASS = {
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
}
TOL = 1e-4


def hf_model(folder, arch):
    return getattr(transformers, HF_CLASS[arch]).from_pretrained(str(folder), dtype=torch.float32).eval()


def image(w, h, seed):
    """A drawn image with structure (not noise), so resizing matters."""
    rng = np.random.default_rng(seed)
    img = Image.new("RGB", (w, h), tuple(int(c) for c in rng.integers(0, 255, 3)))
    d = ImageDraw.Draw(img)
    for _ in range(4):
        x0, y0 = rng.integers(0, w // 2), rng.integers(0, h // 2)
        d.rectangle([x0, y0, x0 + w // 3, y0 + h // 3], fill=tuple(int(c) for c in rng.integers(0, 255, 3)))
    return img


def chat(processor, n_images, text):
    content = [{"type": "image"}] * n_images + [{"type": "text", "text": text}]
    return processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)


def hf_inputs(batch, image_token_id):
    out = {k: torch.from_numpy(np.array(v)) for k, v in batch.items()}
    out["input_ids"] = out["input_ids"].long()
    out["attention_mask"] = out["attention_mask"].long()
    if "image_grid_thw" in out:
        out["image_grid_thw"] = out["image_grid_thw"].long()
        out["mm_token_type_ids"] = (out["input_ids"] == image_token_id).long()
    return out


def compare(ours_logits, ref_logits, mask):
    ours, ref = np.array(ours_logits), ref_logits.detach().numpy()
    valid = np.array(mask).astype(bool)
    diff = np.abs(ours - ref)[valid].max()
    assert np.abs(ref[valid]).max() > 0.1, "reference logits too small for a meaningful comparison"
    assert diff <= TOL, f"max abs diff {diff}"
    return diff


@pytest.fixture(scope="module", params=VL + TEXT)
def arch_pair(request, tiny_checkpoint):
    folder = tiny_checkpoint(request.param)
    model, processor = mlxrl.load(folder, dtype="float32")
    return request.param, folder, model, processor, hf_model(folder, request.param)


def test_text_only_matches_transformers(arch_pair):
    arch, _, model, processor, ref = arch_pair
    texts = [chat(processor, 0, "Count to five: 1, 2, 3"), chat(processor, 0, "Hi")]
    for side in ("right", "left"):
        batch = processor(text=texts, padding_side=side)
        with torch.no_grad():
            expected = ref(**hf_inputs(batch, processor.image_token_id)).logits
        compare(model(**batch), expected, batch["attention_mask"])


def test_images_match_transformers(arch_pair):
    arch, _, model, processor, ref = arch_pair
    if arch in TEXT:
        pytest.skip("text-only architecture")
    ip = processor.image_processor
    near_min = int(np.sqrt(ip.min_pixels)) - 3
    one = processor(text=[chat(processor, 1, "What is this?")], images=[[image(96, 64, 0)]])
    with torch.no_grad():
        expected = ref(**hf_inputs(one, processor.image_token_id)).logits
    compare(model(**one), expected, one["attention_mask"])

    # several images of different sizes / aspect ratios, rows of different lengths, both paddings
    rows = [[image(200, 90, 1), image(near_min, near_min, 2)], [image(64, 160, 3)], []]
    texts = [chat(processor, len(r), f"Describe picture set {i}.") for i, r in enumerate(rows)]
    grids = set()
    for side in ("right", "left"):
        batch = processor(text=texts, images=rows, padding_side=side)
        grids |= {tuple(g) for g in np.array(batch["image_grid_thw"]).tolist()}
        with torch.no_grad():
            expected = ref(**hf_inputs(batch, processor.image_token_id)).logits
        compare(model(**batch), expected, batch["attention_mask"])
    assert len(grids) == 3, grids  # three different grids were exercised


def test_moe_router_loss_matches_transformers_with_images_and_padding(arch_pair):
    """An MoE model's load-balancing loss over a padded batch with images of two sizes equals transformers'
    `aux_loss` (its router logits over the real tokens, the images' included)."""
    arch, _, model, processor, ref = arch_pair
    if "moe" not in arch:
        pytest.skip("not a mixture of experts")
    n = 0 if arch in TEXT else 1
    rows = [[image(200, 90, 1)] if n else [], [image(64, 160, 3)] if n else []]
    texts = [chat(processor, n, "Describe it."), chat(processor, n, "And this one, at some length, please?")]
    batch = processor(text=texts, images=rows if n else None, padding_side="left")
    with torch.no_grad():
        want = float(ref(**hf_inputs(batch, processor.image_token_id), output_router_logits=True).aux_loss)
    aux = []
    model(**batch, router_aux=aux)
    assert abs(float(aux[0]) - want) <= 1e-5 * want, (float(aux[0]), want)


def test_vision_changes_logits(arch_pair):
    """Guard against a forward that ignores the image: other pixels, other logits."""
    arch, _, model, processor, _ = arch_pair
    if arch in TEXT:
        pytest.skip("text-only architecture")
    text = [chat(processor, 1, "What is this?")]
    a = model(**processor(text=text, images=[[image(96, 64, 0)]]))
    b = model(**processor(text=text, images=[[image(96, 64, 5)]]))
    assert np.abs(np.array(a) - np.array(b))[0, -1].max() > 1e-3


def test_rope_index_matches_transformers(arch_pair):
    arch, _, model, processor, ref = arch_pair
    if arch in TEXT:
        pytest.skip("text-only architecture")
    rows = [[image(120, 90, 1), image(60, 200, 2)], [image(64, 64, 3)]]
    batch = processor(text=[chat(processor, 2, "a"), chat(processor, 1, "longer question here")],
                      images=rows, padding_side="left")
    inputs = hf_inputs(batch, processor.image_token_id)
    expected, expected_deltas = ref.model.get_rope_index(
        inputs["input_ids"], mm_token_type_ids=inputs["mm_token_type_ids"],
        image_grid_thw=inputs["image_grid_thw"], attention_mask=inputs["attention_mask"])
    pos, deltas = mrope_positions(batch["input_ids"], batch["image_grid_thw"], batch["attention_mask"],
                                  model.image_token_id, model.merge_size)
    valid = np.array(batch["attention_mask"]).astype(bool)
    np.testing.assert_array_equal(np.array(pos)[:, valid], expected.numpy()[:, valid])
    np.testing.assert_array_equal(np.array(deltas), expected_deltas.numpy().reshape(-1))


def test_hidden_states_and_head(arch_pair):
    arch, _, model, processor, ref = arch_pair
    batch = processor(text=[chat(processor, 0, "hello there")])
    hidden = model(**batch, return_hidden=True)
    with torch.no_grad():
        out = ref(**hf_inputs(batch, processor.image_token_id), output_hidden_states=True)
    np.testing.assert_allclose(np.array(hidden), out.hidden_states[-1].numpy(), atol=TOL)
    assert model.lm_head_weight().shape == (model.text_config.vocab_size, model.text_config.hidden_size)
    logits = hidden @ model.lm_head_weight().T
    np.testing.assert_allclose(np.array(logits), out.logits.numpy(), atol=TOL)


def test_compiled_forward_matches(arch_pair):
    arch, _, model, processor, _ = arch_pair
    if arch in TEXT:
        batch = processor(text=[chat(processor, 0, "compile me")])
        args = (batch["input_ids"], batch["attention_mask"])
        fn = mx.compile(lambda ids, am: model(input_ids=ids, attention_mask=am))
    else:
        batch = processor(text=[chat(processor, 1, "compile me")], images=[[image(80, 120, 4)]])
        meta = model.vision_metadata(np.array(batch["image_grid_thw"]))
        pos, _ = mrope_positions(batch["input_ids"], batch["image_grid_thw"], batch["attention_mask"],
                                 model.image_token_id, model.merge_size)
        args = (batch["input_ids"], batch["attention_mask"], batch["pixel_values"], pos, meta)

        def forward(ids, am, pv, pos, meta):
            return model(input_ids=ids, attention_mask=am, pixel_values=pv, image_grid_thw=batch["image_grid_thw"],
                         position_ids=pos, vision_meta=meta)

        fn = mx.compile(forward)
    np.testing.assert_allclose(np.array(fn(*args)), np.array(model(**batch)), atol=1e-5)


def test_save_round_trip_through_transformers(arch_pair, tmp_path):
    arch, folder, model, processor, _ = arch_pair
    out = mlxrl.save(model, processor, tmp_path / "saved")
    reloaded = hf_model(out, arch)  # transformers reads our folder
    texts = [chat(processor, 0, "round trip")]
    images = None
    if arch in VL:
        texts = [chat(processor, 1, "round trip")]
        images = [[image(100, 70, 9)]]
    batch = processor(text=texts, images=images)
    with torch.no_grad():
        expected = reloaded(**hf_inputs(batch, processor.image_token_id)).logits
    compare(model(**batch), expected, batch["attention_mask"])
    # saved key set equals what transformers itself wrote
    assert set(read_weights(out)) == set(read_weights(folder))
    assert json.loads((out / "config.json").read_text())["model_type"] == arch
    ours_again = load_model(out)
    for (k, a), (_, b) in zip(tree_flatten(model.parameters()), tree_flatten(ours_again.parameters()), strict=True):
        assert mx.array_equal(a, b), k


def test_sanitize_is_idempotent_and_maps_layouts(arch_pair):
    arch, folder, model, _, _ = arch_pair
    raw = read_weights(folder)
    once = model.sanitize(raw)
    twice = model.sanitize(once)
    assert once.keys() == twice.keys()
    assert all(mx.array_equal(once[k], twice[k]) for k in once)
    # the other layout this family has been published in maps to the same weights
    if arch in ("qwen2_vl", "qwen2_5_vl"):
        other = {("model.language_model." + k[6:] if k.startswith("model.") else
                  "model." + k if k.startswith("visual.") else k): v for k, v in raw.items()}
    elif arch in ("qwen3_vl", "qwen3_5", "qwen3_5_moe", "qwen3_vl_moe"):
        lm, vis = "model.language_model.", "model.visual."
        other = {("model." + k[len(lm):] if k.startswith(lm) else
                  "visual." + k[len(vis):] if k.startswith(vis) else k): v for k, v in raw.items()}
    else:
        return
    assert other.keys() != raw.keys()
    assert model.sanitize(other).keys() == once.keys()


def test_packed_row_equals_separate_forwards(arch_pair):
    """Two documents packed in one row with segment ids (positions restart, attention cannot cross)
    give each document the logits it gets alone."""
    arch, _, model, processor, _ = arch_pair
    n_img = 0 if arch in TEXT else 1
    docs = [(chat(processor, n_img, "first document"), [image(90, 60, 1)] if n_img else []),
            (chat(processor, n_img, "the second, longer document"), [image(60, 120, 2)] if n_img else [])]
    alone = [processor(text=[t], images=[imgs] if imgs else None) for t, imgs in docs]
    ids = mx.concatenate([b["input_ids"] for b in alone], axis=1)
    seg = mx.concatenate([mx.full(b["input_ids"].shape, i + 1, dtype=mx.int32) for i, b in enumerate(alone)], axis=1)
    extra = {}
    if n_img:
        extra = {"pixel_values": mx.concatenate([b["pixel_values"] for b in alone]),
                 "image_grid_thw": mx.concatenate([b["image_grid_thw"] for b in alone])}
    packed = np.array(model(input_ids=ids, segment_ids=seg, **extra))
    start = 0
    for b in alone:
        n = b["input_ids"].shape[1]
        np.testing.assert_allclose(packed[0, start:start + n], np.array(model(**b))[0], atol=1e-4)
        start += n
