"""One module (or package) per memory-reduction method; bench/method.py is the contract and
methods/_template.py a starting point. Every module `methods/<name>.py` and package
`methods/<name>/` here is found automatically; names starting with `_` are not methods."""
from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent


def available() -> list[str]:
    """Every method's name: the modules and packages of this folder (no import needed)."""
    names = {p.stem for p in HERE.glob("*.py")}
    names |= {p.parent.name for p in HERE.glob("*/__init__.py")}
    return sorted(n for n in names if not n.startswith("_"))
