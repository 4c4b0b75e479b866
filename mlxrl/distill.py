"""`python -m mlxrl.distill`: on-policy distillation (TRL's DistillationTrainer flags) (`mlxrl.cli.distill`)."""

from . import runtime

if __name__ == "__main__":  # first, before the heavy imports: may re-execute with huge pages
    runtime.setup(cli=True)

from .cli.distill import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
