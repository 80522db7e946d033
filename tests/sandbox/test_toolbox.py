"""ToolBox: dispatch, aliases, cache, counters, fault injection, hostile input, the tool registry."""

from __future__ import annotations

import json
import sqlite3
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import given, settings, strategies as st

from services.sandbox.tools import BackendError, ToolBox, UnknownTool
from services.sandbox.tools.faults import FaultInjector, fault_text, keyed_uniform
from services.sandbox.tools.registry import ALIASES, TOOLS, resolve_tool, tool_schemas
from services.sandbox.world import World
from services.sandbox.world.build import build_official_world

NAMES = [
    "SearchFlight",
    "GoogleDistanceMatrix",
    "SearchAccommodation",
    "SearchRestaurant",
    "SearchAttraction",
    "SearchCity",
]
SAMPLE_CALLS = [
    ("SearchCity", {"state": "Illinois"}),
    ("SearchCity", {"state": "Atlantis"}),
    ("SearchAccommodation", {"city": "Rockford"}),
    ("SearchRestaurant", {"city": "Rockford"}),
    ("SearchAttraction", {"city": "Rockford"}),
    ("SearchAttraction", {"city": "Arcata"}),
    ("GoogleDistanceMatrix", {"departure": "Detroit", "destination": "Norfolk", "mode": "taxi"}),
    ("GoogleDistanceMatrix", {"origin": "Detroit", "destination": "Norfolk"}),
    ("SearchFlight", {"departure": "Rockford", "destination": "Chicago", "date": "2022-03-16"}),
    ("SearchFlight", {"departure": "Rockford", "destination": "Chicago", "departure_date": "2022-03-16"}),
    ("SearchAccommodation", {"city": 5}),
    ("SearchAccommodation", {}),
]


def _build(travelplanner_dir, tmp_path_factory, name):
    url = f"sqlite:///{tmp_path_factory.mktemp(name) / 'world.sqlite'}"
    build_official_world(url, travelplanner_dir / "database", synthesize_flights=False)
    return url


@pytest.fixture(scope="module")
def world(travelplanner_dir, tmp_path_factory):
    w = World(_build(travelplanner_dir, tmp_path_factory, "toolbox-world"))
    yield w
    w.close()


# --- dispatch -------------------------------------------------------------------------------
def test_unknown_tool_raises(world):
    box = ToolBox(world)
    for name in ("BookHotel", "searchcity", "", "NotebookWrite", None, 7):
        with pytest.raises(UnknownTool) as err:
            box.call(name, {})
        assert err.value.name == name
    assert box.stats_snapshot()["unknown_tool_calls"] == 6


def test_names_and_official_aliases(world):
    box = ToolBox(world, cache_size=0)
    assert box.names() == NAMES
    assert ALIASES == {
        "FlightSearch": "SearchFlight",
        "AccommodationSearch": "SearchAccommodation",
        "RestaurantSearch": "SearchRestaurant",
        "AttractionSearch": "SearchAttraction",
        "CitySearch": "SearchCity",
    }
    for alias, name in ALIASES.items():
        assert resolve_tool(alias) is TOOLS[name]
    for dialect in ("star", "official"):
        a = box.call("AttractionSearch", {"city": "Rockford"}, dialect=dialect)
        b = box.call("SearchAttraction", {"city": "Rockford"}, dialect=dialect)
        assert a.text == b.text and a.ok and a.name == "AttractionSearch"


def test_result_fields(world):
    r = ToolBox(world).call("SearchCity", {"state": "Illinois"})
    assert r.name == "SearchCity" and r.ok and not r.fault_injected
    assert 0 < r.elapsed_ms < 1000


def test_dialect_default_and_override(world):
    box = ToolBox(world, dialect="official")
    assert box.call("SearchCity", {"state": "Illinois"}).text.startswith("['Moline'")
    assert box.call("SearchCity", {"state": "Illinois"}, dialect="star").text.startswith("A SearchCity")
    with pytest.raises(ValueError, match="klingon"):
        box.call("SearchCity", {"state": "Illinois"}, dialect="klingon")
    with pytest.raises(ValueError):
        ToolBox(world, dialect="pandas")


def test_none_arguments_mean_no_arguments(world):
    assert ToolBox(world).call("SearchCity", None).text == "Invalid parameters. Please provide state."


