"""Text and pictures into model inputs.

- `processor`: `Processor` (tokenizer + image processor + chat template), transformers' Qwen-VL image
  pipeline.
- `tokenizer`: the Qwen tokenizers built offline and the Qwen chat templates.
- `pictures`: opening a picture as transformers does.
- `tokens`: the token ids every layer agrees on (no MLX, no kernels).

    from mlxrl.processing import Processor
"""


def __getattr__(name: str):
    """`mlxrl.processing.Processor`, imported on first use (the package stays light for `tokens`)."""
    if name == "Processor":
        from .processor import Processor

        return Processor
    raise AttributeError(f"module 'mlxrl.processing' has no attribute {name!r}")
