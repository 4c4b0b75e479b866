"""`python -m mlxrl.orpo`: ORPO preference optimisation (trl.experimental's ORPOTrainer flags) (`mlxrl.cli.orpo`)."""

from . import runtime

if __name__ == "__main__":  # first, before the heavy imports: may re-execute with huge pages
    runtime.setup(cli=True)

from .cli.orpo import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
