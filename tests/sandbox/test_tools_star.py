"""The star dialect on the real tables: Agent-STAR's exact strings, edge cases and argument types.

Expectations are written from the CSV rows (e.g. Rockford's) and from the public tools' format
strings; a pandas re-implementation of those tools over the raw CSVs checks every city.
"""

from __future__ import annotations

import random

import pandas as pd
import pytest

from services.sandbox.tools import ToolBox

RETHINK = "Please rethink your {} search and try again."


@pytest.fixture(scope="module")
def world(reference_world):
    return reference_world


@pytest.fixture(scope="module")
def box(world):
    return ToolBox(world, dialect="star", cache_size=0)


def text(box, name, **arguments):
    return box.call(name, arguments).text


# --- SearchCity ---------------------------------------------------------------------------
def test_search_city_lists_the_state_in_file_order(box):
    r = box.call("SearchCity", {"state": "Illinois"})
    assert r.ok
    assert r.text == (
        "A SearchCity for state Illinois found the following 7 cities:\n"
        "Moline, Belleville, Bloomington, Champaign, Chicago, Rockford, Peoria"
    )


def test_search_city_washington_is_a_state_too(box):
    assert text(box, "SearchCity", state="Washington") == (
        "A SearchCity for state Washington found the following 7 cities:\n"
        "Seattle, Wenatchee, Pasco, Yakima, Walla Walla, Everett, Spokane"
    )


@pytest.mark.parametrize(
    "state,shown",
    [
        ("Banana", "Banana"),
        ("illinois", "illinois"),
        (" Illinois", " Illinois"),
        (5, "5"),
        (None, "None"),
        (True, "True"),
    ],
)
def test_search_city_unknown_state(box, state, shown):
    r = box.call("SearchCity", {"state": state})
    assert not r.ok
    assert r.text == f"There is no city in {shown}. " + RETHINK.format("city")


# --- SearchAccommodation --------------------------------------------------------------------
def test_search_accommodation_rockford(box):
    r = box.call("SearchAccommodation", {"city": "Rockford"})
    assert r.ok
    head, _, body = r.text.partition("\n")
    # 14 CSV rows; "Lower East Dream Room!" has no house rules, so it is invisible (official dropna)
    assert head == "A SearchAccommodation for Rockford found the following 13 accommodations:"
    entries = body.split("\n\n")
    assert len(entries) == 13
    assert entries[0] == (
        "1. [Spacious 3BDR Prime Location!] $1030.0. Room Type: Entire home/apt, "
        "House Rules: No smoking, Minimum Nights: 2.0, Maximum Occupancy: 9, Review Rate Number: 2.0"
    )
    assert entries[1] == (
        "2. [Private Room in a two bedroom apt.] $210.0. Room Type: Private room, "
        "House Rules: No visitors & No smoking, Minimum Nights: 1.0, Maximum Occupancy: 2, "
        "Review Rate Number: 4.0"
    )
    assert entries[-1] == (
        "13. [Midtown 2 Bed United Nations Loc, Full Kitchen] $245.0. Room Type: Entire home/apt, "
        "House Rules: No visitors, Minimum Nights: 3.0, Maximum Occupancy: 3, "
        "Review Rate Number: 4.0\n"
    )
    assert "Lower East Dream Room!" not in r.text


def test_search_accommodation_empty(box):
    r = box.call("SearchAccommodation", {"city": "Atlantis"})
    assert not r.ok
    assert r.text == "There is no accommodation in Atlantis. " + RETHINK.format("accommodation")


