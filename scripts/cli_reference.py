"""Write docs/cli.md, the command-line reference, from the CLIs' own argparse parsers.

    python scripts/cli_reference.py           # (re)write docs/cli.md
    python scripts/cli_reference.py --check   # exit 1 when docs/cli.md is not what the CLIs accept now

Each CLI's `main(["--help"])` runs with argparse's `print_help` intercepted, so the parser walked here is the
one the command builds (its extra flags, mlx-lm's flags, the config dataclass's fields). Every action of every
group becomes a row: the flag and its aliases, the value it takes, its default, its whole help text, and for a
TRL field mlxrl accepts only at TRL's default the one-line refusal it raises otherwise (such fields are left out
of --help: the reference lists them apart).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "cli.md"
sys.path.insert(0, str(ROOT))

# (section, the command, its module, argv): the module's main(argv) builds and parses the parser
CLIS = [
    ("sft", "python -m mlxrl.sft", "mlxrl.sft", ["--help"]),
    ("dpo", "python -m mlxrl.dpo", "mlxrl.dpo", ["--help"]),
    ("orpo", "python -m mlxrl.orpo", "mlxrl.orpo", ["--help"]),
    ("cpo", "python -m mlxrl.cpo", "mlxrl.cpo", ["--help"]),
    ("kto", "python -m mlxrl.kto", "mlxrl.kto", ["--help"]),
    ("grpo", "python -m mlxrl.grpo", "mlxrl.grpo", ["--help"]),
    ("generate", "python -m mlxrl.generate", "mlxrl.cli.generate", ["--help"]),
    ("chat", "python -m mlxrl.chat", "mlxrl.chat", ["--help"]),
    ("plan", "python -m mlxrl.plan", "mlxrl.cli.plan", ["--help"]),
    ("mlxrl", "python -m mlxrl", "mlxrl.__main__", ["--help"]),
]
INTRO = {
    "sft": "Supervised fine-tuning: every `SFTConfig` field is a flag, and mlx-lm's LoRA flags "
           "(`--train --data DIR --iters N ...`) run mlx-lm's run. Also `mlxrl sft ...`.",
    "dpo": "Preference optimisation: every `DPOConfig` field is a flag. Also `mlxrl dpo ...`.",
    "orpo": "Odds-ratio preference optimisation (no reference model): every `ORPOConfig` field is a flag. Also "
            "`mlxrl orpo ...`.",
    "cpo": "Contrastive preference optimisation, SimPO and AlphaPO (no reference model): every `CPOConfig` field "
           "is a flag. Also `mlxrl cpo ...`.",
    "kto": "Kahneman-Tversky optimisation from unpaired (or unpaired preference) rows: every `KTOConfig` field is "
           "a flag. Also `mlxrl kto ...`.",
    "grpo": "Group relative policy optimisation: every `GRPOConfig` field is a flag. Also `mlxrl grpo ...`.",
    "generate": "One reply from a model, an adapter, a checkpoint or a run's output folder; mlx-lm's spellings "
                "are aliases. Also `mlxrl generate ...`.",
    "chat": "A multi-turn conversation in the terminal, with the flags of generate. Also `mlxrl chat ...`.",
    "plan": "The memory planner. Its own flags are below; every field of the chosen trainer's config "
            "(`--trainer sft`: the SFTConfig fields of [sft](#sft); `dpo`, `orpo`, `cpo`, `kto`, `grpo`: theirs) is "
            "accepted as well. Also `mlxrl plan ...`.",
    "mlxrl": "Load a model (or the embedded default), run one forward, print the next-token prediction, "
             "optionally save it in Hugging Face's layout. `mlxrl CMD ...` (CMD one of sft, dpo, orpo, cpo, kto, grpo, "
             "generate, chat, plan) runs `python -m mlxrl.CMD ...`.",
}


class _Captured(Exception):
    def __init__(self, parser):
        super().__init__()
        self.parser = parser


def capture(module: str, argv: list) -> argparse.ArgumentParser:
    """The parser `module.main(argv)` builds, caught when --help would print it."""
    main = importlib.import_module(module).main
    saved = argparse.ArgumentParser.print_help

    def grab(self, file=None):
        raise _Captured(self)

    argparse.ArgumentParser.print_help = grab
    try:
        main(list(argv))
    except _Captured as c:
        return c.parser
    finally:
        argparse.ArgumentParser.print_help = saved
    raise RuntimeError(f"{module}.main({argv}) did not print its help")


def _mlx_lm_defaults() -> dict:
    from mlxrl.cli.mlx_lm_args.spec import DEFAULTS

    return DEFAULTS


MLX_LM_DEFAULTS: dict = {}


def config_classes():
    from mlxrl.registry import config_class, names

    return {c.__name__: c for c in map(config_class, names())}


def cell(text) -> str:
    """Text for a Markdown table cell: one line, pipes and HTML escaped."""
    text = " ".join(str(text).split())
    return (text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|")
            .replace("*", "\\*").replace("[", "\\["))


def value_of(action, formatter) -> str:
    if action.nargs == 0:
        return "(switch)"
    metavar = formatter._get_default_metavar_for_optional(action)
    return formatter._format_args(action, metavar)


def show_default(value) -> str:
    if value is None or value is argparse.SUPPRESS:
        return ""
    if isinstance(value, (list, tuple)) and not value:
        return ""
    return f"`{value!r}`" if isinstance(value, str) and value == "" else f"`{value}`"


def rows_of(group, parser, cls):
    """(working rows, refused rows) of an argument group: (flag, value, default, help)."""
    from mlxrl.trainers.config import choices_of

    formatter = parser._get_formatter()
    fields = {f.name: f for f in dataclasses.fields(cls)} if cls else {}
    working, refused = [], []
    for action in group._group_actions:
        if isinstance(action, argparse._HelpAction):
            continue
        flag = ", ".join(f"`{s}`" for s in action.option_strings)
        field = fields.get(action.dest)
        if field is not None:
            help_text = field.metadata.get("help", "")
            default = field.default if field.default is not dataclasses.MISSING else (
                field.default_factory() if field.default_factory is not dataclasses.MISSING else None)
            choices = choices_of(cls, field.name)
        else:
            help_text = formatter._expand_help(action) if action.help not in (None, argparse.SUPPRESS) else ""
            default, choices = action.default, None
            key = action.dest.removeprefix("mlx_lm_")
            if action.dest.startswith("mlx_lm_") and key in MLX_LM_DEFAULTS:
                default = MLX_LM_DEFAULTS[key]  # absent unless given; mlx-lm's run starts from mlx-lm's defaults
        if choices:
            help_text += f" (one of: {', '.join(str(c) for c in choices)})"
        row = (flag, cell(value_of(action, formatter)), show_default(default), cell(help_text))
        if field is not None and "refused" in field.metadata:
            hidden = " (left out of --help)" if field.metadata.get("hidden") else ""
            refused.append((*row[:3], cell(f"refused unless at its default{hidden}: {field.metadata['refused']}")))
        else:
            working.append(row)
    return working, refused


def table(rows) -> list[str]:
    lines = ["| flag | value | default | what it does |", "|---|---|---|---|"]
    lines += [f"| {flag} | {value} | {default} | {text} |" for flag, value, default, text in rows]
    return lines + [""]


def render() -> str:
    classes = config_classes()
    MLX_LM_DEFAULTS.update(_mlx_lm_defaults())
    out = ["# Command-line reference", "",
           "<!-- Generated by scripts/cli_reference.py from the CLIs' argparse parsers: do not edit by hand. "
           "python scripts/cli_reference.py rewrites it; --check fails when it is stale (a test runs it). -->", "",
           "Every flag each command accepts, with its whole help text; `--help` prints one line per flag. "
           "Values: `N` an integer, `X` a number, `BOOL` true / false (alone: true), `VALUE` text; "
           "`VALUE [VALUE ...]` one or more. Config fields also come from a YAML file (`--config`), "
           "with the flags over it. TRL fields mlxrl does not support are accepted at TRL's default and "
           "refused in one line otherwise: each command lists them in their own table.", ""]
    out += ["| command | section |", "|---|---|"]
    out += [f"| `{command}` | [{name}](#{name}) |" for name, command, _, _ in CLIS] + [""]
    for name, command, module, argv in CLIS:
        parser = capture(module, argv)
        out += [f"## {name}", "", f"`{command}`: {INTRO[name]}", "", f"Usage: `{command} [flags]`", ""]
        for group in parser._action_groups:
            cls = next((c for n, c in classes.items() if group.title == f"{n} fields"), None)
            if name == "plan" and cls is not None:
                continue  # the trainer's config fields: their own sections
            working, refused = rows_of(group, parser, cls)
            title = "flags" if group.title in ("options", "optional arguments") else group.title
            if working:
                out += [f"### {name}: {title}", ""] + table(working)
            if refused:
                out += [f"### {name}: {title} refused in one line", ""] + table(refused)
    return "\n".join(out).rstrip() + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when docs/cli.md differs from what would be written")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        current = OUT.read_text() if OUT.exists() else ""
        if current != text:
            print(f"{OUT.relative_to(ROOT)} is stale: run python scripts/cli_reference.py", file=sys.stderr)
            return 1
        print(f"{OUT.relative_to(ROOT)} is current")
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
