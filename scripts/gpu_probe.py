"""Short diagnostics for MLX's GPU backends (CUDA, Metal), each printing as it goes so a run cut short or a
sticky device error still names the last case that ran.

    python scripts/gpu_probe.py sdpa            # mx.fast.scaled_dot_product_attention against the naive softmax
    python scripts/gpu_probe.py step --layers 2 # a compiled (and an eager) LoRA step of the 0.6B shape, timed
    python scripts/gpu_probe.py vl              # tiny VL models: images alone against together, packed rows
    python scripts/gpu_probe.py decode          # cached decoding against the uncached forward, greedy
    python scripts/gpu_probe.py ops             # reductions, scans, gathers: the device against the CPU stream
    python scripts/gpu_probe.py delta           # the gated delta rule: device vs CPU vs torch; timed at 0.8B widths
    python scripts/gpu_probe.py q35             # Qwen3.5: logits vs transformers, 0.8B-width gradients vs the CPU

`sdpa`: per query / key length, head dim, dtype and mask (none, "causal", a boolean block-diagonal mask as
packed rows use, left-padding masks, additive and boolean), the largest difference of the output and of dq / dk /
dv from the naive computation in float32 (scores, the mask, softmax, values). MLX's CUDA backend takes cuDNN for
bf16 (its backward only for query lengths that are multiples of 128: the 256 rows), its vector kernel for under
4 queries at head dims 64 / 96 / 128 without an array mask, and its unfused ops otherwise (float32 included; head
dim 16 is the tiny test models'). On this CPU both sides are MLX's own ops, so the figures are at rounding level.

`vl`: for the tiny Qwen2-VL, Qwen2.5-VL (random checkpoints built here with transformers) and the embedded
Qwen3-VL: the vision tower's features of five images of different sizes, each alone against all in one call
(the per-segment attention's gather / scatter), eager and compiled; then the hidden states of packed and
padding-free rows against each document alone (what `test_packed_documents_match_unpacked_forward` compares).
Each line is the largest absolute difference: on this CPU ~1e-6. Where one is over 1e-4 the probe says where it
starts: per vision block (its attention, then the block) for the images, and per document of the first differing
batch its M-RoPE positions (equal or not) and each decoder layer's output.

`ops`: MLX's own ops that mlxrl's forward and data layout rest on (reductions over one and several axes, the
M-RoPE index's scans, gathers and their scatter-add VJPs, strided copies), each on the device against the CPU
stream in the same process: on this CPU both are the CPU, so every line is 0.

`sdpa` ends with decoding's case: k / v as the views of mlx-lm's `KVCache` buffer that generation passes (strided,
256 positions a step), and the grouped-query heads' broadcast batched matmul. `decode`: for a tiny Qwen3 and
Qwen2.5-VL and the embedded Qwen3-VL, a prefill then cached steps against the uncached forward (teacher-forced
hidden states), and greedy generation through the engine (two left-padded prompts, two samples each: the shared
prompt cache) against the uncached forward token by token, with the reference's top-1 minus top-2 logit at the
first difference (a near tie flips on rounding, a wide gap is a fault).

`step`: the trainer's trunk step as `bench_trace.py` builds it (LoRA r16 on the seven projections, gradient
checkpointing, tiled MLP), this time with materialised weights and evaluated: the wall time of each of the first
calls, compiled (`mx.compile`, as the trainers run) and eager, so the first call's compile cost and the steady
step are told apart.
"""

from __future__ import annotations  # noqa: I001  (mlxrl must come before mlx.core)

import argparse
import os
import tempfile
import time
from pathlib import Path

import mlxrl  # (first: the fast BLAS before mlx.core)
import mlx.core as mx
import numpy as np

from mlxrl import runtime

runtime.apply_tf32()  # full float32 matmuls on CUDA (MLX reads it at its first): the float32 checks compare values


def naive_attention(q, k, v, scale, mask):
    rep = q.shape[1] // k.shape[1]
    k, v = mx.repeat(k, rep, axis=1), mx.repeat(v, rep, axis=1)
    s = (q * scale) @ k.swapaxes(-1, -2)
    if isinstance(mask, str):
        L, S = s.shape[-2:]
        mask = mx.arange(S - L, S)[:, None] >= mx.arange(S)[None]
    if mask is not None:
        s = mx.where(mask, s, -1e30) if mask.dtype == mx.bool_ else s + mask
    return mx.softmax(s, axis=-1) @ v