# --- SearchRestaurant ----------------------------------------------------------------------
def test_search_restaurant_rockford(box):
    t = text(box, "SearchRestaurant", city="Rockford")
    assert t.startswith(
        "A SearchRestaurant for city Rockford found the following 27 restaurants:\n"
        "1. [Coco Bambu] Avg. Cost $72. Cuisines: Tea, French, Bakery, BBQ, Cafe. Rating: 4.9\n\n"
        "2. [Flying Mango] Avg. Cost $20. Cuisines: American, BBQ, Seafood. Rating: 4.5\n\n"
        "3. [Gajalee Sea Food] Avg. Cost $49. Cuisines: Bakery, BBQ. Rating: 3.9\n\n"
    )
    assert t.endswith("27. [Chaophraya] Avg. Cost $74. Cuisines: Chinese, Pizza, Cafe, Desserts. Rating: 3.9\n")
    # both Subways of Rockford (CSV rows 5459 and 8455) are listed, in file order
    subways = [line for line in t.split("\n") if "[Subway]" in line]
    assert [s.split("Avg. Cost ")[1][:3] for s in subways] == ["$42", "$26"]
    assert "Rating: 0.0" in t  # Cafe Coffee Day: a zero rating is a float like the others


def test_search_restaurant_empty(box):
    assert text(box, "SearchRestaurant", city="Vancouver") == (
        "There is no restaurant in Vancouver. " + RETHINK.format("restaurant")
    )


# --- SearchAttraction -----------------------------------------------------------------------
def test_search_attraction_rockford(box):
    t = text(box, "SearchAttraction", city="Rockford")
    assert t.startswith(
        "A SearchAttraction for city Rockford found the following 20 attractions:\n"
        "1. [Burpee Museum of Natural History](http://www.burpee.org/) Address: 737 N Main St, "
        "Rockford, IL 61103, USA. Contact: (815) 965-3433\n\n"
        "2. [Midway Village Museum](https://www.midwayvillage.com/) Address: 6799 Guilford Rd, "
        "Rockford, IL 61107, USA. Contact: (815) 397-9112\n\n"
    )
    assert t.endswith(
        "20. [Ingersoll Centennial Park](http://rockfordparkdistrict.org/) Address: 315 S 1st St, "
        "Rockford, IL 61104, USA. Contact: (815) 987-8800\n"
    )


def test_search_attraction_city_without_attractions(box):
    # Arcata is a city-set city with accommodations and restaurants but no attractions
    assert text(box, "SearchAccommodation", city="Arcata").startswith("A SearchAccommodation for Arcata")
    assert text(box, "SearchAttraction", city="Arcata") == (
        "There is no attraction in Arcata. " + RETHINK.format("attraction")
    )


# --- SearchFlight ---------------------------------------------------------------------------
def test_search_flight_reference_row(box):
    r = box.call("SearchFlight", {"departure": "St. Petersburg", "destination": "Rockford", "date": "2022-03-16"})
    assert r.ok
    assert r.text == (
        "A SearchFlight for St. Petersburg to Rockford on 2022-03-16 found the following 1 flights:\n"
        "1. [F3573659] $474. Departure: 15:40, Arrival: 17:04, Actual Elapsed Time: 2 hours 24 minutes, "
        "Distance: 1049.0 miles\n"
    )


def test_search_flight_several_rows_are_numbered_in_file_order(box, world):
    rows = world.flights("Denver", "Las Vegas", "2022-03-14")
    assert len(rows) == 21
    t = text(box, "SearchFlight", departure="Denver", destination="Las Vegas", date="2022-03-14")
    assert t.startswith(
        "A SearchFlight for Denver to Las Vegas on 2022-03-14 found the following 21 flights:\n"
        "1. [F3563345] $148. Departure: 22:25, Arrival: 23:36, Actual Elapsed Time: 2 hours 11 minutes, "
        "Distance: 628.0 miles\n\n"
        "2. [F3563364] $293. Departure: 10:00, Arrival: 10:58, Actual Elapsed Time: 1 hours 58 minutes, "
        "Distance: 628.0 miles\n\n"
    )
    entries = t.split("\n", 1)[1].split("\n\n")
    assert [e.split(" ", 2)[:2] for e in entries] == [[f"{i}.", f"[{f.flight_number}]"] for i, f in enumerate(rows, 1)]


def test_search_flight_empty(box):
    r = box.call("SearchFlight", {"departure": "Rockford", "destination": "St. Petersburg", "date": "2022-03-17"})
    assert not r.ok
    assert r.text == (
        "There is no available flight from Rockford to St. Petersburg on 2022-03-17. " + RETHINK.format("flight")
    )


