"""Summaries of a side's result, the side names, ratios, and the SFT table."""

from __future__ import annotations

import statistics

from .checkpoints import QWEN3_5, real_depth


def summarise_sft(r: dict, warmup: int, max_length: int) -> dict:
    st = r["stamps"]
    steps = [y - x for x, y in zip(st[warmup:-1], st[warmup + 1:], strict=True)]
    r["s_per_step"] = statistics.median(steps)
    r["tokens_per_step"] = statistics.median(r["tokens"][warmup:]) if r["tokens"][warmup:] else max_length
    r["tokens_per_s"] = r["tokens_per_step"] / r["s_per_step"]
    return r


NAMES = {"ours": "mlxrl", "ours_keep": "mlxrl+keep", "ours_untiled": "mlxrl untiled", "ours_f32base": "mlxrl f32base",
         "ours_seg": "mlxrl segments", "ours_8bit": "mlxrl 8-bit AdamW", "trl_8bit": "TRL 8-bit AdamW",
         "trl": "TRL", "mlxlm": "mlx-lm", "mlxvlm": "mlx-vlm",
         "grpo_shared": "mlxrl shared", "grpo_unshared": "mlxrl unshared", "grpo_trl": "TRL"}


def _ratio(a: float, b: float | None) -> str:
    return f"{a / b:.2f}x" if b else "-"



def print_sft(a, results: list, peak: float) -> None:
    real = "/".join(sorted({str(real_depth(x)) for x in a.shapes}))
    deltanet = " (Qwen3.5: and the five DeltaNet ones)" if set(a.shapes) & set(QWEN3_5) else ""
    depth = f"{a.layers} of {real} layers (--layers)" if a.layers else f"{real} layers"
    print()
    where = "bfloat16 on the GPU (--gpu)" if a.gpu else "float32"
    print(f"SFT step, random checkpoints ({depth}), batch 1, {where}, gradient checkpointing on every side, AdamW, "
          f"lr full {a.lr_full:g} / LoRA {a.lr_lora:g}, LoRA r16 alpha 32 dropout {a.lora_dropout:g} on the seven "
          f"projections{deltanet}; median of {a.steps} step(s) after {a.warmup} warm-up; MFU vs {peak:.1f} GFLOP/s")
    print(f"{'shape':12} {'T':>5} {'mode':5} {'side':7} {'s/step':>8} {'tokens/s':>9} {'peak RSS':>9} "
          f"{'above base':>10} {'dev peak' if a.gpu else 'MLX peak':>9} {'MFU':>6} {'trainable':>10} "
          f"{'tok/step':>8} {'trained':>8} {'row':>12}  loss")
    for e in results:
        for side, r in e["sides"].items():
            head = f"{e['shape']:12} {e['max_length']:5} {e['mode']:5} {NAMES[side]:7}"
            if "na" in r or "error" in r:
                print(f"{head} {'n/a: ' + r['na'] if 'na' in r else 'failed: ' + r['error']}")
                continue
            key = "device_peak_gb" if a.gpu else "mlx_peak_gb"
            mlx_peak = f"{r[key]:9.2f}" if key in r else f"{'-':>9}"
            mfu = e["flops"] / r["s_per_step"] / 1e9 / peak
            print(f"{head} {r['s_per_step']:8.2f} {r['tokens_per_s']:9.1f} {r['peak_rss_gb']:9.2f} "
                  f"{r['peak_rss_gb'] - r['base_rss_gb']:10.2f} {mlx_peak} {mfu:6.1%} {r['trainable'] / 1e6:9.2f}M "
                  f"{r['tokens_per_step']:8.0f} {r.get('trained_per_step', '?'):>8} {r.get('row_hash', '?'):>12}  "
                  f"{' '.join(f'{x:.4f}' for x in r['loss'])}")
        ok = {s: r for s, r in e["sides"].items() if "s_per_step" in r}
        hashes = {r.get("row_hash") for r in ok.values()}
        images = {NAMES[s]: r["image_tokens"] for s, r in ok.items() if "image_tokens" in r}
        same = "yes" if len(hashes) == 1 and None not in hashes else f"NO {sorted(map(str, hashes))}"
        line = f"  {e['flops'] / 1e12:.3f} TFLOP/step (model); rows identical: {same}"
        if images:
            line += f"; image tokens per row {images}"
        for mine in ("ours", "ours_keep", "ours_untiled", "ours_f32base", "ours_seg", "ours_8bit"):
            if mine not in ok:
                continue
            o = ok[mine]
            for other in ("trl", "trl_8bit", "mlxlm", "mlxvlm"):
                if other in ok:
                    r = ok[other]
                    if a.gpu and "device_peak_gb" in o and "device_peak_gb" in r:
                        line += (f"; {NAMES[mine]}/{NAMES[other]}: tokens/s "
                                 f"{_ratio(o['tokens_per_s'], r['tokens_per_s'])}, device peak "
                                 f"{_ratio(o['device_peak_gb'], r['device_peak_gb'])}")
                        continue
                    line += (f"; {NAMES[mine]}/{NAMES[other]}: tokens/s "
                             f"{_ratio(o['tokens_per_s'], r['tokens_per_s'])}, "
                             f"peak RSS {_ratio(o['peak_rss_gb'], r['peak_rss_gb'])} (above base "
                             f"{_ratio(o['peak_rss_gb'] - o['base_rss_gb'], r['peak_rss_gb'] - r['base_rss_gb'])})")
        print(line)
