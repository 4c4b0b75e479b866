"""The documentation a user enters by: README.md short, its quick start runs as written, no page links outside
the repository or tells how the project was made, docs/cli.md is what the CLIs accept (scripts/cli_reference.py),
the pages build with `mkdocs build --strict` (broken links and anchors fail it), and every command's --help is
one line per flag.

    python -m pytest -q tests/test_docs.py
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
ARCHIVE = {"benchmark-history.md"}  # the runs as recorded at the time: links are checked, wording is not
from mlxrl.cli.main import COMMANDS  # noqa: E402  (every trainer of mlxrl.registry, then the tools)


def pages() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def prose(text: str) -> str:
    """`text` without fenced code blocks and inline code spans (where `[x](y)` is code, not a link)."""
    text = re.sub(r"(?ms)^(```|~~~).*?^\1[^\n]*$", "", text)
    return re.sub(r"`[^`\n]*`", "", text)


def links(text: str) -> list[str]:
    """Targets of Markdown links and images, reference definitions and HTML href / src attributes."""
    text = prose(text)
    found = re.findall(r"!?\[[^\]]*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)", text)
    found += re.findall(r"(?m)^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", text)
    found += re.findall(r"(?i)(?:href|src)\s*=\s*[\"']([^\"']+)[\"']", text)
    return found


def anchors(text: str) -> set[str]:
    """The ids Python-Markdown's toc gives a page's headings (lower case, punctuation dropped, spaces to -)."""
    heads = re.findall(r"(?m)^#{1,6}\s+(.+?)\s*#*\s*$", re.sub(r"(?ms)^```.*?^```", "", text))
    return {re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", h.replace("`", "")).strip().lower()) for h in heads}


NUMBER_WORDS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
                "sixteen seventeen eighteen nineteen twenty").split()


def test_the_supported_models_and_their_counts_follow_the_model_registry():
    """docs/index.md's Supported models table lists exactly the model types mlxrl loads (`models.ARCHITECTURES`),
    and a count of them anywhere in the pages ("the twelve Qwen model types", "all N architectures") is that
    number: a count written once goes stale when a family is added."""
    from mlxrl.models import ARCHITECTURES

    table = (DOCS / "index.md").read_text().split("## Supported models", 1)[1].split("\n\n", 2)[1]
    listed = re.findall(r"(?m)^\|[^|\n]*\|\s*`([a-z0-9_]+)`\s*\|", table)
    assert sorted(listed) == sorted(ARCHITECTURES), (listed, sorted(ARCHITECTURES))
    words = "|".join(NUMBER_WORDS)
    count = rf"\b({words}|\d+)\s+(?:Qwen\s+)?(?:architectures|model types|model families)\b"
    for page in pages():
        if page.name in ARCHIVE:
            continue
        for word in re.findall(count, prose(page.read_text()), flags=re.IGNORECASE):
            n = int(word) if word.isdigit() else NUMBER_WORDS.index(word.lower())
            assert n == len(ARCHITECTURES), f"{page.relative_to(ROOT)} counts {word} model types, the registry " \
                                            f"holds {len(ARCHITECTURES)}"


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= 210, f"README.md has {len(lines)} lines: move sections into docs/"


def test_no_link_leaves_the_repository():
    problems = []
    for page in pages():
        text = page.read_text()
        for url in re.findall(r"(?i)\b(?:https?|ftp)://\S+|\bwww\.\S+", text):  # code blocks included
            problems.append(f"{page.relative_to(ROOT)}: {url}")
        for target in links(text):
            path = target.split("#", 1)[0]
            if re.match(r"(?i)^[a-z][a-z0-9+.-]*:|^//|^/", target):
                problems.append(f"{page.relative_to(ROOT)}: {target} (not a relative link)")
            elif path:
                resolved = (page.parent / path).resolve()
                if not resolved.is_relative_to(ROOT):
                    problems.append(f"{page.relative_to(ROOT)}: {target} (outside the repository)")
                elif not resolved.exists():
                    problems.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
                elif page == README and "#" in target and resolved.suffix == ".md":  # docs/: mkdocs checks them
                    if target.split("#", 1)[1] not in anchors(resolved.read_text()):
                        problems.append(f"README.md: {target} (no such heading)")
    assert not problems, "\n".join(problems)


def test_the_link_checker_finds_outside_links():
    text = "[a](https://example.com) [b](../../x.md) `[c](https://code.example)`\n```\n[d](e)\n```\n"
    assert links(text) == ["https://example.com", "../../x.md"]


NARRATION = re.compile(r"(?i)\bround[ -]?[123]\b|\bthis machine\b|\bthis session\b|\blanded\b")


def test_pages_do_not_narrate_how_they_were_made():
    found = []
    for page in pages():
        if page.name in ARCHIVE:
            continue
        for n, line in enumerate(page.read_text().splitlines(), 1):
            for m in NARRATION.finditer(line):
                found.append(f"{page.relative_to(ROOT)}:{n}: {m.group(0)!r} in {line.strip()[:100]!r}")
    assert not found, "\n".join(found)
    assert NARRATION.search("measured in round 2 on this machine")


def test_cli_reference_is_current(capsys):
    """`python scripts/cli_reference.py --check`, in this process (the CLIs' modules are imported once)."""
    spec = importlib.util.spec_from_file_location("cli_reference", ROOT / "scripts" / "cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--check"]) == 0, capsys.readouterr().err


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    # not -q: mkdocs then drops the warnings that --strict counts, and a broken link passes
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config),
                           "-d", str(site)], cwd=config.parent, capture_output=True, text=True)


