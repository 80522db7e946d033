"""Generated flights over a city set, in the official `clean_Flights_2022.csv` schema (spec §2.2).

The real flights table is not public here, so worlds generate one. The generator is built to be
consistent with the rest of the world and deterministic from a seed:

Routes (ordered city pairs that have flights at all), in priority order for the mileage:
1. pairs of `fixed` rows (real reference flights): their own `Distance`, both directions;
2. pairs in the road-distance table (either direction; the two directions are averaged):
   air miles = road km / 1.609344 / r, with r drawn per unordered pair in ROAD_PER_AIR
   (the real reference flights show r = 1.03 ... 1.45, median 1.17);
3. hub spokes: a pair absent from the road table (or with an empty cell there) where one end is
   a hub gets a route when its road distance can be estimated through a third city
   (min over H of km(A,H) + km(H,B), a 2-hop path), else from coordinates (great circle);
4. isolated cities (no route after 1-3, e.g. islands and Alaska, which have no road rows) are
   linked to their ISOLATED_LINKS nearest hubs by great-circle distance, when coordinates are known.
Pairs under MIN_ROAD_KM of road (or the air equivalent) get no flights.

Per route and day the number of flights is Poisson(lambda), lambda = C * (w_o * w_d)^1.2 * g(miles),
capped at MAX_PER_ROUTE_DAY; w are city weights (hubs are heavy, others log-normal around 1), g
favours 250-1000 mile hops. C is solved so the expected total is `scale` * OFFICIAL_DAILY per day
(scale 1.0 = ~3.8 M rows over March 2022). Thin routes therefore often have no flight on a day,
as in the real data ("There is no flight from A to B on D.").

Density. The paper's 3.8 M rows are most likely the whole table (Jan-Jul 2022): the real March
flight numbers in the train reference rows span F3490076..F4060885, i.e. ~0.57 M rows, about
scale 0.15. On the 135 (origin, dest, date) legs of the train reference information, scale 0.15
gives ~57 legs with flights and 1.25 flights per leg (real: 61 and 2.3); scale 1.0 gives ~93 and 7.6.
The traffic concentration (WEIGHT_*) was chosen to bring these closer to the real ones.

Per flight: elapsed = route mean (38 min + 0.118 min/mile, fitted on the real reference rows)
+ noise; departure in 05:00-23:30 (a few red-eyes) such that the local arrival, shifted by the
time-zone difference, is still on the same day; price = miles * route rate * noise.

Fixed rows are emitted first and unchanged; no generated flight ever falls on a (origin, dest,
date) triple in `covered` or of a fixed row, so reference information stays the complete answer
for those. Generated flight numbers are unique, never collide with fixed ones, and increase in
emission order (like the real file, whose numbers follow row order).
"""

from __future__ import annotations

import datetime as _dt
import math
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from services.sandbox.world.rows import City, Flight

OFFICIAL_ROWS = 3_800_000  # the paper's size of the flights table
OFFICIAL_DAILY = OFFICIAL_ROWS / 31  # scale 1.0: official density, per day
KM_PER_MILE = 1.609344
MIN_ROAD_KM = 150.0  # no flights for shorter hops
ROAD_PER_AIR = (1.08, 1.30)  # road km / air km, drawn per unordered pair
MAX_PER_ROUTE_DAY = 36  # busiest real route-day in the reference rows: 33 (Dallas -> Houston)
HUB_MIN_WEIGHT = 5.0  # cities at least this heavy get spokes to every reachable city
ISOLATED_LINKS = 4
WEIGHT_SIGMA, WEIGHT_MAX, WEIGHT_EXPONENT = 1.0, 2.0, 1.2  # traffic concentration (see plan_routes)
NUMBER_SPACE = 10_000_000  # "F" + 7 digits
ELAPSED_BASE_MIN, ELAPSED_PER_MILE = 38.0, 0.118
ELAPSED_SPREAD = 20  # per-flight noise bound, minutes
EARLIEST_DEP, LATEST_DEP = 5 * 60, 23 * 60 + 30
RED_EYE_SHARE = 0.03

