"""The structured day-by-day plan text: the form our agent prompt asks for and our oracle writes.

    Day 1:
    Current City: from Sarasota to Chicago
    Transportation: Flight Number: F3573659, from Sarasota to Chicago, Departure Time: 08:04, Arrival Time: 10:20
    Breakfast: -
    Attraction: -
    Lunch: -
    Dinner: Coco Bambu, Chicago
    Accommodation: Cozy Room in Wicker Park, Chicago

    Day 2:
    ...

One block per day; the seven labelled lines in that order; values in the benchmark's string
conventions (spec travelplanner.md §5), `-` for nothing. RL scoring reads answers with
`parse_plan`, so it needs no LLM.

What the parser forgives (what an agent plausibly writes around the plan): prose before the
first day and after the last complete day, an `<answer>` wrapper, CRLF line ends, blank lines,
markdown headings, bullets, bold/italic markers around labels and day headers, code fences,
horizontal rules, label case, "Attractions"/"Accommodations" plurals, a date after "Day N", and a
trailing ";" on a meal or accommodation (one entry each; ";" separates the attraction line's entries).
What it does not forgive, because a guess would change the plan: a missing, repeated or unknown
field inside a day, a value on a line of its own, days out of sequence, and (when `days` is
given) a different number of days than the query asks for.

Round trip: for single-line values without surrounding whitespace (and no trailing ";" on a meal or
accommodation), `parse_plan(render_plan(p)) == p`. An empty value is written and read as `-`.
"""

from __future__ import annotations

import re

from services.common.schemas import Plan, PlanDay

# (label as written, PlanDay field), in the order the form lists them.
FIELDS: tuple[tuple[str, str], ...] = (
    ("Current City", "current_city"),
    ("Transportation", "transportation"),
    ("Breakfast", "breakfast"),
    ("Attraction", "attraction"),
    ("Lunch", "lunch"),
    ("Dinner", "dinner"),
    ("Accommodation", "accommodation"),
)
_LABEL_TO_FIELD = {label.lower(): name for label, name in FIELDS}
_LABEL_TO_FIELD.update(
    {
        "attractions": "attraction",
        "accommodations": "accommodation",
        "current_city": "current_city",
        "currentcity": "current_city",
    }
)
_FIELD_TO_LABEL = {name: label for label, name in FIELDS}
# Fields that hold one entry. A ";" after it is the attraction line's separator carried over, not part
# of the city: a policy can drift to "Breakfast: Castell's Kitchen, Ostmore;", which the evaluator would
# read as a restaurant in the city "Ostmore;".
ONE_ENTRY_FIELDS = frozenset({"breakfast", "lunch", "dinner", "accommodation"})

MAX_TEXT_CHARS = 200_000  # a plan of 7 days is a few KB; bounds the work on hostile input
MAX_DAYS = 64

_ANSWER_OPEN = re.compile(r"<answer>", re.IGNORECASE)
_ANSWER_CLOSE = re.compile(r"</answer>", re.IGNORECASE)
# Markdown that may precede a label or a day header: bullets, numbering, headings, quotes.
_LEAD = r"(?:[-*+\u2022>]\s+|\d{1,3}[.)]\s+|#{1,6}\s*)*"
_EMPH = r"(?:\*\*|__|\*|_)?"
_DAY = re.compile(
    rf"^{_LEAD}{_EMPH}\s*day\s*(\d{{1,3}})\s*(?:\([^)]*\)|[-\u2013\u2014,]\s*[^:*_]*)?\s*:?\s*{_EMPH}\s*:?\s*$",
    re.IGNORECASE,
)
_FIELD = re.compile(
    rf"^{_LEAD}(?P<emph>\*\*|__|\*|_)?\s*(?P<label>[A-Za-z_ ]{{2,24}}?)\s*(?P=emph)?\s*:\s*(?P<close>(?P=emph))?(?P<value>.*)$"
)
_NOISE = re.compile(r"^(?:`{3,}.*|~{3,}.*|[-*_=]{3,}|</?answer>|\|[-:| ]{2,}\|?)$", re.IGNORECASE)


class PlanTextError(ValueError):
    """The text is not a plan in the structured form; the message says where and why."""


