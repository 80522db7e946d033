"""World read API + the official loader on the real TravelPlanner data, in SQLite and PostgreSQL:
visible counts, exact matching, first-row-wins distances, both directory layouts, user flights CSVs,
and clear errors for wrong directories."""

from __future__ import annotations

import csv
import uuid
from pathlib import Path

import pandas as pd
import pytest
from sqlalchemy import create_engine, select, text

from services.sandbox.world import World, schema
from services.sandbox.world.build import build_official_world
from services.sandbox.world.loader import OfficialLayout, WorldSourceError, read_flights_csv

REAL_COUNTS = {"cities": 312, "accommodations": 4_285, "restaurants": 9_551, "attractions": 5_302, "distances": 17_602}
FLIGHT_HEADER = [
    "Flight Number",
    "Price",
    "DepTime",
    "ArrTime",
    "ActualElapsedTime",
    "FlightDate",
    "OriginCityName",
    "DestCityName",
    "Distance",
]
FLIGHT_ROWS = [
    ["F3573659", 474, "15:40", "17:04", "2 hours 24 minutes", "2022-03-16", "St. Petersburg", "Rockford", 1049.0],
    ["F3927581", 89, "11:03", "13:31", "2 hours 28 minutes", "2022-03-13", "Washington", "Myrtle Beach", 372.0],
    ["F3792603", 164, "09:19", "10:59", "1 hours 40 minutes", "2022-03-13", "Washington", "Myrtle Beach", 372.0],
    ["F0000001", "", "09:00", "10:00", "1 hours 0 minutes", "2022-03-13", "Washington", "Myrtle Beach", 372.0],
]


@pytest.fixture(scope="module")
def database(travelplanner_dir: Path) -> Path:
    return travelplanner_dir / "database"


@pytest.fixture(scope="module")
def conflicting_pair(database: Path) -> tuple[str, str, str, str]:
    """A distance pair listed twice with different values in the real CSV, and its FIRST row's values."""
    df = pd.read_csv(database / "googleDistanceMatrix" / "distance.csv")
    for (o, d), grp in df.groupby(["origin", "destination"], sort=False):
        vals = grp[["duration", "distance"]].dropna()
        if len(grp) > 1 and len(vals) == len(grp) and len(vals.drop_duplicates()) > 1:
            first = grp.iloc[0]
            return o, d, first["duration"], first["distance"]
    pytest.fail("the real distance table has no conflicting duplicate pair")


def _check_real_world(world: World, conflicting_pair) -> None:
    counts = world.counts()
    for table, n in REAL_COUNTS.items():
        assert counts[table] == n, table
    cities = world.cities()
    assert len(cities) == 312 and sum(c.searchable for c in cities) == 311
    assert [c.city for c in cities if not c.searchable] == ["Jackson"]
    assert cities[0].city == "San Diego" and cities[-1].city == "Eau Claire"
    assert world.cities_in_state("Washington") == [
        "Seattle",
        "Wenatchee",
        "Pasco",
        "Yakima",
        "Walla Walla",
        "Everett",
        "Spokane",
    ]
    assert world.cities_in_state("washington") == [] and world.cities_in_state("None") == []

    # exact, case-sensitive, untrimmed matching
    assert world.accommodations("Rockford") and world.restaurants("Rockford") and world.attractions("Rockford")
    for bad in ("rockford", " Rockford", "Rockford ", "ROCKFORD", "Rockford(Illinois)"):
        assert world.accommodations(bad) == [] and world.restaurants(bad) == [] and world.attractions(bad) == []
    assert world.distance("Detroit", "Norfolk").distance == "1,144 km"
    assert world.distance("detroit", "Norfolk") is None and world.distance("Detroit ", "Norfolk") is None

    # values and order as in the files
    acc = world.accommodations("Rockford")
    assert all(a.city == "Rockford" and a.house_rules for a in acc)  # empty house rules are invisible
    rest = world.restaurants("Rockford")
    assert [r.src_index for r in rest] == sorted(r.src_index for r in rest)
    assert sum(1 for r in rest if r.name == "Subway") == 2  # duplicate (Name, City) pairs stay
    assert world.restaurants("Binghamton")[0][:2] == (0, "Le Petit Souffle")
    assert world.attractions("San Diego")[0].name == "Cabrillo National Monument"
    assert world.attractions("Arcata") == []  # a city-set city without attractions

    # duplicate distance pairs: the first row wins
    o, d, dur, dist = conflicting_pair
    got = world.distance(o, d)
    assert (got.duration, got.distance) == (dur, dist)
    empty = world.distance("Killeen", "Mission")  # a row with empty cells exists but has no values
    assert empty is not None and empty.duration is None and empty.distance is None

    # the reference flights are there, and a covered "no flight" triple stays empty
    dh = world.flights("Dallas", "Houston", "2022-03-11")
    assert len(dh) == 33 and all(f.flight_date == "2022-03-11" for f in dh)
    assert world.flight_by_number("F3573659")[0].dest == "Rockford"
    for o, d, day in (("Abilene", "Amarillo", "2022-03-03"), ("Amarillo", "Baton Rouge", "2022-03-05")):
        assert world.flights(o, d, day) == []  # the reference says "There is no flight ..."
    assert world.flights("dallas", "Houston", "2022-03-11") == []