# Rough traffic weights of the big airports among the official city names (heavier = busier).
OFFICIAL_HUBS: dict[str, float] = {
    "Atlanta": 10,
    "Dallas": 9,
    "Denver": 9,
    "Chicago": 9,
    "Los Angeles": 9,
    "New York": 9,
    "Charlotte": 7,
    "Las Vegas": 7,
    "Orlando": 7,
    "Seattle": 7,
    "Phoenix": 7,
    "Houston": 7,
    "San Francisco": 7,
    "Washington": 6,
    "Miami": 6,
    "Boston": 6,
    "Minneapolis": 6,
    "Detroit": 6,
    "Philadelphia": 6,
    "Newark": 5,
    "Fort Lauderdale": 5,
    "Baltimore": 5,
    "Salt Lake City": 5,
    "San Diego": 5,
    "Tampa": 5,
    "Nashville": 5,
    "Austin": 5,
    "Portland": 4,
    "St. Louis": 4,
    "Honolulu": 4,
    "Kansas City": 3,
    "Sacramento": 3,
    "San Jose": 3,
    "Raleigh": 3,
    "New Orleans": 3,
    "Indianapolis": 3,
    "Cleveland": 3,
    "Pittsburgh": 3,
    "Cincinnati": 3,
    "Columbus": 3,
    "San Antonio": 3,
    "Oakland": 3,
    "Anchorage": 3,
    "San Juan": 3,
    "Santa Ana": 3,
    "Milwaukee": 2.5,
    "Jacksonville": 2.5,
    "Memphis": 2.5,
    "Buffalo": 2.5,
    "Albuquerque": 2.5,
    "Omaha": 2.5,
    "Tucson": 2.5,
    "Boise": 2.5,
    "Reno": 2.5,
    "El Paso": 2.5,
    "Oklahoma City": 2.5,
    "Burbank": 2.5,
    "Long Beach": 2.5,
    "Kahului": 2.5,
    "Charleston": 2,
    "Richmond": 2,
    "Norfolk": 2,
    "Louisville": 2,
    "Hartford": 2,
    "Providence": 2,
    "Spokane": 2,
    "Des Moines": 2,
    "Tulsa": 2,
    "Birmingham": 2,
    "West Palm Beach": 2,
    "Fort Myers": 2,
}

US_STATES = frozenset(
    """Alabama Alaska Arizona Arkansas California Colorado Connecticut Delaware Florida Georgia
Hawaii Idaho Illinois Indiana Iowa Kansas Kentucky Louisiana Maine Maryland Massachusetts Michigan Minnesota
Mississippi Missouri Montana Nebraska Nevada Ohio Oklahoma Oregon Pennsylvania Tennessee Texas Utah Vermont
Virginia Washington Wisconsin Wyoming""".split()
) | {
    "New Hampshire",
    "New Jersey",
    "New Mexico",
    "New York",
    "North Carolina",
    "North Dakota",
    "Rhode Island",
    "South Carolina",
    "South Dakota",
    "West Virginia",
    "District of Columbia",
}

_NUM_KM = re.compile(r"^\s*([\d,]*\.?\d+)\s*(km|m)\s*$")


# --- small helpers ----------------------------------------------------------------------------
def parse_km(value: str | None) -> float | None:
    """'1,144 km' -> 1144.0; '41.7 km' -> 41.7; '850 m' -> 0.85; None/garbage -> None."""
    if value is None:
        return None
    m = _NUM_KM.match(str(value))
    if not m:
        return None
    x = float(m.group(1).replace(",", ""))
    return x / 1000.0 if m.group(2) == "m" else x


def date_range(start: str, end: str) -> list[str]:
    """Inclusive list of YYYY-MM-DD dates."""
    d0, d1 = _dt.date.fromisoformat(start), _dt.date.fromisoformat(end)
    return [(d0 + _dt.timedelta(days=i)).isoformat() for i in range((d1 - d0).days + 1)]


MARCH_2022 = tuple(date_range("2022-03-01", "2022-03-31"))


def haversine_miles(lat1, lon1, lat2, lon2):
    """Great-circle distance in miles (numpy-broadcasting)."""
    p1, p2 = np.radians(lat1), np.radians(lat2)
    dp, dl = p2 - p1, np.radians(np.asarray(lon2) - np.asarray(lon1))
    a = np.sin(dp / 2) ** 2 + np.cos(p1) * np.cos(p2) * np.sin(dl / 2) ** 2
    return 3958.8 * 2 * np.arcsin(np.sqrt(np.clip(a, 0.0, 1.0)))


