"""Conformance with the released TravelPlanner reference information, query by query.

For each train query (all 45 with the full data, the fixture's subset without) and each entry of its
reference information:
- `Attractions/Restaurants/Accommodations in X`: the world's rows equal the typed rows of
  train_ref_info.jsonl, and the official-dialect text equals train.json's Content exactly
  (restaurants with the CSV index, as that tool version printed them);
- `Self-driving/Taxi from A to B`: the official distance text equals the Content;
- `Flight from A to B on D`: the table renderer on the reference rows equals the Content; a world
  holding exactly the reference flights answers with the Content; and the default world (with
  generated flights, which must contain exactly the reference rows on covered triples) too.
"""

from __future__ import annotations

import ast
import json

import pytest

from services.sandbox.tools import ToolBox, official
from services.sandbox.world import loader

N_TRAIN = 45

# official column names of each table, in world row order (restaurants: without src_index)
ATTRACTION_KEYS = ["Name", "Latitude", "Longitude", "Address", "Phone", "Website", "City"]
RESTAURANT_KEYS = ["Name", "Average Cost", "Cuisines", "Aggregate Rating", "City"]
ACCOMMODATION_KEYS = [
    "NAME",
    "price",
    "room type",
    "house_rules",
    "minimum nights",
    "maximum occupancy",
    "review rate number",
    "city",
]
FLIGHT_KEYS = list(loader.FLIGHT_COLUMNS)


@pytest.fixture(scope="module")
def train(travelplanner_dir):
    """[(contents: {description: text}, typed: {description: rows | text})], one per train query."""
    queries = json.loads((travelplanner_dir / "train" / "train.json").read_text(encoding="utf-8"))
    with open(travelplanner_dir / "train" / "train_ref_info.jsonl", encoding="utf-8") as fh:
        typed = [json.loads(line) for line in fh if line.strip()]
    out = []
    for q, t in zip(queries, typed, strict=True):
        entries = ast.literal_eval(q["reference_information"])
        contents = {e["Description"]: e["Content"] for e in entries}
        assert list(contents) == list(t), "train.json and train_ref_info.jsonl disagree on descriptions"
        out.append((contents, t))
    return out


@pytest.fixture(scope="module")
def ref_world(reference_world):
    return reference_world


def as_records(rows, keys, skip=0):
    return [dict(zip(keys, tuple(r)[skip:], strict=True)) for r in rows]


def assert_same_records(got, expected, where):
    assert len(got) == len(expected), f"{where}: {len(got)} rows, reference has {len(expected)}"
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"{where}, row {i}: {g} != {e}"
        for k in e:  # typed equality: 2 == 2.0 would hide a wrong column type
            assert type(g[k]) is type(e[k]), f"{where}, row {i}, {k}: {type(g[k]).__name__} vs {type(e[k]).__name__}"


def split_route(rest):
    origin, _, dest = rest.partition(" to ")
    return origin, dest


def split_flight(description):
    route, _, date = description[len("Flight from ") :].rpartition(" on ")
    return (*split_route(route), date)


def test_every_kind_of_reference_entry(train):
    kinds = {d.split(" ")[0] for contents, _ in train for d in contents}
    assert kinds == {"Attractions", "Restaurants", "Accommodations", "Flight", "Self-driving", "Taxi"}


def test_the_train_split_is_complete(train, full_travelplanner_dir):
    """The whole split: 45 queries, 61 flight tables among their reference entries (full data only)."""
    assert len(train) == N_TRAIN
    assert sum(isinstance(expected, list) for _, _, expected in _flight_entries(train)) == 61


def test_city_tables_and_distances(train, ref_world):
    for q in range(len(train)):
        _check_city_tables_and_distances(q, train, ref_world)


def _check_city_tables_and_distances(q, train, ref_world):
    """Query q's place and distance entries: the world's rows and the official text."""
    box = ToolBox(ref_world, dialect="official", cache_size=0, restaurant_index=True)
    contents, typed = train[q]
    checked = 0
    for description, content in contents.items():
        expected = typed[description]
        kind, _, rest = description.partition(" in ")
        if kind == "Attractions":
            assert_same_records(as_records(ref_world.attractions(rest), ATTRACTION_KEYS), expected, description)
            assert box.call("SearchAttraction", {"city": rest}).text == content, description
        elif kind == "Restaurants":
            assert_same_records(as_records(ref_world.restaurants(rest), RESTAURANT_KEYS, skip=1), expected, description)
            assert box.call("SearchRestaurant", {"city": rest}).text == content, description
        elif kind == "Accommodations":
            assert_same_records(as_records(ref_world.accommodations(rest), ACCOMMODATION_KEYS), expected, description)
            assert box.call("SearchAccommodation", {"city": rest}).text == content, description
        elif description.startswith(("Self-driving from ", "Taxi from ")):
            mode, _, route = description.partition(" from ")
            origin, dest = split_route(route)
            r = box.call("GoogleDistanceMatrix", {"departure": origin, "destination": dest, "mode": mode.lower()})
            assert r.text == content == expected, description
        else:
            assert description.startswith("Flight from "), description
            continue
        checked += 1
    assert checked >= 5, f"train query {q + 1}: {checked} entries checked"


def _flight_entries(train):
    for contents, typed in train:
        for description, content in contents.items():
            if description.startswith("Flight from "):
                yield description, content, typed[description]


def test_flight_renderer_on_reference_rows(train):
    n = 0
    for description, content, expected in _flight_entries(train):
        if isinstance(expected, list):
            rows = [tuple(rec[k] for k in FLIGHT_KEYS) for rec in expected]
            assert official.flights_table(rows) == content, description
            n += 1
        else:
            origin, dest, date = split_flight(description)
            assert content == expected == f"There is no flight from {origin} to {dest} on {date}."
    assert n > 0


def test_flights_of_a_world_holding_the_reference_rows(train, ref_world):
    box = ToolBox(ref_world, dialect="official", cache_size=0)
    for description, content, expected in _flight_entries(train):
        origin, dest, date = split_flight(description)
        rows = ref_world.flights(origin, dest, date)
        assert_same_records(as_records(rows, FLIGHT_KEYS), expected if isinstance(expected, list) else [], description)
        assert box.call("FlightSearch", {"departure": origin, "destination": dest, "date": date}).text == content


@pytest.fixture(scope="module")
def default_world(request):
    pytest.importorskip("services.sandbox.world.flights", reason="the flights generator is not in this checkout")
    return request.getfixturevalue("official_world")


def test_flights_of_the_default_world(train, default_world):
    """Generated flights: covered triples hold exactly the reference rows (needs the generator)."""
    official_world = default_world
    meta = official_world.meta()
    if not str(meta.get("flights", "")).startswith(("synthetic", "csv")):
        pytest.skip(f"the default world has no flights ({meta.get('flights')})")
    box = ToolBox(official_world, dialect="official", cache_size=0)
    for description, content, expected in _flight_entries(train):
        origin, dest, date = split_flight(description)
        rows = official_world.flights(origin, dest, date)
        assert_same_records(as_records(rows, FLIGHT_KEYS), expected if isinstance(expected, list) else [], description)
        assert box.call("FlightSearch", {"departure": origin, "destination": dest, "date": date}).text == content
