"""Generation engine and prompt-shared training forward (tiny random checkpoints, float32).

    python -m pytest -q tests/test_generation.py

- cached, batched greedy generation (left-padded prompts of different lengths, images, G samples
  sharing one prefill) equals uncached argmax decoding of each prompt alone, token for token;
  per-row stops; shared and per-sample prefill agree; seeded sampling is reproducible;
- the sampling filters keep exactly the support transformers' TopK/TopP/MinP warpers keep, and
  draws follow the renormalised distribution;
- the prompt-shared forward gives the repeated forward's log-probs, entropies AND parameter
  gradients (full model, LoRA, gradient checkpointing), text and VLM; compiled == eager.
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from pictures import picture

import mlxrl
from mlxrl.cpu import fastmath
from mlxrl.generation.engine import filter_logprobs, generate, sample_tokens
from mlxrl.generation.shared_prompt import repeated_logprobs, shared_prompt_logprobs
from mlxrl.models.lora import apply_lora

TOL = 1e-4


def chat(processor, n_images, text):
    content = [{"type": "image"}] * n_images + [{"type": "text", "text": text}]
    return processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)


def rows(processor, vl: bool):
    """Three prompts of different lengths; VL: two images of different sizes in the first, none in
    the second, one in the third (so rope deltas differ per row)."""
    if not vl:
        return [chat(processor, 0, "Count to five: 1, 2, 3"), chat(processor, 0, "Hi"),
                chat(processor, 0, "Name a colour of the sky at noon")], [[], [], []]
    return ([chat(processor, 2, "Compare these"), chat(processor, 0, "Hello, how are you today?"),
             chat(processor, 1, "What is it?")],
            [[picture(64, 96, 0), picture(112, 64, 1)], [], [picture(80, 80, 2)]])


def prompts(processor, vl: bool, padding_side="left"):
    texts, images = rows(processor, vl)
    return processor(text=texts, images=images if vl else None, padding_side=padding_side)


@pytest.fixture(scope="module", params=["qwen3", "qwen2", "qwen3_vl", "qwen2_5_vl", "qwen2_vl", "qwen3_5_text"])
def arch_model(request, tiny_checkpoint):
    model, processor = mlxrl.load(tiny_checkpoint(request.param), dtype="float32")
    return request.param, model, processor


def is_vl(arch):
    return arch.endswith("_vl")


# ------------------------------------------------------------------------------------ generation
def uncached_greedy(model, processor, text, images, steps):
    """Argmax decoding of one prompt, unpadded, re-forwarding the whole sequence at every step."""
    batch = processor(text=[text], images=[images] if images else None)
    ids = np.array(batch["input_ids"])[0].tolist()
    extra = {k: batch[k] for k in ("pixel_values", "image_grid_thw") if k in batch}
    out = []
    for _ in range(steps):
        logits = model(mx.array([ids + out]), **extra)
        out.append(int(mx.argmax(logits[0, -1]).item()))
    return out


def test_greedy_cached_batched_equals_uncached(arch_model):
    arch, model, processor = arch_model
    batch = prompts(processor, is_vl(arch))
    G, steps = 2, 6
    texts, images = rows(processor, is_vl(arch))
    refs = [uncached_greedy(model, processor, t, im, steps) for t, im in zip(texts, images, strict=True)]
    # stop row 0 at its 3rd token (if that token does not occur earlier)
    stop = refs[0][2]
    out = generate(model, **batch, num_generations=G, max_tokens=steps, temperature=0.0,
                   stop_token_ids=[stop], pad_token_id=-1)
    ids, mask = np.array(out.completion_ids), np.array(out.completion_mask)
    assert ids.shape[0] == len(texts) * G
    for r in range(ids.shape[0]):
        ref = refs[r // G]
        end = ref.index(stop) + 1 if stop in ref else steps
        assert ids[r, :end].tolist() == ref[:end], f"row {r}"
        assert mask[r].tolist() == [1] * end + [0] * (ids.shape[1] - end)
        assert (ids[r, end:] == -1).all()
        assert bool(out.finished[r]) == (stop in ref) and bool(out.truncated[r]) == (stop not in ref)
    assert np.array(out.prompt_index).tolist() == [r // G for r in range(ids.shape[0])]


def test_continuing_from_the_caches_equals_the_whole_conversation_as_a_prompt(arch_model):
    """Two further turns of some rows (new tokens of different lengths after completions that stopped at
    different steps, one at the last step) from the kept caches == generating from scratch over the whole
    conversation as one prompt: the same greedy tokens and log-probs (Gated DeltaNet's recurrent and
    convolution states, prompt-shared caches and M-RoPE positions included)."""
    from mlxrl.generation.engine import continue_generation

    arch, model, processor = arch_model
    vl = is_vl(arch)
    texts, images = rows(processor, vl)
    batch = prompts(processor, vl)
    G, steps = 2, 5
    first = generate(model, **batch, num_generations=G, max_tokens=steps, temperature=0.0, keep_state=True)
    ids, mask = np.array(first.completion_ids), np.array(first.completion_mask)
    stop = int(ids[2, 1])  # rows stop at different steps: stop where row 2 drew its second token
    first = generate(model, **batch, num_generations=G, max_tokens=steps, temperature=0.0, keep_state=True,
                     stop_token_ids=[stop])
    ids, mask = np.array(first.completion_ids), np.array(first.completion_mask)
    tokenizer = processor.tokenizer
    turn = [tokenizer("\n<|im_start|>user\nresult: 42<|im_end|>\n<|im_start|>assistant\n")["input_ids"],
            tokenizer("\nok")["input_ids"], tokenizer(" and then?")["input_ids"]]
    picked = [0, 3, 5]
    histories = {}
    for r in picked:
        one = processor(text=[texts[r // G]], images=[images[r // G]] if images[r // G] else None)
        histories[r] = (np.array(one["input_ids"])[0].tolist() + ids[r][mask[r] > 0].tolist(),
                        {k: one[k] for k in ("pixel_values", "image_grid_thw") if k in one})
    gen = first
    for round_ in range(2):
        new = [turn[(i + round_) % 3] for i in range(len(picked))]
        gen = continue_generation(model, gen, list(range(len(picked))) if round_ else picked, new, max_tokens=4,
                                  temperature=0.0, stop_token_ids=[stop])
        out_ids, out_mask = np.array(gen.completion_ids), np.array(gen.completion_mask)
        for i, r in enumerate(picked):
            history, extra = histories[r]
            history = history + list(new[i])
            ref = generate(model, mx.array([history]), num_generations=1, max_tokens=4, temperature=0.0,
                           stop_token_ids=[stop], **extra)
            n = int(out_mask[i].sum())
            assert n == int(np.array(ref.completion_mask)[0].sum()), f"{arch} turn {round_} row {r}"
            assert out_ids[i, :n].tolist() == np.array(ref.completion_ids)[0, :n].tolist()
            assert np.abs(np.array(gen.logps)[i, :n] - np.array(ref.logps)[0, :n]).max() < TOL
            histories[r] = (history + out_ids[i, :n].tolist(), extra)
    assert len(set(mask.sum(axis=1).tolist())) > 1  # the first turn's rows did stop at different steps


@pytest.mark.usefixtures("kernel_path")
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_vl"])
def test_sampling_shared_prefill_matches_per_sample_and_training_logps(tiny_checkpoint, arch):
    """Shared prefill == per-sample prefill (same keys); seeded runs repeat; the returned logps
    equal the training forward's (`shared_prompt_logprobs` at the same temperature)."""
    model, processor = mlxrl.load(tiny_checkpoint(arch), dtype="float32")
    batch = prompts(processor, is_vl(arch))
    kw = dict(num_generations=3, max_tokens=5, temperature=0.8, top_k=50, min_p=0.01, seed=7)
    a = generate(model, **batch, **kw)
    b = generate(model, **batch, **kw, shared_prefill=False)
    c = generate(model, **batch, **{**kw, "seed": 8})
    assert (np.array(a.completion_ids) == np.array(b.completion_ids)).all()
    assert mx.abs(a.logps - b.logps).max().item() < TOL
    assert (np.array(a.completion_ids) != np.array(c.completion_ids)).any()
    assert (np.array(a.sampling_logps) >= np.array(a.logps) - 1e-6).all()  # filtering only raises p
    imgs = {k: batch[k] for k in ("pixel_values", "image_grid_thw") if k in batch}
    train = shared_prompt_logprobs(model, batch["input_ids"], batch["attention_mask"], a.completion_ids,
                                   a.completion_mask, temperature=0.8, **imgs)
    assert mx.abs(train - a.logps).max().item() < TOL


