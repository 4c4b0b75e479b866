"""Measured peaks: real optimizer steps on random weights, for `python -m mlxrl.plan --measure` and the
planner's tests (predicted vs measured).

The rows fill max_length exactly: one token per character (`CharTokenizer`) for text, the real Qwen
tokenizer and noise pictures when images are asked for. This module runs the trainers; the memory
model (`plan.model`) imports none of them.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import mlx.core as mx

from .. import registry
from ..registry import scores_sequences, shape_of
from .model import arch_of, image_tokens, load_config, predict
from .shapes import grpo_prompt_length


class CharTokenizer:
    """One token per character (id = code point mod vocab): synthetic rows of an exact length for any
    vocabulary, without the Qwen tokenizer."""

    eos_token, pad_token_id, eos_token_id, chat_template = "\x01", 0, 1, None

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def __call__(self, text, add_special_tokens=False, **_):
        if isinstance(text, str):
            return {"input_ids": [ord(c) % self.vocab_size for c in text]}
        return {"input_ids": [self(t)["input_ids"] for t in text]}

    def decode(self, ids, skip_special_tokens=False, **_):
        return "".join(chr(int(i) + 32) for i in ids)

    def batch_decode(self, rows, **kw):
        return [self.decode(r, **kw) for r in rows]

    def convert_tokens_to_ids(self, _token):
        return -1

    def save_pretrained(self, _path):
        pass


def _text(rng, n: int, vocab: int) -> str:
    return "".join(chr(int(c)) for c in rng.integers(2, max(3, min(vocab, 20000)), size=n))


def synthetic_rows(trainer: str, args, n: int, vocab: int, seed: int = 0, prompt_length: int | None = None
                   ) -> list[dict]:
    """Rows that fill max_length exactly (SFT: text; DPO: a prompt of prompt_length tokens (default half of
    max_length) + chosen / rejected); GRPO: prompts of prompt_length tokens (default 512)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    L = int(getattr(args, "max_length", None) or 1024)
    if shape_of(trainer) == "pairs":
        p = min(int(prompt_length), L - 2) if prompt_length else L // 2
        return [{"prompt": _text(rng, p, vocab), "chosen": _text(rng, L - p - 1, vocab),
                 "rejected": _text(rng, L - p - 1, vocab)} for _ in range(n)]
    if shape_of(trainer) == "groups":
        P = grpo_prompt_length(args, prompt_length)
        return [{"prompt": _text(rng, P, vocab)} for _ in range(n)]
    return [{"text": _text(rng, L + 8, vocab)} for _ in range(n)]


def random_model(cfg: dict, dtype: mx.Dtype, seed: int = 0):
    from ..loading import init_weights
    from ..models import build_model

    mx.random.seed(seed)
    model = build_model(cfg)
    init_weights(model, cfg.get("initializer_range", 0.02))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    # no folder behind random weights: the trainers' output_dir check (`run_dir.check_target`) reads the
    # model's name_or_path, and without one would take the model object itself for a path
    model.name_or_path = None
    return model


def _reward_length(prompts, completions, completion_ids, **_):
    """A reward for measuring GRPO: varies within a group, so every advantage is not zero."""
    return [float(len(set(ids))) for ids in completion_ids]


def _image_processor(cfg: dict, image_size: int):
    """A Qwen-VL image processor for `cfg`'s vision tower that keeps `image_size`-pixel squares as they are."""
    from ..loading import DEFAULT_CONFIG
    from ..processing.processor import ImageProcessor

    pre = dict(json.loads(Path(DEFAULT_CONFIG).read_text())["preprocessor_config"])
    vc = cfg["vision_config"]
    pre.update(patch_size=vc.get("patch_size", 14), merge_size=vc.get("spatial_merge_size", 2),
               temporal_patch_size=vc.get("temporal_patch_size", 2), min_pixels=image_size ** 2,
               max_pixels=image_size ** 2)
    return ImageProcessor.from_dict(pre)