@pytest.mark.parametrize(
    "arguments",
    [
        {},
        {"departure": "A"},
        {"departure": "A", "destination": "B"},
        {"destination": "B", "date": "2022-03-01"},
        {"origin": "A", "destination": "B", "date": "2022-03-01"},
    ],
)
def test_search_flight_missing_parameter(box, arguments):
    r = box.call("SearchFlight", arguments)
    assert not r.ok
    assert r.text == "Invalid parameters. Please provide departure, destination and date."


# --- GoogleDistanceMatrix -------------------------------------------------------------------
@pytest.mark.parametrize(
    "mode,cost",
    [("driving", 57), ("self-driving", 57), ("Self-driving", 57), ("taxi", 1144), ("walking", 1144), ("", 1144)],
)
def test_distance_cost_by_mode(box, mode, cost):
    r = box.call("GoogleDistanceMatrix", {"departure": "Detroit", "destination": "Norfolk", "mode": mode})
    assert r.ok
    assert r.text == (
        "A GoogleDistanceMatrix found the following information:\n"
        f"{mode}, from Detroit to Norfolk, duration: 10 hours 55 mins, distance: 1,144 km, cost: ${cost}"
    )


def test_distance_mode_defaults_to_driving(box):
    assert text(box, "GoogleDistanceMatrix", departure="Detroit", destination="Norfolk").endswith(
        "\ndriving, from Detroit to Norfolk, duration: 10 hours 55 mins, distance: 1,144 km, cost: $57"
    )


def test_distance_decimal_kilometres(box):
    # Harlingen → Brownsville: "30 mins", "41.7 km": int(41.7 * 0.05) = 2, int(41.7) = 41
    assert text(box, "GoogleDistanceMatrix", departure="Harlingen", destination="Brownsville", mode="driving").endswith(
        "driving, from Harlingen to Brownsville, duration: 30 mins, distance: 41.7 km, cost: $2"
    )
    assert text(box, "GoogleDistanceMatrix", departure="Harlingen", destination="Brownsville", mode="taxi").endswith(
        "taxi, from Harlingen to Brownsville, duration: 30 mins, distance: 41.7 km, cost: $41"
    )


def test_distance_first_row_of_a_duplicated_pair_wins(box):
    # New York → Memphis appears twice: "16 hours 20 mins" (line 4044) then "16 hours 19 mins"
    assert "duration: 16 hours 20 mins, distance: 1,762 km, cost: $88" in text(
        box, "GoogleDistanceMatrix", departure="New York", destination="Memphis", mode="driving"
    )


def test_distance_empty_cells(box):
    r = box.call("GoogleDistanceMatrix", {"departure": "Killeen", "destination": "Mission", "mode": "driving"})
    assert not r.ok
    assert r.text == "Sorry, we cannot find the distance between Killeen and Mission."


def test_distance_more_than_a_day(box):
    r = box.call("GoogleDistanceMatrix", {"departure": "Hartford", "destination": "Denver", "mode": "taxi"})
    assert not r.ok
    assert r.text == (
        "The required time exceeds a single day, we cannot provide the cost. "
        "Please consider an alternative transportation instead."
    )


@pytest.mark.parametrize("dep,dst", [("Detroit", "Atlantis"), ("Detroit(Michigan)", "Norfolk"), ("detroit", "Norfolk")])
def test_distance_no_row(box, dep, dst):
    r = box.call("GoogleDistanceMatrix", {"departure": dep, "destination": dst, "mode": "driving"})
    assert not r.ok
    assert r.text == "No valid information found. Please rethink your distance search and try again."


@pytest.mark.parametrize("arguments", [{}, {"departure": "Detroit"}, {"destination": "Norfolk", "mode": "taxi"}])
def test_distance_missing_parameter(box, arguments):
    assert text(box, "GoogleDistanceMatrix", **arguments) == (
        "Invalid parameters. Please provide departure, destination and mode."
    )


