"""`python -m mlxrl.cpo`: CPO preference optimisation (trl.experimental's CPOTrainer flags) (`mlxrl.cli.cpo`)."""

from . import runtime

if __name__ == "__main__":  # first, before the heavy imports: may re-execute with huge pages
    runtime.setup(cli=True)

from .cli.cpo import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