def masks(B: int, L: int, S: int):
    """The masks of a training forward (L == S) or of cached decoding (L queries after S - L cached keys)."""
    doc = mx.array([0] * (S // 3) + [1] * (S - S // 3))
    block = (doc[S - L:, None] == doc[None]) & (mx.arange(S - L, S)[:, None] >= mx.arange(S)[None])
    pad = mx.where(mx.arange(S)[None] >= mx.array([[0], [5]])[:B], 0.0, -1e9)[:, None, None, :]
    return {"none": None, "causal": "causal", "packed bool [1,1,L,S]": block[None, None],
            "left-padding additive [B,1,1,S]": pad, "left-padding bool [B,1,1,S]": pad == 0}


def sdpa(_a) -> None:
    mx.random.seed(0)
    B, Hq, Hkv = 2, 4, 2
    print(f"device {mx.default_device()}; q [B {B}, {Hq} heads, L], kv [{Hkv} heads, S]; max abs difference")
    for L, S in ((70, 70), (1, 70), (7, 70), (256, 256), (1, 256)):
        for D in (16, 64, 80, 128):
            for dtype in (mx.float32, mx.bfloat16):
                q, k, v = mx.random.normal((B, Hq, L, D)), *(mx.random.normal((B, Hkv, S, D)) for _ in range(2))
                cot = mx.random.normal((B, Hq, L, D))
                for name, mask in masks(B, L, S).items():
                    additive = mask is not None and not isinstance(mask, str) and mask.dtype != mx.bool_
                    m = mask.astype(dtype) if additive else mask

                    def fast(q, k, v, m=m, D=D):
                        return mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask=m)

                    def ref(q, k, v, mask=mask, D=D):
                        return naive_attention(q, k, v, D**-0.5, mask)

                    args = [x.astype(dtype) for x in (q, k, v)]
                    print(f"  L {L:>3} S {S:>3} D {D:>3} {str(dtype)[9:]:>8} {name:<32}", end=" ", flush=True)
                    o, g = mx.vjp(fast, args, [cot.astype(dtype)])
                    ro, rg = mx.vjp(ref, [q, k, v], [cot])
                    mx.eval(o, g, ro, rg)
                    diffs = [mx.abs(a.astype(mx.float32) - b).max().item()
                             for a, b in zip([*o, *g], [*ro, *rg], strict=True)]
                    names = ["out", "dq", "dk", "dv"]
                    print("  ".join(f"{n} {d:.2e}" for n, d in zip(names, diffs, strict=True)), flush=True)
    cached_sdpa(B, Hq, Hkv)


def cached_sdpa(B: int, Hq: int, Hkv: int) -> None:
    """Decoding's attention as generation calls it: k / v are what mlx-lm's `KVCache.update_and_fetch` returns,
    views of its preallocated buffer (256 positions a step: strided, not contiguous; MLX's CUDA backend reads
    such views in place for cuDNN's decoding at S >= 256), against the naive softmax over contiguous copies."""
    from mlx_lm.models.cache import KVCache

    print("  k / v as views of mlx-lm's KVCache buffer (cached decoding), forward only:", flush=True)
    for L, S in ((1, 9), (1, 70), (7, 70), (1, 256), (1, 300), (3, 600)):
        for D in (16, 64, 128):
            for dtype in (mx.float32, mx.bfloat16):
                q = mx.random.normal((B, Hq, L, D)).astype(dtype)
                k, v = (mx.random.normal((B, Hkv, S, D)).astype(dtype) for _ in range(2))
                cache = KVCache()
                cache.update_and_fetch(k[:, :, : S - L], v[:, :, : S - L])
                kc, vc = cache.update_and_fetch(k[:, :, S - L :], v[:, :, S - L :])
                mx.eval(kc, vc)
                for name, mask in (("none", None), ("causal", "causal"),
                                   ("left-padding bool", masks(B, L, S)["left-padding bool [B,1,1,S]"])):
                    out = mx.fast.scaled_dot_product_attention(q, kc, vc, scale=D**-0.5, mask=mask)
                    ref = naive_attention(*(x.astype(mx.float32) for x in (q, k, v)), D**-0.5, mask)
                    d = mx.abs(out.astype(mx.float32) - ref).max().item()
                    print(f"  L {L:>3} S {S:>3} D {D:>3} {str(dtype)[9:]:>8} {name:<18} out {d:.2e}", flush=True)
    # the broadcast batched matmul of grouped-query heads (the unfused path, SharedPrefixCache.attention)
    n, rep, L, S, D = 4, 2, 1, 70, 16
    a, b = mx.random.normal((n, Hkv, rep, L, D)), mx.random.normal((n, Hkv, 1, D, S))
    d = mx.abs(a @ b - a @ mx.repeat(b, rep, axis=2)).max().item()
    print(f"  matmul [{n},{Hkv},{rep},{L},{D}] @ [{n},{Hkv},1,{D},{S}] (broadcast) vs repeated: {d:.2e}", flush=True)


def cached_kernels() -> int:
    """Files in MLX's kernel caches: `<tmp>/mlx/<version>/cpu` (g++-built) and `.../ptx` (NVRTC's PTX, or
    MLX_PTX_CACHE_DIR)."""
    roots = [Path(tempfile.gettempdir()) / "mlx", Path(os.environ.get("MLX_PTX_CACHE_DIR", "/nonexistent"))]
    return sum(1 for r in roots if r.is_dir() for f in r.rglob("*") if f.is_file())


def step(a) -> None:
    from bench_trace import BASE, SHAPES, trunk_step

    print(f"device {mx.default_device()}; {a.layers} layers of the 0.6B shape, {a.length} tokens, {a.dtype}, "
          f"{'compiled' if a.compile else 'eager'}, LoRA r16, checkpointing, tiled MLP", flush=True)
    config = {**BASE, **SHAPES["qwen3-0.6b"], "num_hidden_layers": a.layers}
    model, fn = trunk_step(config, a.length, dtype=getattr(mx, a.dtype), compiled=bool(a.compile))
    mx.eval(model.parameters())
    before = cached_kernels()
    for i in range(a.calls):
        t = time.perf_counter()
        value, grads = fn()
        mx.eval(value, grads)
        print(f"  call {i}: {time.perf_counter() - t:.2f} s (loss {value.item():.4g}), kernel cache files "
              f"{cached_kernels()} ({before} before the first call)", flush=True)


def images():
    from PIL import Image

    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
            for w, h in ((100, 37), (60, 90), (150, 120), (80, 80), (40, 100))]


