"""SFT data layer: TRL-identical tokenisation (checked against TRL's own SFTTrainer preparation and its
vision collator), image expansion, truncation, packing (against TRL's pack_dataset), batches,
the prefetcher, loading, and one-line errors.

    python -m pytest -q tests/test_data.py
"""

import io
import itertools
import json
import time
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from PIL import Image, ImageDraw

import mlxrl  # noqa: F401  (before mlx)
from mlxrl.data import (
    Example,
    Prefetcher,
    default_buckets,
    detect_format,
    load_rows,
    make_batches,
    pack_bfd,
    pack_wrapped,
    shape_key,
    tokenize_example,
    truncate_example,
)
from mlxrl.processing.processor import (
    QWEN3_VL_CHAT_TEMPLATE,
    QWEN_CHAT_TEMPLATE,
    QWEN_VL_CHAT_TEMPLATE,
    ImageProcessor,
    Processor,
)

IMAGE_ID = 151655
VL_CFG = {"qwen2_vl": dict(min_pixels=56 * 56, max_pixels=112 * 112),
          "qwen3_vl": dict(min_pixels=64 * 64, max_pixels=128 * 128, patch_size=16, image_mean=[0.5] * 3,
                           image_std=[0.5] * 3)}
VL_TEMPLATE = {"qwen2_vl": (QWEN_VL_CHAT_TEMPLATE, "qwen2_5_vl_training"),
               "qwen3_vl": (QWEN3_VL_CHAT_TEMPLATE, "qwen3_vl_training")}


def trl_template(name: str) -> str:
    trl = pytest.importorskip("trl")
    return (Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja").read_text()


def drawn(w, h, seed, mode="RGB"):
    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    ImageDraw.Draw(img).ellipse([w // 4, h // 4, w // 2, h // 2], fill=(200, 30, 30))
    if mode == "RGBA":
        img.putalpha(Image.fromarray(rng.integers(0, 256, (h, w), dtype=np.uint8)))
    return img


@pytest.fixture(scope="module")
def text_proc(tokenizer):
    return Processor(tokenizer, None, QWEN_CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def vl_proc(tokenizer):
    return Processor(tokenizer, ImageProcessor.from_dict(VL_CFG["qwen2_vl"]), QWEN_VL_CHAT_TEMPLATE)


def one_line_error(fn, *needles):
    with pytest.raises(ValueError) as err:
        fn()
    msg = str(err.value)
    assert "\n" not in msg, msg
    for needle in needles:
        assert needle in msg, (needle, msg)
    return msg


# ------------------------------------------------------------------------------ TRL's text pipeline

def trl_prepare(tokenizer, rows, tmp_path, template, **config):
    """TRL 1.16's own SFTTrainer._prepare_dataset on a bare trainer (no model needed)."""
    from datasets import Dataset
    from datasets.fingerprint import generate_random_fingerprint
    from trl import SFTConfig, SFTTrainer

    trainer = SFTTrainer.__new__(SFTTrainer)
    trainer._tokenizer = tokenizer
    col = config.pop("completion_only_loss", None)
    trainer.completion_only_loss = ("prompt" in rows[0]) if col is None else col
    trainer.chat_template = template
    args = SFTConfig(output_dir=str(tmp_path), bf16=False, report_to=[], shuffle_dataset=False, **config)
    rows = [{**r, "row_id": i} for i, r in enumerate(rows)]
    # datasets fingerprints every map by pickling its arguments (the 150k-token tokenizer: ~2 s a call)
    fast = lambda *a, **k: generate_random_fingerprint()
    with mock.patch("datasets.fingerprint.update_fingerprint", fast), \
            mock.patch("datasets.arrow_dataset.update_fingerprint", fast):
        ds = SFTTrainer._prepare_dataset(trainer, Dataset.from_list(rows), tokenizer, args, False, None, "train")
    return {r["row_id"]: (r["input_ids"], r["labels"]) for r in ds}  # rows TRL dropped as untrainable are missing


TOOL_CHAT = [
    {"role": "system", "content": "You help."}, {"role": "user", "content": "time?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_time", "arguments": {"tz": "UTC"}}}]},
    {"role": "tool", "content": "12:00"},
    {"role": "assistant", "content": "Noon."}, {"role": "user", "content": "thanks"},
    {"role": "assistant", "content": "\n\nYou're welcome 😀"},
]
TEXT_ROWS = {
    "language_modeling": [{"text": "The quick brown fox."}, {"text": "Already ends<|im_end|>"},
                          {"text": "x = 1234567 " * 30}],
    "prompt_completion": [{"prompt": "The sky is", "completion": " blue."},
                          {"prompt": "2 + 2 =", "completion": " 4 " * 40},
                          {"prompt": "Hello wor", "completion": "ld!"}],  # " world" merges across the boundary
    "conversational": [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]},
                       {"messages": TOOL_CHAT}],
    "conversational_pc": [{"prompt": [{"role": "user", "content": "Capital of France?"}],
                           "completion": [{"role": "assistant", "content": "Paris."}]},
                          {"prompt": TOOL_CHAT[:4], "completion": TOOL_CHAT[4:5]}],
}


