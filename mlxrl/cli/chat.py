"""`python -m mlxrl.chat`: a multi-turn conversation in the terminal (the flags of mlxrl.generate).

With a model, an adapter, a checkpoint or a run's output. The conversation's KV cache is kept between
turns: each turn forwards only its own tokens (`mlxrl.generation.api.Chat`).

    python -m mlxrl.chat --adapter_path out/sft-demo
    python -m mlxrl.chat --model Qwen/Qwen3-VL-2B-Instruct --adapter_path out/run --system "Be brief."

In the loop: `/image PATH` attaches a picture to your next message, `/reset` starts over, `/help`,
Ctrl-C stops a reply (what was said stays in the conversation), Ctrl-D (or `/quit`) quits. A picture
that cannot be read, a line that is not text or a turn the chat template refuses is one `error:` line,
and the conversation goes on; a chat template that cannot render even a first turn ends it (exit 2).
"""

from __future__ import annotations

import sys

from ..errors import MlxrlError
from .generate import (
    build_parser,
    check_args,
    decode_text,
    eprint,
    load_from_args,
    read_images,
    read_prompt,
    settings_from_args,
    stdin_encoding,
    write,
)

NOT_SENT = "nothing was sent; type it again"
HELP = "/image PATH attaches a picture to your next message, /reset starts over, Ctrl-C stops a reply, Ctrl-D quits"


def main(argv=None) -> int:
    from .. import runtime
    from .common import run

    runtime.setup(cli=True)
    ns = build_parser("python -m mlxrl.chat", __doc__.splitlines()[0], chat=True).parse_args(argv)
    return run(lambda: _main(ns))


def _read_line(prompt: str) -> str | None:
    """One line of stdin without its newline (None at the end of input), checked to be text (`decode_text`).
    From a terminal, input() reads it (with line editing where Python's readline is loaded). Otherwise
    the line's bytes are read and decoded here: a text-mode stdin decodes a whole chunk ahead of the
    line, and one undecodable byte would then take the lines after it down with it."""
    buffer = getattr(sys.stdin, "buffer", None)
    if buffer is None or sys.stdin.isatty():
        try:
            line = input(prompt)
        except EOFError:
            return None
        except UnicodeDecodeError as e:  # a strict stdin: the line is read, its bytes are in the error
            line = e.object
        return decode_text(line, "that line", stdin_encoding(), NOT_SENT)
    print(prompt, end="", flush=True)
    raw = buffer.readline()
    if not raw:
        return None
    return decode_text(raw, "that line", stdin_encoding(), NOT_SENT).removesuffix("\n").removesuffix("\r")


def _turns(first: str | None):
    """The user's lines: --prompt first (echoed), then stdin until Ctrl-D. A line that is not text is one
    error line, and the conversation goes on."""
    if first is not None:
        print(f">> {first}", flush=True)
        yield first
    while True:
        try:
            line = _read_line(">> ")
        except MlxrlError as e:
            eprint(f"error: {e}")
            continue
        if line is None:
            print(flush=True)
            return
        yield line


def _check_template(chat) -> None:
    """Render a first turn before the first prompt: a chat template that cannot render even that (a syntax
    error, a sandbox violation, its own raise_exception) ends the chat here with one line naming it; one
    that refuses a later turn says so and the conversation goes on."""
    chat.gen.render([*chat.messages, {"role": "user", "content": [{"type": "text", "text": "Hello"}]}],
                    add_generation_prompt=True)


def _main(ns) -> None:
    check_args(ns)
    first, pending = read_prompt(ns.prompt), read_images(ns.image)
    gen = load_from_args(ns)
    if pending and not gen.is_vl:
        raise MlxrlError(f"--image: {gen.model.config.get('model_type')} is a text-only model; it cannot take images")
    settings = settings_from_args(ns)
    chat = gen.chat(system=ns.system)
    _check_template(chat)
    eprint(HELP)
    for line in _turns(first):
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            cmd, _, arg = text.partition(" ")
            if cmd in ("/quit", "/exit", "/q"):
                return
            if cmd == "/reset":
                chat.reset()
                pending = []
                eprint("(a new conversation)")
            elif cmd == "/image":
                try:
                    if not gen.is_vl:
                        raise MlxrlError(f"{gen.model.config.get('model_type')} is a text-only model: it cannot take "
                                         "images")
                    pending += read_images([arg.strip()] if arg.strip() else [])
                    eprint(f"({len(pending)} image(s) attached to your next message)" if arg.strip() else
                           "usage: /image PATH")
                except MlxrlError as e:
                    eprint(f"error: {str(e).replace('--image ', '')}")
            else:
                eprint(HELP if cmd == "/help" else f"unknown command {cmd}: {HELP}")
            continue
        try:
            reply = chat.send(text, pending, on_text=write, **settings)
        except KeyboardInterrupt:
            write("\n")
            eprint("(interrupted)")
            pending = []
            continue
        except MlxrlError as e:  # e.g. the conversation outgrew the context: say so, keep the loop
            eprint(f"error: {e}")
            continue
        pending = []
        write("\n")
        st = reply.stats
        eprint(f"[prefill {st.prefill_tokens} new tokens ({st.prompt_tokens - st.prefill_tokens} cached), "
               f"{st.prefill_tps:.0f} tok/s; {st.generation_tokens} tokens at {st.decode_tps:.1f} tok/s; "
               f"peak {st.peak_memory_gb:.2f} GB]")
