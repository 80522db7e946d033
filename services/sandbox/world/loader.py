"""Load the official TravelPlanner database directory into SQL.

Both layouts are accepted: the TravelPlanner repo's sub-folders (`accommodations/clean_...csv`)
and Agent-STAR's flat folder (`clean_accommodations_2022.csv` beside `background/`). Files are
parsed with `pandas.read_csv` defaults, exactly as the official tools parse them, so a cell the
tools read as missing (empty, "NA", "null", ...) makes its row invisible here too.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from services.sandbox.world.rows import City, Flight


class WorldSourceError(ValueError):
    """The directory is not a TravelPlanner database (a clear message for the CLI)."""


@dataclass(frozen=True)
class OfficialLayout:
    """Resolved paths of one database directory; `flights` is None when the file is absent."""

    root: Path
    city_states: Path
    city_set: Path | None
    accommodations: Path
    restaurants: Path
    attractions: Path
    distances: Path
    flights: Path | None

    @classmethod
    def find(cls, root: Path) -> OfficialLayout:
        root = Path(root)
        if (root / "database").is_dir() and not (root / "background").is_dir():
            root = root / "database"  # accept the parent of `database/` too

        def pick(*candidates: str, required: bool = True) -> Path | None:
            for rel in candidates:
                if (root / rel).is_file():
                    return root / rel
            if required:
                raise WorldSourceError(f"{root}: none of {', '.join(candidates)} exists; not a TravelPlanner database")
            return None

        return cls(
            root=root,
            city_states=pick("background/citySet_with_states.txt"),
            city_set=pick("background/citySet.txt", required=False),
            accommodations=pick("accommodations/clean_accommodations_2022.csv", "clean_accommodations_2022.csv"),
            restaurants=pick("restaurants/clean_restaurant_2022.csv", "clean_restaurant_2022.csv"),
            attractions=pick("attractions/attractions.csv", "attractions.csv"),
            distances=pick("googleDistanceMatrix/distance.csv", "distance.csv"),
            flights=pick("flights/clean_Flights_2022.csv", "clean_Flights_2022.csv", required=False),
        )


def _missing(value: object) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _visible(row: tuple) -> bool:
    return not any(_missing(v) for v in row)


def _opt(value, cast):
    return None if _missing(value) else cast(value)


def read_cities(layout: OfficialLayout) -> list[City]:
    """Cities in file order; tolerant of a trailing newline the official evaluator would choke on."""
    order: dict[str, int] | None = None
    if layout.city_set is not None:
        names = [ln for ln in layout.city_set.read_text(encoding="utf-8").strip().split("\n") if ln]
        order = {name: i for i, name in enumerate(names)}
    out: list[City] = []
    for line in layout.city_states.read_text(encoding="utf-8").strip().split("\n"):
        if not line:
            continue
        city, sep, state = line.partition("\t")
        if not sep:
            raise WorldSourceError(f"{layout.city_states}: line {line!r} is not 'City<TAB>State'")
        position = None if order is None else order.get(city)
        out.append(City(city, state, order is None or position is not None, position))
    return out


def read_accommodations(path: Path) -> Iterator[tuple]:
    df = pd.read_csv(path)
    cols = [
        "NAME",
        "price",
        "room type",
        "house_rules",
        "minimum nights",
        "maximum occupancy",
        "review rate number",
        "city",
    ]
    _require(df, cols, path)
    for raw in df.itertuples(index=False):
        full = tuple(raw)  # visibility is judged on every column, as `dropna()` does
        r = dict(zip(df.columns, full))
        yield (
            _opt(r["NAME"], str),
            _opt(r["price"], float),
            _opt(r["room type"], str),
            _opt(r["house_rules"], str),
            _opt(r["minimum nights"], float),
            _opt(r["maximum occupancy"], int),
            _opt(r["review rate number"], float),
            _opt(r["city"], str),
            _visible(full),
        )


def read_restaurants(path: Path) -> Iterator[tuple]:
    df = pd.read_csv(path)
    cols = ["Name", "Average Cost", "Cuisines", "Aggregate Rating", "City"]
    _require(df, cols, path)
    index_col = "Unnamed: 0" if "Unnamed: 0" in df.columns else None
    for pos, raw in enumerate(df.itertuples(index=False)):
        full = tuple(raw)
        r = dict(zip(df.columns, full))
        src = _opt(r[index_col], int) if index_col else pos
        yield (
            src,
            _opt(r["Name"], str),
            _opt(r["Average Cost"], int),
            _opt(r["Cuisines"], str),
            _opt(r["Aggregate Rating"], float),
            _opt(r["City"], str),
            _visible(full),
        )


def read_attractions(path: Path) -> Iterator[tuple]:
    df = pd.read_csv(path)
    cols = ["Name", "Latitude", "Longitude", "Address", "Phone", "Website", "City"]
    _require(df, cols, path)
    for raw in df.itertuples(index=False):
        full = tuple(raw)
        r = dict(zip(df.columns, full))
        yield (
            _opt(r["Name"], str),
            _opt(r["Latitude"], float),
            _opt(r["Longitude"], float),
            _opt(r["Address"], str),
            _opt(r["Phone"], str),
            _opt(r["Website"], str),
            _opt(r["City"], str),
            _visible(full),
        )


def read_distances(path: Path) -> Iterator[tuple]:
    """All rows, duplicates included, in file order (lookups take the first row of a pair)."""
    df = pd.read_csv(path)
    _require(df, ["origin", "destination", "duration", "distance"], path)
    for o, d, dur, dist in df[["origin", "destination", "duration", "distance"]].itertuples(index=False):
        if _missing(o) or _missing(d):
            continue  # a pair nobody can look up
        yield (str(o), str(d), _opt(dur, str), _opt(dist, str))


FLIGHT_COLUMNS = [
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


def read_flights_csv(path: Path, chunksize: int = 200_000) -> Iterator[tuple]:
    """A real flights CSV in the official schema, streamed (the full file has ~3.8 M rows)."""
    for df in pd.read_csv(path, chunksize=chunksize):
        if "Flight Number" not in df.columns and "Unnamed: 0" in df.columns:
            df = df.rename(columns={"Unnamed: 0": "Flight Number"})  # as the official Flights.load_db does
        _require(df, FLIGHT_COLUMNS, path)
        for raw in df.itertuples(index=False):
            full = tuple(raw)
            r = dict(zip(df.columns, full))
            yield flight_tuple(r, visible=_visible(full))


def flight_tuple(r: dict, visible: bool = True) -> tuple:
    """Official flight record (CSV or reference-information dict) → table tuple."""
    return (
        _opt(r["Flight Number"], str),
        _opt(r["Price"], int),
        _opt(r["DepTime"], str),
        _opt(r["ArrTime"], str),
        _opt(r["ActualElapsedTime"], str),
        _opt(r["FlightDate"], str),
        _opt(r["OriginCityName"], str),
        _opt(r["DestCityName"], str),
        _opt(r["Distance"], float),
        visible,
    )


def reference_flights(ref_info_path: Path) -> tuple[list[Flight], set[tuple[str, str, str]]]:
    """Real flight rows of a `*_ref_info.jsonl` file, and every (origin, dest, date) it covers.

    A covered triple with no rows ("There is no flight ...") must stay empty in a generated world,
    so the reference information remains the complete answer for it.
    """
    import json

    rows: dict[str, Flight] = {}
    covered: set[tuple[str, str, str]] = set()
    with open(ref_info_path, encoding="utf-8") as fh:
        for line in fh:
            info = json.loads(line)
            for key, value in info.items():
                if not key.startswith("Flight from "):
                    continue
                route, _, date = key[len("Flight from ") :].rpartition(" on ")
                origin, _, dest = route.partition(" to ")
                covered.add((origin, dest, date))
                if isinstance(value, list):
                    for rec in value:
                        t = flight_tuple(rec)
                        rows.setdefault(t[0], Flight(*t[:-1]))
    return list(rows.values()), covered


def _require(df: pd.DataFrame, cols: list[str], path: Path) -> None:
    missing = [c for c in cols if c not in df.columns]
    if missing:
        raise WorldSourceError(f"{path}: missing columns {missing}; found {list(df.columns)}")
