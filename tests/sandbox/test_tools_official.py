"""The official dialect: pandas-identical tables without pandas, and the two-stage agent's messages.

The table renderer is checked three ways: hand-written Rockford lines (from train.json's reference
information), the installed pandas on every city's rows, and hypothesis-generated frames.
"""

from __future__ import annotations

import re

import pandas as pd
import pytest
from hypothesis import given, settings, strategies as st

from services.sandbox.tools import ToolBox, official
from services.sandbox.tools.table import Column, render_table


@pytest.fixture(scope="module")
def world(reference_world):
    return reference_world


@pytest.fixture(scope="module")
def box(world):
    return ToolBox(world, dialect="official", cache_size=0)


@pytest.fixture(scope="module")
def city_set(travelplanner_dir):
    return official.load_city_set(travelplanner_dir / "database" / "background" / "citySet.txt")


def text(box, name, **arguments):
    return box.call(name, arguments).text


# --- tables, hand-checked --------------------------------------------------------------------
def test_attraction_table_rockford(box):
    lines = text(box, "SearchAttraction", city="Rockford").split("\n")
    assert len(lines) == 21
    assert lines[0] == (
        "                                   Name  Latitude  Longitude"
        + " " * 58
        + "Address          Phone"
        + " " * 65
        + "Website     City"
    )
    assert lines[1] == (
        "       Burpee Museum of Natural History 42.277324 -89.088142"
        + " " * 27
        + "737 N Main St, Rockford, IL 61103, USA (815) 965-3433"
        + " " * 50
        + "http://www.burpee.org/ Rockford"
    )
    # -88.98463989999999 prints as -88.984640: six decimals, since no value of the column ends in 0
    assert " 42.280499 -88.984640 " in lines[2]


def test_accommodation_table_rockford(box):
    lines = text(box, "SearchAccommodation", city="Rockford").split("\n")
    assert len(lines) == 14
    assert lines[0] == (
        "                                              NAME  price       room type"
        "                                  house_rules  minimum nights  maximum occupancy"
        "  review rate number     city"
    )
    assert lines[1] == (
        "                     Spacious 3BDR Prime Location! 1030.0 Entire home/apt"
        "                                   No smoking             2.0                  9"
        "                 2.0 Rockford"
    )


def test_restaurant_table_with_and_without_index(world):
    plain = ToolBox(world, dialect="official", cache_size=0).call("SearchRestaurant", {"city": "Rockford"}).text
    indexed = (
        ToolBox(world, dialect="official", cache_size=0, restaurant_index=True)
        .call("SearchRestaurant", {"city": "Rockford"})
        .text
    )
    assert plain.split("\n")[1] == (
        "                               Coco Bambu            72"
        "                     Tea, French, Bakery, BBQ, Cafe               4.9 Rockford"
    )
    # with the CSV row index: every cell gains a leading space, the index is left-aligned
    assert indexed.split("\n")[0] == (
        "                                           Name  Average Cost"
        "                                            Cuisines  Aggregate Rating      City"
    )
    assert indexed.split("\n")[1] == (
        "39                                   Coco Bambu            72"
        "                      Tea, French, Bakery, BBQ, Cafe               4.9  Rockford"
    )
    assert indexed.split("\n")[3].startswith("2470 ")


def test_flight_table(box):
    assert text(box, "SearchFlight", departure="St. Petersburg", destination="Rockford", date="2022-03-16") == (
        "Flight Number  Price DepTime ArrTime  ActualElapsedTime FlightDate OriginCityName DestCityName  Distance\n"
        "     F3573659    474   15:40   17:04 2 hours 24 minutes 2022-03-16 St. Petersburg     Rockford    1049.0"
    )


def test_newlines_in_names_are_escaped(box, world):
    # "Great Room! Great Price! \nCan wait to see you !" (Billings) prints with a literal backslash-n
    t = text(box, "SearchAccommodation", city="Billings")
    assert "Great Room! Great Price! \\nCan wait to see you !" in t
    assert len(t.split("\n")) == 1 + len(world.accommodations("Billings"))


# --- tables, against the installed pandas on every city ----------------------------------------
def _frame(columns, rows, index=None):
    return pd.DataFrame([tuple(r) for r in rows], columns=[c.header for c in columns], index=index)