@pytest.mark.parametrize("kind", list(TEXT_ROWS))
@pytest.mark.parametrize("max_length,mode", [(None, "keep_start"), (40, "keep_start"), (40, "keep_end")])
def test_text_rows_tokenise_like_trl(kind, max_length, mode, tokenizer, text_proc, tmp_path):
    rows = TEXT_ROWS[kind]
    want = trl_prepare(tokenizer, rows, tmp_path, QWEN_CHAT_TEMPLATE, max_length=max_length, truncation_mode=mode)
    assert len(want) >= len(rows) - 1
    for i, row in enumerate(rows):
        ex = tokenize_example(row, text_proc, index=i, max_length=max_length, truncation_mode=mode)
        assert ex.input_ids.dtype == np.int32 and ex.labels.dtype == np.int32 and ex.index == i
        assert ex.pixel_values is None and ex.image_grid_thw is None and ex.images == []
        if i not in want:  # TRL drops a row truncation left untrainable; we keep it for the batch guard
            assert ex.num_trainable == 0 and len(ex) == max_length
            continue
        assert ex.input_ids.tolist() == want[i][0]
        assert ex.labels.tolist() == want[i][1]
        assert ex.num_trainable == sum(t != -100 for t in want[i][1][1:])  # what the shifted loss scores
    if kind in ("prompt_completion", "conversational_pc"):  # and the mask really masks something
        assert -100 in want[0][1]


@pytest.mark.parametrize("kind", ["conversational", "conversational_pc"])
def test_assistant_only_loss_matches_trl_generation_template(kind, tokenizer, text_proc, tmp_path):
    """Reference: TRL with its Qwen3-2507 *training* template ({% generation %} markers) and
    transformers' assistant mask; ours: the plain template and ChatML structure."""
    rows = TEXT_ROWS[kind] + [{"messages": TOOL_CHAT[:3]} if kind == "conversational" else
                              {"prompt": TOOL_CHAT[:2], "completion": TOOL_CHAT[2:3]}]
    for col in (None, False):
        want = trl_prepare(tokenizer, rows, tmp_path, trl_template("qwen3_instruct_2507_training"),
                           assistant_only_loss=True, completion_only_loss=col)
        assert len(want) == len(rows)
        for i, row in enumerate(rows):
            ids, labels = want[i]
            ex = tokenize_example(row, text_proc, index=i, assistant_only_loss=True, completion_only_loss=col)
            assert ex.input_ids.tolist() == ids
            assert ex.labels.tolist() == labels, (i, col)
    # the assistant's <|im_end|> and the newline after it are trained; the user's are not
    ex = tokenize_example(TEXT_ROWS["conversational"][0], text_proc, index=0, assistant_only_loss=True)
    trained = ex.labels[ex.labels != -100].tolist()
    assert tokenizer.decode(trained) == "Hello!<|im_end|>\n"


