"""Text helpers: the official evaluator's parsing semantics, and the strict mode's parsers.

Official helpers reproduce the benchmark's regular expressions exactly (spec travelplanner.md
§6.1), including how they fail: they raise `TypeError` on a non-string argument, as the
official helpers do, so the checks that call them fail where the official evaluator crashes.
They are memoised (plans repeat the same strings across checks and across samples).

Strict helpers normalise whitespace and case of keywords, strip a trailing "(State)", and
return `None` instead of guessing when a string cannot be read.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Literal

# --- official semantics (spec §6.1) -----------------------------------------------------------

_BEFORE_PAREN = re.compile(r"^(.*?)\([^)]*\)")
_FROM_TO = re.compile(r"from\s+(.+?)\s+to\s+([^,]+)(?=[,\s]|$)")
_NAME_CITY = re.compile(r"(.*?),\s*([^,]+)(\(\w[\w\s]*\))?$")

FILLER_CITY = "You don't need to fill in the information for this or later days."


@lru_cache(maxsize=8192)
def before_paren(text: str) -> str:
    """Text before the first "(...)" group, unstripped; the text itself when there is none.

    `_BEFORE_PAREN` read in linear time: its lazy prefix cannot cross a newline, and a later "("
    matches only where the first one does (a ")" after it), so the first "(" decides."""
    if not isinstance(text, str):
        raise TypeError(f"expected string, got {type(text).__name__}")
    i = text.find("(")
    if i < 0 or "\n" in text[:i] or text.find(")", i + 1) < 0:
        return text
    return text[:i]


def _space_ends(text: str) -> list[int]:
    """ends[p]: the first index >= p that is not whitespace (`\\s`, i.e. str.isspace)."""
    n = len(text)
    ends = [n] * (n + 1)
    for p in range(n - 1, -1, -1):
        ends[p] = ends[p + 1] if text[p].isspace() else p
    return ends


# Up to this length the regex itself is faster than the linear scan, and its worst case is bounded.
_REGEX_CHARS = 256


@lru_cache(maxsize=8192)
def from_to(text: str) -> tuple[str | None, str | None]:
    """(A, B) of the first "from A to B" (B ends at a comma or the end); (None, None) if absent."""
    if isinstance(text, str) and len(text) <= _REGEX_CHARS:
        m = _FROM_TO.search(text)
        return (m.group(1), m.group(2)) if m else (None, None)
    return from_to_linear(text)


def from_to_linear(text: str) -> tuple[str | None, str | None]:
    """Exactly what `_FROM_TO.search` finds, in linear time (the regex backtracks quadratically on
    long texts with many "from"s or long whitespace runs): for each "from", its whitespace run is
    given back one character at a time, as the regex does, and A ends at the first place where
    `\\s+to\\s+` and one more non-comma character follow, without crossing a newline."""
    if not isinstance(text, str):
        raise TypeError(f"expected string, got {type(text).__name__}")
    s = text.find("from")
    if s < 0 or text.find("to", s + 4) < 0:
        return None, None
    n = len(text)
    ends = _space_ends(text)

    def b_start(e: int) -> int | None:
        """Where B starts when A ends at e (text[e:] = \\s+ "to" \\s+ [^,]), else None."""
        if e >= n or not text[e].isspace():
            return None
        r = ends[e]
        if not text.startswith("to", r):
            return None
        q = r + 2
        w = ends[q]
        if w == q:
            return None
        if w < n and text[w] != ",":
            return w
        return w - 1 if w - q >= 2 else None

    # next_end[p]: the first e >= p where A may end; next_newline[p]: the first newline >= p.
    next_end = [n + 1] * (n + 2)
    next_newline = [n] * (n + 1)
    for p in range(n - 1, -1, -1):
        next_end[p] = p if b_start(p) is not None else next_end[p + 1]
        next_newline[p] = p if text[p] == "\n" else next_newline[p + 1]
    while s >= 0:
        k = ends[s + 4] - (s + 4)
        for j in range(k, 0, -1):
            start = s + 4 + j
            if start >= n:
                continue
            e = next_end[start + 1]
            if e <= next_newline[start]:
                b = b_start(e)
                comma = text.find(",", b)
                return text[start:e], text[b : comma if comma >= 0 else n]
        s = text.find("from", s + 4)
    return None, None


def leg_endpoints(transportation: str, current_city: str) -> tuple[str | None, str | None]:
    """The leg's cities as the official checks read them: from the transportation text, else
    from the day's "from A to B" city."""
    o, d = from_to(transportation)
    if o is None or d is None:
        o, d = from_to(current_city)
    return o, d


@lru_cache(maxsize=8192)
def name_city(text: str) -> tuple[str, str]:
    """("name", "city") split at the last comma, "(State)" removed; ("-", "-") without a comma.

    What `_NAME_CITY.search` finds, in linear time: the city part holds no comma, so the comma is
    the last one; it needs one character after it; the lazy name part starts after the last
    newline before the comma (it cannot cross one). Its optional "(State)" group never takes
    anything the city part has not already taken, so it changes nothing."""
    if not isinstance(text, str):
        raise TypeError(f"expected string, got {type(text).__name__}")
    c = text.rfind(",")
    if c < 0 or c == len(text) - 1:
        return "-", "-"
    start = text.rfind("\n", 0, c) + 1
    return text[start:c].strip(), before_paren(text[c + 1 :].strip()).strip()


def official_transport_kind(text: str) -> str | None:
    """The official keyword classifier: taxi, then self-driving, then flight; else None."""
    low = text.lower()
    if "taxi" in low:
        return "Taxi"
    if "self-driving" in low:
        return "Self-driving"
    if "flight" in low:
        return "Flight"
    return None