@pytest.mark.usefixtures("full_travelplanner_dir")
def test_tables_equal_installed_pandas_for_every_city(world):
    checked = 0
    for n, city in enumerate(sorted({c.city for c in world.cities()} | {"Bellingham", "Bishop", "Brunswick"})):
        for columns, rows in (
            (official.ACCOMMODATION_COLUMNS, world.accommodations(city)),
            (official.ATTRACTION_COLUMNS, world.attractions(city)),
            (official.RESTAURANT_COLUMNS, [r[1:] for r in world.restaurants(city)]),
        ):
            if not rows:
                continue
            assert render_table(columns, rows) == _frame(columns, rows).to_string(index=False), (city, columns[0])
            checked += 1
            if n % 4 == 0:  # the indexed form (restaurants' old form) on a quarter of the cities
                idx = list(range(len(rows) * 7, 0, -7))  # uneven widths in the index column
                assert render_table(columns, rows, index=idx) == _frame(columns, rows, idx).to_string(), city
    assert checked > 850


_floats = (
    st.floats(allow_nan=False, allow_infinity=True)
    | st.floats(min_value=-1e7, max_value=1e7)
    | st.sampled_from([0.0, -0.0, 1e-7, 5e-7, 1e6, 1e6 + 0.5, 123456.789, 1e16, 2.5, 42.2773242])
)
_rows = st.lists(st.tuples(st.text(max_size=10), st.integers(-(10**12), 10**12), _floats), min_size=1, max_size=6)
_COLS = (Column("s", "str"), Column("i", "int"), Column("f", "float"))


@settings(max_examples=400, deadline=None)
@given(rows=_rows, index=st.none() | st.lists(st.integers(-1000, 10**6), min_size=6, max_size=6))
def test_renderer_equals_pandas_on_generated_frames(rows, index):
    idx = index[: len(rows)] if index is not None else None
    expected = _frame(_COLS, rows, idx)
    assert render_table(_COLS, rows, index=idx) == (expected.to_string() if idx else expected.to_string(index=False))


# --- argument checks and messages ------------------------------------------------------------
@pytest.mark.usefixtures("full_travelplanner_dir")
def test_invalid_city_lists_the_city_set(box, world, city_set):
    searchable = world.city_set()
    r = box.call("SearchAccommodation", {"city": "Atlantis"})
    assert not r.ok
    assert r.text == f"Atlantis is not valid city in {city_set!r}."
    assert searchable == city_set and len(searchable) == 311 and "Jackson" not in searchable


def test_jackson_is_not_searchable_in_two_stage_mode(box):
    # Jackson is in citySet_with_states.txt (and has rows) but not in citySet.txt
    assert text(box, "SearchRestaurant", city="Jackson").startswith("Jackson is not valid city in ['San Diego', ")


@pytest.mark.usefixtures("full_travelplanner_dir")
def test_official_city_set_order_reproduces_the_message_exactly(world, city_set, box):
    assert city_set.index("Charleston") == 258  # elsewhere than in citySet_with_states.txt
    # the world keeps citySet.txt's order, so the default message is already exact
    assert text(box, "SearchAttraction", city="Gotham") == f"Gotham is not valid city in {city_set!r}."
    override = ToolBox(world, dialect="official", cache_size=0, city_set=list(reversed(city_set)))
    assert text(override, "SearchAttraction", city="Gotham") == f"Gotham is not valid city in {city_set[::-1]!r}."


def test_no_result_texts(world):
    # every city-set city has accommodations and restaurants; an extended set reaches the empty case
    box = ToolBox(
        world,
        dialect="official",
        cache_size=0,
        city_set=[c.city for c in world.cities() if c.searchable] + ["Atlantis"],
    )
    assert box.call("SearchAccommodation", {"city": "Atlantis"}).text == "There is no attraction in this city."
    assert box.call("SearchRestaurant", {"city": "Atlantis"}).text == "There is no restaurant in this city."
    r = box.call("SearchAttraction", {"city": "Arcata"})
    assert not r.ok and r.text == "There is no attraction in this city."


def test_flight_checks_in_order(box):
    def search(o, d, date):
        return text(box, "FlightSearch", departure=o, destination=d, date=date)

    assert search("Atlantis", "Gotham", "March 3") == "'March 3' is not in the format YYYY-MM-DD"
    assert search("Atlantis", "Rockford", "2022-03-16").startswith("Atlantis is not valid city in [")
    assert search("Rockford", "Gotham", "2022-03-16").startswith("Gotham is not valid city in [")
    assert (
        search("Rockford", "St. Petersburg", "2022-03-17")
        == "There is no flight from Rockford to St. Petersburg on 2022-03-17."
    )
    # the agent's regex is re.match with `$`: a trailing newline passes the format check
    assert (
        search("Rockford", "St. Petersburg", "2022-03-17\n")
        == "There is no flight from Rockford to St. Petersburg on 2022-03-17\n."
    )


