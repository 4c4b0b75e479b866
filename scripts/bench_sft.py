"""mlxrl's SFTTrainer vs TRL 1.16's SFTTrainer, side by side, on the same random Qwen3-VL checkpoints.

    python scripts/bench_sft.py                                  # tiny and small, max_length 1024, batch 1
    python scripts/bench_sft.py --models small --steps 4 --batch 2 --max_length 1024
    python scripts/bench_sft.py --models small --profile         # + where our step's time goes

Checkpoints: `scripts/tiny_checkpoints.py` builds them with transformers (float32, saved with
`save_pretrained`), and both sides load the same folder (ours with `mlxrl.load`): "tiny" (hidden
64, 2 layers) and "small" (~285M parameters: hidden 1024, 8 layers, 16/8 heads of 128, MLP 3072,
tied 151936 vocab, a 4-block vision tower; the size where the streamed LM head matters).

Data: language-modelling rows (`{"text": ...}`) of random English words, each longer than
`--max_length` tokens, so every row is truncated (keep_start) to exactly `max_length` real tokens
and every position but the last is trained on both sides: no padding, identical token counts.

Settings, identical on both sides: full fine-tuning (vision tower included), float32 (TRL's default
bf16=True is turned off), gradient checkpointing `--gradient_checkpointing` (default on, TRL's and
ours default), batch `--batch`, AdamW lr 1e-5, grad-norm clipping 1.0, no saving, logging every step.
TRL runs its default loss path (its chunked fused LM head with entropy and accuracy, as TRL users
get it); ours runs its default (streamed head, differentiable, compiled step). Torch uses 2 threads.

Timing: each side runs in its own subprocess, `--warmup` first steps (compilation, allocator and
first-touch costs) are skipped, s/step is the median of the `--steps` timed steps (step-end to
step-end stamps), tokens/s = real (non-padding) tokens per step / s per step. Peak memory is the
process's peak resident set size (`ru_maxrss`), reported whole and above the process's size right
before the model is loaded (after imports); for ours also MLX's allocator peak (`mx.get_peak_memory`).

MFU (ours, and TRL for comparison) = model FLOP/s / peak FLOP/s, where the peak is the best float32
matmul rate (2048x2048, `--peak_n`, best of 5) that MLX (with mlxrl's BLAS) or torch (2 threads)
reaches in this run, measured in a subprocess before and after the models run (the machine is
shared, so it is measured under about the same load). Model FLOPs per step are
counted exactly from the config, for B rows of T tokens of which R positions are trained:

    text layer (forward)  2*T*D*(Hq*hd + 2*Hkv*hd) + 2*T*(Hq*hd)*D      q, k, v, o projections
                          + 2*T*D*I*3                                   gate, up, down
                          + 2*2*T*T*Hq*hd                               QK^T and AV (the full square,
                                                                        as dense SDPA computes it)
    LM head (forward)     2*R*D*V                                       trained positions only
    training              3 * (B * L * layer + head)   [+ B * L * layer with gradient checkpointing:
                                                        the recomputed forward, "hardware" FLOPs]

(backward = 2x forward for every matmul: input and weight gradients). Not counted: norms,
rotary, softmax, the embedding gather, the optimizer, and the extra head matmul our streamed head
spends to recompute logits in backward. Text-only rows: the vision tower does no work.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("the of and to in is was for that with as on by at from his her an which one all were they this "
         "model train token image colour shape square circle river mountain window garden morning evening "
         "quickly slowly under over between around because before after while people machine memory speed "
         "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KB on Linux


def text_rows(n: int, max_length: int, seed: int = 0) -> list[dict]:
    """Rows of random words, each well over max_length tokens (about 1.3 tokens per word here)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [{"text": " ".join(rng.choice(WORDS, max_length + 64))} for _ in range(n)]