def test_sharegpt_conversations_and_tools_column(text_proc):
    plain = tokenize_example({"messages": TEXT_ROWS["conversational"][0]["messages"]}, text_proc, index=0)
    share = tokenize_example({"conversations": [{"from": "user", "value": "Hi"},
                                                {"from": "assistant", "value": "Hello!"}]}, text_proc, index=0)
    assert share.input_ids.tolist() == plain.input_ids.tolist()
    tools = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {}}}]
    row = {"messages": TEXT_ROWS["conversational"][0]["messages"], "tools": json.dumps(tools)}
    text = text_proc.tokenizer.decode(tokenize_example(row, text_proc, index=0).input_ids)
    assert '"name": "f"' in text and text.startswith("<|im_start|>system\n# Tools")


# ---------------------------------------------------------------------------- TRL's vision collator

@pytest.fixture(scope="module")
def hf_vl_processors(tokenizer):
    """transformers' Qwen2-VL / Qwen3-VL processors (PIL image processor, no video processor)."""
    from transformers import Qwen2VLProcessor, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    def no_video(cls):
        class NoVideo(cls):
            def check_argument_for_proper_class(self, name, arg):
                if name != "video_processor":
                    return super().check_argument_for_proper_class(name, arg)
        return NoVideo

    out = {}
    for arch, cls in (("qwen2_vl", Qwen2VLProcessor), ("qwen3_vl", Qwen3VLProcessor)):
        ref = no_video(cls)(image_processor=Qwen2VLImageProcessorPil(**VL_CFG[arch]), tokenizer=tokenizer,
                            video_processor=None, chat_template=VL_TEMPLATE[arch][0])
        ours = Processor(tokenizer, ImageProcessor.from_dict(VL_CFG[arch]), VL_TEMPLATE[arch][0])
        out[arch] = (ref, ours)
    return out


def vl_rows():
    a, b, c = drawn(100, 37, 0), drawn(60, 90, 1), drawn(150, 120, 2)
    return [
        {"images": [a], "messages": [{"role": "user", "content": "What is this?"},
                                     {"role": "assistant", "content": "A red dot."}]},
        {"images": [b, c], "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Compare"}, {"type": "image"},
                                         {"type": "text", "text": "and"}, {"type": "image"}]},
            # TRL would also put the images into a later user turn whose content is a string: keep it a list
            {"role": "assistant", "content": "Same dot."},
            {"role": "user", "content": [{"type": "text", "text": "Sure?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Yes."}]}]},
        {"images": [], "messages": [{"role": "user", "content": "No image."},
                                    {"role": "assistant", "content": "Fine."}]},
    ]


def vl_pc_rows():
    return [{"images": [drawn(80, 80, 3)], "prompt": [{"role": "user", "content": "Colour?"}],
             "completion": [{"role": "assistant", "content": "Red."}]},
            {"images": [drawn(40, 100, 4), drawn(64, 64, 5)],
             "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                                     {"type": "text", "text": "Which is wider?"}]}],
             "completion": [{"role": "assistant", "content": "The second."}]}]


def assert_same_as_collator(ex: Example, out: dict):
    assert ex.input_ids.tolist() == out["input_ids"][0].tolist()
    assert ex.labels.tolist() == out["labels"][0].tolist()
    if "pixel_values" in out:
        np.testing.assert_allclose(ex.pixel_values, out["pixel_values"].numpy(), atol=1e-5, rtol=0)
        assert ex.image_grid_thw.tolist() == out["image_grid_thw"].tolist()
    else:
        assert ex.pixel_values is None


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen3_vl"])
def test_vision_rows_match_trl_collator(arch, hf_vl_processors):
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling as Collator

    ref, ours = hf_vl_processors[arch]
    training = trl_template(VL_TEMPLATE[arch][1])
    for aol in (False, True):
        collate = Collator(ref, assistant_only_loss=aol, chat_template=training if aol else None)
        for i, row in enumerate(vl_rows()):
            ex = tokenize_example(row, ours, index=i, assistant_only_loss=aol)
            assert_same_as_collator(ex, collate([dict(row)]))
            # each image is one run of t*h*w/4 placeholders between <|vision_start|> and <|vision_end|>
            counts = ex.image_spans[:, 1] - ex.image_spans[:, 0]
            assert counts.tolist() == (ex.image_grid_thw.prod(1) // 4).tolist() if ex.images else counts.size == 0
            assert int((ex.input_ids == IMAGE_ID).sum()) == int(counts.sum())
            for s, e in ex.image_spans:
                assert (ex.input_ids[s:e] == IMAGE_ID).all()
                assert ex.input_ids[s - 1] == 151652 and ex.input_ids[e] == 151653  # vision start / end
    collate = Collator(ref, completion_only_loss=True)
    for i, row in enumerate(vl_pc_rows()):
        ex = tokenize_example(row, ours, index=i)
        assert ex.num_trainable > 0
        assert_same_as_collator(ex, collate([dict(row)]))


def test_image_sources_decode_to_the_same_pixels(vl_proc, tmp_path):
    img = drawn(70, 50, 7, "RGBA")
    path = tmp_path / "a.png"
    img.save(path)
    want = vl_proc.image_processor([img])[0]  # the processor composites alpha onto white itself
    msgs = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "!"}]
    for source in (img, str(path), path.read_bytes(), {"bytes": path.read_bytes(), "path": None},
                   {"bytes": None, "path": str(path)}):
        ex = tokenize_example({"images": [source], "messages": msgs}, vl_proc, index=0)
        np.testing.assert_array_equal(ex.pixel_values, want)
        assert ex.images[0] is source  # kept as given; decoded only when pixel_values is read
    single = tokenize_example({"image": img, "messages": msgs}, vl_proc, index=0)
    np.testing.assert_array_equal(single.pixel_values, want)