@pytest.mark.parametrize("mode,kind", [(None, "NoneType"), (3, "int"), (1.5, "float")])
def test_distance_non_string_mode_fails_like_python(box, mode, kind):
    # the public code evaluates `"driving" in mode`, which raises TypeError for these
    r = box.call("GoogleDistanceMatrix", {"departure": "Detroit", "destination": "Norfolk", "mode": mode})
    assert not r.ok
    assert r.text == f"Tool calling error: argument of type '{kind}' is not iterable"
    # ... but only once a row is found: a missing pair answers first
    assert text(box, "GoogleDistanceMatrix", departure="X", destination="Y", mode=mode).startswith(
        "No valid information"
    )


# --- argument types (all tools) -------------------------------------------------------------
@pytest.mark.parametrize("value,shown", [(5, "5"), (None, "None"), (True, "True"), (1.5, "1.5"), (float("nan"), "nan")])
@pytest.mark.parametrize(
    "tool,noun,prefix",
    [
        ("SearchAccommodation", "accommodation", "There is no accommodation in "),
        ("SearchRestaurant", "restaurant", "There is no restaurant in "),
        ("SearchAttraction", "attraction", "There is no attraction in "),
    ],
)
def test_non_string_scalars_match_nothing_and_are_echoed(box, value, shown, tool, noun, prefix):
    r = box.call(tool, {"city": value})
    assert not r.ok
    assert r.text == f"{prefix}{shown}. " + RETHINK.format(noun)


def test_non_string_flight_arguments(box):
    assert text(box, "SearchFlight", departure=1, destination=None, date=20220316) == (
        "There is no available flight from 1 to None on 20220316. " + RETHINK.format("flight")
    )


@pytest.mark.parametrize(
    "tool,arguments",
    [
        ("SearchCity", {"state": ["Illinois"]}),
        ("SearchAccommodation", {"city": {"name": "Rockford"}}),
        ("SearchRestaurant", {"city": ["Rockford"]}),
        ("SearchAttraction", {"city": []}),
        ("SearchFlight", {"departure": "Rockford", "destination": ["A"], "date": "2022-03-16"}),
        ("GoogleDistanceMatrix", {"departure": "Detroit", "destination": "Norfolk", "mode": ["driving"]}),
    ],
)
def test_lists_and_objects_are_a_tool_calling_error(box, tool, arguments):
    r = box.call(tool, arguments)
    assert not r.ok
    assert r.text.startswith("Tool calling error: parameter '")
    assert "must be a string" in r.text


def test_arguments_that_are_not_an_object(box):
    r = box.call("SearchCity", ["Illinois"])
    assert not r.ok and r.text == "Tool calling error: arguments must be a JSON object, not an array"


def test_extra_arguments_are_ignored(box):
    assert text(box, "SearchCity", state="Illinois", page=2) == text(box, "SearchCity", state="Illinois")


