"""Qwen3.5 (`qwen3_5_text`): Gated DeltaNet layers mixed with gated attention (`text`)."""