def test_vision_text_rows_get_eos_and_images(vl_proc):
    """Deliberate difference from TRL's vision collator: EOS is added to text/completions here too."""
    ph = "<|vision_start|><|image_pad|><|vision_end|>"
    ex = tokenize_example({"images": [drawn(60, 60, 0)], "prompt": f"{ph}Colour:", "completion": " red"},
                          vl_proc, index=0)
    assert ex.input_ids[-1] == vl_proc.eos_token_id and ex.labels[-1] == vl_proc.eos_token_id
    assert vl_proc.tokenizer.decode(ex.labels[ex.labels != -100]) == " red<|im_end|>"
    assert len(ex.images) == 1 and ex.image_spans.shape == (1, 2)


# ------------------------------------------------------------------------------------- truncation

def test_truncation_keeps_whole_images_and_drops_the_rest(vl_proc):
    imgs = [drawn(60, 60, 0), drawn(90, 40, 1)]
    row = {"images": imgs, "messages": [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "first " * 20}]},
        {"role": "assistant", "content": "ok " * 10},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "second"}]},
        {"role": "assistant", "content": "done"}]}
    full = tokenize_example(row, vl_proc, index=3, max_length=None)
    (s0, e0), (s1, e1) = full.image_spans.tolist()
    n0 = int(full.image_grid_thw[0].prod())
    head = tokenize_example(row, vl_proc, index=3, max_length=s1 - 1)  # second image entirely cut off
    assert head.input_ids.tolist() == full.input_ids[:s1 - 1].tolist() and len(head.images) == 1
    np.testing.assert_array_equal(head.pixel_values, full.pixel_values[:n0])
    assert head.image_grid_thw.tolist() == full.image_grid_thw[:1].tolist()
    tail = tokenize_example(row, vl_proc, index=3, max_length=len(full) - e0, truncation_mode="keep_end")
    assert tail.input_ids.tolist() == full.input_ids[e0:].tolist() and len(tail.images) == 1
    np.testing.assert_array_equal(tail.pixel_values, full.pixel_values[n0:])
    assert tail.image_spans.tolist() == [[s1 - e0, e1 - e0]]
    one_line_error(lambda: tokenize_example(row, vl_proc, index=3, max_length=s1 + 2),
                   "row 3", "image 1", f"max_length >= {e1}")
    one_line_error(lambda: truncate_example(full, len(full) - s0 - 1, "keep_end"), "row 3", "image 0",
                   f"max_length >= {len(full) - s0}")


# ----------------------------------------------------------------------------------------- errors

