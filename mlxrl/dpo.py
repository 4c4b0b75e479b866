"""`python -m mlxrl.dpo`: direct preference optimisation (TRL's DPOTrainer flags) (`mlxrl.cli.dpo`)."""

from . import runtime

if __name__ == "__main__":  # first, before the heavy imports: may re-execute with huge pages
    runtime.setup(cli=True)

from .cli.dpo import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
