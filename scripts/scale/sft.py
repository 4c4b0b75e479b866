"""The SFT table's runs: one child per shape, length, mode and side (`run_sft`), each with its spec (`sft_spec`)."""

from __future__ import annotations

import json
from pathlib import Path

from .checkpoints import SHAPES, checkpoint, depths
from .common import MLXVLM, SFT
from .flops import step_flops
from .report import NAMES, print_sft, summarise_sft
from .spawn import child


def sft_spec(a, folder: Path, out: Path, mode: str, t: int, vl: bool) -> dict:
    return {"ckpt": str(folder), "out": str(out), "mode": mode, "bits": a.quant, "q_group_size": a.q_group_size,
            "max_length": t, "steps": a.steps, "warmup": a.warmup, "lr": a.lr_full if mode == "full" else a.lr_lora,
            "lora_dropout": a.lora_dropout, "vl": vl, "images": a.images, "image_px": a.image_px,
            "mlxlm_quant": a.mlxlm_quant, "gpu": a.gpu, "segments": a.checkpoint_segments, "optim": a.optim,
            "compile": a.compile == "true", "tiled_mlp_tokens": a.tiled_mlp_tokens}



def run_sft(a, root: Path, tmp: Path, env) -> dict:
    modes = list(a.modes) + (["qlora"] if a.quant else [])
    if a.gpu:  # TFLOP/s -> GFLOP/s, as the CPU figures
        peaks = [{k: v * 1e3 if k in ("mlx", "torch") else v for k, v in child("gpu_peak", {"n": a.peak_n}).items()}]
        print(f"bf16 matmul {a.peak_n}^2, best of 5: MLX ({peaks[0].get('mlx_device')}) {peaks[0]['mlx']:.0f}, "
              f"torch {peaks[0].get('torch', 0):.0f} GFLOP/s", flush=True)
    else:
        peaks = [SFT._peaks(a.peak_n)]
        print(f"fp32 matmul {a.peak_n}^2, best of 5: MLX ({peaks[0]['blas']}) {peaks[0]['mlx']:.1f}, "
              f"torch {peaks[0]['torch']:.1f} GFLOP/s", flush=True)
    results = []
    for shape in a.shapes:
        folder = checkpoint(root, shape, a.layers, env, a.ckpt_dtype)
        config = json.loads((folder / "config.json").read_text())
        vl = SHAPES[shape][0] == "vl"
        for t in a.max_length:
            for mode in modes:
                entry = {"shape": shape, "layers": depths(a.layers, shape)[0], "max_length": t, "mode": mode,
                         "sides": {}}
                for side in a.sides:
                    if side == "trl" and mode == "qlora":
                        entry["sides"][side] = {"na": "no bitsandbytes on CPU"}
                        continue
                    if side == "mlxlm" and vl:
                        entry["sides"][side] = {"na": "mlx-lm's trainer is text-only"}
                        continue
                    if side == "mlxvlm" and MLXVLM.unsupported(config):
                        entry["sides"][side] = {"na": MLXVLM.unsupported(config)}
                        continue
                    r = child(side, sft_spec(a, folder, tmp / f"{shape}-{t}-{mode}-{side}", mode, t, vl), env)
                    if "error" not in r:
                        r = summarise_sft(r, a.warmup, t)
                        dev = f", device peak {r['device_peak_gb']:.2f} GB" if "device_peak_gb" in r else ""
                        print(f"{shape} T={t} {mode} {NAMES[side]}: {r['s_per_step']:.2f} s/step, "
                              f"{r['tokens_per_s']:.1f} tokens/s, peak RSS {r['peak_rss_gb']:.2f} GB{dev}, "
                              f"losses {[round(x, 4) for x in r['loss']]}", flush=True)
                    entry["sides"][side] = r
                grids = next((r["grids"] for r in entry["sides"].values() if r.get("grids")), ())
                trained = next((r["trained_per_step"] for s, r in entry["sides"].items()
                                if s != "mlxlm" and r.get("trained_per_step")), t - 1)
                entry["flops"] = step_flops(config, t, trained, mode, grids)
                results.append(entry)
    if not a.gpu:
        peaks.append(SFT._peaks(a.peak_n))
    peak = max(max(p["mlx"], p.get("torch", 0)) for p in peaks)
    print(f"{'bf16' if a.gpu else 'fp32'} matmul {a.peak_n}^2 after the runs: MLX {peaks[-1]['mlx']:.1f}, "
          f"torch {peaks[-1].get('torch', 0):.1f} GFLOP/s; peak used for MFU: {peak:.1f} GFLOP/s")
    print_sft(a, results, peak)
    return {"peaks": peaks, "peak_gflops": peak, "runs": results}