def utc_offset_hours(lat: float, lon: float) -> int:
    """A plausible standard-time UTC offset from coordinates (US zones where they apply)."""
    if 15 <= lat <= 72 and -180 <= lon <= -60:
        if lat < 24 and lon < -150:
            return -10  # Hawaii
        if lat > 51 and lon < -130:
            return -9  # Alaska
        if lat < 19.5 and lon > -68.5:
            return -4  # Puerto Rico, Virgin Islands
        if lon > -86.5:
            return -5
        if lon > -101.5:
            return -6
        if lon > -114.5:
            return -7
        return -8
    return int(max(-11, min(12, round(lon / 15.0))))


def _elapsed_table(limit: int = 24 * 60) -> np.ndarray:
    return np.array([f"{m // 60} hours {m % 60} minutes" for m in range(limit)], dtype=object)


_HHMM = np.array([f"{m // 60:02d}:{m % 60:02d}" for m in range(24 * 60)], dtype=object)
_ELAPSED = _elapsed_table()


# --- route planning -----------------------------------------------------------------------------
@dataclass
class RoutePlan:
    """Every route of a generated table, as parallel arrays (exposed for tests and reports)."""

    names: list[str]  # city names, index = city id
    origin: np.ndarray  # int32 city ids
    dest: np.ndarray
    miles: np.ndarray  # float64, integral values
    source: np.ndarray  # int8: 1 fixed, 2 road table, 3 hub via 2-hop road, 4 hub/isolated great circle
    road_km: np.ndarray  # float64 road km behind the mileage (nan for great-circle routes)
    rate: np.ndarray  # expected flights per day (already scaled and capped)
    elapsed_mean: np.ndarray  # minutes
    price_per_mile: np.ndarray
    shift_min: np.ndarray  # local arrival clock minus departure clock, minus elapsed (time zones)

    SOURCES = {1: "fixed", 2: "road", 3: "hub-2hop", 4: "great-circle"}

    def __len__(self) -> int:
        return len(self.origin)

    def pairs(self) -> dict[tuple[str, str], int]:
        return {
            (self.names[o], self.names[d]): i for i, (o, d) in enumerate(zip(self.origin.tolist(), self.dest.tolist()))
        }


def city_coordinates_from_attractions(rows: Iterable[Sequence]) -> dict[str, tuple[float, float]]:
    """Median (lat, lon) per city of attraction rows (name, lat, lon, address, phone, website, city, ...)."""
    acc: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        lat, lon, city = r[1], r[2], r[6]
        if city is None or lat is None or lon is None or (isinstance(lat, float) and math.isnan(lat)):
            continue
        acc.setdefault(city, []).append((float(lat), float(lon)))
    return {c: (float(np.median([p[0] for p in v])), float(np.median([p[1] for p in v]))) for c, v in acc.items()}


