"""The embedded synthetic VQA set (mlxrl.data.synthetic) and exact-match evaluation (mlxrl.evaluate)."""

from collections import Counter, defaultdict

import numpy as np
import pytest

import mlxrl
from mlxrl.data.synthetic import COLORS, COUNTS, DEFAULT_SIDES, SHAPES, SIDES, TYPES, make_vqa
from mlxrl.evaluate import (
    _encode,
    _predict,
    answer_correct,
    exact_match,
    exact_match_by_type,
    split_row,
    text_only_baseline,
)

ANSWERS = {"color": tuple(COLORS), "shape": SHAPES, "count": COUNTS, "position": SIDES}


@pytest.fixture(scope="module")
def default():
    return mlxrl.load_default()


def _question(row):
    return row["messages"][0]["content"][1]["text"]


def _answer(row):
    return row["messages"][1]["content"][0]["text"]


def test_format_and_determinism():
    a, b = make_vqa(16, seed=3, types=TYPES), make_vqa(16, seed=3, types=TYPES)
    for x, y in zip(a, b, strict=True):
        assert x["messages"] == y["messages"] and x["type"] == y["type"]
        assert x["images"][0].tobytes() == y["images"][0].tobytes()
    row = a[0]
    assert [m["role"] for m in row["messages"]] == ["user", "assistant"]
    assert row["messages"][0]["content"][0] == {"type": "image"}
    assert len(row["images"]) == 1 and row["images"][0].mode == "RGB"
    for r in a:
        assert _answer(r) in ANSWERS[r["type"]] and " " not in _answer(r)
    # other seeds and the test split are other scenes
    assert {r["type"] for r in make_vqa(8, seed=3)} == {"color"}  # the default: what learns fast
    for other in (make_vqa(16, seed=4, types=TYPES), make_vqa(16, seed=3, split="test", types=TYPES)):
        assert [r["images"][0].tobytes() for r in other] != [r["images"][0].tobytes() for r in a]
    with pytest.raises(ValueError, match="split"):
        make_vqa(2, split="validation")
    with pytest.raises(ValueError, match="types"):
        make_vqa(2, types=("colour",))
    with pytest.raises(ValueError, match="sides"):
        make_vqa(2, sides=(128, 96))


@pytest.mark.parametrize("n, types", [(480, TYPES), (250, ("color",)), (333, ("shape", "count", "position"))])
def test_answers_balanced_per_question_text(n, types):
    """The question text alone predicts nothing: majority-answer accuracy per text is chance."""
    rows = make_vqa(n, seed=0, types=types)
    by_text = defaultdict(Counter)
    for r in rows:
        by_text[(r["type"], _question(r))][_answer(r)] += 1
    for (qtype, text), counts in by_text.items():
        k = len(ANSWERS[qtype])
        assert set(counts) == set(ANSWERS[qtype]), text
        assert max(counts.values()) - min(counts.values()) <= 1, (text, counts)  # dealt evenly
        assert max(counts.values()) / sum(counts.values()) <= 1 / k + 0.05, (text, counts)
    chance = np.mean([1 / len(ANSWERS[r["type"]]) for r in rows])
    assert text_only_baseline(rows) <= chance + 0.02
    per_type = Counter(r["type"] for r in rows)
    assert set(per_type) == set(types) and max(per_type.values()) - min(per_type.values()) <= 1


def test_text_only_baseline_by_hand():
    def row(q, a):
        return {"messages": [{"role": "user", "content": [{"type": "text", "text": q}]},
                             {"role": "assistant", "content": [{"type": "text", "text": a}]}]}
    rows = [row("A?", "x"), row("A?", "x"), row("A?", "y"), row("B?", "z")]
    assert text_only_baseline(rows) == pytest.approx(3 / 4)


@pytest.mark.parametrize("sides, types", [(DEFAULT_SIDES, ("color",)), ((64, 160), TYPES)])
def test_images_vary(sides, types):
    rows = make_vqa(200, seed=1, types=types, sides=sides)
    images = [r["images"][0] for r in rows]
    assert len({im.tobytes() for im in images}) == len(images)
    sizes = {im.size for im in images}
    assert all(sides[0] <= s <= sides[1] for size in sizes for s in size)
    ratios = [w / h for w, h in sizes]
    spread = sides[1] / sides[0]
    assert len(sizes) > 50 and min(ratios) < spread ** -0.5 and max(ratios) > spread ** 0.5
    # every scene's shapes are drawn: some pixels far from the light background
    assert all((np.asarray(im).min(axis=-1) < 100).mean() > 0.01 for im in images)