def test_star_ignores_official_parameter_aliases(world):
    box = ToolBox(world, cache_size=0)
    assert (
        box.call("SearchFlight", {"origin": "A", "destination": "B", "date": "2022-03-01"}).text
        == "Invalid parameters. Please provide departure, destination and date."
    )
    assert box.call(
        "GoogleDistanceMatrix", {"origin": "Detroit", "destination": "Norfolk"}, dialect="official"
    ).text.startswith("driving, from Detroit to Norfolk, duration")


# --- cache ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dialect", ["star", "official"])
def test_cache_on_and_off_give_the_same_results(world, dialect):
    cold = ToolBox(world, dialect=dialect, cache_size=0)
    warm = ToolBox(world, dialect=dialect, cache_size=64)
    for _ in range(3):
        for name, arguments in SAMPLE_CALLS:
            a, b = cold.call(name, arguments), warm.call(name, arguments)
            assert (a.text, a.ok) == (b.text, b.ok), (name, arguments)
    info = warm.cache_info()
    assert info["enabled"] and info["hits"] > 0 and cold.cache_info()["hits"] == 0
    # non-string values are never cached (5, 5.0 and True are equal keys but print differently)
    one = warm.call("SearchAttraction", {"city": 1}, dialect="star").text
    assert one != warm.call("SearchAttraction", {"city": True}, dialect="star").text
    assert one.startswith("There is no attraction in 1.")


def test_cache_is_keyed_by_dialect_and_bounded(world):
    box = ToolBox(world, cache_size=2)
    star = box.call("SearchCity", {"state": "Texas"}).text
    assert box.call("SearchCity", {"state": "Texas"}, dialect="official").text != star
    box.call("SearchCity", {"state": "Ohio"})
    assert box.cache_info()["size"] == 2
    hits = box.cache_info()["hits"]
    box.call("SearchCity", {"state": "Ohio"})
    assert box.cache_info()["hits"] == hits + 1
    box.call("SearchCity", {"state": "Texas"})  # evicted (least recently used): a miss
    assert box.cache_info()["hits"] == hits + 1
    box.set_cache_size(0)
    assert box.cache_info() | {"hits": 0, "misses": 0} == {
        "enabled": False,
        "max_size": 0,
        "size": 0,
        "hits": 0,
        "misses": 0,
    }


def test_long_arguments_are_not_cached(world):
    box = ToolBox(world, cache_size=8)
    box.call("SearchCity", {"state": "x" * 10_000})
    assert box.cache_info()["size"] == 0


# --- counters ---------------------------------------------------------------------------------
def test_stats_count_calls_errors_faults_and_hits(world):
    box = ToolBox(world, cache_size=8)
    box.call("SearchCity", {"state": "Illinois"})
    box.call("CitySearch", {"state": "Illinois"})  # alias → same tool, a cache hit
    box.call("SearchCity", {"state": "Atlantis"})
    box.call("SearchCity", {"state": "Illinois"}, fault_rate=1.0)
    s = box.stats["SearchCity"]
    assert s == {"calls": 4, "ok": 2, "errors": 1, "faults": 1, "cache_hits": 1}
    assert box.stats["SearchFlight"]["calls"] == 0
    json.dumps(box.stats_snapshot()), json.dumps(box.cache_info())


# --- fault injection --------------------------------------------------------------------------
def test_fault_text_uses_the_name_as_called(world):
    box = ToolBox(world, fault_rate=1.0)
    for name in ("SearchFlight", "FlightSearch"):
        r = box.call(name, {"departure": "A", "destination": "B", "date": "2022-03-01"})
        assert r.fault_injected and not r.ok
        assert r.text == f"Error: Current tool {name} is not available."
    assert fault_text("SearchCity") == "Error: Current tool SearchCity is not available."


def test_keyed_faults_are_deterministic_and_order_free(world):
    box = ToolBox(world, cache_size=0)

    def outcome(key, seed=11):
        return box.call("SearchCity", {"state": "Texas"}, fault_rate=0.3, fault_seed=seed, fault_key=key).fault_injected

    keys = [f"traj-{i}/{j}" for i in range(20) for j in range(10)]
    forward = [outcome(k) for k in keys]
    backward = [outcome(k) for k in reversed(keys)][::-1]
    assert forward == backward
    assert 30 < sum(forward) < 90  # ≈ 60 of 200
    assert [outcome(k, seed=12) for k in keys] != forward
    # the key alone decides: the run-level seed is the default seed of keyed draws
    box2 = ToolBox(world, fault_rate=0.3, fault_seed=11, cache_size=0)
    assert [box2.call("SearchCity", {"state": "Texas"}, fault_key=k).fault_injected for k in keys] == forward


