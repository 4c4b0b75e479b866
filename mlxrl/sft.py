"""`python -m mlxrl.sft`: supervised fine-tuning (TRL's SFTTrainer flags, or mlx-lm's LoRA flags) (`mlxrl.cli.sft`)."""

from . import runtime

if __name__ == "__main__":  # first, before the heavy imports: may re-execute with huge pages
    runtime.setup(cli=True)

from .cli.sft import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
