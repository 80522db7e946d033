"""The official name/city parsers run in linear time and read every text exactly as the official
regular expressions do (which backtrack quadratically on long, adversarial fields)."""

from __future__ import annotations

import time

from hypothesis import given, settings, strategies as st

from services.reward.evaluator import parsing as P

# Pieces that exercise every branch of the regexes: keywords, whitespace of several kinds
# (newlines included), commas, parentheses, non-ASCII letters.
ATOMS = st.sampled_from(
    ["from", "to", "t", "o", "ro", " ", "  ", "\t", "\n", "\u00a0", ",", "(", ")", "a", "B", "é", ";", "From", "TO"]
)
TEXTS = st.lists(ATOMS, max_size=16).map("".join)


def regex_before_paren(text: str) -> str:
    m = P._BEFORE_PAREN.search(text)
    return m.group(1) if m else text


def regex_from_to(text: str) -> tuple[str | None, str | None]:
    m = P._FROM_TO.search(text)
    return (m.group(1), m.group(2)) if m else (None, None)


def regex_name_city(text: str) -> tuple[str, str]:
    m = P._NAME_CITY.search(text)
    if not m:
        return "-", "-"
    return m.group(1).strip(), regex_before_paren(m.group(2).strip()).strip()


def regex_strict_leg(text: str) -> tuple[str, str] | None:
    m = P._STRICT_LEG.search(P.norm_ws(text))
    return (P.strict_city(m.group(1)), P.strict_city(m.group(2))) if m else None


@settings(max_examples=3000, deadline=None, database=None)
@given(TEXTS)
def test_linear_parsers_agree_with_the_official_regexes(text):
    assert P.before_paren.__wrapped__(text) == regex_before_paren(text)
    assert P.from_to_linear(text) == regex_from_to(text)
    assert P.from_to.__wrapped__(text) == regex_from_to(text)
    assert P.name_city.__wrapped__(text) == regex_name_city(text)
    assert P.strict_leg_route.__wrapped__(text) == regex_strict_leg(text)


def test_long_fields_are_read_in_linear_time():
    texts = [
        "from a " * 570,
        "from a" + " " * 3990 + "x",
        "a" * 3999 + ",",
        "(" * 4000,
        "from " + "a " * 1990 + "to ,",
        "x, " * 1300 + "(y",
    ]
    for text in texts:
        # this thread's CPU time: what the scans cost, not how long other processes (parallel test workers)
        # kept the CPU
        started = time.thread_time()
        P.before_paren.__wrapped__(text)
        P.from_to_linear(text)
        P.name_city.__wrapped__(text)
        P.strict_leg_route.__wrapped__(text)
        elapsed = time.thread_time() - started
        # The regexes take 30-120 ms on each of these; the linear scans about 1 ms.
        assert elapsed < 0.02, f"{elapsed * 1000:.1f} ms on {text[:30]!r}..."
