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
from collections.abc import Iterable, Sequence
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


def render_table(columns: Sequence[Column], rows: Sequence[Sequence[Any]], *,
                 index: Sequence[int] | None = None) -> str:
    """`DataFrame(rows, columns).to_string(index=False)`, or `.to_string()` with `index` given."""
    lead = index is not None
    blocks: list[list[str]] = []
    if index is not None:
        blocks.append(_index_block(index))
    for j, col in enumerate(columns):
        cells = format_cells(col.kind, [row[j] for row in rows], lead)
        header = col.header if col.kind == "str" else " " + col.header
        width = max(len(header), max(map(len, cells), default=0))
        blocks.append([header.rjust(width)] + [c.rjust(width) for c in cells])
    return "\n".join(" ".join(line) for line in zip(*blocks))


def format_cells(kind: ColumnKind, values: Sequence[Any], lead: bool = False) -> list[str]:
    """One column's cells before justification."""
    if kind == "str":
        cells = [_escape(v) for v in values]
        return [" " + c for c in cells] if lead else cells
    if kind == "int":
        spec = " d" if lead else "d"
        return [format(int(v), spec) for v in values]
    return _float_cells([float(v) for v in values], lead)


def _escape(value: Any) -> str:
    return str(value).replace("\t", "\\t").replace("\r", "\\r").replace("\n", "\\n")


def _float_cells(values: list[float], lead: bool) -> list[str]:
    fixed = _trim_zeros([format(v, " .6f" if lead else ".6f") for v in values],
                        [math.isfinite(v) for v in values])
    magnitudes = [abs(v) for v in values]
    has_small = any(0 < m < _SMALL for m in magnitudes)
    too_wide = max(map(len, fixed), default=0) > _WIDE
    if has_small or (too_wide and any(m > _LARGE for m in magnitudes)):
        return [format(v, " .6e" if lead else ".6e") for v in values]
    return fixed


def _trim_zeros(cells: list[str], numeric: Iterable[bool]) -> list[str]:
    """Cut the trailing zeros all numeric cells share, leaving at least one decimal digit.

    A finite value formatted with `.6f` is exactly what pandas' "number with decimal" regex
    matches; `inf`/`nan` are left alone and do not block trimming, as in pandas.
    """
    numeric = list(numeric)
    nums = [c for c, n in zip(cells, numeric) if n]
    if not nums:
        return cells
    cut = min(len(c) - len(c.rstrip("0")) for c in nums)
    out = []
    for c, n in zip(cells, numeric):
        if n:
            if cut:
                c = c[:-cut]
            if c.endswith("."):
                c += "0"
        out.append(c)
    return out


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
