"""Shared by the benchmark scripts: print a markdown table and write it to a file."""
from __future__ import annotations

from typing import List, Optional


def emit(lines: List[str], out: Optional[str]) -> None:
    """Print ``lines``; also write them to ``out`` when given."""
    text = "\n".join(lines)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
