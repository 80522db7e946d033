"""The fully synthetic world: presets, determinism, official value domains, quirks, and that the
read API serves every city (so queries over it can be satisfied)."""

from __future__ import annotations

import os
import re
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from sqlalchemy import select

from services.sandbox.world import World, schema
from services.sandbox.world.build import build_synthetic_world
from services.sandbox.world.flights import parse_km
from services.sandbox.world.synthetic import (
    CUISINES,
    HOUSE_RULES,
    PRESETS,
    ROOM_TYPES,
    format_duration,
    format_km,
    generate_world,
    resolve_size,
)

DURATION_RE = re.compile(r"^(\d+ hours? \d+ mins?|\d+ mins?|\d+ days? \d+ hours?)$")
DISTANCE_RE = re.compile(r"^(\d{1,3}(,\d{3})*|\d+\.\d) km$")
PHONE_RE = re.compile(r"^(\(\d{3}\) \d{3}-\d{4}|Unknown)$")
WEBSITE_RE = re.compile(r"^(https?://\S+/|Unknown)$")
FLIGHT_NUMBER_RE = re.compile(r"^F\d{7}$")
HHMM_RE = re.compile(r"^([01]\d|2[0-3]):[0-5]\d$")


def _build(tmp_path: Path, name: str, **kw) -> tuple[World, dict]:
    url = f"sqlite:///{tmp_path / (name + '.sqlite')}"
    meta = build_synthetic_world(url, **kw)
    return World(url), meta


def _dump(world: World, table: str) -> list[tuple]:
    t = schema.TABLES[table]
    with world.engine.connect() as conn:
        return [tuple(r) for r in conn.execute(select(t).order_by(t.c.id))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    world, meta = _build(tmp_path_factory.mktemp("tiny"), "tiny", size="tiny", seed=0)
    yield world, meta
    world.close()


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    world, meta = _build(tmp_path_factory.mktemp("small"), "small", size="small", seed=1)
    yield world, meta
    world.close()


@pytest.fixture(scope="module")
def medium(tmp_path_factory):
    world, meta = _build(tmp_path_factory.mktemp("medium"), "medium", size="medium", seed=2)
    yield world, meta
    world.close()


# --- formats -------------------------------------------------------------------------------------------
def test_google_style_strings():
    assert format_km(41.74) == "41.7 km" and format_km(693.2) == "693 km" and format_km(1144.4) == "1,144 km"
    assert format_duration(45) == "45 mins" and format_duration(1) == "1 min"
    assert format_duration(61) == "1 hour 1 min" and format_duration(655) == "10 hours 55 mins"
    assert format_duration(26 * 60 + 10) == "1 day 2 hours" and format_duration(49 * 60) == "2 days 1 hour"
    assert format_duration(24 * 60 + 5) == "1 day 0 hours"
    for m in range(1, 4000, 7):
        assert DURATION_RE.match(format_duration(m))


def test_size_resolution():
    assert resolve_size("tiny")[1]["cities"] == PRESETS["tiny"]["cities"]
    label, params = resolve_size({"preset": "small", "cities": 9, "states": 3})
    assert (
        label == "small+custom" and params["cities"] == 9 and params["restaurants"] == PRESETS["small"]["restaurants"]
    )
    with pytest.raises(ValueError, match="unknown world size"):
        resolve_size("huge")
    with pytest.raises(ValueError, match="unknown size keys"):
        resolve_size({"citys": 3})
    with pytest.raises(ValueError, match="one city per state"):
        resolve_size({"cities": 2, "states": 3})


# --- presets -----------------------------------------------------------------------------------------------
def test_tiny_is_tiny_and_fast(tiny):
    world, meta = tiny
    assert meta["kind"] == "synthetic" and meta["size"] == "tiny" and meta["seed"] == 0
    assert meta["seconds"] < 5
    counts = world.counts()
    assert counts == meta["visible_rows"]
    assert counts["cities"] == 6 and meta["states"] == 2
    cities = world.cities()
    for c in cities:
        assert 3 <= len(world.accommodations(c.city)) <= 4
        assert 4 <= len(world.restaurants(c.city)) <= 6
        assert 2 <= len(world.attractions(c.city)) <= 4
    assert counts["distances"] == 6 * 5 + 1  # every ordered pair, plus one duplicate row
    assert 1_000 <= counts["flights"] <= 3_000
    assert meta["rows"]["accommodations"] == counts["accommodations"] + 1  # one invisible row


def test_small_and_medium_counts(small, medium):
    for (world, meta), lo_hi in (
        (
            small,
            dict(
                cities=(16, 16),
                accommodations=(60, 130),
                restaurants=(96, 192),
                attractions=(40, 130),
                distances=(240, 250),
                flights=(15_000, 23_000),
            ),
        ),
        (
            medium,
            dict(
                cities=(60, 60),
                accommodations=(600, 1_000),
                restaurants=(700, 1_800),
                attractions=(280, 900),
                distances=(3_000, 3_000),
                flights=(170_000, 205_000),
            ),
        ),
    ):
        counts = world.counts()
        assert counts == meta["visible_rows"]
        for table, (lo, hi) in lo_hi.items():
            assert lo <= counts[table] <= hi, (meta["size"], table, counts[table])
        assert meta["rows"]["accommodations"] > counts["accommodations"]  # invisible rows exist


def test_dict_overrides(tmp_path):
    world, meta = _build(
        tmp_path,
        "custom",
        size={"preset": "tiny", "cities": 9, "states": 3, "flights_per_day": 30, "dates": ("2022-04-01", "2022-04-03")},
        seed=5,
    )
    try:
        assert meta["size"] == "tiny+custom" and meta["params"]["cities"] == 9
        assert len(world.cities()) == 9 and len({c.state for c in world.cities()}) == 3
        with world.engine.connect() as conn:
            dates = {r[0] for r in conn.execute(select(schema.flights.c.flight_date).distinct())}
        assert dates == {"2022-04-01", "2022-04-02", "2022-04-03"}
        assert 40 <= meta["rows"]["flights"] <= 150
    finally:
        world.close()


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("STAR_RUN_SLOW"), reason="full-size world (~1 min); set STAR_RUN_SLOW=1")
def test_full_preset_has_benchmark_scale(tmp_path):
    world, meta = _build(tmp_path, "full", size="full", seed=0)
    try:
        c = world.counts()
        assert c["cities"] == 312 and meta["states"] == 64
        assert 4_500 <= meta["rows"]["accommodations"] <= 5_600
        assert 9_000 <= c["restaurants"] <= 10_000
        assert 5_000 <= c["attractions"] <= 5_600
        assert c["distances"] == 17_602
        assert c["flights"] >= 3_800_000
        assert sum(1 for x in world.cities() if not x.searchable) == 1
        assert sum(1 for x in world.cities() if not world.attractions(x.city)) == 35
    finally:
        world.close()


