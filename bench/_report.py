"""What every side-by-side benchmark does with its table: print it, and append it to --out."""

from __future__ import annotations

from pathlib import Path


def emit(table: str, out: Path | None) -> None:
    print(table)
    if out:
        with out.open("a") as f:
            f.write("\n" + table)
