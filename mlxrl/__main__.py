"""`python -m mlxrl` and the `mlxrl` console command (`mlxrl.cli.main`)."""

from . import runtime

if __name__ == "__main__":  # first, before the heavy imports: may re-execute with huge pages
    runtime.setup(cli=True)

from .cli.main import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
