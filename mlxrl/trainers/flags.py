"""Config from the command line and YAML: every field a flag (`build_parser`), a YAML file of fields
(`--config`, values coerced by each field's type), defaults < YAML < explicit flags, every value
checked (`config.check_config`) before any model loads. Another tool's spelling of the same settings
(mlx-lm's, `mlxrl.cli.mlx_lm_args`) arrives as `Spelled` fields, one set per level, and is checked too."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import numbers
import re
import sys
import types
import typing
from pathlib import Path

from .config import ConfigError, check_config, choices_of, field_kind


def _parse_bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "y", "on"):
        return True
    if s.lower() in ("0", "false", "no", "n", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {s!r}")


def _arg_type(tp):
    """(type, nargs) for a dataclass field annotation (strings under `from __future__`)."""
    if typing.get_origin(tp) is list:
        return typing.get_args(tp)[0], "+"
    args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else ()
    inner = [a for a in args if a is not type(None)] if args else [tp]
    base = inner[0] if inner else str
    if typing.get_origin(base) is list:
        return typing.get_args(base)[0], "+"
    if base is bool:
        return _parse_bool, "?"
    return base, None


class ArgumentParser(argparse.ArgumentParser):
    """argparse with whole flag names only (`--learning_rat` is an error, not `--learning_rate`) and
    errors in one line that points at --help instead of the full usage."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        # `--adam_epsilon -1e-8` is a value, not a flag (argparse's own pattern misses exponents and inf)
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|nan)$", re.I)

    def error(self, message):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


HELP_REFERENCE = "every flag in full: docs/cli.md (python scripts/cli_reference.py writes it)"


def one_line(text: str, limit: int) -> str:
    """`text`'s first sentence on one line, without its full stop (as the one-sentence helps read), cut at a word
    before `limit` characters ("..." marks the cut)."""
    text = " ".join(text.split())
    text = re.split(r"(?<=[a-z0-9)][.!?])\s+(?=[A-Z(`'\"])", text, maxsplit=1)[0]
    if text.endswith(".") and not text.endswith(".."):
        text = text[:-1]
    if len(text) <= limit:
        return text
    cut = text[:limit - 3].rsplit(" ", 1)[0].rstrip(" ,;:(")
    return cut + "..."


class OneLineHelpFormatter(argparse.HelpFormatter):
    """`--help` in one line per flag: a short usage line, the description, then per group `  --flag VALUE
    summary (default: x)` where the summary is the help's first sentence cut to one line (never wrapped: the
    whole text is in docs/cli.md), and a last line pointing there (the parser's epilog)."""

    COLUMN = 36  # where the summaries start (a longer flag pushes its own summary right)
    SUMMARY = 100  # characters of help kept per flag
    DEFAULT = 40  # characters of a default value kept

    def __init__(self, prog, indent_increment=2, max_help_position=COLUMN, width=None):
        super().__init__(prog, indent_increment, max_help_position, width=1_000_000)

    def add_usage(self, usage, actions, groups, prefix=None):
        super().add_usage(usage if usage is not None else "%(prog)s [flags]", actions, groups, prefix)

    def _format_text(self, text):  # description and epilog: one paragraph each, unwrapped
        if "%(prog)" in text:
            text = text % dict(prog=self._prog)
        return " ".join(text.split()) + "\n\n"

    def _get_default_metavar_for_optional(self, action):
        return {int: "N", float: "X", _parse_bool: "BOOL"}.get(action.type, "VALUE")

    def _format_action(self, action):
        invocation = self._format_action_invocation(action)
        help_text = self._expand_help(action) if action.help else ""
        body, default = help_text, None
        m = re.match(r"(?s)(.*)\s*\(default: (.*?)\)\s*$", help_text)
        if m:  # the config fields' help ends in "(default: x)" (build_parser)
            body, default = m.group(1), m.group(2)
        elif action.nargs != 0 and action.default is not argparse.SUPPRESS and "default" not in help_text:
            default = str(action.default)
        summary = one_line(body, self.SUMMARY)
        if default not in (None, "None", "[]"):
            summary = f"{summary} (default: {one_line(default, self.DEFAULT)})".strip()
        indent = " " * self._current_indent
        width = max(self.COLUMN - self._current_indent - 2, 0)
        return f"{indent}{invocation:<{width}}  {summary}".rstrip() + "\n"