def plan_routes(
    cities: Sequence[City],
    distances: Iterable[Sequence],
    *,
    seed: int,
    fixed: Sequence[Flight] = (),
    coords: Mapping[str, tuple[float, float]] | None = None,
    hubs: Mapping[str, float] | None = None,
    scale: float = 1.0,
) -> RoutePlan:
    """Decide which ordered pairs have flights, their mileage, daily rate, times and prices."""
    names = list(dict.fromkeys(c.city for c in cities))
    idx = {c: i for i, c in enumerate(names)}
    n = len(names)
    states = {}
    for c in cities:
        states.setdefault(c.city, c.state)
    rng = np.random.default_rng([seed, 1])

    # Road km matrix (first row per ordered pair, then symmetrised by averaging).
    km = np.full((n, n), np.nan)
    for row in distances:
        o, d = row[0], row[1]
        i, j = idx.get(o), idx.get(d)
        if i is None or j is None or i == j or not np.isnan(km[i, j]):
            continue
        v = parse_km(row[3] if len(row) > 3 else None)
        km[i, j] = np.nan if v is None else v
    # a pair seen once keeps the first row even if its cell is empty: "first row wins"
    sym = np.where(np.isnan(km), km.T, np.where(np.isnan(km.T), km, (km + km.T) / 2))

    # City weights: the known hubs, otherwise log-normal around 1.
    hub_w = dict(OFFICIAL_HUBS if hubs is None else hubs)
    noise = np.exp(rng.normal(0.0, WEIGHT_SIGMA, n))
    weight = np.array([hub_w.get(c, 0.0) for c in names], dtype=float)
    weight = np.where(weight > 0, weight * np.exp(rng.normal(0.0, 0.1, n)), np.minimum(noise, WEIGHT_MAX))
    is_hub = np.array([hub_w.get(c, 0.0) >= HUB_MIN_WEIGHT for c in names])

    # Coordinates: given ones (sanity-checked against the state), estimated for the rest.
    lat, lon = _coordinates(names, states, coords or {}, sym)
    has_xy = ~np.isnan(lat)

    ratio = rng.uniform(*ROAD_PER_AIR, size=(n, n))
    ratio = np.triu(ratio, 1) + np.triu(ratio, 1).T

    miles = np.full((n, n), np.nan)
    source = np.zeros((n, n), dtype=np.int8)
    road = np.full((n, n), np.nan)

    ok = ~np.isnan(sym) & (sym >= MIN_ROAD_KM)
    np.fill_diagonal(ok, False)
    miles[ok] = np.round(sym[ok] / KM_PER_MILE / ratio[ok])
    road[ok] = sym[ok]
    source[ok] = 2
    known = ~np.isnan(sym)  # a road distance exists (short hops included: they stay flightless)

    # Hub spokes for pairs without a road-table distance.
    road0 = np.where(np.isnan(sym), np.inf, sym)
    np.fill_diagonal(road0, 0.0)
    for h in np.flatnonzero(is_hub):
        via = np.min(road0[h][:, None] + road0, axis=0)  # h -> H -> j
        via_in = np.min(road0[:, h][None, :] + road0, axis=1)  # j -> H -> h (road is ~symmetric)
        est = np.minimum(via, via_in)
        gc = haversine_miles(lat[h], lon[h], lat, lon) if has_xy[h] else np.full(n, np.nan)
        for j in range(n):
            if j == h or known[h, j]:
                continue
            if np.isfinite(est[j]) and est[j] >= MIN_ROAD_KM:
                m, s, rk = round(est[j] / KM_PER_MILE / ratio[h, j]), 3, est[j]
            elif not np.isfinite(est[j]) and has_xy[j] and gc[j] * KM_PER_MILE * ROAD_PER_AIR[0] >= MIN_ROAD_KM:
                m, s, rk = round(float(gc[j])), 4, np.nan
            else:
                continue
            for a, b in ((h, j), (j, h)):
                if source[a, b] == 0:
                    miles[a, b], source[a, b], road[a, b] = m, s, rk

    # Real reference rows: their own mileage, both directions.
    for f in fixed:
        i, j = idx.get(f.origin), idx.get(f.dest)
        if i is None or j is None or i == j or f.distance is None:
            continue
        for a, b in ((i, j), (j, i)):
            if source[a, b] != 1:
                miles[a, b], source[a, b], road[a, b] = float(f.distance), 1, sym[a, b]

    # Isolated cities: link to the nearest hubs by great-circle distance.
    pool = np.flatnonzero(has_xy & (weight >= min(3.0, np.quantile(weight, 0.9)))) if n else np.zeros(0, int)
    for c in np.flatnonzero(has_xy & ~(source > 0).any(axis=1) & ~(source > 0).any(axis=0)):
        cand = pool[pool != c]
        if len(cand) == 0:
            continue
        gc = haversine_miles(lat[c], lon[c], lat[cand], lon[cand])
        far = gc * KM_PER_MILE * ROAD_PER_AIR[0] >= MIN_ROAD_KM
        order = np.argsort(gc[far], kind="stable")[:ISOLATED_LINKS]
        for j, m in zip(cand[far][order], gc[far][order]):
            for a, b in ((c, j), (j, c)):
                miles[a, b], source[a, b], road[a, b] = round(float(m)), 4, np.nan

    o, d = np.nonzero(source > 0)
    mi = miles[o, d]
    src = source[o, d]

    # Time zones; drop routes on which no departure can arrive the same local day.
    tz = np.array([utc_offset_hours(a, b) if not np.isnan(a) else 99 for a, b in zip(lat, lon)], dtype=np.int64)
    tz[tz == 99] = int(np.median(tz[tz != 99])) if (tz != 99).any() else 0  # unplaceable: a typical zone
    shift = (tz[d] - tz[o]) * 60
    r_rng = np.random.default_rng([seed, 2])
    elapsed_mean = np.maximum(35.0, ELAPSED_BASE_MIN + ELAPSED_PER_MILE * mi + r_rng.normal(0, 6, len(o)))
    keep = (elapsed_mean + ELAPSED_SPREAD + shift <= 24 * 60 - 1) & (elapsed_mean + ELAPSED_SPREAD < 24 * 60)
    price_per_mile = np.clip(r_rng.lognormal(np.log(0.30), 0.22, len(o)), 0.17, 0.60)

    base = (weight[o] * weight[d]) ** WEIGHT_EXPONENT * _distance_factor(mi)
    rate = _calibrate(base, scale * OFFICIAL_DAILY, keep)
    sel = keep
    return RoutePlan(
        names,
        o[sel].astype(np.int32),
        d[sel].astype(np.int32),
        mi[sel],
        src[sel],
        road[o, d][sel],
        rate[sel],
        elapsed_mean[sel],
        price_per_mile[sel],
        shift[sel],
    )