def probe_models(archs=("qwen2_vl", "qwen2_5_vl")):
    """(name, model, processor): the tiny checkpoints of `archs` built here (random weights, float32), then the
    embedded Qwen3-VL."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("tiny", Path(__file__).with_name("tiny_checkpoints.py"))
    tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny)
    root = Path(tempfile.mkdtemp(prefix="gpu_probe_"))
    for arch in archs:
        yield (arch, *mlxrl.load(tiny.build(arch, root / arch), dtype="float32"))
    yield ("qwen3_vl (embedded)", *mlxrl.load_default())


def as_mx(x):
    return None if x is None else mx.array(x)


def documents_of(b):
    """(row, segment mask, example id) of each document of a packed / padding-free batch: a row's documents are
    its segments 1, 2, ...; example_ids lists them row by row."""
    docs = [(row, ids == seg) for row, ids in enumerate(b.segment_ids) for seg in range(1, ids.max() + 1)]
    return [(row, where, ex) for (row, where), ex in zip(docs, b.example_ids, strict=True)]


def hidden(model, input_ids, pixel_values, grid, **rest):
    """The model's last hidden states (numpy) for numpy inputs (pixel_values / grid None: a row without images)."""
    out = model(input_ids=mx.array(input_ids), pixel_values=as_mx(pixel_values), image_grid_thw=as_mx(grid),
                return_hidden=True, **{k: mx.array(v) for k, v in rest.items()})
    return np.array(out)


