"""`python -m mlxrl.chat`: a multi-turn conversation in the terminal (`mlxrl.cli.chat`)."""

from . import runtime

if __name__ == "__main__":  # first, before the heavy imports: may re-execute with huge pages
    runtime.setup(cli=True)

from .cli.chat import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
