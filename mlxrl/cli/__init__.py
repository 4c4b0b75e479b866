"""The commands: `python -m mlxrl` (`main`), `mlxrl.sft` / `dpo` / `grpo` (`sft`, `dpo`, `grpo`),
`mlxrl.generate` / `chat` (`generate`, `chat`), `mlxrl.plan` (`plan`); what they share (`common`: one-line
errors and exit codes, data then model loading), the embedded demos (`demos`) and mlx-lm's LoRA flags
(`mlx_lm_args`). The `python -m` entry modules at the package root only call these.
"""