def test_right_padded_prompts_are_left_aligned(arch_model):
    arch, model, processor = arch_model
    left, right = prompts(processor, is_vl(arch)), prompts(processor, is_vl(arch), "right")
    kw = dict(num_generations=2, max_tokens=4, temperature=1.0, seed=3)
    a, b = generate(model, **left, **kw), generate(model, **right, **kw)
    assert (np.array(a.completion_ids) == np.array(b.completion_ids)).all()


# -------------------------------------------------------------------------------------- sampling
PROBS = np.array([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02])


@pytest.mark.parametrize("kw, support", [
    (dict(top_k=3), [0, 1, 2]),
    (dict(top_p=0.7), [0, 1, 2]),  # 0.4 + 0.25 < 0.7 <= 0.8: the smallest set reaching top_p
    (dict(min_p=0.2), [0, 1, 2, 3]),  # p >= 0.2 * 0.4
    (dict(top_k=5, top_p=0.9), [0, 1, 2, 3]),  # top_p of the top-5 renormalised (mass 0.95)
    (dict(), list(range(7))),
])
def test_sampler_support_and_frequencies(kw, support):
    n = 20000
    logits = mx.broadcast_to(mx.array(np.log(PROBS), dtype=mx.float32), (n, len(PROBS)))
    tok, slp, lp = sample_tokens(logits, mx.random.key(0), temperature=1.0, **kw)
    tok = np.array(tok)
    assert set(np.unique(tok).tolist()) == set(support)
    expect = np.zeros_like(PROBS)
    expect[support] = PROBS[support] / PROBS[support].sum()
    freq = np.bincount(tok, minlength=len(PROBS)) / n
    assert np.abs(freq - expect).max() < 0.015  # ~4 standard deviations at n = 20000
    np.testing.assert_allclose(np.exp(np.array(slp)), expect[tok], rtol=1e-5)
    np.testing.assert_allclose(np.exp(np.array(lp)), PROBS[tok], rtol=1e-5)


