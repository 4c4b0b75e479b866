"""The Python API: `load(...)` -> `Generator` (replies, batches) and `Chat` (a conversation that keeps its cache)."""

from __future__ import annotations

import contextlib
import time
from dataclasses import replace

import mlx.core as mx
import numpy as np

from ..errors import MlxrlError
from .context import Context, Reply, Stats
from .engine import END_OF_TEXT, is_vl
from .refs import load_model, template_file
from .settings import DEFAULT_BASE_SEED, Settings


# --------------------------------------------------------------------------------------- API
def blocks(content) -> list:
    return content if isinstance(content, list) else []


def is_image_block(b) -> bool:
    return isinstance(b, dict) and (b.get("type") == "image" or "image" in b or "image_url" in b)


def split_images(messages: list[dict], images=None) -> list:
    """The images of a conversation in the order the chat template places them: each image block's
    `image` payload (a PIL image, a path or a uint8 array), or, for blocks without one, the next of `images`."""
    spare = list(images or [])
    out = []
    for m in messages:
        for b in blocks(m.get("content")):
            if not is_image_block(b):
                continue
            payload = b.get("image")
            if payload is None:
                if not spare:
                    raise MlxrlError("an image block has no 'image' and no images= are left for it")
                payload = spare.pop(0)
            out.append(payload)
    if spare:
        raise MlxrlError(f"{len(spare)} image(s) given but the messages have no image block left for them")
    return out


def render(processor, messages: list[dict], template: str, **kwargs) -> str:
    """The chat template applied to `messages` by the trainers' own `data.formats.render_chat`, which turns
    whatever the template raises (a TemplateSyntaxError, the jinja sandbox's SecurityError, the template's
    `raise_exception(...)`) into one line; here that line names the template's file (`template_file`)."""
    from ..data.files import DataError
    from ..data.formats import render_chat

    try:
        return render_chat(processor, messages, {}, **kwargs)
    except DataError as e:  # render_chat names "row", which here is the conversation
        raise MlxrlError(f"{template}: {str(e).removeprefix('row: ')}") from None


def _to_mx(pixel_values):
    return None if pixel_values is None else mx.array(np.asarray(pixel_values, dtype=np.float32))


@contextlib.contextmanager
def eval_mode(model):
    """The model in eval mode (no dropout) for a generation, then back in the mode it was in: a model
    generating right after training is still in train mode, where LoRA dropout would make greedy replies
    random."""
    training = model.training
    model.eval()
    try:
        yield model
    finally:
        if training:
            model.train()