def present(value: object) -> bool:
    """A plan value the official checks treat as filled: truthy and not '-'."""
    return bool(value) and value != "-"


def run_lengths(values: list) -> list[tuple[object, int]]:
    """Consecutive equal values collapsed to (value, run length)."""
    out: list[tuple[object, int]] = []
    for v in values:
        if out and out[-1][0] == v:
            out[-1] = (v, out[-1][1] + 1)
        else:
            out.append((v, 1))
    return out


def valid_city_sequence(cities: list[str]) -> bool:
    """At least 3 entries; a city's run must be contiguous (a revisit may only be the first or
    last entry), and an inner run must be longer than one entry."""
    n = len(cities)
    if n < 3:
        return False
    seen: set[str] = set()
    i = 0
    while i < n:
        city = cities[i]
        if city in seen and i not in (0, n - 1):
            return False
        j = i
        while j < n and cities[j] == city:
            j += 1
        if j - i == 1 and 0 < i < n - 1:
            return False
        seen.add(city)
        i = j
    return True


def distance_cost(distance: str, duration: str, mode: str) -> int | None:
    """Per-vehicle cost of a distance row: int(km * 0.05) for driving, int(km) for taxi;
    None for a multi-day duration or an unknown mode (the official `run_for_evaluation`)."""
    if "day" in duration:
        return None
    km = float(distance.replace("km", "").replace(",", ""))
    if "driving" in mode:
        return int(km * 0.05)
    if mode == "taxi":
        return int(km)
    return None


# --- strict parsing -----------------------------------------------------------------------------

TransportKind = Literal["flight", "self-driving", "taxi", "unknown"]

_STRICT_TRAVEL = re.compile(r"^from\s+(.+?)\s+to\s+(.+)$", re.IGNORECASE)
_STRICT_LEG = re.compile(r"\bfrom\s+(.+?)\s+to\s+(.+?)\s*(?:,|;|$)", re.IGNORECASE)
_FROM_WORD = re.compile(r"\bfrom\s", re.IGNORECASE)
_FLIGHT_NO = re.compile(r"\b(F\d{3,})\b")
_DEP = re.compile(r"departure\s+time\s*:\s*(\d{1,2}:\d{2})", re.IGNORECASE)
_ARR = re.compile(r"arrival\s+time\s*:\s*(\d{1,2}:\d{2})", re.IGNORECASE)
_KIND_PATTERNS: tuple[tuple[TransportKind, re.Pattern[str]], ...] = (
    ("flight", re.compile(r"\bflights?\b|\bflying\b|\bfly\b|\bairplane\b|\bplane\b|\bairline\b", re.IGNORECASE)),
    ("taxi", re.compile(r"\btaxis?\b|\bcabs?\b", re.IGNORECASE)),
    (
        "self-driving",
        re.compile(
            r"\bself[\s_-]*driv\w*|\bdriv(?:e|es|ing|en)\b|\bdrove\b|\bcars?\b|\brental\b"
            r"|\broad\s*trip\b",
            re.IGNORECASE,
        ),
    ),
)


def norm_ws(text: str) -> str:
    """Whitespace runs collapsed to one space, ends stripped."""
    return " ".join(text.split())


@lru_cache(maxsize=8192)
def strict_city(text: str) -> str:
    """A city as written in a plan: text before any "(State)", whitespace-normalised."""
    return norm_ws(text.split("(", 1)[0])


@lru_cache(maxsize=8192)
def strict_travel(current_city: str) -> tuple[str, str] | None:
    """(A, B) when current_city is exactly "from A to B" (keywords in any case), else None."""
    m = _STRICT_TRAVEL.match(norm_ws(current_city))
    if not m:
        return None
    return strict_city(m.group(1)), strict_city(m.group(2))


@lru_cache(maxsize=8192)
def strict_leg_route(text: str) -> tuple[str, str] | None:
    """(A, B) of a transportation text's "from A to B" (B ends at a comma, ';' or the end)."""
    text = norm_ws(text)
    # In normalised text, where the first "from" finds no " to " after it no later one does:
    # anchoring there keeps the search linear (it backtracks quadratically over many "from"s).
    first = _FROM_WORD.search(text)
    m = _STRICT_LEG.match(text, first.start()) if first else None
    if not m:
        return None
    return strict_city(m.group(1)), strict_city(m.group(2))


@lru_cache(maxsize=8192)
def strict_name_city(text: str) -> tuple[str, str] | None:
    """("name", "city") split at the last comma, both whitespace-normalised; None without one."""
    name, sep, city = norm_ws(text).rpartition(",")
    if not sep:
        return None
    name, city = norm_ws(name), strict_city(city)
    if not name or not city:
        return None
    return name, city


def strict_transport_kinds(text: str) -> set[TransportKind]:
    """Every transport mode a text names, by keyword ("Drive", "car", "cab", "plane", ...)."""
    kinds: set[TransportKind] = {kind for kind, pat in _KIND_PATTERNS if pat.search(text)}
    if _FLIGHT_NO.search(text):
        kinds.add("flight")
    return kinds


def strict_flight_number(text: str) -> str | None:
    m = _FLIGHT_NO.search(text)
    return m.group(1) if m else None


def strict_times(text: str) -> tuple[str | None, str | None]:
    """(departure, arrival) times written in a flight text, zero-padded to HH:MM."""

    def pad(m: re.Match[str] | None) -> str | None:
        return m.group(1).zfill(5) if m else None

    return pad(_DEP.search(text)), pad(_ARR.search(text))