# --- SQLite ---------------------------------------------------------------------------------------------------
@pytest.mark.usefixtures("full_travelplanner_dir")
def test_official_world_in_sqlite(official_world, conflicting_pair):
    _check_real_world(official_world, conflicting_pair)
    meta = official_world.meta()
    assert meta["kind"] == "official" and meta["flights"].startswith("synthetic")


@pytest.mark.usefixtures("full_travelplanner_dir")
def test_invisible_rows_are_stored_but_hidden(official_world):
    with official_world.engine.connect() as conn:
        t = schema.accommodations
        total = conn.execute(select(t.c.id)).all()
        hidden = conn.execute(select(t).where(t.c.visible.is_(False))).all()
    assert len(total) == 5_047 and len(hidden) == 5_047 - 4_285
    assert all(None in tuple(row) for row in hidden)
    assert sum(1 for row in hidden if row.house_rules is None) == 710


@pytest.mark.usefixtures("full_travelplanner_dir")
def test_flat_agent_star_layout(tmp_path: Path, database: Path, conflicting_pair):
    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / "background").symlink_to(database / "background", target_is_directory=True)
    for rel in (
        "accommodations/clean_accommodations_2022.csv",
        "restaurants/clean_restaurant_2022.csv",
        "attractions/attractions.csv",
        "googleDistanceMatrix/distance.csv",
    ):
        (flat / Path(rel).name).symlink_to(database / rel)
    layout = OfficialLayout.find(flat)
    assert layout.accommodations.parent == flat and layout.flights is None
    url = f"sqlite:///{tmp_path / 'flat.sqlite'}"
    meta = build_official_world(url, flat, synthesize_flights=False)
    assert meta["flights"] == "none" and meta["flight_rows"] == 0
    world = World(url)
    try:
        counts = world.counts()
        assert {k: counts[k] for k in REAL_COUNTS} == REAL_COUNTS and counts["flights"] == 0
        o, d, dur, dist = conflicting_pair
        assert world.distance(o, d).distance == dist
    finally:
        world.close()


def test_parent_of_database_is_accepted(travelplanner_dir: Path):
    layout = OfficialLayout.find(travelplanner_dir)
    assert layout.root == travelplanner_dir / "database"
    assert layout.city_set is not None and layout.city_states.name == "citySet_with_states.txt"


def _write_flights(path: Path, *, index_column: str | None = None) -> None:
    """index_column: None (official header), "extra" (a leading unnamed 0..n index), or "number"
    (an old file whose unnamed first column holds the flight number)."""
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        if index_column == "number":
            w.writerow([""] + FLIGHT_HEADER[1:])
            w.writerows(FLIGHT_ROWS)
        elif index_column == "extra":
            w.writerow([""] + FLIGHT_HEADER)
            w.writerows([[i] + row for i, row in enumerate(FLIGHT_ROWS)])
        else:
            w.writerow(FLIGHT_HEADER)
            w.writerows(FLIGHT_ROWS)


