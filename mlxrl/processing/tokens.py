"""Token ids every layer agrees on, kept in one light module (no MLX, no kernels): the ignored label
and the Qwen chat's stop tokens."""

IGNORE_INDEX = -100  # a label that is not trained on (transformers' and TRL's convention)
IM_END, END_OF_TEXT = 151645, 151643  # Qwen: <|im_end|> closes a chat turn, <|endoftext|> a document
QWEN_STOP_TOKEN_IDS = (IM_END, END_OF_TEXT)

__all__ = ["END_OF_TEXT", "IGNORE_INDEX", "IM_END", "QWEN_STOP_TOKEN_IDS"]