def test_errors_are_one_line_and_name_the_row(vl_proc, text_proc, tmp_path):
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "?"}]}]
    one_line_error(lambda: detect_format({"prompt": "a"}, 7), "row 7", "'completion'")
    one_line_error(lambda: detect_format({"input": "a", "output": "b"}, 8), "row 8", "'input'", "'messages'")
    one_line_error(lambda: detect_format({"prompt": "a", "completion": [{"role": "assistant", "content": "b"}]}, 9),
                   "row 9", "both")
    one_line_error(lambda: tokenize_example({"images": [drawn(50, 50, 0)], "messages": msgs}, vl_proc, index=5),
                   "row 5", "2 image block(s)", "1 image(s)")
    one_line_error(lambda: tokenize_example({"text": "<|image_pad|> hi"}, vl_proc, index=6), "row 6", "1 image")
    one_line_error(lambda: tokenize_example({"images": [drawn(50, 50, 0), b"not a png"], "messages": msgs},
                                            vl_proc, index=4), "row 4", "image 1")
    missing = str(tmp_path / "missing.png")
    one_line_error(lambda: tokenize_example({"images": [missing, drawn(9, 9, 0)], "messages": msgs}, vl_proc,
                                            index=2), "row 2", "image 0", missing)
    one_line_error(lambda: tokenize_example({"text": "hi"}, text_proc, index=11, assistant_only_loss=True),
                   "row 11", "assistant_only_loss")
    one_line_error(lambda: tokenize_example({"images": [drawn(50, 50, 0)], "text": "hi"}, text_proc,
                                            index=12), "row 12", "text-only")


# ---------------------------------------------------------------------------------------- packing

def trl_pack(seqs, max_length, strategy):
    from datasets import Dataset
    from trl import pack_dataset

    return pack_dataset(Dataset.from_dict({"input_ids": seqs}), max_length, strategy=strategy)[:]


def test_bfd_groups_like_trl():
    rng = np.random.default_rng(0)
    for max_length in (16, 37, 64):
        lengths = [int(x) for x in rng.integers(0, 80, 300)] + [max_length, max_length + 5, 1, 1, 0]
        seqs = [[i + 1] * n for i, n in enumerate(lengths)]  # token = index + 1, to read TRL's rows back
        packed = trl_pack(seqs, max_length, "bfd")
        want = [list(dict.fromkeys(t - 1 for t in row)) for row in packed["input_ids"]]
        got = pack_bfd(lengths, max_length)
        assert got == want
        for row, seq_lengths in zip(got, packed["seq_lengths"], strict=True):
            assert [min(lengths[i], max_length) for i in row] == seq_lengths
            assert sum(seq_lengths) <= max_length
        assert sorted(i for row in got for i in row) == [i for i, n in enumerate(lengths) if n > 0]


def text_examples(n, seed=0, lo=1, hi=50):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        ids = rng.integers(10, 1000, int(rng.integers(lo, hi))).astype(np.int32)
        labels = np.where(rng.random(len(ids)) < 0.7, ids, -100).astype(np.int32)
        out.append(Example(ids, labels, index=100 + i))
    return out


def test_wrapped_cuts_like_trl_for_text():
    examples = text_examples(40)
    rows = pack_wrapped(examples, 32)
    want = trl_pack([e.input_ids.tolist() for e in examples], 32, "wrapped")["input_ids"]
    got = [np.concatenate([examples[i].input_ids[s:e] for i, s, e in row]).tolist() for row in rows]
    assert got == want


def fake_vl_example(index, layout, seed):
    """Text runs and images (negative counts): [5, -6, 3] = 5 text tokens, a 6-token image, 3 text tokens."""
    rng = np.random.default_rng(seed)
    ids, spans, pixels, grids = [], [], [], []
    for n in layout:
        if n < 0:  # an image of grid (1, 2, -2n): -n tokens after the 2x2 merge, 4 patches each
            spans.append((len(ids), len(ids) - n))
            pixels.append(rng.normal(size=(-4 * n, 8)).astype(np.float32))
            grids.append((1, 2, -2 * n))
        ids += [IMAGE_ID] * -n if n < 0 else rng.integers(10, 1000, n).tolist()
    ids = np.asarray(ids, np.int32)
    return Example(ids, ids.copy(), [None] * len(spans), np.concatenate(pixels), np.asarray(grids), index,
                   np.asarray(spans))