def vl(_a) -> None:
    from mlxrl.data import make_batches, tokenize_example

    print(f"device {mx.default_device()}; max abs difference", flush=True)
    pics = images()
    for name, model, proc in probe_models():
        alone = [model.image_features(*map(mx.array, proc.image_processor([p])))[0] for p in pics]
        pv, grid = proc.image_processor(pics)
        pv, meta = mx.array(pv), model.vision_metadata(grid)  # the layout on the host, as the trainers do
        features = lambda p, meta, m=model: m.image_features(p, None, meta)[0]  # noqa: E731
        for label, fn in (("eager", features), ("compiled", mx.compile(features))):
            out = fn(pv, meta)
            parts = mx.split(out, np.cumsum([a.shape[0] for a in alone])[:-1].tolist())
            diffs = [mx.abs(a - b).max().item() for a, b in zip(alone, parts, strict=True)]
            print(f"  {name:<20} vision, 5 images together vs alone, {label:<8}: "
                  + " ".join(f"{d:.1e}" for d in diffs), flush=True)
            if label == "eager" and max(diffs) > 1e-4:
                vision_stages(model, proc, pics, pv, grid, meta)
        rows = [{"images": [pics[i]], "messages": [{"role": "user", "content": f"Image {i}?"},
                                                   {"role": "assistant", "content": "A picture."}]}
                for i in range(len(pics))] + [{"images": [], "messages": [
                    {"role": "user", "content": "No image."}, {"role": "assistant", "content": "Fine."}]}]
        examples = [tokenize_example(r, proc, index=i) for i, r in enumerate(rows)]
        ref = [hidden(model, e.input_ids[None], e.pixel_values, e.image_grid_thw)[0] for e in examples]
        for kw in ({"packing": True}, {"padding_free": True}):
            worst, differing = 0.0, None
            for b in make_batches(examples, 3, max_length=512, pad_token_id=proc.pad_token_id, seed=1, **kw):
                h = hidden(model, b.input_ids, b.pixel_values, b.image_grid_thw, attention_mask=b.attention_mask,
                           segment_ids=b.segment_ids)
                batch_worst = max(float(np.abs(h[row][where] - ref[ex]).max()) for row, where, ex in documents_of(b))
                if batch_worst > 1e-4 and differing is None:
                    differing = b
                worst = max(worst, batch_worst)
            print(f"  {name:<20} hidden states, {next(iter(kw))} rows vs each document alone: {worst:.1e}",
                  flush=True)
            if differing is not None:
                text_stages(model, examples, differing)


def recorded(fn, classes):
    """fn()'s result and the output of every call of an instance of `classes` during it, in call order."""
    log, saved = [], {c: c.__call__ for c in classes}

    def wrap(orig):
        def call(self, *a, **k):
            out = orig(self, *a, **k)
            log.append((type(self).__name__, out))
            return out
        return call

    for c in classes:
        c.__call__ = wrap(saved[c])
    try:
        return fn(), log
    finally:
        for c, f in saved.items():
            c.__call__ = f


def vision_stages(model, proc, pics, pv, grid, meta) -> None:
    """Where images together first leave images alone: each vision block's attention and output, per image."""
    tower = model.vision_tower
    classes = (type(tower.blocks[0]), type(tower.blocks[0].attn))
    _, together = recorded(lambda: mx.eval(model.image_features(pv, None, meta)[0]), classes)
    counts = [int(np.prod(g)) for g in grid]
    bounds = np.cumsum([0, *counts])
    worst = [0.0] * len(together)
    for i, p in enumerate(pics):
        _, alone = recorded(lambda p=p: mx.eval(model.image_features(*map(mx.array, proc.image_processor([p])))[0]),
                            classes)
        for j, ((_, a), (_, b)) in enumerate(zip(alone, together, strict=True)):
            worst[j] = max(worst[j], mx.abs(a - b[int(bounds[i]) : int(bounds[i + 1])]).max().item())
    print("    per vision stage (patches of each image, together vs alone): "
          + " ".join(f"{n}{j // 2} {w:.1e}" for j, ((n, _), w) in enumerate(zip(together, worst, strict=True))),
          flush=True)