def test_filters_out_of_range_are_refused():
    logits = mx.array(np.log(PROBS)[None], dtype=mx.float32)
    for kw in (dict(min_p=1.5), dict(top_p=0.0), dict(top_k=-1)):
        with pytest.raises(ValueError, match="sampling filters out of range"):
            sample_tokens(logits, mx.random.key(0), **kw)


def test_temperature_applies_before_filters():
    """top_p on the tempered distribution (transformers' order): at T=0.5 the top token alone
    holds 0.4^2 / sum(p^2) = 0.63 of the mass, so top_p=0.6 keeps only it."""
    logits = mx.array(np.log(PROBS)[None], dtype=mx.float32)
    sampling, tempered = filter_logprobs(logits, temperature=0.5, top_p=0.6)
    assert np.isfinite(np.array(sampling)[0]).tolist() == [True] + [False] * 6
    t = PROBS**2 / (PROBS**2).sum()
    np.testing.assert_allclose(np.exp(np.array(tempered)[0]), t, rtol=1e-5)


def test_filters_match_transformers_warpers():
    torch = pytest.importorskip("torch")
    from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((8, 500)) * 3).astype(np.float32)
    for temp, k, p, m in [(1.0, 40, 1.0, 0.0), (0.7, 0, 0.9, 0.0), (1.3, 0, 1.0, 0.05), (0.9, 50, 0.8, 0.02)]:
        ref = torch.from_numpy(logits) / temp
        for make, on in ((lambda: TopKLogitsWarper(k), k > 0), (lambda: TopPLogitsWarper(p), p < 1),  # noqa: B023
                         (lambda: MinPLogitsWarper(m), m > 0)):  # noqa: B023
            if on:
                ref = make()(None, ref)
        ref = torch.log_softmax(ref, -1).numpy()
        ours = np.array(filter_logprobs(mx.array(logits), temp, k, p, m)[0])
        assert (np.isfinite(ours) == np.isfinite(ref)).all(), (temp, k, p, m)
        fin = np.isfinite(ref)
        np.testing.assert_allclose(ours[fin], ref[fin], atol=1e-5)


