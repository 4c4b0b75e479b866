"""`python -m mlxrl.kto`: Kahneman-Tversky optimisation (TRL's KTOTrainer flags) (`mlxrl.cli.kto`)."""

from . import runtime

if __name__ == "__main__":  # first, before the heavy imports: may re-execute with huge pages
    runtime.setup(cli=True)

from .cli.kto import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
