"""`python -m mlxrl.reward`: a reward model (TRL's RewardTrainer flags) (`mlxrl.cli.reward`)."""

from . import runtime

if __name__ == "__main__":  # first, before the heavy imports: may re-execute with huge pages
    runtime.setup(cli=True)

from .cli.reward import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