def _distance_factor(mi: np.ndarray) -> np.ndarray:
    ramp = np.clip((mi - 60.0) / 190.0, 0.15, 1.0)  # short hops are thin
    tail = np.where(mi > 1000.0, (1000.0 / np.maximum(mi, 1.0)) ** 0.8, 1.0)
    return ramp * tail


def _calibrate(base: np.ndarray, target: float, keep: np.ndarray) -> np.ndarray:
    """rate = min(cap, C * base) with C solved so sum(rate over kept routes) = target (bisection)."""
    b = np.where(keep, base, 0.0)
    if target <= 0 or b.sum() <= 0:
        return np.zeros_like(b)
    cap_total = MAX_PER_ROUTE_DAY * np.count_nonzero(b)
    if target >= cap_total:
        return np.where(b > 0, float(MAX_PER_ROUTE_DAY), 0.0)
    lo, hi = 0.0, target / b[b > 0].min() + 1.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if np.minimum(MAX_PER_ROUTE_DAY, mid * b).sum() < target:
            lo = mid
        else:
            hi = mid
    return np.minimum(MAX_PER_ROUTE_DAY, hi * b)


def _coordinates(names, states, given, sym) -> tuple[np.ndarray, np.ndarray]:
    n = len(names)
    lat = np.array([given[c][0] if c in given else np.nan for c in names], dtype=float)
    lon = np.array([given[c][1] if c in given else np.nan for c in names], dtype=float)
    # A US-state city whose coordinates lie outside the US area is distrusted (source-data mix-ups).
    us_box = (lat >= 15) & (lat <= 72) & (lon >= -180) & (lon <= -60)
    bad = np.array([states.get(c) in US_STATES for c in names], dtype=bool) & ~np.isnan(lat) & ~us_box
    lat[bad] = lon[bad] = np.nan
    trusted = ~np.isnan(lat)
    # Cities with road distances to placed cities but no coordinates: the grid point whose great-circle
    # distances (times a typical road/air ratio) best match the road distances, nearest ones weighted most.
    coarse = np.meshgrid(np.arange(15.0, 72.0, 1.0), np.arange(-180.0, -59.0, 1.0), indexing="ij")
    fine = np.meshgrid(np.arange(-1.0, 1.01, 0.25), np.arange(-1.0, 1.01, 0.25), indexing="ij")
    for i in np.flatnonzero(~trusted):
        nb = np.flatnonzero(trusted & ~np.isnan(sym[i]) & (sym[i] > 0))
        if len(nb) < 3:
            continue
        nb = nb[np.argsort(sym[i, nb], kind="stable")[:60]]
        best = (0.0, 0.0)
        for stage in (0, 1):
            g_lat, g_lon = coarse if stage == 0 else (fine[0] + best[0], fine[1] + best[1])
            g_lat, g_lon = g_lat.ravel(), g_lon.ravel()
            gc_km = haversine_miles(g_lat[:, None], g_lon[:, None], lat[nb][None, :], lon[nb][None, :]) * KM_PER_MILE
            err = (((gc_km * 1.2 - sym[i, nb]) / np.maximum(sym[i, nb], 50.0)) ** 2).sum(axis=1)
            k = int(np.argmin(err))
            best = (float(g_lat[k]), float(g_lon[k]))
        lat[i], lon[i] = best
    # Still unknown: the mean of the same state's placed cities.
    for i in np.flatnonzero(np.isnan(lat)):
        same = [j for j in range(n) if j != i and states.get(names[j]) == states.get(names[i]) and not np.isnan(lat[j])]
        if same:
            lat[i], lon[i] = float(np.mean(lat[same])), float(np.mean(lon[same]))
    return lat, lon