class Generator:
    """A loaded model (with its adapter), its processor and its default settings; see the module docstring.

    `gen(messages, **settings)` -> Reply; `on_text=callable` receives the reply's text as it is decoded.
    settings: max_new_tokens, temperature, top_p, top_k, min_p, repetition_penalty, seed, stop_token_ids
    (None: the defaults, i.e. generation_config.json's, else `Settings()`'s)."""

    def __init__(self, model, processor, defaults: dict | None = None, description: str = "",
                 template: str | None = None):
        self.model, self.processor, self.description = model, processor, description
        self.defaults = Settings(**(defaults or {}))
        # where the chat template came from, for its errors: by default the model's own folder
        self.template = template or template_file(getattr(model, "name_or_path", None))

    @classmethod
    def load(cls, model: str | None = None, adapter_path=None, *, dtype=None, base_seed: int = DEFAULT_BASE_SEED,
             quantize: tuple[int, int] | None = None, log=None) -> Generator:
        net, processor, defaults, description, template = load_model(model, adapter_path, dtype=dtype,
                                                                     base_seed=base_seed, quantize=quantize, log=log)
        return cls(net, processor, defaults, description, template)

    @property
    def is_vl(self) -> bool:
        return is_vl(self.model)

    def settings(self, **overrides) -> Settings:
        unknown = set(overrides) - set(Settings.__dataclass_fields__)
        if unknown:
            raise TypeError(f"unknown setting(s): {', '.join(sorted(unknown))}")
        given = {k: v for k, v in overrides.items() if v is not None}
        if "stop_token_ids" in given:
            given["stop_token_ids"] = tuple(int(t) for t in given["stop_token_ids"])
        return replace(self.defaults, **given).check()

    def render(self, messages: list[dict], **kwargs) -> str:
        """The chat template applied to `messages` (`render`: what the template raises is one line naming it)."""
        return render(self.processor, messages, self.template, **kwargs)

    def encode(self, messages: list[dict], images=None, add_generation_prompt: bool = True):
        """(ids [L] int64, pixel_values or None, image_grid_thw or None, rendered text) of one conversation."""
        imgs = split_images(messages, images)
        if imgs and not self.is_vl:
            raise MlxrlError(f"{self.model.config.get('model_type')} is a text-only model: it cannot take images")
        text = self.render(messages, add_generation_prompt=add_generation_prompt)
        batch = self.processor(text=[text], images=[imgs] if imgs else None, return_tensors="np")
        return batch["input_ids"][0], batch.get("pixel_values"), batch.get("image_grid_thw"), text

    def _reply(self, context: Context, ids, pixel_values, grid, settings: Settings, on_text=None) -> Reply:
        from mlx_lm.tokenizer_utils import NaiveStreamingDetokenizer

        detok = NaiveStreamingDetokenizer(self.processor.tokenizer)
        stats, tokens = Stats(), []
        for tok in context.stream(ids, _to_mx(pixel_values), grid, settings, stats):
            tokens.append(tok)
            if on_text is not None:
                detok.add_token(tok)
                piece = detok.last_segment
                if piece:
                    on_text(piece)
        if on_text is not None:
            detok.finalize()
            if piece := detok.last_segment:
                on_text(piece)
        return Reply(self.processor.decode(tokens), tokens, context.finish_reason, stats)

    def __call__(self, messages: list[dict], *, images=None, on_text=None, **settings) -> Reply:
        """Reply to one conversation (a fresh cache): messages in the chat format (content a string or a
        list of blocks; image blocks carry their picture as "image", or take the next of `images`)."""
        s = self.settings(**settings)
        ids, pv, grid, _ = self.encode(messages, images)
        with eval_mode(self.model):
            return self._reply(Context(self.model), ids, pv, grid, s, on_text)

    def batch(self, conversations: list[list[dict]], **settings) -> list[Reply]:
        """Replies to many conversations at once: left-padded into one batch for `mlxrl.generation.engine.generate`
        (prefill once, decode all rows together; greedy replies equal `gen(messages)`'s). With a
        repetition penalty (which that engine does not apply) they are made one by one instead."""
        from .engine import generate

        s = self.settings(**settings)
        if s.repetition_penalty != 1.0:
            return [self(m, **settings) for m in conversations]
        texts, images = [], []
        for m in conversations:
            imgs = split_images(m)
            if imgs and not self.is_vl:
                raise MlxrlError(f"{self.model.config.get('model_type')} is a text-only model: it cannot take images")
            texts.append(self.render(m, add_generation_prompt=True))
            images.append(imgs)
        batch = self.processor(text=texts, images=images if any(images) else None, padding_side="left")
        longest = int(batch["attention_mask"].sum(axis=1).max().item())
        ctx = int(self.model.language_model.config.max_position_embeddings)
        if longest >= ctx:
            raise MlxrlError(f"a prompt is {longest} tokens, as long as the model's context or longer ({ctx}): "
                             "shorten it")
        t0 = time.perf_counter()
        mx.reset_peak_memory()
        with eval_mode(self.model):
            out = generate(self.model, **batch, num_generations=1, max_tokens=min(s.max_new_tokens, ctx - longest),
                           temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
                           stop_token_ids=s.stop_token_ids or (-1,), pad_token_id=END_OF_TEXT, seed=s.seed)
        ids, mask = np.asarray(out.completion_ids), np.asarray(out.completion_mask).astype(bool)
        finished = np.asarray(out.finished)
        elapsed, peak = time.perf_counter() - t0, mx.get_peak_memory() / 1e9
        replies = []
        for r in range(len(conversations)):
            toks = ids[r][mask[r]].tolist()
            if finished[r]:
                toks = toks[:-1]
            stats = Stats(prompt_tokens=int(batch["attention_mask"][r].sum().item()), generation_tokens=len(toks),
                          decode_s=elapsed, peak_memory_gb=peak)
            replies.append(Reply(self.processor.decode(toks), toks, "stop" if finished[r] else "length", stats))
        return replies

    def chat(self, system: str | None = None) -> Chat:
        return Chat(self, system)