def text_stages(model, examples, b) -> None:
    """For a packed / padding-free batch that differs: the M-RoPE positions and each decoder layer's output of
    each document against the document alone."""
    from mlxrl.models.vl import mrope_positions

    layer = type(model.language_model.layers[0])
    run = lambda **kw: mx.eval(model(return_hidden=True, **kw))  # noqa: E731
    _, packed = recorded(lambda: run(input_ids=mx.array(b.input_ids), attention_mask=mx.array(b.attention_mask),
                                     segment_ids=mx.array(b.segment_ids), pixel_values=as_mx(b.pixel_values),
                                     image_grid_thw=as_mx(b.image_grid_thw)), (layer,))
    pos, _ = mrope_positions(mx.array(b.input_ids), as_mx(b.image_grid_thw), mx.array(b.attention_mask),
                             model.image_token_id, model.merge_size, mx.array(b.segment_ids))
    for row, where, ex in documents_of(b):
        e = examples[ex]
        _, alone = recorded(lambda e=e: run(input_ids=mx.array(e.input_ids[None]), pixel_values=as_mx(e.pixel_values),
                                            image_grid_thw=as_mx(e.image_grid_thw)), (layer,))
        own, _ = mrope_positions(mx.array(e.input_ids[None]), as_mx(e.image_grid_thw), None, model.image_token_id,
                                 model.merge_size)
        same_pos = np.array_equal(np.array(pos)[:, row][:, where], np.array(own)[:, 0])
        layers = [float(np.abs(np.array(p)[row][where] - np.array(a)[0]).max())
                  for (_, p), (_, a) in zip(packed, alone, strict=True)]
        n_img = 0 if e.image_grid_thw is None else len(e.image_grid_thw)
        print(f"    document {ex} (row {row}, {int(where.sum())} tokens, {n_img} images): positions "
              f"{'equal' if same_pos else 'DIFFER'}; per layer " + " ".join(f"{d:.1e}" for d in layers), flush=True)