def build_parser(cls, prog: str, description: str, extra=None, config_flags=("--config",),
                 config_help: str = "YAML file of config fields (CLI flags override it)") -> argparse.ArgumentParser:
    parser = ArgumentParser(prog=prog, description=description, formatter_class=OneLineHelpFormatter,
                            epilog=HELP_REFERENCE)
    if extra:
        extra(parser)
    parser.add_argument(*config_flags, dest="config", default=None, help=config_help)
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(f"{cls.__name__} fields")
    for f in dataclasses.fields(cls):
        tp, nargs = _arg_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        kw = {"type": tp, "default": argparse.SUPPRESS, "help": f"{f.metadata.get('help', '')} (default: {default})"}
        if f.metadata.get("hidden"):  # TrainingArguments' fields with no use here (`trl_fields`)
            kw["help"] = argparse.SUPPRESS
        if nargs == "?":
            kw.update(nargs="?", const=True)
        elif nargs:
            kw["nargs"] = nargs
        group.add_argument(f"--{f.name}", **kw)
    return parser


# ------------------------------------------------------------------------------------------ YAML

class BadValue(Exception):
    pass


def scalar(kind: str, value):
    """One value as `kind` (bool / int / float / str), or BadValue saying what was expected."""
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str):
            try:
                return _parse_bool(value.strip())
            except argparse.ArgumentTypeError:
                pass
        raise BadValue(f"expected true or false, got {value!r}")
    if kind in ("int", "float"):
        if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)):
            raise BadValue(f"expected {'an integer' if kind == 'int' else 'a number'}, got {value!r}")
        number = value
        if isinstance(value, str):
            try:
                number = int(value.strip()) if kind == "int" else float(value.strip())
            except ValueError:
                try:
                    number = float(value.strip())
                except ValueError:
                    raise BadValue(f"expected {'an integer' if kind == 'int' else 'a number'}, "
                                    f"got {value!r}") from None
        if kind == "float":
            return float(number)
        if isinstance(number, numbers.Integral):
            return int(number)
        if math.isfinite(number) and float(number).is_integer():
            return int(number)
        raise BadValue(f"expected an integer, got {value!r}")
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        raise BadValue(f"expected text, got {value!r} (YAML reads unquoted yes/no/on/off as true/false: "
                        f"quote it, e.g. \"{'yes' if value else 'no'}\")")
    if isinstance(value, numbers.Real):
        return str(value)
    raise BadValue(f"expected text, got {type(value).__name__} {value!r}")


def coerce_value(tp, value, name: str = ""):
    """`value` (from YAML or an API call) as the field type `tp`: numbers from strings ("1e-4", "2"),
    a list from a scalar, None only where the field is Optional. Raises BadValue."""
    kind, optional, item = field_kind(tp)
    if value is None:
        if optional:
            return None
        raise BadValue("a value is required (it cannot be empty or null)")
    if kind == "list":
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        item_kind = field_kind(item)[0]
        return [scalar(item_kind, v) for v in values]
    if kind == "str" and name == "report_to" and isinstance(value, (list, tuple)):
        return ",".join(scalar("str", v) for v in value)  # transformers accepts a list of trackers
    if isinstance(value, (list, tuple, dict)):
        raise BadValue(f"expected one value, got a {type(value).__name__}")
    return scalar(kind, value)


def _yaml_problem(e) -> tuple[int | None, str]:
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    problem = getattr(e, "problem", None) or getattr(e, "context", None) or (str(e).splitlines() or [""])[0]
    return (mark.line + 1 if mark is not None else None), problem


def read_yaml_mapping(path: str) -> tuple[dict, dict]:
    """(the YAML file's top-level mapping, key -> its line number); one line naming the file (and the line)
    for an unreadable file, a syntax error or a file that is not a mapping."""
    import yaml

    try:
        text = Path(path).expanduser().read_text()
    except OSError as e:
        raise ConfigError(f"cannot read --config {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"--config {path}: not a text (UTF-8) file") from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        line, problem = _yaml_problem(e)
        raise ConfigError(f"--config {path}{f' line {line}' if line else ''}: YAML syntax error: {problem}") from None
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of field: value lines, got a YAML "
                          f"{type(data).__name__}")
    lines = {}
    if isinstance(node, yaml.MappingNode):
        for key, _ in node.value:
            lines.setdefault(str(key.value), key.start_mark.line + 1)
    return data, lines