# --- every city against a pandas re-implementation of the public tools ----------------------
class PandasStarTools:
    """Agent-STAR's tools as published: DataFrame filters over the raw CSVs, f-string lines."""

    def __init__(self, database):
        self.acc = pd.read_csv(database / "accommodations" / "clean_accommodations_2022.csv").dropna()[
            [
                "NAME",
                "price",
                "room type",
                "house_rules",
                "minimum nights",
                "maximum occupancy",
                "review rate number",
                "city",
            ]
        ]
        self.rest = pd.read_csv(database / "restaurants" / "clean_restaurant_2022.csv").dropna()[
            ["Name", "Average Cost", "Cuisines", "Aggregate Rating", "City"]
        ]
        self.attr = pd.read_csv(database / "attractions" / "attractions.csv").dropna()[
            ["Name", "Latitude", "Longitude", "Address", "Phone", "Website", "City"]
        ]
        self.dist = pd.read_csv(database / "googleDistanceMatrix" / "distance.csv")
        # `df[df.city == c]` per call is slow; splitting once keeps each group's file order
        self._acc = dict(tuple(self.acc.groupby("city", sort=False)))
        self._rest = dict(tuple(self.rest.groupby("City", sort=False)))
        self._attr = dict(tuple(self.attr.groupby("City", sort=False)))
        first = self.dist.drop_duplicates(["origin", "destination"], keep="first")
        self._dist = {
            (o, d): (dur, dist)
            for o, d, dur, dist in first[["origin", "destination", "duration", "distance"]].itertuples(index=False)
        }

    def accommodation(self, city):
        df = self._acc.get(city, self.acc.iloc[:0])
        if len(df) == 0:
            return f"There is no accommodation in {city}. Please rethink your accommodation search and try again."
        lines = [
            f"{i + 1}. [{r[0]}] ${r[1]}. Room Type: {r[2]}, House Rules: {r[3]}, Minimum Nights: {r[4]}, "
            f"Maximum Occupancy: {r[5]}, Review Rate Number: {r[6]}\n"
            for i, r in enumerate(df.itertuples(index=False))
        ]
        return f"A SearchAccommodation for {city} found the following {len(lines)} accommodations:\n" + "\n".join(lines)

    def restaurant(self, city):
        df = self._rest.get(city, self.rest.iloc[:0])
        if len(df) == 0:
            return f"There is no restaurant in {city}. Please rethink your restaurant search and try again."
        lines = [
            f"{i + 1}. [{r[0]}] Avg. Cost ${r[1]}. Cuisines: {r[2]}. Rating: {r[3]}\n"
            for i, r in enumerate(df.itertuples(index=False))
        ]
        return f"A SearchRestaurant for city {city} found the following {len(lines)} restaurants:\n" + "\n".join(lines)

    def attraction(self, city):
        df = self._attr.get(city, self.attr.iloc[:0])
        if len(df) == 0:
            return f"There is no attraction in {city}. Please rethink your attraction search and try again."
        lines = [
            f"{i + 1}. [{r[0]}]({r[5]}) Address: {r[3]}. Contact: {r[4]}\n"
            for i, r in enumerate(df.itertuples(index=False))
        ]
        return f"A SearchAttraction for city {city} found the following {len(lines)} attractions:\n" + "\n".join(lines)

    def distance(self, o, d, mode):
        if (o, d) not in self._dist:
            return "No valid information found. Please rethink your distance search and try again."
        dur, dist = self._dist[(o, d)]
        if pd.isna(dur) or pd.isna(dist):
            return f"Sorry, we cannot find the distance between {o} and {d}."
        km = eval(dist.replace("km", "").replace(",", "").strip())  # noqa: S307 - the public code's parsing
        cost = int(km * 0.05) if "driving" in mode else int(km)
        if "day" in dur:
            return (
                "The required time exceeds a single day, we cannot provide the cost. "
                "Please consider an alternative transportation instead."
            )
        return (
            f"A GoogleDistanceMatrix found the following information:\n{mode}, from {o} to {d}, duration: {dur}, "
            f"distance: {dist}, cost: ${cost}"
        )


@pytest.fixture(scope="module")
def pandas_tools(travelplanner_dir):
    return PandasStarTools(travelplanner_dir / "database")


def test_every_city_matches_the_pandas_tools(box, world, pandas_tools):
    cities = sorted({c.city for c in world.cities()} | set(pandas_tools.acc["city"]) | {"Bellingham", "Atlantis"})
    for city in cities:
        assert text(box, "SearchAccommodation", city=city) == pandas_tools.accommodation(city), city
        assert text(box, "SearchRestaurant", city=city) == pandas_tools.restaurant(city), city
        assert text(box, "SearchAttraction", city=city) == pandas_tools.attraction(city), city


def test_distance_pairs_match_the_pandas_tools(box, pandas_tools):
    rng = random.Random(7)
    pairs = list(pandas_tools._dist)
    sample = rng.sample(pairs, min(3000, len(pairs))) + [
        ("Killeen", "Mission"),
        ("Hartford", "Denver"),
        ("Harlingen", "Brownsville"),
    ]
    for o, d in sample:
        for mode in ("driving", "taxi", "self-driving"):
            assert text(box, "GoogleDistanceMatrix", departure=o, destination=d, mode=mode) == pandas_tools.distance(
                o, d, mode
            ), (o, d, mode)
