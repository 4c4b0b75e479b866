"""`python -m mlxrl.grpo`: group relative policy optimisation (TRL's GRPOTrainer flags) (`mlxrl.cli.grpo`)."""

from . import runtime

if __name__ == "__main__":  # first, before the heavy imports: may re-execute with huge pages
    runtime.setup(cli=True)

from .cli.grpo import colour_reward, main  # noqa: E402, F401  (the demo's reward, `mlxrl.grpo:colour_reward`)

if __name__ == "__main__":
    raise SystemExit(main())