@pytest.mark.parametrize("keyed", [False, True])
def test_fault_rate_is_respected_over_10k_draws(keyed):
    inj = FaultInjector(rate=0.2, seed=5)
    hits = sum(inj.draw("SearchCity", key=f"k{i}" if keyed else None) for i in range(10_000))
    assert abs(hits - 2000) < 200  # 5 standard deviations (sd = 40)


def test_unkeyed_stream_is_reproducible_per_seed():
    def run(seed):
        inj = FaultInjector(rate=0.5, seed=seed)
        return [inj.draw("SearchCity") for _ in range(64)]

    assert run(1) == run(1)
    assert run(1) != run(2)
    inj = FaultInjector(rate=0.5, seed=1)
    first = [inj.draw("SearchCity") for _ in range(64)]
    inj.configure(rate=0.5, seed=1)  # reconfiguring restarts the stream
    assert [inj.draw("SearchCity") for _ in range(64)] == first == run(1)


def test_per_tool_and_per_call_rates(world):
    box = ToolBox(world, fault_rate=0.0, per_tool_fault_rates={"FlightSearch": 1.0}, cache_size=0)
    assert box.fault_config() == {"rate": 0.0, "seed": 0, "per_tool": {"SearchFlight": 1.0}}
    assert box.call("SearchFlight", {}).fault_injected
    assert not box.call("SearchCity", {"state": "Ohio"}).fault_injected
    assert not box.call("SearchFlight", {}, fault_rate=0.0).fault_injected  # per-call wins
    box.set_faults(rate=1.0, seed=3, per_tool={"SearchCity": 0.0})
    assert box.call("SearchFlight", {}).fault_injected
    assert not box.call("SearchCity", {"state": "Ohio"}).fault_injected
    with pytest.raises(ValueError, match="NoSuchTool"):
        box.set_faults(rate=0.1, per_tool={"NoSuchTool": 0.5})
    with pytest.raises(ValueError):
        box.call("SearchCity", {"state": "Ohio"}, fault_rate=1.5)
    with pytest.raises(ValueError):
        FaultInjector(rate=float("nan"))


def test_per_call_seed_without_key_is_deterministic(world):
    box = ToolBox(world, cache_size=0)
    a = [box.call("SearchCity", {"state": "Ohio"}, fault_rate=0.5, fault_seed=s).fault_injected for s in range(40)]
    b = [box.call("SearchCity", {"state": "Ohio"}, fault_rate=0.5, fault_seed=s).fault_injected for s in range(40)]
    assert a == b and 5 < sum(a) < 35


def test_keyed_uniform_range_and_odd_keys():
    values = [keyed_uniform(0, k) for k in ("", "a", "\ud800", "x" * 100_000, "traj-1/2")]
    assert all(0.0 <= v < 1.0 for v in values) and len(set(values)) == len(values)


# --- hostile input -----------------------------------------------------------------------------
HOSTILE = [
    "'; DROP TABLE accommodations; --",
    "Rock%",
    "Rock_ord",
    "Rockford\x00",
    "\x00",
    "\u202eRockford",
    "Rock\u00a0ford",
    "\ud800",
    "Rockford\udfff",
    "🛫",
    "rockford",
    " Rockford",
    "Rockford ",
    "x" * (1 << 20),
    "Rockford\n",
    "%",
    "*",
    "NULL",
    "null",
]


