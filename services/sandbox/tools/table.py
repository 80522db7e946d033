"""Fixed-width tables, byte-identical to pandas `DataFrame.to_string()` for the world's columns.

The official TravelPlanner tools print DataFrames with `to_string(index=False)` (and, in the
version that produced the released reference information, restaurants with `to_string()`, i.e.
with the index). Calling pandas per request costs milliseconds, so this module reproduces the
rules pandas applies to string, int64 and float64 columns under default display options:

- every cell and header is right-justified to the column width; columns are joined by one space;
- numeric column headers get one leading space;
- with the index shown, every cell gets a leading space (`leading_space=True` in pandas), the
  index is left-justified under an empty header;
- strings: `\\t`, `\\r`, `\\n` are shown escaped (`pprint_thing(escape_chars=...)`);
- ints: `{:d}`;
- floats: `{:.6f}` (display.precision = 6), then the largest number of trailing zeros that every
  finite value has is cut (keeping one decimal), unless a value is tiny (0 < |x| < 1e-6) or the
  column is both wide (> 12 chars) and large (|x| > 1e6), in which case it is `{:.6e}`.

Verified against the pandas that produced the reference information (train.json) and against
the installed pandas, city by city (tests/sandbox/test_tools_official.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

ColumnKind = Literal["str", "int", "float"]

PRECISION = 6  # pandas display.precision
_LARGE = 1e6
_SMALL = 10 ** (-PRECISION)
_WIDE = PRECISION + 6


@dataclass(frozen=True)
class Column:
    header: str
    kind: ColumnKind


def render_table(
    columns: Sequence[Column], rows: Sequence[Sequence[Any]], *, index: Sequence[int] | None = None
) -> str:
    """`DataFrame(rows, columns).to_string(index=False)`, or `.to_string()` with `index` given."""
    lead = index is not None
    blocks: list[list[str]] = []
    if index is not None:
        blocks.append(_index_block(index))
    by_column = list(zip(*rows)) if rows else [()] * len(columns)
    for col, values in zip(columns, by_column, strict=True):
        cells = format_cells(col.kind, values, lead)
        header = col.header if col.kind == "str" else " " + col.header
        width = max(len(header), max(map(len, cells), default=0))
        blocks.append([header.rjust(width)] + [c.rjust(width) for c in cells])
    return "\n".join(" ".join(line) for line in zip(*blocks))


def format_cells(kind: ColumnKind, values: Sequence[Any], lead: bool = False) -> list[str]:
    """One column's cells before justification."""
    if kind == "str":
        cells = [v if type(v) is str else str(v) for v in values]
        if _needs_escape(cells):
            cells = [_escape(c) for c in cells]
        return [" " + c for c in cells] if lead else cells
    if kind == "int":
        spec = " d" if lead else "d"
        return [format(int(v), spec) for v in values]
    return _float_cells([float(v) for v in values], lead)


def _needs_escape(cells: list[str]) -> bool:
    joined = "".join(cells)  # one pass in C instead of three per cell: escapes are rare
    return "\n" in joined or "\t" in joined or "\r" in joined


def _escape(value: str) -> str:
    return value.replace("\t", "\\t").replace("\r", "\\r").replace("\n", "\\n")


def _float_cells(values: list[float], lead: bool) -> list[str]:
    fixed = _trim_zeros(values, [format(v, " .6f" if lead else ".6f") for v in values])
    has_small = any(0.0 < abs(v) < _SMALL for v in values)
    if has_small or (max(map(len, fixed), default=0) > _WIDE and any(abs(v) > _LARGE for v in values)):
        return [format(v, " .6e" if lead else ".6e") for v in values]
    return fixed


def _trim_zeros(values: list[float], cells: list[str]) -> list[str]:
    """Cut the trailing zeros all finite cells share, leaving at least one decimal digit.

    A finite value formatted with `.6f` is exactly what pandas' "number with decimal" regex
    matches; `inf`/`nan` cells are left alone and do not block trimming, as in pandas. Each
    finite cell has exactly PRECISION decimals, so cutting at most PRECISION - 1 characters is
    the same as pandas' "trim to the point, then put one 0 back".
    """
    cut = PRECISION - 1
    finite = False
    for v, c in zip(values, cells):
        if math.isfinite(v):
            finite = True
            zeros = len(c) - len(c.rstrip("0"))
            if zeros < cut:
                cut = zeros
                if not cut:
                    return cells
    if not finite:
        return cells
    return [c[:-cut] if math.isfinite(v) else c for v, c in zip(values, cells)]


def _index_block(index: Sequence[int]) -> list[str]:
    """Left-justified integer labels under an empty header (pandas formats them as `{: d}` and
    then strips the leading spaces every label shares)."""
    labels = [format(int(i), " d") for i in index]
    width = max(map(len, labels), default=0)
    labels = [s.ljust(width) for s in labels]
    while labels and all(s.startswith(" ") for s in labels):
        labels = [s[1:] for s in labels]
    width = max(map(len, labels), default=0)
    return ["".ljust(width)] + labels