def model_flops(config: dict, batch: int, seq: int, trained: int, checkpointing: bool) -> float:
    """Training FLOPs of one step (see the module docstring for the formula)."""
    t = config.get("text_config", config)
    d, inter, layers = t["hidden_size"], t["intermediate_size"], t["num_hidden_layers"]
    hq, hkv = t["num_attention_heads"], t["num_key_value_heads"]
    hd = t.get("head_dim") or d // hq
    layer = 2 * seq * d * (hq * hd + 2 * hkv * hd) + 2 * seq * hq * hd * d + 2 * seq * d * inter * 3
    layer += 2 * 2 * seq * seq * hq * hd
    trunk = batch * layers * layer
    head = 2 * trained * d * t["vocab_size"]
    return 3 * (trunk + head) + (trunk if checkpointing else 0)


# ---------------------------------------------------------------------------------------------- children
def run_peak(n: int, reps: int, lib: str) -> dict:
    """Best fp32 n x n matmul GFLOP/s of MLX (with mlxrl's BLAS) or of torch (2 threads, as TRL runs).

    One library per process: mlxrl loads OpenBLAS with RTLD_GLOBAL, and a torch imported after it
    in the same process resolves its BLAS calls there too (measured ~60 vs ~270 GFLOP/s)."""

    def best(matmul, a, b, sync):
        sync(matmul(a, b))
        top = 0.0
        for _ in range(reps):
            t = time.perf_counter()
            sync(matmul(a, b))
            top = max(top, 2 * n**3 / (time.perf_counter() - t) / 1e9)
        return top

    if lib == "torch":
        import torch

        torch.set_num_threads(2)
        return {"torch": best(torch.matmul, torch.randn(n, n), torch.randn(n, n), lambda x: x)}
    sys.path.insert(0, str(ROOT))
    import mlxrl.cpu.blas as rt  # noqa: I001  (the fast BLAS is loaded before mlx.core)
    import mlx.core as mx

    return {"mlx": best(mx.matmul, mx.random.normal((n, n)), mx.random.normal((n, n)), mx.eval), "blas": rt.BLAS_IN_USE}


def _peaks(n: int) -> dict:
    return {**_child(["--side", "peak", "--lib", "mlx", "--peak_n", str(n)]),
            **_child(["--side", "peak", "--lib", "torch", "--peak_n", str(n)])}


def _timed_trainer(base_cls, stamps):
    """`base_cls` stamping the time of each log entry (logging_steps=1: each step's end). Not a TrainerCallback:
    those import transformers, whose memory the peak RSS would count on our side."""
    class Timed(base_cls):
        def _record(self, entry):
            stamps.append(time.perf_counter())
            super()._record(entry)

        def save_final(self):  # TRL runs with save_strategy="no": no final save on either side
            pass

    return Timed


def run_ours(a) -> dict:
    sys.path.insert(0, str(ROOT))
    import mlxrl  # noqa: I001  (before mlx.core: it loads the fast BLAS)
    import mlx.core as mx
    from mlxrl.trainers.sft.config import SFTConfig
    from mlxrl.trainers.sft.trainer import SFTTrainer

    total = a.steps + a.warmup
    rows = text_rows(total * a.batch, a.max_length)
    base = rss_gb()
    model, processor = mlxrl.load(a.ckpt)
    stamps: list[float] = []
    args = SFTConfig(output_dir=a.out, max_steps=total, per_device_train_batch_size=a.batch, learning_rate=1e-5,
                     logging_steps=1, save_strategy="no", save_steps=0, disable_tqdm=True, max_length=a.max_length,
                     gradient_checkpointing=a.gradient_checkpointing, seed=42, optim=a.optim)
    cls = SFTTrainer
    if a.head == "fused":  # experiment: the row-tiled fused head in place of the trainer's head_logprobs
        from mlxrl.losses.fused_head import fused_head_loss
        from mlxrl.losses.sft import sft_loss
        from mlxrl.trainers.forward import hidden_rows

        class FusedHead(SFTTrainer):
            def loss(self, model, batch, num_items):
                h = hidden_rows(model, batch)
                loss, logp, ent, top = fused_head_loss(h, model.lm_head_weight(), batch["targets"],
                                                       num_items=num_items, skip_ignored=False,
                                                       weight_grad=self.head_trainable)
                _, metrics = sft_loss(logp, batch["targets"], num_items=num_items, entropy=ent, argmax=top)
                return loss, metrics

        cls = FusedHead
    trainer = _timed_trainer(cls, stamps)(model, processor, args, train_dataset=rows)
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    trainer.train()
    logs = [e for e in trainer.log_history if "loss" in e]
    tokens = [e["num_tokens"] for e in logs]
    first = trainer._batches_of(trainer.train_examples[: a.batch], 0, False, a.batch)
    trained = sum(b["trained_tokens"] for b in first)
    out = {"stamps": [t0, *stamps], "tokens": [tokens[0], *(y - x for x, y in zip(tokens, tokens[1:], strict=False))],
           "trained_per_step": trained, "peak_rss_gb": rss_gb(), "base_rss_gb": base,
           "mlx_peak_gb": mx.get_peak_memory() / 1e9, "loss": [e["loss"] for e in logs],
           "compiled_shapes": trainer.compiled_shapes}
    if a.profile:
        out["profile"] = profile_ours(trainer, a)
    return out