@pytest.mark.parametrize("variant", [None, "extra", "number"])
def test_user_flights_csv(tmp_path: Path, database: Path, variant):
    csv_path = tmp_path / "clean_Flights_2022.csv"
    _write_flights(csv_path, index_column=variant)
    rows = list(read_flights_csv(csv_path))
    assert [r[0] for r in rows] == ["F3573659", "F3927581", "F3792603", "F0000001"]
    assert [r[-1] for r in rows] == [True, True, True, False]  # the empty price makes the last row invisible
    assert rows[0][1:9] == (
        474,
        "15:40",
        "17:04",
        "2 hours 24 minutes",
        "2022-03-16",
        "St. Petersburg",
        "Rockford",
        1049.0,
    )
    assert type(rows[0][1]) is int and type(rows[0][8]) is float

    url = f"sqlite:///{tmp_path / 'user.sqlite'}"
    meta = build_official_world(url, database, flights_csv=csv_path)
    assert meta["flights"] == "csv:clean_Flights_2022.csv" and meta["flight_rows"] == 4
    world = World(url)
    try:
        assert world.counts()["flights"] == 3
        got = world.flights("Washington", "Myrtle Beach", "2022-03-13")
        assert [f.flight_number for f in got] == ["F3927581", "F3792603"]  # file order, invisible row hidden
        assert world.flight_by_number("F0000001") == []
        assert world.flights("Washington", "Myrtle Beach", "2022-03-14") == []
    finally:
        world.close()


def test_flights_file_in_the_directory_is_used(tmp_path: Path, database: Path):
    root = tmp_path / "db"
    root.mkdir()
    for sub in ("background", "accommodations", "restaurants", "attractions", "googleDistanceMatrix"):
        (root / sub).symlink_to(database / sub, target_is_directory=True)
    (root / "flights").mkdir()
    _write_flights(root / "flights" / "clean_Flights_2022.csv")
    url = f"sqlite:///{tmp_path / 'dir.sqlite'}"
    meta = build_official_world(url, root)
    assert meta["flights"] == "csv:clean_Flights_2022.csv"
    world = World(url)
    try:
        assert world.counts()["flights"] == 3
    finally:
        world.close()


def test_wrong_directory_is_a_clear_error(tmp_path: Path):
    url = f"sqlite:///{tmp_path / 'x.sqlite'}"
    with pytest.raises(WorldSourceError, match="not a TravelPlanner database") as err:
        build_official_world(url, tmp_path / "does-not-exist")
    assert "does-not-exist" in str(err.value)
    (tmp_path / "half" / "background").mkdir(parents=True)
    (tmp_path / "half" / "background" / "citySet_with_states.txt").write_text("Rockford\tIllinois")
    with pytest.raises(WorldSourceError, match="clean_accommodations_2022.csv"):
        build_official_world(url, tmp_path / "half")
    (tmp_path / "bad").mkdir()
    bad_csv = tmp_path / "bad" / "flights.csv"
    bad_csv.write_text("a,b\n1,2\n")
    with pytest.raises(WorldSourceError, match="missing columns"):
        list(read_flights_csv(bad_csv))


# --- PostgreSQL -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pg_world(pg_url: str, database: Path, travelplanner_dir: Path):
    """The official world built into a schema of its own (safe beside parallel test runs)."""
    name = f"star_test_{uuid.uuid4().hex[:10]}"
    admin = create_engine(pg_url)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{name}"'))
    url = f"{pg_url}{'&' if '?' in pg_url else '?'}options=-csearch_path%3D{name}"
    try:
        meta = build_official_world(
            url, database, seed=0, flight_scale=0.01, ref_info=[travelplanner_dir / "train" / "train_ref_info.jsonl"]
        )
        world = World(url)
        yield world, meta, name
        world.close()
    finally:
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{name}" CASCADE'))
        admin.dispose()


@pytest.mark.usefixtures("full_travelplanner_dir")
@pytest.mark.postgres
def test_official_world_in_postgres(pg_world, conflicting_pair, official_world):
    world, meta, name = pg_world
    with world.engine.connect() as conn:
        assert conn.execute(text("select current_schema()")).scalar() == name
        tables = {
            r[0] for r in conn.execute(text("select tablename from pg_tables where schemaname = :s"), {"s": name})
        }
    assert set(schema.TABLES) <= tables
    _check_real_world(world, conflicting_pair)
    assert world.is_ready() and world.meta()["flight_scale"] == 0.01
    assert 313 + 30_000 <= world.counts()["flights"] <= 313 + 46_000
    # the same answers as SQLite for the real tables
    for city in ("Rockford", "San Diego", "Charlotte Amalie", "Jackson"):
        assert world.accommodations(city) == official_world.accommodations(city)
        assert world.restaurants(city) == official_world.restaurants(city)
        assert world.attractions(city) == official_world.attractions(city)
    assert world.flights("Las Vegas", "Denver", "2022-03-12") == official_world.flights(
        "Las Vegas", "Denver", "2022-03-12"
    )
