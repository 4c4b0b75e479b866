"""`python -m mlxrl.generate` (and the pieces `python -m mlxrl.chat` shares): flags, images, the streamed reply."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..errors import MlxrlError
from ..generation.api import Generator, blocks, is_image_block, load
from ..generation.refs import local_config, resolve
from ..generation.settings import DEFAULT_BASE_SEED, DEFAULT_MAX_NEW_TOKENS, Settings


# --------------------------------------------------------------------------------------- CLI
def build_parser(prog: str, description: str, chat: bool = False) -> argparse.ArgumentParser:
    """The flags `python -m mlxrl.generate` and `python -m mlxrl.chat` share (mlx-lm's spellings are aliases)."""
    from ..trainers.flags import HELP_REFERENCE, OneLineHelpFormatter

    ap = argparse.ArgumentParser(prog=prog, description=description, allow_abbrev=False,
                                 formatter_class=OneLineHelpFormatter, epilog=HELP_REFERENCE)
    ap.add_argument("--model", default=None, help="Hub id or folder; also a run's output_dir, an adapter or a "
                    "checkpoint. The embedded default has random weights unless --adapter_path names a trained demo "
                    "output (default: the embedded default)")
    ap.add_argument("--adapter_path", "--adapter-path", default=None, help="the trained result: an "
                    "adapter, a checkpoint, a fine-tuned folder or a run's output_dir. Any of: a PEFT adapter "
                    "(LoRA/DoRA), an mlxrl checkpoint-<step>, a merged or fully fine-tuned folder, or a training "
                    "run's output_dir")
    ap.add_argument("--prompt", "-p", default=None, help=("the first message; " if chat else "the prompt; ")
                    + "'-' reads stdin" + ("" if chat else ". Without --prompt and --image: a held-out question "
                                                          "of the embedded task (see --demo_example)"))
    ap.add_argument("--image", nargs="+", action="extend", default=[], metavar="FILE",
                    help="image file(s) for the " + ("first message" if chat else "prompt") + " (VL models)")
    ap.add_argument("--system", "--system-prompt", default=None, help="system prompt")
    ap.add_argument("--max_new_tokens", "--max-tokens", "-m", type=int, default=None,
                    help=f"default: generation_config.json's max_new_tokens, else {DEFAULT_MAX_NEW_TOKENS}")
    ap.add_argument("--temperature", "--temp", type=float, default=None,
                    help="0: greedy (default unless generation_config.json says do_sample)")
    ap.add_argument("--top_p", "--top-p", type=float, default=None, help="nucleus filter (1: off)")
    ap.add_argument("--top_k", "--top-k", type=int, default=None, help="top-k filter (0: off)")
    ap.add_argument("--min_p", "--min-p", type=float, default=None, help="min-p filter (0: off)")
    ap.add_argument("--repetition_penalty", type=float, default=None, help="transformers' (1: off)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: float32 on CPU, bf16 on GPU)")
    ap.add_argument("--base_seed", type=int, default=DEFAULT_BASE_SEED,
                    help=f"the seed of the embedded default's random weights (default {DEFAULT_BASE_SEED}, the "
                         "trainers' default). Set it to the training run's --seed")
    ap.add_argument("--load_in_4bit", action="store_true", help="quantize the base to 4 bits before the adapter "
                    "goes on. An adapter trained with --load_in_4bit fits that base")
    ap.add_argument("--load_in_8bit", action="store_true", help="the same, 8 bits")
    ap.add_argument("--q_group_size", type=int, default=64, help="quantization group size (32, 64, 128)")
    if not chat:
        ap.add_argument("--demo_example", type=int, default=None, metavar="K",
                        help="ask held-out question K of the embedded task, the default without --prompt. "
                             "The question is from the test split `python -m mlxrl.sft` scores, with its picture "
                             "for a VL model")
    return ap


def settings_from_args(ns) -> dict:
    names = ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed")
    return {k: getattr(ns, k) for k in names if getattr(ns, k) is not None}


def read_images(paths) -> list:
    """Upright RGB PIL images of the given files, opened as transformers opens them
    (`data.images.open_image`); a missing, unreadable or too large one, or a folder, is one line."""
    from ..data.images import open_image

    return [open_image(Path(p).expanduser(), f"--image {p}") for p in paths]


def decode_text(data, where: str, encoding: str = "utf-8", advice: str = "convert it") -> str:
    """`data` (bytes, or text that Python decoded with surrogateescape, as it does for stdin in a C or
    UTF-8 locale) as text, or one line: `where`, the first byte that is not `encoding` text, `advice`.
    (The surrogates surrogateescape leaves would otherwise reach the tokenizer, which fails on them
    with a TypeError.)"""
    try:
        if isinstance(data, (bytes, bytearray)):
            return data.decode(encoding)
        data.encode("utf-8")  # lone surrogates refuse to encode
        return data
    except UnicodeError as e:
        bad = e.object[e.start]
        byte = bad if isinstance(bad, int) else ord(bad) & 0xFF  # a surrogate U+DC80..U+DCFF holds byte 0x80..0xFF
        raise MlxrlError(f"{where} is not {encoding} text (byte {byte:#04x} at position {e.start}): "
                         f"{advice}") from None


def stdin_encoding() -> str:
    return getattr(sys.stdin, "encoding", None) or "utf-8"


def read_stdin(where: str) -> str:
    """All of stdin as text, decoded here from its bytes (`decode_text`; a text stream without bytes, as in
    tests, is checked the same way)."""
    buffer = getattr(sys.stdin, "buffer", None)
    encoding = stdin_encoding()
    return decode_text(sys.stdin.read() if buffer is None else buffer.read(), where, encoding,
                       f"convert it to {encoding} (e.g. with iconv)")


def read_prompt(prompt: str | None) -> str | None:
    if prompt == "-":
        return read_stdin("--prompt -: stdin")
    return prompt


def check_args(ns) -> None:
    """What can be refused before the model loads: flag values, missing files."""
    Settings(**settings_from_args(ns)).check()
    quantize = quantize_from_args(ns)
    if quantize is not None:
        from ..models.quantize import check_quantization

        check_quantization(*quantize)
    for flag in ("model", "adapter_path"):
        value = getattr(ns, flag)
        if value is not None and flag == "adapter_path":
            resolve(value)
    if ns.model is not None and not Path(ns.model).expanduser().is_dir():
        from ..hub import check_model_reference

        check_model_reference(ns.model)
    if ns.image and ns.model is not None and (Path(ns.model).expanduser() / "config.json").is_file():
        from ..models import VL_TYPES

        model_type = (local_config(ns.model) or {}).get("model_type")
        if model_type is not None and model_type not in VL_TYPES:
            raise MlxrlError(f"--image: {ns.model} is a text-only model ({model_type}); it cannot take images")
    if getattr(ns, "demo_example", None) is not None:
        if ns.demo_example < 0:
            raise MlxrlError(f"--demo_example {ns.demo_example}: must be >= 0")
        if ns.prompt is not None or ns.image:
            raise MlxrlError("--demo_example asks a question of the embedded task: drop --prompt / --image")


def quantize_from_args(ns) -> tuple[int, int] | None:
    if ns.load_in_4bit and ns.load_in_8bit:
        raise MlxrlError("--load_in_4bit and --load_in_8bit: choose one")
    bits = 4 if ns.load_in_4bit else 8 if ns.load_in_8bit else None
    return None if bits is None else (bits, ns.q_group_size)


def eprint(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def load_from_args(ns) -> Generator:
    from .. import runtime

    eprint(runtime.startup_line(runtime.compute_dtype(ns.dtype)))
    t0 = time.perf_counter()
    gen = load(ns.model, ns.adapter_path, dtype=ns.dtype, base_seed=ns.base_seed, quantize=quantize_from_args(ns),
               log=eprint)
    eprint(f"loaded {gen.description} in {time.perf_counter() - t0:.1f}s")
    if ns.model is None and ns.adapter_path is None and (Path("out/sft-demo") / "config.json").is_file():
        eprint("note: out/sft-demo holds a trained demo: pass --adapter_path out/sft-demo to talk to it")
    return gen


def demo_messages(gen: Generator, k: int, seed: int) -> tuple[list[dict], str]:
    """(prompt messages, expected answer) of held-out row k of the embedded task (`python -m mlxrl.sft`'s test
    split: seed + 1, its picture for a VL model, the text variant otherwise)."""
    from ..data.synthetic import demo_rows
    from ..evaluate import split_row

    row = demo_rows(gen.processor, k + 1, seed=seed + 1, split="test")[k]
    prompt, answer = split_row(row)
    images = list(row.get("images") or [])
    for m in prompt:  # put each picture into its block, where `gen` looks for it
        for b in blocks(m.get("content")):
            if is_image_block(b) and images:
                b["image"] = images.pop(0)
    return prompt, answer


def _user_message(text: str, images: list, system: str | None) -> list[dict]:
    content = [{"type": "image", "image": im} for im in images] + [{"type": "text", "text": text}]
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]


def write(piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()


def main(argv=None) -> int:
    from .. import runtime
    from .common import run

    runtime.setup(cli=True)
    ns = build_parser("python -m mlxrl.generate", __doc__.splitlines()[0]).parse_args(argv)
    return run(lambda: _main(ns))


def _main(ns) -> None:
    check_args(ns)
    prompt, images = read_prompt(ns.prompt), read_images(ns.image)
    if images and prompt is None:
        raise MlxrlError("--image needs --prompt (what to ask about the picture)")
    gen = load_from_args(ns)
    if images and not gen.is_vl:
        raise MlxrlError(f"--image: {gen.model.config.get('model_type')} is a text-only model; it cannot take images")
    expected = None
    if prompt is None:
        k = ns.demo_example or 0
        messages, expected = demo_messages(gen, k, ns.base_seed)
        if ns.system:
            messages = [{"role": "system", "content": ns.system}, *messages]
        question = " ".join(b["text"] for m in messages if m["role"] == "user" for b in blocks(m["content"])
                            if isinstance(b, dict) and isinstance(b.get("text"), str))
        eprint(f"held-out question {k} of the embedded task{' (with its picture)' if gen.is_vl else ''}: "
               f"{question!r}; expected answer: {expected!r}")
    else:
        messages = _user_message(prompt, images, ns.system)
    eprint("=" * 10)
    reply = gen(messages, on_text=write, **settings_from_args(ns))
    write("\n")
    eprint("=" * 10)
    if expected is not None:
        eprint(f"expected {expected!r}: {'correct' if reply.text.strip() == expected else 'wrong'}")
    if reply.finish_reason == "length":
        eprint(f"(stopped at --max_new_tokens {gen.settings(**settings_from_args(ns)).max_new_tokens})")
    for line in reply.stats.lines():
        eprint(line)