@pytest.mark.parametrize("value", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_city_finds_nothing_and_echoes(world, value):
    box = ToolBox(world)
    r = box.call("SearchAccommodation", {"city": value})
    assert not r.ok
    assert r.text == f"There is no accommodation in {value}. Please rethink your accommodation search and try again."
    r = box.call("SearchAccommodation", {"city": value}, dialect="official")
    assert not r.ok and r.text.startswith(f"{value} is not valid city in [")
    assert box.call("SearchAccommodation", {"city": "Rockford"}).ok  # the table is still there


@pytest.mark.usefixtures("full_travelplanner_dir")
def test_hostile_strings_in_every_tool(world):
    box = ToolBox(world, cache_size=0)
    for value in HOSTILE:
        for dialect in ("star", "official"):
            for name in NAMES:
                arguments = {p: value for p in TOOLS[name].param_names}
                r = box.call(name, arguments, dialect=dialect)
                assert not r.ok and isinstance(r.text, str)
    assert world.counts()["accommodations"] == 4285


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
argument_dicts = st.dictionaries(
    st.sampled_from(["city", "state", "departure", "destination", "date", "mode", "origin", "departure_date", "x"]),
    json_values | st.sampled_from(["Rockford", "Illinois", "Detroit", "Norfolk", "2022-03-16", "taxi", "driving"]),
    max_size=4,
)


@pytest.fixture(scope="module")
def boxes(world):
    return {True: ToolBox(world, cache_size=256), False: ToolBox(world, cache_size=0)}


@settings(max_examples=600, deadline=None)
@given(
    name=st.sampled_from(NAMES + list(ALIASES)),
    arguments=argument_dicts | json_values,
    dialect=st.sampled_from(["star", "official"]),
    cache=st.booleans(),
)
def test_arbitrary_arguments_never_raise(boxes, name, arguments, dialect, cache):
    box = boxes[cache]
    r = box.call(name, arguments, dialect=dialect)
    assert isinstance(r.text, str) and r.text
    assert r.ok == (not _failure_text(r.text, dialect)), r.text[:200]


def _failure_text(text, dialect):
    """The dialect's error and no-result texts (anchored, so echoed arguments cannot fake them)."""
    if dialect == "star":
        return text.startswith(
            (
                "Invalid parameters. Please provide ",
                "There is no ",
                "Tool calling error: ",
                "No valid information found.",
                "Sorry, we cannot find the distance",
                "The required time exceeds a single day",
            )
        )
    return (
        text in ("No valid information.", "Invalid State")
        or (text.startswith("Illegal ") and text.endswith(" Please try again."))
        or (" is not valid city in [" in text and text.endswith("]."))
        or text.endswith("' is not in the format YYYY-MM-DD")
        or text.startswith("There is no ")
        or text.endswith(", no valid information.")
    )


# --- concurrency and the backend ---------------------------------------------------------------
def test_concurrent_calls_match_sequential(world):
    box = ToolBox(world, cache_size=16)
    expected = [box.call(n, a).text for n, a in SAMPLE_CALLS]
    with ThreadPoolExecutor(8) as pool:
        for _ in range(5):
            got = list(pool.map(lambda c: box.call(*c).text, SAMPLE_CALLS * 4))
            assert got == expected * 4


def test_database_failure_is_a_backend_error(travelplanner_dir, tmp_path_factory):
    url = _build(travelplanner_dir, tmp_path_factory, "broken-world")
    w = World(url)
    box = ToolBox(w, cache_size=0)
    conn = sqlite3.connect(url.split("///", 1)[1])
    conn.execute("DROP TABLE restaurants")
    conn.commit()
    conn.close()
    w.engine.dispose()
    with pytest.raises(BackendError):
        box.call("SearchRestaurant", {"city": "Rockford"})
    assert box.call("SearchCity", {"state": "Ohio"}).ok  # background tables are in memory
    w.close()


# --- registry -----------------------------------------------------------------------------------
def test_openai_tool_schemas():
    tools = tool_schemas()
    assert [t["function"]["name"] for t in tools] == NAMES
    assert all(t["type"] == "function" and t["function"]["description"] for t in tools)
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert by_name["SearchFlight"]["required"] == ["departure", "destination", "date"]
    assert by_name["GoogleDistanceMatrix"]["required"] == ["departure", "destination"]
    mode = by_name["GoogleDistanceMatrix"]["properties"]["mode"]
    assert mode["enum"] == ["driving", "taxi"] and mode["default"] == "driving"
    assert by_name["SearchCity"] == {
        "type": "object",
        "properties": {"state": by_name["SearchCity"]["properties"]["state"]},
        "required": ["state"],
    }
    for params in by_name.values():
        assert all(p["type"] == "string" for p in params["properties"].values())
        assert set(params["required"]) <= set(params["properties"])
    assert json.loads(json.dumps(tools)) == tools
    assert tool_schemas("plain") == [t["function"] for t in tools]
    with pytest.raises(ValueError):
        tool_schemas("anthropic")


def test_required_parameters_match_the_tools_own_checks(world):
    """Leaving out any required parameter gets the tool's 'Invalid parameters' text, and only then."""
    box = ToolBox(world, cache_size=0)
    full = {
        "departure": "Detroit",
        "destination": "Norfolk",
        "date": "2022-03-16",
        "mode": "taxi",
        "city": "Rockford",
        "state": "Ohio",
    }
    for name, spec in TOOLS.items():
        arguments = {p: full[p] for p in spec.param_names}
        assert not box.call(name, arguments).text.startswith("Invalid parameters")
        for p in spec.param_names:
            partial = {k: v for k, v in arguments.items() if k != p}
            missing = box.call(name, partial).text.startswith("Invalid parameters")
            assert missing == (p in spec.required), (name, p)
