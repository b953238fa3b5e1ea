"""The code passes ruff (its settings: pyproject.toml's [tool.ruff])."""
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import REPO


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff is not installed: pip install -r requirements-test.txt"
    out = subprocess.run([ruff, "check", "--output-format", "concise", "bench", "methods", "tests"],
                         cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