def load(model: str | None = None, adapter_path=None, *, dtype=None, base_seed: int = DEFAULT_BASE_SEED,
         quantize: tuple[int, int] | None = None, log=None) -> Generator:
    """Load a model (Hub id or folder; None: the embedded default) plus an adapter, a checkpoint or a run's
    output (`adapter_path`), ready to generate: `load(...)(messages)` -> Reply. quantize=(4, 64): the base
    quantized as `--load_in_4bit` does (an adapter trained over a 4-bit base). See the module docstring."""
    return Generator.load(model, adapter_path, dtype=dtype, base_seed=base_seed, quantize=quantize, log=log)


class Chat:
    """A conversation that keeps its KV cache between turns: each turn forwards only its own tokens.

    `send(text, images=(), on_text=None, **settings)` -> Reply; `messages` is the history, `reset()`
    starts over. A turn's tokens are what the cache holds (the earlier prompts and replies, token for
    token) followed by the new turn rendered by the chat template; when the template renders the
    history differently from what the cache holds, the common prefix is kept and the rest re-forwarded."""

    def __init__(self, generator: Generator, system: str | None = None):
        self.gen, self.system = generator, system
        self.context = Context(generator.model)
        self.reset()

    def reset(self) -> None:
        self.messages: list[dict] = [{"role": "system", "content": self.system}] if self.system else []
        self.images: list = []
        self.context.reset()
        self._text, self._ids, self._pixels, self._grid = "", [], None, None

    def encode(self, text: str, images=()) -> tuple[list[dict], list[int], object, object, str]:
        """(messages with the new user turn, ids, pixel_values, image_grid_thw, rendered text) of the next turn."""
        images = list(images)
        if images and not self.gen.is_vl:
            raise MlxrlError(f"{self.gen.model.config.get('model_type')} is a text-only model: it cannot take images")
        user = {"role": "user", "content": [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]}
        messages = [*self.messages, user]
        proc = self.gen.processor
        rendered = self.gen.render(messages, add_generation_prompt=True)
        if self._ids and rendered.startswith(self._text):  # append the new turn to what the cache holds
            b = proc(text=[rendered[len(self._text):]], images=[images] if images else None, return_tensors="np")
            ids = self._ids + b["input_ids"][0].tolist()
            pixels, grid = self._pixels, self._grid
            if "pixel_values" in b:
                pixels = b["pixel_values"] if pixels is None else np.concatenate([pixels, b["pixel_values"]])
                grid = b["image_grid_thw"] if grid is None else np.concatenate([grid, b["image_grid_thw"]])
        else:  # the first turn, or a template that rewrote the history: render everything
            every = self.images + images
            b = proc(text=[rendered], images=[every] if every else None, return_tensors="np")
            ids, pixels, grid = b["input_ids"][0].tolist(), b.get("pixel_values"), b.get("image_grid_thw")
        return messages, ids, pixels, grid, rendered

    def send(self, text: str, images=(), *, on_text=None, **settings) -> Reply:
        """The reply to a new user turn (`text`, with `images` before it); `on_text` receives it as it is
        decoded. Ctrl-C keeps what was said so far in the history (and the cache), then re-raises. Turn k
        (from 0) samples with seed + k, so that turns do not reuse one another's random draws."""
        s = self.gen.settings(**settings)
        s = replace(s, seed=s.seed + sum(m["role"] == "user" for m in self.messages))
        messages, ids, pixels, grid, rendered = self.encode(text, images)
        try:
            reply = self.gen._reply(self.context, ids, pixels, grid, s, on_text)
        except KeyboardInterrupt:
            held = self.context.tokens
            self._commit(messages, ids, held[len(ids):] if held[:len(ids)] == list(ids) else [], pixels, grid,
                         rendered, images)
            raise
        self._commit(messages, ids, reply.token_ids, pixels, grid, rendered, images)
        return reply

    def _commit(self, messages, ids, tokens, pixels, grid, rendered, images) -> None:
        """Record the turn: the history gets the reply's text; `_ids` / `_text` are the sequence the cache
        holds (the reply's stop token included when it was forwarded) and the text it renders to."""
        ids, held = list(ids), self.context.tokens
        n = len(ids) + len(tokens)
        stop = held[n:n + 1] if held[:n] == ids + list(tokens) else []
        self._ids = ids + list(tokens) + stop
        self._text = rendered + self.gen.processor.decode(list(tokens) + stop)
        self._pixels, self._grid = pixels, grid
        self.images += list(images)
        self.messages = [*messages, {"role": "assistant", "content": self.gen.processor.decode(list(tokens))}]
