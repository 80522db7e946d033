"""The structured plan text: exact fields, tolerant surroundings, and the round trip."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from services.common.schemas import Plan, PlanDay
from services.formatter.structured import FIELDS, ONE_ENTRY_FIELDS, PlanTextError, parse_plan, render_plan

DAY1 = PlanDay(
    day=1,
    current_city="from Sarasota to Chicago",
    transportation="Flight Number: F3573659, from Sarasota to Chicago, Departure Time: 08:04, Arrival Time: 10:20",
    dinner="Coco Bambu, Chicago",
    accommodation="Cozy Room in Wicker Park, Chicago",
)
DAY2 = PlanDay(
    day=2,
    current_city="Chicago",
    breakfast="Dial A Cake, Chicago",
    attraction="Millennium Park, Chicago;Art Institute of Chicago, Chicago;",
    lunch="Flying Mango, Chicago",
    dinner="Cafe Southall, Chicago",
    accommodation="-",
)
PLAN = Plan(days=[DAY1, DAY2])


def gold_plans(travelplanner_dir: Path) -> list[Plan]:
    records = json.loads((travelplanner_dir / "train" / "train.json").read_text(encoding="utf-8"))
    plans = []
    for r in records:
        _, days = ast.literal_eval(r["annotated_plan"])
        plans.append(Plan(days=[PlanDay(**d) for d in days if d]))
    return plans


def test_render_is_the_contract_form():
    text = render_plan(PLAN)
    assert text.startswith(
        "Day 1:\nCurrent City: from Sarasota to Chicago\n"
        "Transportation: Flight Number: F3573659, from Sarasota to Chicago, Departure Time: 08:04, Arrival Time: 10:20\n"
        "Breakfast: -\nAttraction: -\nLunch: -\nDinner: Coco Bambu, Chicago\n"
        "Accommodation: Cozy Room in Wicker Park, Chicago\n\nDay 2:\nCurrent City: Chicago\n"
    )
    assert text.count("\n\n") == 1


def test_gold_plans_round_trip(travelplanner_dir):
    plans = gold_plans(travelplanner_dir)
    assert plans
    for plan in plans:
        assert parse_plan(render_plan(plan), days=len(plan.days)) == plan


def test_agent_decorations_are_forgiven():
    text = (
        "Sure! After checking flights and restaurants, here is the plan.\r\n\r\n"
        "<answer>\r\n**Day 1:**\r\n"
        "- **Current City:** from Sarasota to Chicago\r\n"
        "- **Transportation**: Flight Number: F3573659, from Sarasota to Chicago, Departure Time: 08:04, Arrival Time: 10:20\r\n"
        "- Breakfast: -\r\n* attraction: \r\n  - Lunch: -\r\n"
        "- **Dinner:** **Coco Bambu, Chicago**\r\n- Accommodation: Cozy Room in Wicker Park, Chicago\r\n\r\n\r\n"
        "---\r\n### Day 2 (March 17, 2022)\r\n```\r\nCurrent City: Chicago\r\nTransportation: -\r\n"
        "Breakfast: Dial A Cake, Chicago\r\n"
        "Attractions: Millennium Park, Chicago;Art Institute of Chicago, Chicago;\r\n"
        "Lunch: Flying Mango, Chicago\r\nDinner: Cafe Southall, Chicago\r\nAccommodations: -\r\n```\r\n"
        "Total cost: $1,234. Enjoy your trip!\r\n</answer>"
    )
    assert parse_plan(text, days=2) == PLAN


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "no 'Day 1:' line"),
        ("I could not find a plan. Answer not found.", "no 'Day 1:' line"),
        ("Day 2:\n" + "\n".join(f"{label}: -" for label, _ in FIELDS), "'Day 2' where Day 1 was expected"),
        (
            "Day 1:\nCurrent City: Chicago\nTransportation: -",
            "Day 1 has no Breakfast, Attraction, Lunch, Dinner, Accommodation line",
        ),
        ("Day 1:\nCurrent City: Chicago\nCurrent City: Boston", "second Current City line"),
        ("Day 1:\nCurrent City: Chicago\nCost: 300", "unknown field 'Cost' in Day 1"),
        ("Day 1:\nCurrent City: Chicago\nthen we fly home", "expected a labelled line of Day 1 (Transportation: ...)"),
        ("Day 1:\nCurrent City:\nChicago", "expected a labelled line"),
    ],
)
def test_bad_text_is_a_clear_error(text, message):
    with pytest.raises(PlanTextError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_plan(text)


def test_day_count_must_match_the_query():
    text = render_plan(PLAN)
    assert parse_plan(text, days=2) == PLAN
    with pytest.raises(PlanTextError, match="the plan has 2 day\\(s\\) but the query asks for 3"):
        parse_plan(text, days=3)
    with pytest.raises(PlanTextError, match="Day 3' where Day 2"):
        parse_plan(text.replace("Day 2:", "Day 3:"))


def test_non_text_and_huge_text_are_refused():
    with pytest.raises(PlanTextError, match="must be a string"):
        parse_plan(None)  # type: ignore[arg-type]
    with pytest.raises(PlanTextError, match="characters"):
        parse_plan("x" * 300_000)


def test_a_stray_separator_after_one_entry_is_dropped():
    # Run 31's drift: the attraction line's ";" after a meal made the evaluator read the city "Chicago;".
    text = (
        render_plan(PLAN)
        .replace("Coco Bambu, Chicago", "Coco Bambu, Chicago ;")
        .replace("Dial A Cake, Chicago", "Dial A Cake, Chicago;")
        .replace("Cozy Room in Wicker Park, Chicago", "Cozy Room in Wicker Park, Chicago;")
    )
    assert parse_plan(text) == PLAN
    # The attraction line keeps its separators: they are the benchmark's own form there.
    assert parse_plan(text).days[1].attraction.endswith("Chicago;")
    # A meal of nothing but separators is no meal.
    assert parse_plan(text.replace("Breakfast: -", "Breakfast: ;", 1)).days[0].breakfast == "-"


def test_render_keeps_values_on_one_line():
    day = DAY2.model_copy(update={"lunch": "Flying\nMango, Chicago", "breakfast": ""})  # day=2: renumbered
    plan = parse_plan(render_plan(Plan(days=[day])))
    assert plan.days[0].lunch == "Flying Mango, Chicago"
    assert plan.days[0].breakfast == "-"


# Values as a plan writes them: one line, no surrounding blanks, any printable text (colons,
# semicolons, parentheses, markdown-like characters and non-ASCII included).
_value = (
    st.text(
        alphabet=st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp"), blacklist_characters="\x85\x1c\x1d\x1e"),
        min_size=1,
        max_size=60,
    )
    .map(str.strip)
    .filter(lambda v: v != "")
)


def _day_fields_of(value: st.SearchStrategy[str]) -> st.SearchStrategy[dict[str, str]]:
    """A day's fields; a meal or accommodation holds one entry, so a trailing ";" there is read as a
    stray separator and cannot round-trip."""
    entry = value.filter(lambda v: not v.endswith(";"))
    return st.fixed_dictionaries({name: entry if name in ONE_ENTRY_FIELDS else value for _, name in FIELDS})


_day_fields = _day_fields_of(_value)


@settings(max_examples=300, deadline=None)
@given(st.lists(_day_fields, min_size=1, max_size=7))
def test_round_trip_is_identity(days):
    plan = Plan(days=[PlanDay(day=i + 1, **fields) for i, fields in enumerate(days)])
    assert parse_plan(render_plan(plan), days=len(days)) == plan


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=400))
def test_any_text_parses_or_fails_clearly(text):
    try:
        plan = parse_plan(text)
    except PlanTextError as exc:
        assert str(exc)
    else:
        assert plan.days and [d.day for d in plan.days] == list(range(1, len(plan.days) + 1))


# How agents decorate the form: each label line and day header may get its own markdown.
_label_styles = st.sampled_from(
    [
        "{l}: {v}",
        "**{l}:** {v}",
        "**{l}**: {v}",
        "- {l}: {v}",
        "* **{l}:** {v}",
        "  {l}:   {v}  ",
        "{L}: {v}",
        "1. {l}: {v}",
    ]
)
_day_styles = st.sampled_from(
    ["Day {n}:", "**Day {n}:**", "### Day {n}", "Day {n} (2022-03-1{n})", "## **Day {n}**", "Day {n} - Arrival"]
)
_plain_value = (
    st.text(alphabet=st.sampled_from("abcdefgh XYZ,;.()'&-0123456789:"), min_size=1, max_size=40)
    .map(str.strip)
    .filter(lambda v: v and not v.startswith(("*", "-", ":")) and not v.endswith("*"))
)


@settings(max_examples=200, deadline=None)
@given(
    days=st.lists(_day_fields_of(_plain_value), min_size=1, max_size=5),
    styles=st.data(),
    newline=st.sampled_from(["\n", "\r\n"]),
    prose=st.sampled_from(["", "Here is the plan.\n\n"]),
)
def test_decorated_plans_read_the_same(days, styles, newline, prose):
    plan = Plan(days=[PlanDay(day=i + 1, **fields) for i, fields in enumerate(days)])
    lines = [prose]
    for i, day in enumerate(plan.days, 1):
        lines.append(styles.draw(_day_styles).format(n=i))
        for label, name in FIELDS:
            style = styles.draw(_label_styles)
            lines.append(style.format(l=label, L=label.upper(), v=getattr(day, name)))
        lines.append("")
    lines.append("Let me know if you want changes!")
    assert parse_plan(newline.join(lines), days=len(days)) == plan


def test_drafts_in_thinking_are_ignored():
    draft = render_plan(Plan(days=[DAY1.model_copy(update={"dinner": "Draft Diner, Chicago"})]))
    final = render_plan(PLAN)
    turn = f"<think>First idea:\n{draft}\nBetter dinner on day 1.</think>\n<answer>\n{final}</answer>"
    assert parse_plan(turn, days=2) == PLAN
