"""The docs' custom training loop (docs/sft.md) runs as written (only the output folder is redirected)."""

import re
from pathlib import Path

import numpy as np

README = Path(__file__).resolve().parents[1] / "docs" / "sft.md"


def test_custom_loop_from_readme_runs(tmp_path, capsys):
    text = README.read_text()
    code = re.search(r"<!-- custom-loop -->\n```python\n(.*?)```\n<!-- /custom-loop -->", text, re.S).group(1)
    assert len(code.splitlines()) <= 45
    code = code.replace('"out/custom"', repr(str(tmp_path / "custom")))
    exec(compile(code, "README custom loop", "exec"), {"__name__": "readme"})
    losses = [float(m) for m in re.findall(r"loss (\S+)", capsys.readouterr().out)]
    assert len(losses) == 8 and np.isfinite(losses).all()
    assert np.mean(losses[-2:]) < losses[0]  # it learns
    assert (tmp_path / "custom" / "model.safetensors").exists()