def decode(_a) -> None:
    from mlxrl.generation.engine import generate

    print(f"device {mx.default_device()}; cached decoding against the uncached forward (float32)", flush=True)
    rng = np.random.default_rng(1)
    for name, model, _proc in probe_models(("qwen3", "qwen2_5_vl")):
        ids = rng.integers(10, 5000, size=(1, 12))
        full = hidden(model, ids, None, None)[0]
        cache = model.make_cache()
        steps = [np.array(model(input_ids=mx.array(ids[:, :8]), cache=cache, return_hidden=True))[0]]
        diffs = [float(np.abs(steps[0] - full[:8]).max())]
        for t in range(8, ids.shape[1]):
            h = np.array(model(input_ids=mx.array(ids[:, t : t + 1]), cache=cache, return_hidden=True))[0, 0]
            diffs.append(float(np.abs(h - full[t]).max()))
        print(f"  {name:<20} hidden, prefill of 8 then 4 cached steps (teacher-forced): "
              + " ".join(f"{d:.1e}" for d in diffs), flush=True)
        # greedy through the engine (two left-padded prompts, 2 samples each: the shared-prompt cache) against the
        # uncached forward token by token; at a first difference, the reference's top-1 minus top-2 logit there
        # (a near tie flips on rounding; a wide gap is a fault)
        prompts = [rng.integers(10, 5000, size=n).tolist() for n in (5, 9)]
        width = max(map(len, prompts))
        batch = np.array([[0] * (width - len(p)) + p for p in prompts])
        mask = np.array([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out = generate(model, mx.array(batch), mx.array(mask), num_generations=2, max_tokens=6, temperature=0.0,
                       stop_token_ids=[], pad_token_id=-1)
        got = np.array(out.completion_ids)
        for r, p in enumerate(prompts):
            seq, line = list(p), "same 6 tokens"
            for t in range(6):
                logits = np.array(model(input_ids=mx.array([seq])))[0, -1]
                top = np.sort(logits)[-2:]
                want = int(np.argmax(logits))
                if (got[2 * r : 2 * r + 2, t] != want).any():
                    line = f"first difference at token {t}: {got[2 * r : 2 * r + 2, t].tolist()} vs {want}, " \
                           f"reference top-1 - top-2 logit {top[1] - top[0]:.2e}"
                    break
                seq.append(want)
            print(f"  {name:<20} greedy, prompt {r} ({len(p)} tokens, left-padded) x 2 samples: {line}", flush=True)


def ops(_a) -> None:
    """MLX's ops on the default device against the same ops on the CPU stream, the kinds mlxrl's forward and
    data layout use: reductions over one or several axes (MLX's CUDA reduce kernels: ml-explore/mlx#3109, an
    illegal memory access in them when built with CUDA 13.1), the scans of the M-RoPE index, gathers and their
    scatter-add VJPs, strided copies."""
    dev = mx.default_device()
    print(f"device {dev}; each op on it against the CPU stream: max abs difference", flush=True)
    rng = np.random.default_rng(0)
    a = mx.array(rng.normal(size=(2, 4, 8, 16)).astype(np.float32))
    pos = mx.array(rng.integers(0, 300, (3, 2, 70)).astype(np.int32))
    seg = mx.array(np.sort(rng.integers(0, 5, (2, 256)), axis=1).astype(np.int32))
    table, idx = mx.array(rng.normal(size=(256, 64)).astype(np.float32)), mx.array(rng.integers(0, 256, (500, 4)))
    cot = mx.array(rng.normal(size=(500, 4, 64)).astype(np.float32))
    cases = {}
    for ax in (0, 1, 2, 3, (0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (0, 1, 2), (0, 1, 3)):
        cases[f"sum over {ax} of [2, 4, 8, 16]"] = lambda s, ax=ax: mx.sum(a, axis=ax, stream=s)
        cases[f"max over {ax} of [2, 4, 8, 16]"] = lambda s, ax=ax: mx.max(a, axis=ax, stream=s)
    cases["sum over (1, 2) of a transposed view"] = lambda s: mx.sum(a.transpose(3, 1, 0, 2), axis=(1, 2), stream=s)
    cases["int32 max over (0, 2) of [3, 2, 70] (M-RoPE deltas)"] = lambda s: mx.max(pos, axis=(0, 2), stream=s)
    cases["int32 cumsum along rows of [2, 256]"] = lambda s: mx.cumsum(seg, axis=1, stream=s)
    cases["int32 cummax along rows of [2, 256]"] = lambda s: mx.cummax(seg, axis=1, stream=s)
    cases["int32 cumsum, flattened [512]"] = lambda s: mx.cumsum(seg.reshape(-1), stream=s)
    cases["take [256, 64] rows by [500, 4]"] = lambda s: mx.take(table, idx, axis=0, stream=s)
    cases["scatter-add: the VJP of that take"] = lambda s: mx.vjp(
        lambda t: mx.take(t, idx, axis=0, stream=s), [table], [cot])[1][0]
    cases["copy of a [2, 4, 8, 16] slice, transposed"] = lambda s: mx.contiguous(
        a[:, 1:3, ::2].transpose(0, 2, 1, 3), stream=s)
    for name, fn in cases.items():
        with mx.stream(dev):
            got = fn(dev)
        with mx.stream(mx.cpu):
            ref = fn(mx.cpu)
        d = mx.abs(got.astype(mx.float32) - ref.astype(mx.float32)).max().item()
        print(f"  {name:<52} {d:.2e}", flush=True)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def delta(a) -> None:
    """The gated delta rule (`mlxrl.models.gated_delta`) on the device: values and every input's gradient
    against the same op on the CPU stream and against transformers' `torch_chunk_gated_delta_rule` under torch
    autograd (float32, a length that is not a multiple of the chunk, an initial state, packed documents); then
    forward + backward timed at Qwen3.5-0.8B's DeltaNet widths, ours (its own VJP) and MLX's autograd of the
    same chunked forward against torch's on CUDA, with each side's peak device memory."""
    from mlxrl.models.gated_delta import gated_delta_rule

    dev = mx.default_device()
    rng = np.random.default_rng(0)

    def inputs(B, T, hk, hv, dk, dv):
        f = np.float32
        return [rng.standard_normal((B, T, hk, dk), f), rng.standard_normal((B, T, hk, dk), f),
                rng.standard_normal((B, T, hv, dv), f), -rng.uniform(0.01, 1.0, (B, T, hv)).astype(f),
                rng.uniform(0.0, 1.0, (B, T, hv)).astype(f), 0.1 * rng.standard_normal((B, hv, dk, dv), f),
                rng.standard_normal((B, T, hv, dv), f)]

    B, T, hk, hv, dk, dv = 2, 1000, 2, 4, 32, 48
    arrays = inputs(B, T, hk, hv, dk, dv)
    starts = np.zeros((B, T), bool)
    starts[1, [0, 333, 700]] = True

    def ours(stream, docs):
        with mx.stream(stream):
            *ins, w = (mx.array(x) for x in arrays)
            d = mx.array(starts) if docs else None

            def loss(q, k, v, g, beta, s0):
                out, final = gated_delta_rule(q, k, v, g, beta, s0, d, use_qk_l2norm_in_kernel=True)
                return (out * w).sum() + final.sum()

            value, grads = mx.value_and_grad(loss, argnums=list(range(6)))(*ins)
            mx.eval(value, grads)
            return [np.array(x) for x in (value, *grads)]

    names = ("value", "dq", "dk", "dv", "dg", "dbeta", "dstate")
    print(f"device {dev}; gated delta rule B={B} T={T} heads {hk}/{hv} dk {dk} dv {dv}, float32, initial state: "
          "relative difference", flush=True)
    for docs in (False, True):
        got, ref = ours(dev, docs), ours(mx.cpu, docs)
        print(f"  {'packed documents' if docs else 'one sequence':<17} device vs CPU stream: "
              + " ".join(f"{n} {_rel(x, y):.1e}" for n, x, y in zip(names, got, ref, strict=True)), flush=True)
    try:
        import torch
        from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule
    except ImportError as e:
        print(f"  (no torch reference: {e})")
        return
    cuda = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    *leaves, w = (torch.tensor(x, device=cuda) for x in arrays)
    for x in leaves:
        x.requires_grad_(True)
    out, final = torch_chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                              use_qk_l2norm_in_kernel=True)
    value = (out * w).sum() + final.sum()
    value.backward()
    theirs = [value.detach().cpu().numpy()] + [x.grad.cpu().numpy() for x in leaves]
    got = ours(dev, False)
    print(f"  {'one sequence':<17} device vs torch ({cuda}): "
          + " ".join(f"{n} {_rel(x, y):.1e}" for n, x, y in zip(names, got, theirs, strict=True)), flush=True)

    print("forward + backward at Qwen3.5-0.8B's widths (16/16 heads of 128), B=1: median of 3 after the first; "
          "peak device memory above the inputs", flush=True)
    for T in a.lengths:
        arrays = inputs(1, T, 16, 16, 128, 128)
        for dtype in ("float32", "bfloat16"):
            for side in ("ours", "mlx_autograd", "torch"):
                if side == "torch":
                    tdt = getattr(torch, dtype)
                    *ins, w = (torch.tensor(x, device=cuda).to(tdt) for x in arrays[:5] + arrays[6:])

                    def run(ins=ins, w=w):
                        leaves = [x.clone().requires_grad_(True) for x in ins]
                        out, _ = torch_chunk_gated_delta_rule(*leaves, use_qk_l2norm_in_kernel=True)
                        (out.float() * w.float()).sum().backward()
                        if cuda == "cuda":
                            torch.cuda.synchronize()

                    if cuda == "cuda":
                        torch.cuda.synchronize()
                        torch.cuda.reset_peak_memory_stats()
                        base = torch.cuda.memory_allocated()
                    else:
                        base = 0
                    peak = lambda base=base: (torch.cuda.max_memory_allocated() - base) if cuda == "cuda" else 0  # noqa: E731
                else:
                    mdt = getattr(mx, dtype)
                    *ins, w = (mx.array(x).astype(mdt) for x in arrays[:5] + arrays[6:])
                    mx.eval(ins, w)

                    def loss(q, k, v, g, beta, w=w, custom=side == "ours"):
                        out, _ = gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, custom_vjp=custom)
                        return (out.astype(mx.float32) * w.astype(mx.float32)).sum()

                    fn = mx.value_and_grad(loss, argnums=list(range(5)))

                    def run(fn=fn, ins=ins):
                        mx.eval(fn(*ins))

                    mx.reset_peak_memory()
                    base = mx.get_active_memory()
                    peak = lambda base=base: mx.get_peak_memory() - base  # noqa: E731
                try:
                    t0 = time.perf_counter()
                    run()
                    first = time.perf_counter() - t0
                    mem = peak()
                    times = []
                    for _ in range(3):
                        t0 = time.perf_counter()
                        run()
                        times.append(time.perf_counter() - t0)
                    print(f"  T {T:>5} {dtype:<8} {side:<12} first {first:7.3f} s, then {sorted(times)[1]:7.4f} s, "
                          f"peak {mem / 1e9:6.2f} GB", flush=True)
                except Exception as e:  # an out-of-memory or a device fault: say so, go on
                    print(f"  T {T:>5} {dtype:<8} {side:<12} failed: {str(e).splitlines()[0][:160]}", flush=True)
                del ins, w


def q35(a) -> None:
    """Qwen3.5 (`qwen3_5_text`) on the device: a tiny random model's logits against transformers' on the CPU
    (float32); the loss and every parameter's gradient at 0.8B widths (3 DeltaNet layers + 1 gated attention,
    a small vocabulary, 1000 tokens) on the device against the CPU stream, float32, and the device's bfloat16
    loss against that float32 one."""
    import torch
    import transformers
    from mlx.utils import tree_flatten, tree_unflatten

    from mlxrl.models.qwen3_5.model import Model

    dev = mx.default_device()
    torch.manual_seed(0)
    tiny = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=8, linear_value_head_dim=12, rms_norm_eps=1e-6)
    cfg = transformers.Qwen3_5TextConfig(**tiny)
    hf = transformers.Qwen3_5ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight", "dt_bias", "A_log")):
                p.add_(0.3 * torch.randn_like(p))
    ours = Model({**cfg.to_dict(), "model_type": "qwen3_5_text"})
    ours.load_weights(list(ours.sanitize({k: mx.array(v.numpy()) for k, v in hf.state_dict().items()}).items()))
    ours.eval()
    print(f"device {dev}; Qwen3.5 text", flush=True)
    for T in (70, 130):
        ids = np.random.default_rng(T).integers(0, 300, (2, T))
        with torch.no_grad():
            want = hf(input_ids=torch.tensor(ids)).logits.numpy()
        got = np.array(ours(mx.array(ids)))
        print(f"  tiny, T {T}: logits max abs diff from transformers (CPU, float32) "
              f"{np.abs(got - want).max():.2e}", flush=True)

    wide = dict(tiny, vocab_size=4096, hidden_size=1024, intermediate_size=3584, num_attention_heads=8,
                num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
                linear_key_head_dim=128, linear_value_head_dim=128, model_type="qwen3_5_text",
                layer_types=["linear_attention"] * 3 + ["full_attention"], max_position_embeddings=8192)
    model = Model({**transformers.Qwen3_5TextConfig(**{k: v for k, v in wide.items() if k != "model_type"}).to_dict(),
                   "model_type": "qwen3_5_text"})
    mx.eval(model.parameters())
    rng = np.random.default_rng(1)
    ids, targets = (mx.array(rng.integers(0, 4096, (1, 1000))) for _ in range(2))
    params = dict(tree_flatten(model.trainable_parameters()))

    def loss(p):
        model.update(tree_unflatten(list(p.items())))
        out = model(ids).astype(mx.float32)
        return mx.mean(mx.logsumexp(out, axis=-1) - mx.take_along_axis(out, targets[..., None], -1)[..., 0])

    results = {}
    for name, stream, dtype in (("device f32", dev, mx.float32), ("cpu f32", mx.cpu, mx.float32),
                                ("device bf16", dev, mx.bfloat16)):
        with mx.stream(stream):
            p = {k: v.astype(dtype) for k, v in params.items()}
            t0 = time.perf_counter()
            value, grads = mx.value_and_grad(loss)(p)
            mx.eval(value, grads)
            results[name] = (value.item(), {k: np.array(g.astype(mx.float32)) for k, g in grads.items()})
            print(f"  0.8B widths, 4 layers, 1000 tokens, {name}: loss {value.item():.6f} "
                  f"({time.perf_counter() - t0:.2f} s)", flush=True)
    (l0, g0), (l1, g1) = results["device f32"], results["cpu f32"]
    worst = max(((_rel(g0[k], g1[k]), k) for k in g1), key=lambda x: x[0])
    print(f"  device vs CPU stream, float32: loss {abs(l0 - l1):.2e}, worst gradient {worst[0]:.2e} ({worst[1]})",
          flush=True)
    lb, gb = results["device bf16"]
    worst = max(((_rel(gb[k], g1[k]), k) for k in g1), key=lambda x: x[0])
    print(f"  device bfloat16 vs CPU float32: loss {abs(lb - l1):.2e}, worst gradient {worst[0]:.2e} ({worst[1]})",
          flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["sdpa", "step", "vl", "decode", "ops", "delta", "q35"])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--compile", type=int, default=1)
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192], help="delta: the timed lengths")
    a = ap.parse_args(argv)
    {"sdpa": sdpa, "step": step, "vl": vl, "decode": decode, "ops": ops, "delta": delta, "q35": q35}[a.what](a)


if __name__ == "__main__":
    main()