def profile_ours(trainer, a) -> dict:
    """Seconds of each part of our step on one batch, after training warmed the allocator up:
    data preparation, the trunk's forward, the trunk's forward+backward (to the hidden rows, a random
    cotangent; embedding gradient included), the streamed head's forward+backward (w.r.t. hidden and
    weight; the trainer's vocabulary-tiled `head_logprobs`, and the row-tiled `fused_head_loss`
    where this version has it), and the optimizer update (clipping + AdamW). Each part is compiled
    like the trainer's step and run once (a step of the small model takes minutes on a busy 2-core
    machine); the sum of the parts is about one training step."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from mlxrl.losses.head import head_logprobs
    from mlxrl.trainers.engine import hidden_rows

    model = trainer.model
    make = trainer._batches_of(trainer.train_examples[: a.batch], 0, False, a.batch, lazy=True)[0]

    def timeit(fn):
        t = time.perf_counter()
        out = fn()
        mx.eval(out)
        return time.perf_counter() - t, out

    res = {}
    res["data (collate + to device)"], arrays = timeit(lambda: trainer.to_device(make()))
    batch = make()
    num_items = mx.array(batch["trained_tokens"], dtype=mx.float32)
    state = [model.state, mx.random.state]

    fwd = mx.compile(lambda arr: hidden_rows(model, arr), inputs=state, outputs=state)
    res["trunk forward"], h = timeit(lambda: fwd(arrays))
    ct = mx.random.normal(h.shape) * 1e-3
    mx.eval(ct)

    trunk_vg = nn.value_and_grad(model, lambda m, arr, c: (hidden_rows(m, arr) * c).sum())
    trunk_step = mx.compile(lambda arr, c: trunk_vg(model, arr, c), inputs=state, outputs=state)
    res["trunk forward+backward"], grads = timeit(lambda: trunk_step(arrays, ct)[1])

    w = model.lm_head_weight()
    targets = arrays["targets"]

    def head_loss(hh, ww):
        logp, ent, top = head_logprobs(hh, ww, targets, chunk_size=trainer.args.chunk_size, return_entropy=True,
                                       return_argmax=True, skip_ignored=False)
        return -logp.sum() / num_items + 0 * ent.sum()

    head_step = mx.compile(mx.value_and_grad(head_loss, argnums=(0, 1)))
    res["head forward+backward (trainer's head_logprobs)"] = timeit(lambda: head_step(h, w))[0]
    try:  # the row-tiled fused head (3 matmuls instead of 4), where this version of mlxrl has it
        from mlxrl.losses.fused_head import fused_head_loss
    except ImportError:
        fused_head_loss = None
    if fused_head_loss is not None:
        fused = mx.compile(mx.value_and_grad(
            lambda hh, ww: fused_head_loss(hh, ww, targets, num_items=num_items, skip_ignored=False)[0],
            argnums=(0, 1)))
        res["head forward+backward (fused_head_loss)"] = timeit(lambda: fused(h, w))[0]

    def update():
        norm = trainer._update(grads)
        return [model.parameters(), trainer.optimizer.state, norm]

    res["optimizer (clip + AdamW)"] = timeit(update)[0]
    res["params_m"] = sum(v.size for _, v in tree_flatten(model.parameters())) / 1e6
    return res


def run_trl(a) -> dict:
    sys.path.insert(0, str(ROOT))
    import torch
    import transformers
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    torch.set_num_threads(2)
    total = a.steps + a.warmup
    rows = text_rows(total * a.batch, a.max_length)
    base = rss_gb()
    model = transformers.Qwen3VLForConditionalGeneration.from_pretrained(a.ckpt, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(a.ckpt)
    stamps: list[float] = []

    class Stamp(TrainerCallback):
        def on_step_end(self, *args, **kw):
            stamps.append(time.perf_counter())

    args = SFTConfig(output_dir=a.out, max_steps=total, per_device_train_batch_size=a.batch, learning_rate=1e-5,
                     logging_steps=1, save_strategy="no", report_to="none", bf16=False, use_cpu=True,
                     gradient_checkpointing=a.gradient_checkpointing, max_length=a.max_length, disable_tqdm=True,
                     seed=42, dataloader_num_workers=0, optim=a.optim)
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                         callbacks=[Stamp()])
    t0 = time.perf_counter()
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    tokens = [e["num_tokens"] for e in logs]
    return {"stamps": [t0, *stamps], "tokens": [tokens[0], *(y - x for x, y in zip(tokens, tokens[1:], strict=False))],
            "peak_rss_gb": rss_gb(), "base_rss_gb": base, "loss": [e["loss"] for e in logs]}


# ---------------------------------------------------------------------------------------------- parent
def _child(args: list[str]) -> dict:
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True)
    line = [s for s in proc.stdout.splitlines() if s.startswith("RESULT ")]
    if proc.returncode or not line:
        sys.exit(f"child {' '.join(args[:4])} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(line[-1][len("RESULT "):])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tiny", "small"], choices=["tiny", "small"])
    ap.add_argument("--steps", type=int, default=2, help="timed optimizer steps per side")
    ap.add_argument("--warmup", type=int, default=1, help="untimed first steps (compilation, first-touch costs)")
    ap.add_argument("--batch", type=int, default=1, help="rows per step (each max_length tokens)")
    ap.add_argument("--max_length", type=int, default=1024)
    ap.add_argument("--optim", default="adamw_torch", choices=["adamw_torch", "adafactor"],
                    help="optimizer on both sides (HF TrainingArguments' optim)")
    ap.add_argument("--gradient_checkpointing", type=lambda s: s.lower() in ("1", "true", "yes"), default=True)
    ap.add_argument("--peak_n", type=int, default=2048, help="matmul size for the fp32 peak (MLX and torch)")
    ap.add_argument("--head", choices=["trainer", "fused"], default="trainer",
                    help="ours: the trainer's loss as is, or (experiment) the row-tiled fused_head_loss in its place")
    ap.add_argument("--profile", action="store_true", help="also time the parts of our step (small model)")
    ap.add_argument("--ckpt_dir", help="reuse/keep checkpoints here (default: a temporary folder)")
    ap.add_argument("--side", choices=["ours", "trl", "peak"], help=argparse.SUPPRESS)
    ap.add_argument("--lib", choices=["mlx", "torch"], help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.side:  # a child process
        fn = {"ours": run_ours, "trl": run_trl, "peak": lambda a: run_peak(a.peak_n, 5, a.lib)}[a.side]
        print("RESULT " + json.dumps(fn(a)), flush=True)
        return

    sys.path.insert(0, str(ROOT / "scripts"))
    from tiny_checkpoints import build

    common = ["--steps", str(a.steps), "--warmup", str(a.warmup), "--batch", str(a.batch), "--max_length",
              str(a.max_length), "--gradient_checkpointing", str(a.gradient_checkpointing), "--head", a.head,
              "--optim", a.optim]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt_root = Path(a.ckpt_dir or tmp)
        peaks = [_peaks(a.peak_n)]
        print(f"fp32 matmul {a.peak_n}x{a.peak_n}, best of 5: MLX ({peaks[0]['blas']}) {peaks[0]['mlx']:.1f}, "
              f"torch {peaks[0]['torch']:.1f} GFLOP/s", flush=True)
        for size in a.models:
            folder = ckpt_root / ("qwen3_vl" if size == "tiny" else "qwen3_vl-small")
            if not (folder / "config.json").exists():
                folder = build("qwen3_vl", ckpt_root, size=size)
            config = json.loads((folder / "config.json").read_text())
            res = {}
            for side in ("ours", "trl"):
                extra = ["--profile"] if side == "ours" and a.profile and size == "small" else []
                r = _child(["--side", side, "--ckpt", str(folder), "--out", str(Path(tmp) / f"{size}-{side}"),
                            *common, *extra])
                st = r["stamps"]
                steps = [y - x for x, y in zip(st[a.warmup:-1], st[a.warmup + 1:], strict=True)]
                r["s_per_step"] = statistics.median(steps)
                r["tokens_per_step"] = statistics.median(r["tokens"][a.warmup:])
                r["tokens_per_s"] = r["tokens_per_step"] / r["s_per_step"]
                print(f"{size} {side}: {r['s_per_step']:.2f} s/step, {r['tokens_per_s']:.0f} tokens/s, "
                      f"peak RSS {r['peak_rss_gb']:.2f} GB, losses {[round(x, 3) for x in r['loss']]}", flush=True)
                res[side] = r
            trained = res["ours"]["trained_per_step"]
            flops = model_flops(config, a.batch, a.max_length, trained, a.gradient_checkpointing)
            results.append((size, config, flops, res))
        peaks.append(_peaks(a.peak_n))
    # the machine's peak: the best rate either library reached, before or after the models ran
    peak_gflops = max(max(p["mlx"], p["torch"]) for p in peaks)
    print(f"fp32 matmul {a.peak_n}x{a.peak_n} after the runs: MLX {peaks[1]['mlx']:.1f}, torch "
          f"{peaks[1]['torch']:.1f} GFLOP/s; peak used for MFU: {peak_gflops:.1f} GFLOP/s")

    print()
    print(f"SFT step, Qwen3-VL random checkpoints, text rows of {a.max_length} tokens, batch {a.batch}, full "
          f"fine-tuning, {a.optim}, fp32, gradient checkpointing {'on' if a.gradient_checkpointing else 'off'}; "
          f"median of {a.steps} steps after {a.warmup} warm-up step(s)")
    hdr = (f"{'model':6} {'side':6} {'s/step':>8} {'tokens/s':>9} {'x TRL':>6} {'peak RSS GB':>12} {'x TRL':>6} "
           f"{'above base':>11} {'x TRL':>6} {'MLX peak GB':>12} {'MFU':>6}")
    print(hdr)
    for size, _, flops, res in results:
        trl = res["trl"]
        trl_above = trl["peak_rss_gb"] - trl["base_rss_gb"]
        for side in ("ours", "trl"):
            r = res[side]
            above = r["peak_rss_gb"] - r["base_rss_gb"]
            mfu = flops / r["s_per_step"] / 1e9 / peak_gflops
            mlx_peak = f"{r['mlx_peak_gb']:12.2f}" if "mlx_peak_gb" in r else f"{'-':>12}"
            print(f"{size:6} {'mlxrl' if side == 'ours' else 'TRL':6} {r['s_per_step']:8.2f} {r['tokens_per_s']:9.1f} "
                  f"{r['tokens_per_s'] / trl['tokens_per_s']:6.2f} {r['peak_rss_gb']:12.2f} "
                  f"{r['peak_rss_gb'] / trl['peak_rss_gb']:6.2f} {above:11.2f} {above / trl_above:6.2f} "
                  f"{mlx_peak} {mfu:6.1%}")
    for size, _, flops, res in results:
        ours = res["ours"]
        achieved = flops / ours["s_per_step"] / 1e9
        print(f"MFU {size}: {flops / 1e12:.2f} TFLOP/step (model FLOPs, formula in the docstring) / "
              f"{ours['s_per_step']:.2f} s = {achieved:.1f} GFLOP/s = {achieved / peak_gflops:.1%} of the measured "
              f"fp32 matmul peak {peak_gflops:.1f} GFLOP/s (target >= 50% on small)")
        if "profile" in ours:
            p = ours["profile"]
            print(f"profile of our step, {size} ({p.pop('params_m'):.0f}M parameters), seconds:")
            for k, v in p.items():
                print(f"  {k:48} {v:8.2f}")


if __name__ == "__main__":
    main()
