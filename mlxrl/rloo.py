"""`python -m mlxrl.rloo`: REINFORCE leave-one-out (TRL's RLOOTrainer flags) (`mlxrl.cli.rloo`)."""

from . import runtime

if __name__ == "__main__":  # first, before the heavy imports: may re-execute with huge pages
    runtime.setup(cli=True)

from .cli.rloo import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