def test_rows_render_through_the_default_processor(default):
    _, processor = default
    rows = make_vqa(8, seed=2, types=TYPES, sides=(64, 160))
    texts = [processor.apply_chat_template(r["messages"]) for r in rows]
    batch = processor(text=texts, images=[r["images"] for r in rows], return_tensors="np")
    grid = batch["image_grid_thw"]
    ip = processor.image_processor
    for i, r in enumerate(rows):
        w, h = r["images"][0].size
        assert tuple(grid[i]) == ip.grid(h, w)
        assert ip.min_pixels <= grid[i, 1] * grid[i, 2] * ip.patch_size ** 2 <= ip.max_pixels
        n_image_tokens = int((batch["input_ids"][i] == processor.image_token_id).sum())
        assert n_image_tokens == grid[i].prod() // ip.merge_size ** 2
    assert batch["pixel_values"].shape[0] == grid.prod(axis=1).sum()


class _FakeModel:
    """Logits whose argmax is the true next token at answer and end positions (garbage elsewhere, so
    prompt positions must not count), except: "red" answers predict "blue", and after a "blue"
    answer the end token is missed. No apply_lm_head: exact_match must use the full logits."""

    def __init__(self, tokenizer):
        ids = lambda w: tokenizer(w, add_special_tokens=False)["input_ids"]
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.answer_ids = {i for a in ANSWERS.values() for w in a for i in ids(w)}
        self.red, self.blue, self.newline = ids("red")[0], ids("blue")[0], ids("\n")[0]
        self.vocab = self.end + 1

    def __call__(self, input_ids, **_):
        import mlx.core as mx

        ids = np.asarray(input_ids)
        nxt = np.concatenate([ids[:, 1:], np.zeros_like(ids[:, :1])], axis=1)
        pred = np.where(np.isin(nxt, [*self.answer_ids, self.end]), nxt, 0)
        pred[nxt == self.red] = self.blue
        pred[(nxt == self.end) & (ids == self.blue)] = self.newline
        return (mx.arange(self.vocab)[None, None, :] == mx.array(pred)[:, :, None]).astype(mx.float32)


def test_exact_match_counts_exactly_the_right_rows(default):
    _, processor = default
    rows = make_vqa(24, seed=5, types=("color", "count"))
    fake = _FakeModel(processor.tokenizer)
    expected = np.array([_answer(r) not in ("red", "blue") for r in rows])
    assert 0 < expected.sum() < len(rows)
    for bs in (1, 5, 8):
        np.testing.assert_array_equal(answer_correct(fake, processor, rows, batch_size=bs), expected)
    assert exact_match(fake, processor, rows, batch_size=8) == pytest.approx(expected.mean())
    by_type = exact_match_by_type(fake, processor, rows)
    assert by_type["count"] == 1.0
    colour = [e for e, r in zip(expected, rows, strict=True) if r["type"] == "color"]
    assert by_type["color"] == pytest.approx(np.mean(colour))
    assert by_type["all"] == pytest.approx(expected.mean())


def test_untrained_default_model_scores_near_zero(default):
    model, processor = default
    rows = make_vqa(16, seed=6, split="test", types=TYPES)
    correct = answer_correct(model, processor, rows, batch_size=8)
    assert correct.mean() <= 0.1
    # the LM head run on the answer positions only predicts what the full logits do
    batch, rows_at, pos, _ = _encode(processor, rows[:4])
    np.testing.assert_array_equal(_predict(model, batch, rows_at, pos),
                                  _predict(lambda **b: model(**b), batch, rows_at, pos))


def test_split_row_formats():
    rows = make_vqa(1, seed=0)
    prompt, answer = split_row(rows[0])
    assert prompt == rows[0]["messages"][:1] and answer == _answer(rows[0])
    pc = {"prompt": rows[0]["messages"][:1], "completion": rows[0]["messages"][1:]}
    assert split_row(pc) == (prompt, answer)
    with pytest.raises(ValueError):
        split_row({"text": "x"})