def image_rows(trainer: str, args, n: int, images: int, image_size: int, seed: int = 0,
               prompt_length: int | None = None) -> list[dict]:
    """Vision rows for `measure`: `images` noise pictures of `image_size` pixels a side in the user turn,
    then text of about max_length tokens (one token per " x"); DPO: a prompt of prompt_length tokens
    (default half of max_length) + chosen / rejected; GRPO: the pictures and a prompt of prompt_length
    tokens. The text's length matches `shapes.forward_shape`, which counts the image tokens on top of max_length / the
    prompt."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    L = int(getattr(args, "max_length", None) or 1024)

    def words(k):
        return " x" * max(1, k)

    def pictures():
        return [Image.fromarray(rng.integers(0, 255, (image_size, image_size, 3), dtype=np.uint8))
                for _ in range(images)]

    def user(k):
        return {"role": "user", "content": [{"type": "image"}] * images + [{"type": "text", "text": words(k)}]}

    if shape_of(trainer) == "groups":
        return [{"prompt": [user(grpo_prompt_length(args, prompt_length) - 24)], "images": pictures()}
                for _ in range(n)]
    if shape_of(trainer) == "pairs":
        p = min(int(prompt_length), L - 10) if prompt_length else L // 2
        return [{"prompt": [user(p - 24)], "chosen": [{"role": "assistant", "content": words(L - p - 8)}],
                 "rejected": [{"role": "assistant", "content": words(L - p - 8)}], "images": pictures()}
                for _ in range(n)]
    return [{"messages": [user(L // 2 - 16), {"role": "assistant", "content": words(L - L // 2 - 8)}],
             "images": pictures()} for _ in range(n)]


def measure(config: dict | str | None, args, trainer: str = "sft", steps: int = 3,
            prompt_length: int | None = None, images: int = 0, image_size: int | None = None) -> int:
    """mx.get_peak_memory() over `steps` real optimizer steps (random weights, synthetic rows of
    max_length tokens; GRPO: prompts of prompt_length, generation included; a VL config with `images`
    of `image_size` pixels per row: the real Qwen tokenizer and image rows, max_length raised by the
    image tokens as `predict` counts them), minus what was allocated before the model was built."""
    import contextlib
    import gc
    import io
    import tempfile

    from ..processing.processor import Processor

    cfg = config if isinstance(config, dict) else load_config(config)
    gc.collect()
    mx.clear_cache()
    base = mx.get_active_memory()
    model = random_model(cfg, args.compute_dtype(), getattr(args, "seed", 0))
    if scores_sequences(trainer):  # a reward model: the decoder with a score head (`models.score`)
        from ..models.score import init_score, make_classifier

        make_classifier(model, 1)
        init_score(model)
        mx.eval(model.parameters())
    vocab = model.language_model.config.vocab_size
    processor = Processor(CharTokenizer(vocab))
    images = images if images and image_size and "vision_config" in cfg else 0
    text_args = args  # the rows' text follows the given max_length; the run's max_length adds the images
    if images:
        from ..processing.processor import QWEN3_VL_CHAT_TEMPLATE, QWEN_VL_CHAT_TEMPLATE, build_qwen_tokenizer

        template = QWEN3_VL_CHAT_TEMPLATE if cfg.get("model_type") == "qwen3_vl" else QWEN_VL_CHAT_TEMPLATE
        processor = Processor(build_qwen_tokenizer(template), _image_processor(cfg, image_size), template)
        extra = image_tokens(arch_of(cfg, args), images, image_size) + 32  # + vision markers and the template
        if getattr(args, "max_length", None):
            args = dataclasses.replace(args, max_length=int(args.max_length) + extra)
    with tempfile.TemporaryDirectory() as tmp:
        args = dataclasses.replace(args, output_dir=tmp, max_steps=steps, save_strategy="no", logging_steps=10**6,
                                   disable_tqdm=True)
        n = args.per_device_train_batch_size * args.gradient_accumulation_steps * steps
        kw = {}
        if shape_of(trainer) == "groups":  # enough prompts for every round of `steps` steps
            n = n // int(args.num_generations) + 4 * steps * args.gradient_accumulation_steps
            if not registry.holds_teacher(trainer):
                kw["reward_funcs"] = [_reward_length]
        if registry.holds_teacher(trainer):  # a teacher of the student's config (`predict`'s default)
            kw["teacher_model"] = random_model(cfg, args.compute_dtype(), getattr(args, "seed", 0) + 1)
        rows = (image_rows(trainer, text_args, n, images, image_size, prompt_length=prompt_length) if images
                else synthetic_rows(trainer, args, n, vocab, prompt_length=prompt_length))
        cls = _trainer_class(trainer)
        with contextlib.redirect_stdout(io.StringIO()):
            t = cls(model, processor, args, train_dataset=rows, **kw)
            t.train()
        peak = mx.get_peak_memory()
        del t, model
        gc.collect()
    mx.clear_cache()
    return int(peak - base)


def _trainer_class(trainer: str):
    base = registry.trainer_class(trainer)

    class Measured(base):
        def save_final(self):  # nothing to keep
            pass

    return Measured


def config_class(trainer: str):
    return registry.config_class(trainer)


def check_trainer_config(trainer: str, args) -> None:
    """The trainer's own checks beyond `check_config` (DPO's loss types and beta, GRPO's group size and
    batching), which its CLI runs before any model loads: a plan of a run the trainer refuses is refused."""
    registry.check_config(trainer, args)


def sweep(cfg: dict, args, trainer: str, lengths=None, ranks=None, prompt_length: int | None = None
          ) -> list[tuple[str, int, int]]:
    """(setting, predicted, measured) for a few sequence lengths (GRPO: max_completion_length) and LoRA ranks."""
    out = []
    key = "max_completion_length" if shape_of(trainer) == "groups" else "max_length"
    L = int(getattr(args, key, None) or 256)

    def row(name, a):
        out.append((name, predict(cfg, a, trainer, suggest=False, prompt_length=prompt_length).total,
                    measure(cfg, a, trainer, prompt_length=prompt_length)))

    for length in lengths or (max(16, L // 2), L, 2 * L):
        row(f"{key}={length}", dataclasses.replace(args, **{key: length}))
    for r in ranks or (4, 16, 64):
        row(f"use_peft lora_r={r}", dataclasses.replace(args, use_peft=True, lora_r=r, lora_alpha=2 * r))
    return out