# --------------------------------------------------------------------------- prompt-shared forward
def completions(n, C, seed, vocab=151936, avoid=(151655, 151656)):
    """Random completion ids [n, C] with right padding (lengths 1..C) and its mask."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 151000, (n, C))
    ids[np.isin(ids, avoid)] = 0
    lengths = rng.integers(1, C + 1, n)
    lengths[0] = C
    mask = (np.arange(C)[None] < lengths[:, None]).astype(np.int32)
    return mx.array(ids.astype(np.int32)), mx.array(mask)


def grads_of(model, fn, batch, comp_ids, comp_mask, weights, **kw):
    imgs = {k: batch[k] for k in ("pixel_values", "image_grid_thw") if k in batch}

    def loss(_):
        out = fn(model, batch["input_ids"], batch["attention_mask"], comp_ids, comp_mask, temperature=0.7,
                 return_entropy=True, **imgs, **kw)
        logp, ent = out
        return (weights * logp).sum() + 0.1 * (weights * ent).sum(), (logp, ent)

    (value, (logp, ent)), grads = nn.value_and_grad(model, lambda: loss(None))()
    mx.eval(value, logp, ent, grads)
    return logp, ent, dict(tree_flatten(grads))


def assert_grads_close(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        scale = max(1.0, mx.abs(b[k]).max().item())
        diff = mx.abs(a[k] - b[k]).max().item()
        assert diff <= TOL * scale, f"{k}: max abs diff {diff} (scale {scale})"


def shared_vs_repeated(model, processor, arch, G=3, C=5, seed=0, padding_side="left"):
    batch = prompts(processor, is_vl(arch), padding_side)
    n = batch["input_ids"].shape[0] * G
    comp_ids, comp_mask = completions(n, C, seed)
    weights = mx.array(np.random.default_rng(seed + 1).standard_normal((n, C)).astype(np.float32))
    s = grads_of(model, shared_prompt_logprobs, batch, comp_ids, comp_mask, weights)
    r = grads_of(model, repeated_logprobs, batch, comp_ids, comp_mask, weights)
    return s, r


@pytest.mark.usefixtures("kernel_path")
def test_shared_forward_equals_repeated_logps_and_grads(arch_model):
    arch, model, processor = arch_model
    (lp_s, ent_s, g_s), (lp_r, ent_r, g_r) = shared_vs_repeated(model, processor, arch)
    assert mx.abs(lp_r).max().item() > 1.0
    assert mx.abs(lp_s - lp_r).max().item() <= TOL
    assert mx.abs(ent_s - ent_r).max().item() <= TOL
    assert_grads_close(g_s, g_r)
    # the gradient reaches what only the prompt touches: the vision tower (through the prompt's K/V)
    if is_vl(arch):
        vision = [k for k in g_s if k.startswith(("visual.", "model.visual."))]
        assert vision and max(mx.abs(g_s[k]).max().item() for k in vision) > 0


@pytest.mark.usefixtures("kernel_path")
@pytest.mark.parametrize("arch", ["qwen3_vl", "qwen3_5_text"])
def test_shared_forward_right_padded_prompts_equal_repeated(tiny_checkpoint, arch):
    """Right-padded prompts (their real keys at the start of the row: the native kernel's key windows
    end before the padding; Qwen3.5's recurrent layers hand the state after each prompt's last real token to
    its completions) give the repeated forward's log-probs and gradients."""
    model, processor = mlxrl.load(tiny_checkpoint(arch), dtype="float32")
    (lp_s, ent_s, g_s), (lp_r, ent_r, g_r) = shared_vs_repeated(model, processor, arch, seed=5,
                                                                padding_side="right")
    assert mx.abs(lp_s - lp_r).max().item() <= TOL
    assert mx.abs(ent_s - ent_r).max().item() <= TOL
    assert_grads_close(g_s, g_r)