@pytest.mark.parametrize(
    "tool,arguments,expected",
    [
        (
            "SearchFlight",
            {"departure": "Rockford", "destination": "Chicago"},
            "Illegal Flight Search. Please try again.",
        ),
        (
            "SearchFlight",
            {"departure": "Rockford", "destination": "Chicago", "date": 20220316},
            "Illegal Flight Search. Please try again.",
        ),
        ("SearchAccommodation", {}, "Illegal Accommodation Search. Please try again."),
        ("SearchRestaurant", {"town": "Rockford"}, "Illegal Restaurant Search. Please try again."),
        ("SearchAttraction", {}, "Illegal Attraction Search. Please try again."),
        ("SearchCity", {}, "Illegal City Search. Please try again."),
        ("SearchCity", {"state": ["Texas"]}, "Illegal City Search. Please try again."),
        ("GoogleDistanceMatrix", {"departure": "Detroit"}, "Illegal GoogleDistanceMatrix. Please try again."),
        (
            "GoogleDistanceMatrix",
            {"departure": 5, "destination": "Norfolk"},
            "Illegal GoogleDistanceMatrix. Please try again.",
        ),
        (
            "GoogleDistanceMatrix",
            {"departure": "Detroit", "destination": "Norfolk", "mode": None},
            "Illegal GoogleDistanceMatrix. Please try again.",
        ),
        ("SearchCity", "Texas", "Illegal City Search. Please try again."),
    ],
)
def test_malformed_arguments_are_illegal(box, tool, arguments, expected):
    r = box.call(tool, arguments)
    assert not r.ok and r.text == expected


def test_non_string_city_is_an_invalid_city(box):
    assert text(box, "SearchAttraction", city=5).startswith("5 is not valid city in ['San Diego'")
    assert text(box, "SearchAttraction", city=None).startswith("None is not valid city in [")


def test_city_search(box):
    r = box.call("CitySearch", {"state": "Washington"})
    assert r.ok and r.text == "['Seattle', 'Wenatchee', 'Pasco', 'Yakima', 'Walla Walla', 'Everett', 'Spokane']"
    assert text(box, "CitySearch", state="Mississippi") == "['Gulfport', 'Jackson', 'Hattiesburg']"
    for state in ("Atlantis", "washington", 7, None):
        r = box.call("CitySearch", {"state": state})
        assert not r.ok and r.text == "Invalid State"


@pytest.mark.parametrize(
    "mode,cost", [("self-driving", "57"), ("driving", "57"), ("taxi", "1144"), ("Taxi", "None"), ("walking", "None")]
)
def test_distance_modes(box, mode, cost):
    r = box.call("GoogleDistanceMatrix", {"departure": "Detroit", "destination": "Norfolk", "mode": mode})
    assert r.ok
    assert r.text == f"{mode}, from Detroit to Norfolk, duration: 10 hours 55 mins, distance: 1,144 km, cost: {cost}"


def test_distance_cuts_before_a_parenthesis(box):
    assert (
        text(box, "GoogleDistanceMatrix", origin="Detroit(Michigan)", destination="Norfolk (Virginia)", mode="taxi")
        == "taxi, from Detroit to Norfolk , no valid information."
    )
    assert text(
        box, "GoogleDistanceMatrix", departure="Detroit(MI)", destination="Norfolk(VA)", mode="taxi"
    ).startswith("taxi, from Detroit to Norfolk, duration: 10 hours 55 mins")


def test_distance_no_information(box):
    assert (
        text(box, "GoogleDistanceMatrix", departure="Killeen", destination="Mission", mode="taxi")
        == "No valid information."
    )
    assert (
        text(box, "GoogleDistanceMatrix", departure="Hartford", destination="Denver", mode="taxi")
        == "No valid information."
    )
    r = box.call("GoogleDistanceMatrix", {"departure": "Atlantis", "destination": "Norfolk", "mode": "self-driving"})
    assert not r.ok and r.text == "self-driving, from Atlantis to Norfolk, no valid information."
    assert (
        text(box, "GoogleDistanceMatrix", departure="Atlantis", destination="Norfolk", mode=3)
        == "3, from Atlantis to Norfolk, no valid information."
    )


def test_distance_mode_defaults_to_driving(box):
    assert text(box, "GoogleDistanceMatrix", departure="Detroit", destination="Norfolk").startswith("driving, from")


_REGEX = re.compile(r"^(.*?)\([^)]*\)")


@settings(max_examples=500, deadline=None)
@given(st.text(alphabet="ab()\n ", max_size=12))
def test_extract_before_parenthesis_equals_the_official_regex(s):
    m = _REGEX.search(s)
    assert official.extract_before_parenthesis(s) == (m.group(1) if m else s)


def test_extract_before_parenthesis_is_linear():
    s = "(" * 200_000  # the official regex backtracks quadratically on this
    assert official.extract_before_parenthesis(s) == s
