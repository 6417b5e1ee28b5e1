"""The README's embedding example runs as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_embedding_example_runs(tmp_path):
    readme = (ROOT / "README.md").read_text()
    code = re.search(r"## Embedding API\n\n```python\n(.*?)```", readme, re.S)
    assert code, "the README lost its embedding example"
    script = tmp_path / "example.py"
    script.write_text(code.group(1))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.rstrip().endswith("length 8")