def test_wrapped_never_cuts_an_image():
    examples = [fake_vl_example(i, [3 + i % 5, -4 - i % 3, 2, -5], i) for i in range(12)]
    rows = pack_wrapped(examples, 16)
    flat = [(i, s, e) for row in rows for i, s, e in row]
    assert all(sum(e - s for _, s, e in row) <= 16 for row in rows)
    for i, ex in enumerate(examples):  # every token once, in order; no piece starts or ends inside an image
        pieces = [(s, e) for j, s, e in flat if j == i]
        assert [s for s, _ in pieces] == [0] + [e for _, e in pieces[:-1]] and pieces[-1][1] == len(ex)
        for s, e in pieces:
            assert not any(a < s < b or a < e < b for a, b in ex.image_spans)
    batches = make_batches(examples, 2, packing=True, packing_strategy="wrapped", max_length=16, pad_token_id=0,
                           shuffle=False)
    pixels = np.concatenate([b.pixel_values for b in batches])
    np.testing.assert_array_equal(pixels, np.concatenate([e.pixel_values for e in examples]))
    big = fake_vl_example(0, [2, -20], 0)
    one_line_error(lambda: pack_wrapped([big], 16), "row 0", "image 0", "max_length=16")


# ---------------------------------------------------------------------------------------- batches

def documents(batch):
    """(ids, labels) of every document of the batch, rows in order."""
    segs = batch.segment_ids if batch.segment_ids is not None else batch.attention_mask
    return [(batch.input_ids[r][seg == k], batch.labels[r][seg == k])
            for r, seg in enumerate(segs) for k in range(1, seg.max() + 1)]


@pytest.mark.parametrize("mode", ["plain", "bfd", "wrapped", "padding_free", "bfd_padding_free"])
def test_batches_are_deterministic_bucketed_and_complete(mode):
    examples = text_examples(37)
    kw = {"plain": {}, "bfd": {"packing": True}, "wrapped": {"packing": True, "packing_strategy": "wrapped"},
          "padding_free": {"padding_free": True}, "bfd_padding_free": {"packing": True, "padding_free": True}}[mode]
    make = lambda **extra: make_batches(examples, 4, max_length=100, pad_token_id=7, **kw, **extra)
    a, b, c = make(seed=1, epoch=0), make(seed=1, epoch=0), make(seed=1, epoch=1)
    for x, y in zip(a, b, strict=True):
        for key in ("input_ids", "labels", "attention_mask", "segment_ids"):
            np.testing.assert_array_equal(getattr(x, key), getattr(y, key))
    assert [x.example_ids for x in a] != [x.example_ids for x in c]  # a new order each epoch
    buckets = default_buckets(400 if "padding_free" in mode else 100)
    assert buckets == ((64, 128, 256, 400) if "padding_free" in mode else (64, 100))
    docs = {}
    for batch in a:
        B, L = batch.input_ids.shape
        assert L in buckets and L == min(x for x in buckets if x >= batch.attention_mask.sum(1).max())
        assert B == 1 if "padding_free" in mode else B <= 4
        assert batch.input_ids.dtype == batch.labels.dtype == batch.attention_mask.dtype == np.int32
        assert (batch.input_ids[batch.attention_mask == 0] == 7).all()
        assert (batch.labels[batch.attention_mask == 0] == -100).all()
        assert batch.num_tokens == batch.attention_mask.sum()
        assert batch.num_trainable == (batch.labels != -100).sum()
        if mode == "plain":
            assert batch.segment_ids is None
        else:  # documents 1..k, contiguous, then padding 0
            for seg, mask in zip(batch.segment_ids, batch.attention_mask, strict=True):
                n = int(mask.sum())
                assert (seg[n:] == 0).all() and seg[0] == 1 and (np.diff(seg[:n]) >= 0).all()
                assert set(np.diff(seg[:n]).tolist()) <= {0, 1} and (mask == (seg > 0)).all()
        for ids in batch.example_ids:
            docs[ids] = docs.get(ids, 0) + 1
    by_id = {e.index: e for e in examples}
    assert set(docs) == set(by_id)
    if mode != "wrapped":  # every example exactly once, intact, first label masked
        assert set(docs.values()) == {1}
        for batch in a:
            for (ids, labels), ex_id in zip(documents(batch), batch.example_ids, strict=True):
                ex = by_id[ex_id]
                assert ids.tolist() == ex.input_ids.tolist()
                assert labels.tolist() == [-100] + ex.labels[1:].tolist()