# --- the generator --------------------------------------------------------------------------------
def synthesize_flights(
    cities: Sequence[City],
    distances: Iterable[Sequence],
    *,
    seed: int,
    fixed: Sequence[Flight] = (),
    covered: Iterable[tuple[str, str, str]] = (),
    dates: Sequence[str] | None = None,
    scale: float = 1.0,
    coords: Mapping[str, tuple[float, float]] | None = None,
    hubs: Mapping[str, float] | None = None,
    plan: RoutePlan | None = None,
) -> Iterator[Flight]:
    """Yield the fixed rows, then generated flights date by date (see the module docstring).

    `distances`: rows (origin, destination, duration, distance) as in the distance table.
    `coords`: optional city -> (lat, lon), used for time zones and for routes without road data.
    `hubs`: city -> traffic weight; default: the big real airports (OFFICIAL_HUBS).
    Same arguments and seed give identical rows in identical order.
    """
    fixed = [Flight(*f) for f in fixed]
    dates = list(MARCH_2022 if dates is None else dates)
    if plan is None:
        plan = plan_routes(cities, distances, seed=seed, fixed=fixed, coords=coords, hubs=hubs, scale=scale)
    yield from fixed

    n_routes, n_days = len(plan), len(dates)
    if n_routes == 0 or n_days == 0:
        return
    # Triples the generator must leave alone.
    route_of = plan.pairs()
    date_of = {d: k for k, d in enumerate(dates)}
    blocked: dict[int, list[int]] = {}
    for o, d, day in {*covered, *((f.origin, f.dest, f.flight_date) for f in fixed)}:
        r, k = route_of.get((o, d)), date_of.get(day)
        if r is not None and k is not None:
            blocked.setdefault(k, []).append(r)

    counts = np.empty((n_days, n_routes), dtype=np.int32)
    for k, day in enumerate(dates):
        c = np.random.default_rng([seed, 3, _day_key(day)]).poisson(plan.rate).astype(np.int32)
        if k in blocked:
            c[blocked[k]] = 0
        counts[k] = c
    total = int(counts.sum())

    # Unique numbers, none shared with fixed rows, increasing in emission order.
    taken = {int(f.flight_number[1:]) for f in fixed if re.fullmatch(r"F\d{7}", f.flight_number or "")}
    if total + len(taken) > NUMBER_SPACE:
        raise ValueError(f"{total} flights do not fit the 7-digit flight-number space; lower scale or dates")
    num_rng = np.random.default_rng([seed, 4])
    numbers = np.sort(num_rng.choice(NUMBER_SPACE, size=total + len(taken), replace=False))
    if taken:
        numbers = numbers[~np.isin(numbers, np.fromiter(taken, dtype=np.int64))][:total]
    else:
        numbers = numbers[:total]

    names = np.array(plan.names, dtype=object)
    miles_f = plan.miles.astype(float)
    start = 0
    for k, day in enumerate(dates):
        c = counts[k]
        m = int(c.sum())
        if m == 0:
            continue
        rng = np.random.default_rng([seed, 5, _day_key(day)])
        r = np.repeat(np.arange(n_routes), c)
        e = np.rint(plan.elapsed_mean[r] + np.clip(rng.normal(0, 8, m), -ELAPSED_SPREAD, ELAPSED_SPREAD))
        e = np.maximum(e, 30).astype(np.int64)
        s = plan.shift_min[r]
        lo = np.maximum(0, -(e + s))  # arrival not before midnight
        hi = 24 * 60 - 1 - e - s  # arrival not after 23:59
        pref_lo = np.where(rng.random(m) < RED_EYE_SHARE, 0, EARLIEST_DEP)
        lo = np.maximum(lo, np.minimum(pref_lo, hi))
        hi = np.maximum(lo, np.minimum(hi, LATEST_DEP))
        dep = lo + np.floor(rng.random(m) * (hi - lo + 1)).astype(np.int64)
        arr = dep + e + s
        price = np.maximum(
            15, np.rint(miles_f[r] * plan.price_per_mile[r] * np.clip(rng.lognormal(0, 0.2, m), 0.6, 1.9))
        )
        nums = numbers[start : start + m]
        start += m
        cols = (
            [f"F{x:07d}" for x in nums.tolist()],
            price.astype(np.int64).tolist(),
            _HHMM[dep].tolist(),
            _HHMM[arr].tolist(),
            _ELAPSED[e].tolist(),
            [day] * m,
            names[plan.origin[r]].tolist(),
            names[plan.dest[r]].tolist(),
            miles_f[r].tolist(),
        )
        yield from map(Flight._make, zip(*cols))


def _day_key(day: str) -> int:
    return _dt.date.fromisoformat(day).toordinal()


def expected_rows(plan: RoutePlan, n_days: int) -> float:
    return float(plan.rate.sum()) * n_days
