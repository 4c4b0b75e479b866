"""TRL's SFTConfig fields that change the processor before any row is tokenised: `eos_token` and
`chat_template_path`.

As in TRL's SFTTrainer, they change the processor the trainer was given (so the final save writes
them with the tokenizer): `eos_token` must already be in the vocabulary; `chat_template_path` is a
`.jinja` / `.j2` file, or a local tokenizer folder whose chat template, and eos token, are taken
(TRL's `clone_chat_template`). TRL also adds the folder's special tokens and resizes the embeddings
to fit them; mlxrl changes no model shape, so a template whose tokens the vocabulary lacks is
refused in one line.
"""

from __future__ import annotations

import json
from pathlib import Path

from .config import ConfigError


def _token_text(value) -> str | None:
    """A tokenizer_config.json token entry: a string or {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


def read_template_folder(root: Path) -> tuple[str, str | None, list[str]]:
    """(chat template, eos token or None, the special tokens the folder's tokenizer adds) of a local tokenizer
    folder: chat_template.jinja, chat_template.json or tokenizer_config.json's `chat_template`."""
    config = {}
    if (root / "tokenizer_config.json").is_file():
        config = json.loads((root / "tokenizer_config.json").read_text())
    template = None
    if (root / "chat_template.jinja").is_file():
        template = (root / "chat_template.jinja").read_text()
    elif (root / "chat_template.json").is_file():
        template = json.loads((root / "chat_template.json").read_text()).get("chat_template")
    template = template or config.get("chat_template")
    if isinstance(template, list):  # several named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if not template:
        raise ConfigError(f"chat_template_path {root}: the folder has no chat template (chat_template.jinja, "
                          "chat_template.json or tokenizer_config.json's chat_template)")
    added = [_token_text(v) for v in (config.get("added_tokens_decoder") or {}).values()]
    return template, _token_text(config.get("eos_token")), [t for t in added if t]


def apply_tokenizer_args(processor, args) -> None:
    """Set `args.chat_template_path`'s template (and a folder's eos token), then `args.eos_token`, on
    `processor`; refuse, in one line, a token the vocabulary lacks or a path that is neither."""
    path, eos = getattr(args, "chat_template_path", None), getattr(args, "eos_token", None)
    if path is None and eos is None:
        return
    tok = processor.tokenizer
    vocab = tok.get_vocab()
    if path is not None:
        p = Path(path).expanduser()
        if p.is_file() and p.suffix in (".jinja", ".j2"):
            processor.chat_template = p.read_text()
        elif p.is_dir():
            template, folder_eos, added = read_template_folder(p)
            missing = [t for t in added + ([folder_eos] if folder_eos else []) if t not in vocab]
            if missing:
                raise ConfigError(f"chat_template_path {path}: its tokenizer has tokens this model's vocabulary "
                                  f"lacks ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); mlxrl "
                                  "does not resize the embeddings: use a template written for this tokenizer")
            processor.chat_template = template
            if folder_eos:
                tok.eos_token = folder_eos  # eos_token, when also given, is set after it
        else:
            raise ConfigError(f"chat_template_path {path}: not a .jinja / .j2 file nor a local tokenizer folder")
    if eos is not None:
        if eos not in vocab:
            raise ConfigError(f"eos_token {eos!r} is not in the tokenizer's vocabulary: use a token it has (e.g. "
                              f"{tok.eos_token!r})")
        tok.eos_token = eos