def fields_from_yaml(data: dict, lines: dict, path: str, cls, others=()) -> dict:
    """{field: value} of a YAML mapping's `cls` fields, coerced by their types; an unknown key (one not in
    `others` either, another spelling's keys) or a bad value is one line naming the file and line."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    out = {}
    for key, value in data.items():
        where = f"--config {path} line {lines.get(str(key), '?')}"
        if key not in names:
            close = difflib.get_close_matches(str(key), [*names, *others], n=1)
            hint = f" (did you mean {close[0]}?)" if close else f" (not a {cls.__name__} field; see --help)"
            raise ConfigError(f"{where}: unknown field {key!r}{hint}")
        if value is False and "no" in (choices_of(cls, key) or ()):
            value = "no"  # `eval_strategy: no` unquoted is a YAML boolean
        if isinstance(value, dict) and (key.endswith("_kwargs") or refused_field(cls, key)):
            out[key] = value  # a mapping (`config.checkpointing_kwargs`), or refused in one line by check_config
            continue
        try:
            out[key] = coerce_value(hints[key], value, key)
        except BadValue as e:
            raise ConfigError(f"{where}: {key}: {e}") from None
    return out


def read_yaml_config(path: str, cls) -> dict:
    """{field: value} of a YAML config file, coerced by `cls`'s field types; one-line errors naming
    the file and line for a syntax error, an unknown field or a bad value."""
    data, lines = read_yaml_mapping(path)
    return fields_from_yaml(data, lines, path, cls)


def refused_field(cls, name: str) -> bool:
    return any(f.name == name and "refused" in f.metadata for f in dataclasses.fields(cls))


@dataclasses.dataclass
class Spelled:
    """Config fields the user set in another tool's spelling (mlx-lm's flags and YAML keys), per level:
    `defaults` (that tool's defaults, what its command asks for), `yaml` (the fields of a --config file in
    its spelling, ours included; None: the file is ours, read here), `flags` (set by its flags: the same
    field given by one of ours is refused) and `implied` (what its flags imply besides, e.g. the evaluation
    batch size its --batch-size also sets: our flags override them); `labels`: field -> how the user spelled
    it ("--iters"), so that an error names what the user wrote."""

    defaults: dict = dataclasses.field(default_factory=dict)
    yaml: dict | None = None
    flags: dict = dataclasses.field(default_factory=dict)
    implied: dict = dataclasses.field(default_factory=dict)
    labels: dict = dataclasses.field(default_factory=dict)


def config_from_args(cls, ns: argparse.Namespace, spelled: Spelled | None = None):
    """defaults < YAML (--config) < explicit CLI flags; every value checked before any model loads.
    `spelled`: another spelling's fields, each under the level it came from (its defaults above ours);
    a field set by both spellings' flags is refused."""
    spelled = spelled or Spelled()
    values = dict(spelled.defaults)
    yaml_values = spelled.yaml
    if yaml_values is None:
        yaml_values = read_yaml_config(ns.config, cls) if getattr(ns, "config", None) else {}
    values.update(yaml_values)
    flags = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)}
    for name in sorted(set(flags) & set(spelled.flags)):
        raise ConfigError(f"{spelled.labels.get(name, name)} and --{name} both set {name}: give one of them")
    values.update(spelled.implied)
    values.update(spelled.flags)
    values.update(flags)
    # what the user set (YAML or flags): demo settings must not replace them
    ns.explicit_fields = set(yaml_values) | set(spelled.implied) | set(spelled.flags) | set(flags)
    if (values.get("load_in_4bit") or values.get("load_in_8bit")) and "use_peft" not in ns.explicit_fields:
        values["use_peft"] = True  # a quantized base implies LoRA (an explicit --use_peft false is refused)
    try:
        cfg = cls(**values)
        check_config(cfg, flags=True)  # the optimizer too: before any model is loaded
    except ConfigError as e:
        raise ConfigError(relabel(str(e), spelled.labels)) from None
    if cfg.use_cpu:  # before the model loads: its default dtype follows the device
        from .. import runtime

        runtime.setup(tf32=cfg.tf32, use_cpu=True)
    return cfg


def relabel(message: str, labels: dict) -> str:
    """A config error about --field, reworded to name the spelling the user wrote for it ("--iters 0: ...")."""
    for name, label in labels.items():
        m = re.match(rf"--{re.escape(name)}(?=[ =:]|$)", message)
        if m:
            return label + message[m.end():]
    return message


def parse_config(cls, argv=None, prog=None, description=""):
    parser = build_parser(cls, prog or sys.argv[0], description)
    return config_from_args(cls, parser.parse_args(argv))