def test_padding_free_matches_trl_collator():
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    examples = text_examples(9, seed=3)
    collate = DataCollatorForLanguageModeling(pad_token_id=7, padding_free=True)
    by_id = {e.index: e for e in examples}
    for batch in make_batches(examples, 4, padding_free=True, max_length=64, pad_token_id=7, seed=5):
        want = collate([{"input_ids": by_id[i].input_ids.tolist(), "labels": by_id[i].labels.tolist()}
                        for i in batch.example_ids])
        n = want["input_ids"].shape[1]
        assert batch.input_ids[:, :n].tolist() == want["input_ids"].tolist()
        assert batch.labels[:, :n].tolist() == want["labels"].tolist()
        # TRL's restarting position ids are where our segment ids change
        starts = np.flatnonzero(want["position_ids"][0].numpy() == 0).tolist()
        assert np.flatnonzero(np.diff(batch.segment_ids[0][:n], prepend=0)).tolist() == starts


def test_vision_batches_keep_images_in_row_order(vl_proc):
    rows = vl_rows() + vl_pc_rows()
    examples = [tokenize_example(r, vl_proc, index=i) for i, r in enumerate(rows)]
    for kw in ({}, {"packing": True}, {"padding_free": True}):
        for batch in make_batches(examples, 2, max_length=256, pad_token_id=0, seed=2, **kw):
            parts = [examples[i] for i in batch.example_ids if examples[i].images]
            if not parts:
                assert batch.pixel_values is None and batch.image_grid_thw is None
                continue
            np.testing.assert_array_equal(batch.pixel_values, np.concatenate([e.pixel_values for e in parts]))
            assert batch.image_grid_thw.tolist() == np.concatenate([e.image_grid_thw for e in parts]).tolist()
            # image placeholders in the batch (row-major) match the grids in order
            n_img = int((batch.input_ids == IMAGE_ID).sum())
            assert n_img == int(batch.image_grid_thw.prod(1).sum() // 4)
            assert shape_key(batch) == (*batch.input_ids.shape, batch.pixel_values.shape[0])


def test_bfd_batches_truncate_long_examples_like_trl():
    examples = text_examples(6, lo=90, hi=120)
    batches = make_batches(examples, 2, packing=True, max_length=64, pad_token_id=0, shuffle=False)
    by_id = {e.index: e for e in examples}
    for batch in batches:
        for (ids, _), ex_id in zip(documents(batch), batch.example_ids, strict=True):
            assert ids.tolist() == by_id[ex_id].input_ids[:64].tolist()
    one_line_error(lambda: make_batches(examples, 2, max_length=64, pad_token_id=0), "max_length=64")
    one_line_error(lambda: make_batches(text_examples(3, lo=70, hi=71), 2, max_length=100, pad_token_id=0,
                                        seq_buckets=(32, 64)), "largest sequence bucket 64")


def test_packed_documents_match_unpacked_forward():
    """End to end with the embedded tiny Qwen3-VL: each document of a packed / padding-free row (images,
    segment ids, pixel order) gets the hidden states it gets alone (the LM head is per token)."""
    import mlx.core as mx

    model, proc = mlxrl.load_default()
    examples = [tokenize_example(r, proc, index=i) for i, r in enumerate(vl_rows() + vl_pc_rows())]
    arr = lambda x: None if x is None else mx.array(x)
    alone = [np.array(model(input_ids=mx.array(e.input_ids[None]), pixel_values=arr(e.pixel_values),
                            image_grid_thw=arr(e.image_grid_thw), return_hidden=True)[0]) for e in examples]
    for kw in ({"packing": True}, {"padding_free": True}):
        for b in make_batches(examples, 3, max_length=512, pad_token_id=proc.pad_token_id, seed=1, **kw):
            logits = np.array(model(input_ids=mx.array(b.input_ids), attention_mask=mx.array(b.attention_mask),
                                    segment_ids=mx.array(b.segment_ids), pixel_values=arr(b.pixel_values),
                                    image_grid_thw=arr(b.image_grid_thw), return_hidden=True))
            docs = [(r, k) for r in range(len(logits)) for k in range(1, b.segment_ids[r].max() + 1)]
            for (r, k), ex_id in zip(docs, b.example_ids, strict=True):
                got = logits[r][b.segment_ids[r] == k]
                np.testing.assert_allclose(got, alone[ex_id], atol=1e-4, rtol=1e-4, err_msg=f"{kw} row {ex_id}")


# ------------------------------------------------------------------------------------- prefetcher

def test_prefetcher_is_bounded_and_ordered():
    produced = []

    def items():
        for i in range(20):
            produced.append(i)
            yield i

    with Prefetcher(items, depth=3) as it:
        time.sleep(0.3)
        assert len(produced) == 4  # 3 queued + 1 waiting to be put: the producer blocks
        assert list(it) == list(range(20))


def test_prefetcher_propagates_errors_and_closes():
    def failing():
        yield 1
        raise KeyError("broken row 3")

    it = Prefetcher(failing)
    assert next(it) == 1
    with pytest.raises(KeyError, match="broken row 3"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)
    it = Prefetcher(lambda: itertools.count(), depth=1)
    next(it)
    time.sleep(0.1)
    it.close()
    assert not it._thread.is_alive()  # a producer blocked on the full queue is released


# ---------------------------------------------------------------------------------------- loading

def test_load_rows_files_folders_and_hub(tmp_path, monkeypatch):
    rows = [{"text": "a"}, {"text": "b"}]
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "1.json").write_text(json.dumps(rows))
    (tmp_path / "d" / "2.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    drawn(20, 20, 0).save(buf, format="PNG")
    img = buf.getvalue()
    pq.write_table(pa.Table.from_pylist([{"text": "c", "images": [{"bytes": img, "path": None}]}]),
                   tmp_path / "d" / "3.parquet")
    assert load_rows(tmp_path / "d" / "1.json") == rows
    got = load_rows(str(tmp_path / "d"))
    assert got[:4] == rows + rows and got[4]["images"][0]["bytes"] == img
    one_line_error(lambda: load_rows(tmp_path / "nope.jsonl"), "nope.jsonl")
    import datasets
    import huggingface_hub

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    one_line_error(lambda: load_rows("no-such-org/no-such-dataset"), "'no-such-org/no-such-dataset'", "Hub")


def test_unreadable_images_name_the_row(vl_proc, tmp_path):
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]},
            {"role": "assistant", "content": "!"}]
    for bad in (b"not an image", str(tmp_path / "missing.png")):
        with pytest.raises(ValueError, match=r"^row 7: cannot read image 0"):
            tokenize_example({"images": [bad], "messages": msgs}, vl_proc, index=7)
    # a valid header with its pixel data cut off fails when decoded (in the data worker), naming the row
    path = tmp_path / "cut.png"
    drawn(64, 64, 1).save(path)
    path.write_bytes(path.read_bytes()[:120])
    ex = tokenize_example({"images": [str(path)], "messages": msgs}, vl_proc, index=9)
    with pytest.raises(ValueError, match=r"^row 9: cannot read image 0"):
        _ = ex.pixel_values


@pytest.mark.parametrize("kw", [{}, {"packing": True}, {"padding_free": True}])
def test_shards_split_each_global_batch(kw):
    """Ranks get disjoint slices of the one-process global batch; uneven tails are split evenly
    and a tail smaller than the number of shards is dropped."""
    examples = text_examples(23, lo=5, hi=40)
    whole = make_batches(examples, 6, max_length=64, pad_token_id=0, seed=4, **kw)
    shards = [make_batches(examples, 2, max_length=64, pad_token_id=0, seed=4, num_shards=3, shard=r, **kw)
              for r in range(3)]
    assert len({len(s) for s in shards}) == 1  # every rank takes part in every step
    for k, batch in enumerate(whole):
        if k == len(shards[0]):  # the dropped tail: fewer rows than shards
            assert batch.input_ids.shape[0] < 3 and not kw.get("padding_free")
            break
        parts = [s[k] for s in shards]
        assert sorted(i for p in parts for i in p.example_ids) == sorted(batch.example_ids)
        assert sum(p.num_trainable for p in parts) == batch.num_trainable
