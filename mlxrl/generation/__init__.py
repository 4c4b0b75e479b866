"""Generation: what samples from a model, for GRPO's rounds and for people.

- `engine`: batched sampling with mlx-lm's caches and samplers (`generate`), transformers' order of
  logits processors, one key per step.
- `shared_prompt`: GRPO's prompt-shared forward (each prompt's prefix run once for its G completions).
- `settings`, `refs`, `context`, `api`: the generate / chat API that `mlxrl.generate` exports
  (`load`, `Generator`, `Chat`), and `python -m mlxrl.generate` / `python -m mlxrl.chat` use.
"""