# --- determinism -------------------------------------------------------------------------------------------
def test_same_seed_same_world_different_seed_different(tmp_path, small):
    again, _ = _build(tmp_path, "again", size="small", seed=1)
    other, _ = _build(tmp_path, "other", size="small", seed=2)
    try:
        for table in schema.TABLES:
            assert _dump(again, table) == _dump(small[0], table), table
        assert _dump(other, "cities") != _dump(small[0], "cities")
        assert _dump(other, "flights") != _dump(small[0], "flights")
    finally:
        again.close()
        other.close()


def test_generation_is_deterministic_in_memory():
    a, b = generate_world("small", seed=9), generate_world("small", seed=9)
    assert (a.cities, a.accommodations, a.restaurants, a.attractions, a.distances) == (
        b.cities,
        b.accommodations,
        b.restaurants,
        b.attractions,
        b.distances,
    )


# --- value domains -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["tiny", "small", "medium"])
def test_value_domains(which, request):
    world, meta = request.getfixturevalue(which)
    cities = world.cities()
    names = [c.city for c in cities]
    assert len(set(names)) == len(names)
    for n in names:  # valid tool arguments
        assert n == n.strip() and "," not in n and "(" not in n and re.match(r"^[A-Z][A-Za-z. ']+$", n)
    by_state = defaultdict(list)
    for c in cities:
        by_state[c.state].append(c.city)
    for state, members in by_state.items():
        assert world.cities_in_state(state) == members
        assert state not in names
    city_set = set(names)

    for a in _dump(world, "accommodations"):
        _id, name, price, room, rules, min_n, occ, review, city, visible = a
        if not visible:
            assert None in a
            continue
        assert room in ROOM_TYPES and city
        assert 50.0 <= price <= 1200.0 and float(price).is_integer()
        parts = rules.split(" & ")
        assert set(parts) <= set(HOUSE_RULES) and len(parts) == len(set(parts)) >= 1
        assert min_n in {1.0, 2.0, 3.0, 4.0, 5.0, 7.0, 10.0, 14.0, 30.0}
        assert 1 <= occ <= 11 and (occ == 1 if room == "Shared room" else True)
        assert review in {1.0, 2.0, 3.0, 4.0, 5.0}
        assert name == name.strip() and len(name) > 3

    src = [r[1] for r in _dump(world, "restaurants")]
    assert src == list(range(len(src)))  # the unnamed index column: source row numbers
    for r in _dump(world, "restaurants"):
        _id, _src, name, cost, cuisines, rating, city, visible = r
        if not visible:
            assert None in r
            continue
        labels = cuisines.split(", ")
        assert set(labels) <= set(CUISINES) and 2 <= len(labels) <= 6 and len(set(labels)) == len(labels)
        assert 10 <= cost <= 250 and isinstance(cost, int)
        assert rating == 0.0 or 1.8 <= rating <= 4.9
        assert round(rating, 1) == rating

    for t in _dump(world, "attractions"):
        _id, name, lat, lon, address, phone, website, city, visible = t
        if not visible:
            assert None in t
            continue
        assert -90 <= lat <= 90 and -180 <= lon <= 180
        assert address.endswith(", USA") and f", {city}, " in address
        assert PHONE_RE.match(phone) and WEBSITE_RE.match(website)

    for _id, o, d, dur, dist in _dump(world, "distances"):
        assert o != d
        assert (dur is None) == (dist is None)
        if dur is not None:
            assert DURATION_RE.match(dur) and DISTANCE_RE.match(dist)
    for f in world.flights(names[0], names[-1], "2022-03-03") + world.flights(names[-1], names[0], "2022-03-04"):
        assert FLIGHT_NUMBER_RE.match(f.flight_number) and HHMM_RE.match(f.dep_time) and HHMM_RE.match(f.arr_time)
        assert f.origin in city_set and f.dest in city_set and isinstance(f.distance, float)