def render_plan(plan: Plan) -> str:
    """The structured text of a plan (values as they are; newlines inside a value become spaces).
    Days are numbered by position, from 1, whatever their `day` field says."""
    blocks = []
    for number, day in enumerate(plan.days, 1):
        lines = [f"Day {number}:"]
        for label, name in FIELDS:
            lines.append(f"{label}: {_one_line(getattr(day, name))}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"


def _one_line(value: str) -> str:
    text = " ".join(value.splitlines()) if ("\n" in value or "\r" in value) else value
    return text if text.strip() else "-"


def parse_plan(text: str, days: int | None = None) -> Plan:
    """Read a plan written in the structured form (see the module doc); `days`, when given, is the
    number of days the query asks for. Raises `PlanTextError` with a clear message."""
    if not isinstance(text, str):
        raise PlanTextError(f"plan text must be a string, not {type(text).__name__}")
    if len(text) > MAX_TEXT_CHARS:
        raise PlanTextError(f"plan text has {len(text)} characters (limit {MAX_TEXT_CHARS})")
    body = _answer_body(text)
    parsed: list[PlanDay] = []
    current: dict[str, str] | None = None  # the fields of the day being read
    number = 0

    def close_day() -> None:
        assert current is not None
        missing = [_FIELD_TO_LABEL[n] for _, n in FIELDS if n not in current]
        if missing:
            raise PlanTextError(f"Day {number} has no {', '.join(missing)} line")
        parsed.append(PlanDay(day=number, **current))

    for lineno, raw in enumerate(body.splitlines(), 1):
        line = raw.strip()
        if not line or _NOISE.match(line):
            continue
        day_match = _DAY.match(line)
        if day_match:
            if current is not None:
                close_day()
            number, expected = int(day_match.group(1)), len(parsed) + 1
            if number != expected:
                raise PlanTextError(f"line {lineno}: 'Day {number}' where Day {expected} was expected")
            if number > MAX_DAYS:
                raise PlanTextError(f"plan text has more than {MAX_DAYS} days")
            current = {}
            continue
        if current is None:
            continue  # prose before the first day
        complete = len(current) == len(FIELDS)
        field = _field(line)
        if field is None or field[0] is None:
            if complete:
                continue  # prose after a complete day: a closing remark, a cost summary
            if field is None:
                raise PlanTextError(
                    f"line {lineno}: expected a labelled line of Day {number} "
                    f"({_FIELD_TO_LABEL[_next_missing(current)]}: ...), got {_clip(line)!r}"
                )
            raise PlanTextError(
                f"line {lineno}: unknown field {_clip(field[1])!r} in Day {number}; the fields are "
                + ", ".join(label for label, _ in FIELDS)
            )
        name, value = field
        if name in current:
            raise PlanTextError(f"line {lineno}: Day {number} has a second {_FIELD_TO_LABEL[name]} line")
        current[name] = value
    if current is None:
        raise PlanTextError("no 'Day 1:' line found in the plan text")
    close_day()
    if days is not None and len(parsed) != days:
        raise PlanTextError(f"the plan has {len(parsed)} day(s) but the query asks for {days}")
    return Plan(days=parsed)


def _answer_body(text: str) -> str:
    """The text inside <answer>…</answer> when the agent's whole turn was passed in (its thinking
    may hold drafts). A tag inside a field's value is part of the value, not a wrapper."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    start = None
    for m in _ANSWER_OPEN.finditer(text):
        line_start = text.rfind("\n", 0, m.start()) + 1
        field = _field(text[line_start : m.start()].strip() + "x")
        if field is None or field[0] is None:
            start = m.end()
    if start is None:
        return text
    closing = [m.start() for m in _ANSWER_CLOSE.finditer(text, start)]
    end = closing[-1] if closing else -1
    return text[start:end] if end >= 0 else text[start:]


def _field(line: str) -> tuple[str | None, str] | None:
    """(field name, value) of a labelled line; (None, label) for an unknown label; None when the
    line has no label at all."""
    m = _FIELD.match(line)
    if not m:
        return None
    label = " ".join(m.group("label").split()).lower().rstrip("_")
    name = _LABEL_TO_FIELD.get(label)
    if name is None:
        return None, m.group("label").strip()
    value = m.group("value").strip()
    emph = m.group("emph")
    if emph and not m.group("close") and value.endswith(emph):
        # "**Current City: Chicago**": the closing marker sits after the value.
        value = value[: -len(emph)].rstrip()
    elif emph and len(value) > 2 * len(emph) and value.startswith(emph) and value.endswith(emph):
        value = value[len(emph) : -len(emph)].strip()  # "**Dinner**: **Coco Bambu, Chicago**"
    if name in ONE_ENTRY_FIELDS:
        value = value.rstrip(";").rstrip()
    return name, value or "-"


def _next_missing(current: dict[str, str]) -> str:
    return next(n for _, n in FIELDS if n not in current)


def _clip(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "…"
