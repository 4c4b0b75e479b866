"""`python -m mlxrl`: load a model (or the embedded default), run one image+text forward, print
the next-token prediction, and optionally save the model as a Hugging Face folder. With a command
first, the `mlxrl` console command (as `trl sft ...`): `mlxrl sft|dpo|orpo|cpo|kto|reward|grpo|rloo|distill|generate|
chat|plan ...` is `python -m mlxrl.sft ...` and so on.

    mlxrl sft --model Qwen/Qwen3-0.6B --dataset data.jsonl --use_peft true
    mlxrl chat --model out/merged

    python -m mlxrl                                  # embedded tiny Qwen3-VL, no network
    python -m mlxrl --model Qwen/Qwen3-VL-2B-Instruct --image cat.png --prompt "What is this?"
    python -m mlxrl --model ./my-model --save out/   # write an HF-layout copy
    python -m mlxrl --save out/ --overwrite          # replace an earlier save of ours in out/

--save never deletes what mlxrl did not write: a non-empty folder that is not an earlier save of ours
(one with mlxrl_save.json listing every file in it) is refused, as is an existing file.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from ..registry import names as trainer_names


def demo_image():
    """A red disc on a blue square on white: something to look at without any file."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (200, 150), "white")
    d = ImageDraw.Draw(img)
    d.rectangle([20, 30, 90, 100], fill=(40, 80, 200))
    d.ellipse([110, 40, 170, 100], fill=(220, 30, 30))
    return img


COMMANDS = (*trainer_names(), "generate", "chat", "plan")


def console() -> None:
    """The `mlxrl` command: `mlxrl CMD ...` runs `python -m mlxrl.CMD ...`, plain `mlxrl ...` runs `python -m
    mlxrl ...` (the same process setup, huge pages included, as the `python -m` forms)."""
    argv = sys.argv[1:]
    module = f"mlxrl.{argv[0]}" if argv and argv[0] in COMMANDS else "mlxrl"
    rest = argv[1:] if module != "mlxrl" else argv
    os.execv(sys.executable, [sys.executable, "-m", module, *rest])


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COMMANDS:  # python -m mlxrl sft ...
        import importlib

        return importlib.import_module(f"{__package__}.{argv[0]}").main(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m mlxrl", description=__doc__.splitlines()[0],
                                 epilog=f"commands: mlxrl {{{','.join(COMMANDS)}}} ... (python -m mlxrl.CMD ...)")
    ap.add_argument("--model", default=None, help="Hub id or local folder (default: the embedded tiny Qwen3-VL)")
    ap.add_argument("--image", default=None, help="image file (default: a drawn demo image; ignored by text models)")
    ap.add_argument("--prompt", default="What shapes are in the picture?")
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: float32 on CPU, bf16 on GPU)")
    ap.add_argument("--save", default=None, help="write the model + processor here in Hugging Face layout (a new or "
                    "empty folder, or an earlier save of ours with --overwrite)")
    ap.add_argument("--overwrite", action="store_true",
                    help="with --save: replace an earlier mlxrl save in that folder")
    args = ap.parse_args(argv)

    import mlxrl
    from mlxrl.cli.common import run

    print(mlxrl.runtime.startup_line(), flush=True)
    return run(lambda: _main(args))  # the CLIs' boundary: a user error is one line and exit 2, Ctrl-C 130


def _main(args) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    import mlxrl

    dtype = mlxrl.runtime.compute_dtype(args.dtype)  # a bad --dtype is refused before anything loads
    if args.save:  # a folder we may not write is refused before the model loads
        from pathlib import Path

        from mlxrl.atomic import check_save_target

        check_save_target(Path(args.save).expanduser().resolve(), args.overwrite, "--overwrite")
    t0 = time.perf_counter()
    model, processor = mlxrl.load(args.model, dtype=dtype) if args.model else mlxrl.load_default(dtype=dtype)
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    print(f"loaded {getattr(model, 'name_or_path', args.model)} ({model.config.get('model_type')}, "
          f"{n_params / 1e6:.1f}M parameters) in {time.perf_counter() - t0:.1f}s")
    vl = processor.image_processor is not None
    content = ([{"type": "image"}] if vl else []) + [{"type": "text", "text": args.prompt}]
    text = chat_text(model, processor, [{"role": "user", "content": content}])
    if vl:
        from mlxrl.cli.generate import read_images  # opened as transformers opens a picture: one line if it cannot be

        image = read_images([args.image])[0] if args.image else demo_image()
        batch = processor(text=[text], images=[[image]])
    else:
        batch = processor(text=[text])
    t0 = time.perf_counter()
    logits = model(**batch)
    probs = mx.softmax(logits[0, -1].astype(mx.float32))
    top = mx.argsort(-probs)[:5]
    mx.eval(top, probs)
    ms = (time.perf_counter() - t0) * 1e3
    shape = "x".join(map(str, batch["image_grid_thw"].tolist()[0])) if vl else "none"
    print(f"forward: {batch['input_ids'].shape[1]} tokens, image grid {shape}, {ms:.0f} ms")
    preds = ", ".join(f"{processor.decode([int(i)])!r} {float(probs[i]):.3f}" for i in top.tolist())
    print(f"next-token top-5: {preds}")
    if args.save:
        out = mlxrl.save(model, processor, args.save, overwrite=args.overwrite)
        print(f"saved Hugging Face folder: {out}")


def chat_text(model, processor, messages) -> str:
    """The prompt through the model's chat template (`mlxrl.generate`'s `render`: what the template raises
    is one line naming its file)."""
    from mlxrl.generation.api import render
    from mlxrl.generation.refs import template_file

    return render(processor, messages, template_file(getattr(model, "name_or_path", None)), add_generation_prompt=True)