def test_house_rules_and_cuisines_cover_the_vocabulary(medium):
    rows = _dump(medium[0], "accommodations")
    rules = Counter(x for r in rows if r[-1] for x in r[4].split(" & "))
    assert set(rules) == set(HOUSE_RULES)
    rooms = Counter(r[3] for r in rows if r[-1])
    assert set(rooms) == set(ROOM_TYPES) and rooms["Shared room"] < rooms["Private room"]
    labels = Counter(x for r in _dump(medium[0], "restaurants") if r[-1] for x in r[4].split(", "))
    assert set(labels) == set(CUISINES)


# --- the read API serves every city; typical queries can be satisfied -----------------------------------
@pytest.mark.parametrize("which", ["tiny", "small", "medium"])
def test_every_city_is_served(which, request):
    world, meta = request.getfixturevalue(which)
    cities = world.cities()
    without_attractions = [c.city for c in cities if not world.attractions(c.city)]
    assert len(without_attractions) == meta["params"]["cities_without_attractions"]
    flown_from = set()
    with world.engine.connect() as conn:
        for (o,) in conn.execute(select(schema.flights.c.origin).distinct()):
            flown_from.add(o)
    for c in cities:
        accs = world.accommodations(c.city)
        rests = world.restaurants(c.city)
        assert accs and rests, c
        assert all(a.city == c.city for a in accs) and all(r.city == c.city for r in rests)
        # an entire home for 4, a private room, 1-night minimum, and for every house rule a place without it
        assert any(
            a.room_type == "Entire home/apt" and a.maximum_occupancy >= 4 and a.minimum_nights == 1 for a in accs
        )
        assert any(a.room_type == "Private room" and a.minimum_nights == 1 for a in accs)
        for rule in HOUSE_RULES:
            assert any(rule not in a.house_rules for a in accs), (c, rule)
        covered = {x for r in rests for x in r.cuisines.split(", ")}
        assert len(covered) >= min(15, 2 * len(rests))
        assert c.city in flown_from, c
    # cities in one state are within a day's drive of each other
    by_state = defaultdict(list)
    for c in cities:
        by_state[c.state].append(c.city)
    for members in by_state.values():
        for a in members:
            for b in members:
                if a != b:
                    d = world.distance(a, b)
                    assert d is not None and d.duration is not None and "day" not in d.duration, (a, b)


def test_flights_agree_with_the_synthetic_distance_table(small):
    world = small[0]
    cities = [c.city for c in world.cities()]
    checked = 0
    for o in cities:
        for d in cities:
            row = world.distance(o, d)
            if o == d or row is None or row.distance is None:
                continue
            km = parse_km(row.distance)
            flights = world.flights(o, d, "2022-03-15") + world.flights(o, d, "2022-03-16")
            if km < 150:
                assert not flights
            for f in flights:
                assert 1.05 <= km / 1.609344 / f.distance <= 1.33
                checked += 1
    assert checked > 50


# --- quirks ----------------------------------------------------------------------------------------------
def test_quirks_first_distance_row_wins(small):
    world = small[0]
    rows = _dump(world, "distances")
    first: dict[tuple[str, str], tuple] = {}
    dup_conflicts = 0
    for _id, o, d, dur, dist in rows:
        if (o, d) in first:
            if first[(o, d)] != (dur, dist):
                dup_conflicts += 1
                got = world.distance(o, d)
                assert (got.duration, got.distance) == first[(o, d)]
            continue
        first[(o, d)] = (dur, dist)
    assert len(rows) - len(first) == PRESETS["small"]["duplicate_distance_rows"]
    assert dup_conflicts >= 1


def test_quirks_in_medium(medium):
    world, meta = medium
    rows = _dump(world, "distances")
    assert any(r[3] is None for r in rows)  # an island state: no road to the mainland
    acc_cities = {r[8] for r in _dump(world, "accommodations")}
    city_set = {c.city for c in world.cities()}
    extras = acc_cities - city_set - {None}
    assert len(extras) == meta["params"]["extra_cities"]  # in the tables, not in the city set
    flights = _dump(world, "flights")
    invisible = [f for f in flights if not f[-1]]
    assert len(invisible) == meta["params"]["invisible_flights"] and all(f[2] is None for f in invisible)