def test_shared_forward_lora_and_checkpointing(tiny_checkpoint):
    model, processor = mlxrl.load(tiny_checkpoint("qwen3_vl"), dtype="float32")
    apply_lora(model, r=4, alpha=8, dropout=0.0)
    # lora_b starts at zero: give it values so that every LoRA parameter gets a gradient
    mx.random.seed(0)
    new = [(k, mx.random.normal(v.shape) * 0.05) for k, v in tree_flatten(model.trainable_parameters())
           if k.endswith("lora_b")]
    model.load_weights(new, strict=False)
    (lp_s, _, g_s), (lp_r, _, g_r) = shared_vs_repeated(model, processor, "qwen3_vl", seed=3)
    assert all(k.endswith(("lora_a", "lora_b")) for k in g_s)
    assert mx.abs(lp_s - lp_r).max().item() <= TOL
    assert_grads_close(g_s, g_r)
    model.language_model.gradient_checkpointing = True
    lp_c, _, g_c = shared_vs_repeated(model, processor, "qwen3_vl", seed=3)[0]
    assert mx.abs(lp_c - lp_s).max().item() <= TOL
    assert_grads_close(g_c, g_s)
    # keep_attention: the recomputation replays the kernel's kept outputs (prompt pass and both completion
    # attentions of every layer), with the same log-probs and gradients
    replays = []
    attend = fastmath.KeptAttention.attend
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fastmath.KeptAttention, "attend", lambda self, *a: replays.append(self.replay) or attend(self, *a))
        model.language_model.keep_attention = True
        lp_k, _, g_k = shared_vs_repeated(model, processor, "qwen3_vl", seed=3)[0]
    model.language_model.gradient_checkpointing = model.language_model.keep_attention = False
    layers = len(model.language_model.layers)
    kernel = fastmath.kernels_for(mx.zeros((1,))) is not None  # MLXRL_NATIVE=0: no kernel, nothing kept
    assert replays.count(False) == replays.count(True) == (3 * layers if kernel else 0)
    assert mx.abs(lp_k - lp_s).max().item() <= TOL
    assert_grads_close(g_k, g_s)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_vl"])
def test_shared_forward_compiles(tiny_checkpoint, arch):
    model, processor = mlxrl.load(tiny_checkpoint(arch), dtype="float32")
    batch = prompts(processor, is_vl(arch))
    G, C = 2, 4
    n = batch["input_ids"].shape[0] * G
    comp_ids, comp_mask = completions(n, C, 5)
    weights = mx.array(np.random.default_rng(6).standard_normal((n, C)).astype(np.float32))
    imgs = {}
    if is_vl(arch):
        imgs = dict(pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"],
                    vision_meta=model.vision_metadata(batch["image_grid_thw"]))

    def loss(ids, mask, cids, cmask, w, *images):
        extra = dict(imgs, pixel_values=images[0], image_grid_thw=images[1]) if images else {}
        logp = shared_prompt_logprobs(model, ids, mask, cids, cmask, temperature=0.9, skip_ignored=False, **extra)
        return (w * logp).sum(), logp

    args = [batch["input_ids"], batch["attention_mask"], comp_ids, comp_mask, weights]
    if imgs:
        args += [imgs["pixel_values"], imgs["image_grid_thw"]]
    step = nn.value_and_grad(model, loss)
    (v_e, lp_e), g_e = step(*args)
    compiled = mx.compile(step, inputs=model.state, outputs=model.state)
    (v_c, lp_c), g_c = compiled(*args)
    assert mx.abs(lp_c - lp_e).max().item() <= 1e-5
    assert abs(v_c.item() - v_e.item()) <= 1e-4 * max(1.0, abs(v_e.item()))
    assert_grads_close(dict(tree_flatten(g_c)), dict(tree_flatten(g_e)))


def test_docs_generation_example_runs(capsys):
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
    code = re.search(r"<!-- generation-example -->\n```python\n(.*?)```\n<!-- /generation-example -->", text, re.S)
    ns = {"__name__": "readme"}
    exec(compile(code.group(1), "README generation example", "exec"), ns)
    assert ns["logp"].shape == ns["out"].completion_ids.shape == (8, ns["out"].completion_ids.shape[1])
    assert mx.abs(ns["logp"] - ns["out"].logps).max().item() < TOL
