"""`python -m mlxrl.generate` and its Python API: talk to what you trained (a streamed reply, its speed
and peak memory).

Prefill and decode speed and peak memory follow the reply (`python -m mlxrl.chat` is the multi-turn
loop over the same pieces). `--load_in_4bit` / `--load_in_8bit` quantize the base before an adapter
trained over a quantized (QLoRA) base goes on.

    python -m mlxrl.generate --adapter_path out/sft-demo          # the SFT demo's result, a held-out picture
    python -m mlxrl.generate --model Qwen/Qwen3-VL-2B-Instruct --image cat.png --prompt "What is this?"
    python -m mlxrl.generate --model Qwen/Qwen3-0.6B --adapter_path out/run --prompt "Hi" --temperature 0.7
    python -m mlxrl.generate --model ./base --adapter_path out/run/checkpoint-200 --prompt -   # prompt from stdin

The reply goes to stdout, everything else to stderr. Bad input (a missing adapter, an adapter of another
base, an image for a text model, a prompt longer than the context, stdin that is not text, a chat template
that raises: named with its file) is one `error:` line, exit status 2. Pictures given as files are opened
as transformers' `load_image` opens them (`mlxrl.data.images.open_image`: EXIF orientation applied).

In Python (custom evaluation loops):

    from mlxrl.generate import load
    gen = load("Qwen/Qwen3-VL-2B-Instruct", adapter_path="out/run")    # model + adapter, once
    reply = gen([{"role": "user", "content": [{"type": "image", "image": "cat.png"},
                                              {"type": "text", "text": "What is it?"}]}], max_new_tokens=32)
    reply.text, reply.token_ids, reply.finish_reason, reply.stats
    gen.batch([messages_1, messages_2], temperature=0)    # many conversations at once (left-padded)
    chat = gen.chat(system="Be brief.")                    # keeps its KV cache between turns
    chat.send("Hello").text

What a model reference can be (`--model` and `--adapter_path`, resolved by `resolve`): a Hugging Face
model folder or Hub id (a merged or fully fine-tuned folder included); a PEFT adapter folder
(adapter_config.json: LoRA or DoRA; its base is `--model`, else the adapter's base_model_name_or_path,
`mlxrl:default` being the embedded default); an mlxrl checkpoint (`checkpoint-<step>`: the trained
weights only; the base as for an adapter, found in the run folder or recognised as the embedded
default by its config); or a training run's output_dir (its adapter, else its `model/` or `merged/`
folder, else its newest checkpoint).

Sampling settings start from the model's generation_config.json when it has one, as transformers'
`generate()` does (do_sample, temperature, top_k, top_p, min_p, repetition_penalty, max_new_tokens,
eos_token_id; fields it leaves out take transformers' defaults: greedy unless do_sample, top_k 50,
temperature 1, top_p 1); flags override. Without one: greedy, 256 new tokens, stop at <|im_end|> or
<|endoftext|>. A temperature above 0 samples (with transformers' order: repetition penalty, then
logits / temperature, top_k, top_p, min_p), 0 is greedy.

How a reply is made (`Context`): one sequence, one mlx-lm `KVCache` per layer, and the list of
tokens the cache holds. `prefill(ids)` keeps the longest cached prefix of `ids` (never splitting an
image), trims the rest, and forwards only the new tokens (with the pixels of the images among them;
text in chunks of `prefill_step_size`); positions are those of the whole sequence (M-RoPE for
Qwen-VL, computed over all of `ids` and sliced), so a continued cache and a fresh one see the same
positions. Decoding is pipelined like mlx-lm's `generate_step`: the forward of token t is queued
(`mx.async_eval`) before token t is read back, so the CPU builds the next graph while the device
computes. A chat turn appends the new turn's tokens to what the cache holds (the conversation is
not re-prefilled); if the chat template rewrote earlier turns, the common prefix is kept instead.
Draws use keys split from `mx.random.key(seed)`, one per step, as `mlxrl.generation.generate` does:
with the same seed and settings a reply equals that engine's single sample.

Rooms of `mlxrl.generation`: `settings` (sampling defaults), `refs` (model / adapter / checkpoint / run
references), `context` (the KV cache and decoding), `api` (`load`, `Generator`, `Chat`); the command is
`mlxrl.cli.generate`.
"""

from . import runtime

if __name__ == "__main__":  # first, before the rest loads: may re-execute with huge pages
    runtime.setup(cli=True)

from .cli.generate import main  # noqa: E402
from .generation.api import Chat, Generator, load, split_images  # noqa: E402
from .generation.context import Context, Reply, Stats, image_spans  # noqa: E402
from .generation.refs import load_model, resolve  # noqa: E402
from .generation.settings import DEFAULT_MAX_NEW_TOKENS, Settings, generation_config_defaults  # noqa: E402

__all__ = ["Chat", "Context", "DEFAULT_MAX_NEW_TOKENS", "Generator", "Reply", "Settings", "Stats",
           "generation_config_defaults", "image_spans", "load", "load_model", "main", "resolve", "split_images"]

if __name__ == "__main__":
    raise SystemExit(main())