def test_pages_build_strictly(tmp_path):
    done = mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert done.returncode == 0, done.stderr + done.stdout
    assert (tmp_path / "site" / "index.html").exists() and (tmp_path / "site" / "cli.html").exists()


def test_a_broken_anchor_fails_the_build(tmp_path):
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(DOCS, tmp_path / "docs")
    testing = tmp_path / "docs" / "testing.md"
    testing.write_text(testing.read_text() + "\nSee [nothing](sft.md#no-such-heading).\n")
    done = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0 and "no-such-heading" in done.stdout + done.stderr


HELP_MODULES = {**{name: f"mlxrl.{name}" for name in COMMANDS}, "generate": "mlxrl.cli.generate",
                "plan": "mlxrl.cli.plan"}


@pytest.mark.parametrize("command", COMMANDS)
def test_help_is_one_line_per_flag(command, capsys):
    """`python -m mlxrl.CMD --help` (its main(["--help"])): a one-line usage, one line per flag (no wrapped
    help), a few lines more for the description and the group titles, and a last line pointing at docs/cli.md."""
    main = importlib.import_module(HELP_MODULES[command]).main
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    lines = capsys.readouterr().out.rstrip("\n").splitlines()
    flags = [ln for ln in lines if re.match(r"^\s+-", ln)]
    assert lines[0] == f"usage: python -m mlxrl.{command} [flags]", lines[0]
    assert "docs/cli.md" in lines[-1]
    assert len(flags) >= 15 and len(lines) <= len(flags) + 20, (len(lines), len(flags))
    wrapped = [ln for ln in lines if ln[:1].isspace() and not re.match(r"^\s+-", ln)]
    assert not wrapped, f"--help wraps a flag's help: {wrapped[:3]}"
    # a flag's line: the invocation (single spaces inside, a metavar's "[VALUE ...]" included), two or more
    # spaces, its summary; a summary cut at the limit ends in "word..." (`flags.one_line`), never in " ..."
    summaries = {ln: re.match(r"\s+\S+(?: \S+)*(?: {2,}(.*))?$", ln)[1] or "" for ln in flags}
    cut = [ln for ln, summary in summaries.items() if re.search(r"[^\s.]\.\.\.", summary)]
    assert not cut, f"--help cuts a flag's summary (shorten the help's first sentence): {cut[:3]}"


def quick_start() -> tuple[list[str], list[str]]:
    """The rows (```json blocks) and commands (```bash blocks) of README's "Quick start" section."""
    text = README.read_text()
    section = re.search(r"(?ms)^## Quick start\s*$(.*?)(?=^## )", text)
    assert section, "README.md has no '## Quick start' section"
    body = section.group(1)
    rows = [ln for block in re.findall(r"(?ms)^```json\s*$(.*?)^```", body) for ln in block.splitlines() if ln.strip()]
    commands = [ln.strip() for block in re.findall(r"(?ms)^```bash\s*$(.*?)^```", body)
                for ln in block.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    return rows, commands


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_readme_quick_start_runs_as_written(tiny_checkpoint, tmp_path):
    """The README's rows written to the file its command names, its commands run in an empty folder with the
    model id replaced by a tiny local checkpoint of the same architecture (Qwen3); the run saves its result."""
    rows, commands = quick_start()
    assert rows and commands
    for row in rows:
        assert "messages" in json.loads(row)
    model = str(tiny_checkpoint("qwen3"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    train = [shlex.split(c) for c in commands if c.startswith("python -m mlxrl.sft")]
    assert train, "the quick start has no python -m mlxrl.sft command"
    for argv in map(shlex.split, commands):
        assert argv[:2] == ["python", "-m"] and argv[2].startswith("mlxrl"), argv
        assert flag(argv, "--model") == "Qwen/Qwen3-0.6B", argv
        argv[argv.index("--model") + 1] = model
        if argv[2] == "mlxrl.sft":
            (tmp_path / flag(argv, "--dataset")).write_text("\n".join(rows) + "\n")
        if argv[2] == "mlxrl.generate" and "--max_new_tokens" not in argv:
            argv += ["--max_new_tokens", "8"]  # a random tiny model never stops by itself
        done = subprocess.run([sys.executable, *argv[1:]], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, (argv, done.stderr[-2000:])
        if argv[2] == "mlxrl.sft":
            out = tmp_path / flag(argv, "--output_dir")
            assert (out / "adapter_model.safetensors").exists() or (out / "model.safetensors").exists(), \
                sorted(p.name for p in out.iterdir())
            assert (out / "metrics.jsonl").exists()
        else:
            assert done.stdout.strip()


def test_quick_start_parser_reads_the_section(monkeypatch, tmp_path):
    fake = tmp_path / "README.md"
    fake.write_text("## Quick start\n\n```bash\npython -m mlxrl.sft --model Qwen/Qwen3-0.6B\n```\n## Next\n")
    monkeypatch.setattr(sys.modules[__name__], "README", fake)
    assert quick_start() == ([], ["python -m mlxrl.sft --model Qwen/Qwen3-0.6B"])
