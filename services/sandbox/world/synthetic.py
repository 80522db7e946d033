"""A fully synthetic travel world in the official schema and value domains (spec §2).

Everything is generated from a seed: a fictional country of states and cities placed on a map
(US-like coordinates, so time zones and distances behave), then per city accommodations,
restaurants and attractions, a road-distance table, and flights (services.sandbox.world.flights,
the same generator the official world uses). Names are invented from syllables ("Velmora",
"Port Quorath") so they are obviously synthetic, yet readable and valid tool arguments (no commas,
no parentheses, no surrounding spaces).

Guarantees for query synthesis: every city in the city set has visible accommodations (an entire
home for 4+ people and a private room, with different house rules, bookable for one night) and
restaurants whose cuisines together cover the 15 labels when there are enough of them; every pair
of cities in one state has a road distance of less than a day's drive. Realistic quirks, at small
rates and configurable: invisible rows with an empty field, duplicate distance rows (some with
conflicting values: the first row wins), distance rows with empty cells (island states cannot be
driven to), cities without attractions, a city that is not searchable (like Jackson), and extra
cities that appear in the tables but not in the city set.

Sizes: PRESETS (tiny, small, medium, full), or a dict {"preset": name, **overrides}.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from services.sandbox.world.flights import KM_PER_MILE, MARCH_2022, OFFICIAL_DAILY, date_range, haversine_miles
from services.sandbox.world.rows import City

ROOM_TYPES = ("Entire home/apt", "Private room", "Shared room")
HOUSE_RULES = ("No pets", "No smoking", "No children under 10", "No parties", "No visitors")
CUISINES = (
    "Tea",
    "BBQ",
    "Seafood",
    "Cafe",
    "Desserts",
    "Pizza",
    "Fast Food",
    "Bakery",
    "Mediterranean",
    "French",
    "Mexican",
    "Chinese",
    "Indian",
    "Italian",
    "American",
)

# Preset knobs. Counts per city are (low, high) uniform, or (low, high, p_high) where p_high is
# the share of cities that get exactly `high` (the real attraction table is capped at 20).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        states=2,
        cities=6,
        map_extent=0.22,
        accommodations=(3, 4),
        restaurants=(4, 6),
        attractions=(2, 4),
        distance_rows=None,  # None: every ordered pair
        duplicate_distance_rows=1,
        conflicting_duplicates=1,
        flights_per_day=60,
        cities_without_attractions=0,
        unsearchable_cities=0,
        extra_cities=0,
        island_states=0,
        invisible_accommodations=1,
        invisible_restaurants=0,
        invisible_attractions=0,
        invisible_flights=0,
    ),
    "small": dict(
        states=4,
        cities=16,
        map_extent=0.4,
        accommodations=(4, 8),
        restaurants=(6, 12),
        attractions=(3, 8),
        distance_rows=None,
        duplicate_distance_rows=6,
        conflicting_duplicates=1,
        flights_per_day=600,
        cities_without_attractions=1,
        unsearchable_cities=0,
        extra_cities=0,
        island_states=0,
        invisible_accommodations=3,
        invisible_restaurants=1,
        invisible_attractions=1,
        invisible_flights=2,
    ),
    "medium": dict(
        states=12,
        cities=60,
        map_extent=0.75,
        accommodations=(6, 16),
        restaurants=(12, 30),
        attractions=(5, 15),
        distance_rows=3_000,
        duplicate_distance_rows=120,
        conflicting_duplicates=4,
        flights_per_day=6_000,
        cities_without_attractions=3,
        unsearchable_cities=0,
        extra_cities=1,
        island_states=1,
        invisible_accommodations=25,
        invisible_restaurants=2,
        invisible_attractions=2,
        invisible_flights=10,
    ),
    "full": dict(  # the benchmark's scale (spec §2.7)
        states=64,
        cities=312,
        map_extent=1.0,
        accommodations=(4, 28),
        restaurants=(16, 45),
        attractions=(2, 20, 0.9),
        distance_rows=17_602,
        duplicate_distance_rows=1_446,
        conflicting_duplicates=25,
        flights_per_day=OFFICIAL_DAILY * 1.002,  # >= 3.8 M rows over March despite Poisson noise
        cities_without_attractions=35,
        unsearchable_cities=1,
        extra_cities=3,
        island_states=2,
        invisible_accommodations=100,
        invisible_restaurants=5,
        invisible_attractions=5,
        invisible_flights=40,
    ),
}
# dates: (first, last) inclusive, default March 2022; hub_share: share of cities that are hubs.
COMMON_DEFAULTS: dict[str, Any] = dict(dates=None, hub_share=0.08)

_ROOT_A = (
    "Vel",
    "Zan",
    "Quor",
    "Thal",
    "Mir",
    "Oro",
    "Kess",
    "Dra",
    "Ysel",
    "Bel",
    "Cor",
    "Fen",
    "Lum",
    "Nym",
    "Ost",
    "Pry",
    "Rav",
    "Sor",
    "Tyr",
    "Ulm",
    "Vex",
    "Wyn",
    "Xan",
    "Yor",
    "Zir",
    "Ar",
    "Esk",
    "Ild",
    "Jun",
    "Kal",
    "Brim",
    "Cael",
    "Dun",
    "Elv",
    "Gorm",
    "Hesk",
    "Isk",
    "Jor",
    "Lor",
    "Mor",
    "Nor",
    "Pel",
    "Quel",
    "Ryn",
    "Sil",
    "Tam",
    "Vor",
    "Wes",
    "Zol",
    "Ald",
)
_ROOT_B = (
    "mora",
    "thal",
    "dor",
    "wyn",
    "ris",
    "vane",
    "holm",
    "ferra",
    "quay",
    "lith",
    "more",
    "ven",
    "dell",
    "spire",
    "mar",
    "gard",
    "ona",
    "iel",
    "oth",
    "ara",
    "ux",
    "ith",
    "brook",
    "crest",
    "haven",
    "ford",
    "mouth",
    "wick",
    "stead",
    "moor",
)
_CITY_PREFIX = ("Port ", "Lake ", "Fort ", "New ", "Mount ", "East ", "West ")
_CITY_SUFFIX = (" Falls", " Harbor", " Springs", " Crossing", " Bay", " Heights", " Junction")
_STATE_SUFFIX = ("ia", "ora", "and", "eth", "onia", "ara", "ica", "esh", "avia", "undra")
_STREETS = (
    "Main",
    "Oak",
    "Lantern",
    "Quill",
    "Harbor",
    "Ember",
    "Willow",
    "Granite",
    "Mill",
    "Beacon",
    "Cedar",
    "Juniper",
    "Copper",
    "Orchard",
    "Falcon",
    "River",
    "Summit",
    "Meadow",
    "Kestrel",
    "Aster",
)
_STREET_KIND = ("St", "Ave", "Rd", "Blvd", "Ln", "Dr", "Way")
_SURNAMES = (
    "Marlow",
    "Quince",
    "Ashby",
    "Thorne",
    "Vance",
    "Okoro",
    "Lindqvist",
    "Farrow",
    "Delacroix",
    "Pemberton",
    "Nakamura",
    "Rourke",
    "Sterling",
    "Valdez",
    "Whitlock",
    "Yearwood",
    "Zeller",
    "Brannigan",
    "Castell",
    "Dunmore",
)
_FOOD_ADJ = (
    "Golden",
    "Rustic",
    "Little",
    "Crimson",
    "Salty",
    "Smoky",
    "Hungry",
    "Velvet",
    "Copper",
    "Blue",
    "Wild",
    "Lucky",
    "Humble",
    "Twisted",
    "Silver",
)
_FOOD_NOUN = (
    "Spoon",
    "Lantern",
    "Fig",
    "Kettle",
    "Anchor",
    "Pepper",
    "Oven",
    "Olive",
    "Barrel",
    "Ladle",
    "Garden",
    "Harbor",
    "Table",
    "Skillet",
    "Mango",
)
_FOOD_KIND = ("Kitchen", "Grill", "Bistro", "Diner", "Cafe", "Eatery", "Tavern", "Canteen", "Trattoria", "Bakehouse")
_CHAINS = ("Bytebite Burgers", "Pizzatron", "Noodle Nebula", "Taco Orbit", "Cluckworks")
_ACC_ADJ = (
    "Cozy",
    "Sunny",
    "Spacious",
    "Charming",
    "Quiet",
    "Bright",
    "Modern",
    "Rustic",
    "Stylish",
    "Airy",
    "Renovated",
    "Hidden",
)
_ACC_UNIT = {
    "Entire home/apt": ("{n}BR apartment", "loft", "cottage", "townhouse", "{n} bedroom home", "studio", "bungalow"),
    "Private room": ("private room", "bedroom", "room with private bath", "guest room", "garden room"),
    "Shared room": ("shared room", "bunk in shared dorm", "shared loft space", "couch in shared flat"),
}
_ACC_WHERE = (
    "near {city} center",
    "in Old {city}",
    "by the river",
    "close to the park",
    "on a quiet street",
    "steps from the market",
    "with city view",
    "near the station",
    "in the arts district",
)
_ATTR_PATTERNS = (
    "{city} Museum of {topic}",
    "{root} Park",
    "{root} Botanical Garden",
    "Old {city} Lighthouse",
    "{root} Falls Trail",
    "{city} Art Gallery",
    "{root} Nature Reserve",
    "{city} Science Center",
    "{root} Historic District",
    "{root} Memorial",
    "{city} Aquarium",
    "{root} Lake Overlook",
    "{city} Zoo",
    "{root} Observatory",
    "{root} Castle Ruins",
    "{city} Farmers Market",
)
_TOPICS = (
    "Natural History",
    "Flight",
    "Maritime History",
    "Modern Art",
    "Clockwork",
    "Textiles",
    "Railways",
    "Folk Music",
    "Minerals",
    "Lanterns",
)


@dataclass
class SyntheticWorld:
    """Generated tables as lists of tuples in WorldWriter column order (with `visible` where it exists)."""

    params: dict[str, Any]
    cities: list[City]
    coords: dict[str, tuple[float, float]]
    hubs: dict[str, float]
    accommodations: list[tuple] = field(default_factory=list)
    restaurants: list[tuple] = field(default_factory=list)
    attractions: list[tuple] = field(default_factory=list)
    distances: list[tuple] = field(default_factory=list)


def resolve_size(size: str | dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """('tiny' | ... | dict with optional 'preset' and overrides) -> (label, full parameter dict)."""
    if isinstance(size, str):
        if size not in PRESETS:
            raise ValueError(f"unknown world size {size!r}; choose one of {', '.join(PRESETS)} or pass a dict")
        return size, {**COMMON_DEFAULTS, **PRESETS[size]}
    if not isinstance(size, dict):
        raise TypeError("size must be a preset name or a dict of overrides")
    over = dict(size)
    base = over.pop("preset", "tiny")
    if base not in PRESETS:
        raise ValueError(f"unknown preset {base!r}")
    known = set(PRESETS[base]) | set(COMMON_DEFAULTS)
    unknown = set(over) - known
    if unknown:
        raise ValueError(f"unknown size keys {sorted(unknown)}; known: {sorted(known)}")
    params = {**COMMON_DEFAULTS, **PRESETS[base], **over}
    if params["cities"] < params["states"]:
        raise ValueError("need at least one city per state")
    return f"{base}+custom", params


# --- names -----------------------------------------------------------------------------------------
class _Names:
    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.used: set[str] = set()

    def _pick(self, seq):
        return seq[int(self.rng.integers(len(seq)))]

    def unique(self, make) -> str:
        for _ in range(1000):
            name = make()
            if name not in self.used:
                self.used.add(name)
                return name
        raise RuntimeError("name space exhausted")

    def root(self) -> str:
        return self._pick(_ROOT_A) + self._pick(_ROOT_B)

    def city(self) -> str:
        def make():
            base = self.root()
            u = self.rng.random()
            if u < 0.12:
                return self._pick(_CITY_PREFIX) + base
            if u < 0.22:
                return base + self._pick(_CITY_SUFFIX)
            return base

        return self.unique(make)

    def state(self) -> str:
        def make():
            name = self._pick(_ROOT_A) + self._pick(_STATE_SUFFIX)
            return ("North " + name) if self.rng.random() < 0.08 else name

        return self.unique(make)


def _state_codes(states: list[str]) -> dict[str, str]:
    codes: dict[str, str] = {}
    used: set[str] = set()
    for s in states:
        letters = [ch.upper() for ch in s.replace("North ", "N") if ch.isalpha()]
        for second in letters[1:] + [chr(c) for c in range(65, 91)]:
            code = letters[0] + second
            if code not in used:
                break
        used.add(code)
        codes[s] = code
    return codes


# --- geography -------------------------------------------------------------------------------------
def _split_cities(rng, n_states: int, n_cities: int) -> list[int]:
    """Cities per state: a few big states, many small ones, every state at least one city."""
    if n_states == 1:
        return [n_cities]
    w = rng.pareto(1.2, n_states) + 0.3
    counts = np.ones(n_states, dtype=int)
    rest = n_cities - n_states
    if rest > 0:
        counts += rng.multinomial(rest, w / w.sum())
    if n_cities >= 3 * n_states:  # small worlds: every state can host a 3-city trip
        while counts.min() < 3:
            counts[np.argmin(counts)] += 1
            counts[np.argmax(counts)] -= 1
    return counts.tolist()


def _place(
    rng,
    n: int,
    center: tuple[float, float],
    radius_km: float,
    min_sep_km: float,
    box: tuple[float, float, float, float],
) -> list[tuple[float, float]]:
    pts: list[tuple[float, float]] = []
    sep = min_sep_km
    tries = 0
    while len(pts) < n:
        tries += 1
        if tries % 200 == 0:
            sep *= 0.8
        ang, rad = rng.uniform(0, 2 * math.pi), radius_km * math.sqrt(rng.uniform(0, 1))
        lat = center[0] + rad * math.sin(ang) / 111.0
        lon = center[1] + rad * math.cos(ang) / (111.0 * math.cos(math.radians(center[0])))
        lat = min(max(lat, box[0]), box[1])
        lon = min(max(lon, box[2]), box[3])
        if all(haversine_miles(lat, lon, a, b) * KM_PER_MILE >= sep for a, b in pts):
            pts.append((round(lat, 6), round(lon, 6)))
    return pts


MAINLAND = (27.0, 48.5, -123.0, -70.0)  # lat/lon box of the fictional mainland (US-like time zones)


def _mainland(extent: float) -> tuple[float, float, float, float]:
    """The mainland box shrunk around its centre (small worlds: every drive under a day)."""
    clat, clon = (MAINLAND[0] + MAINLAND[1]) / 2, (MAINLAND[2] + MAINLAND[3]) / 2
    hlat, hlon = (MAINLAND[1] - MAINLAND[0]) / 2 * extent, (MAINLAND[3] - MAINLAND[2]) / 2 * extent
    return (clat - hlat, clat + hlat, clon - hlon, clon + hlon)


ISLANDS = ((20.5, -157.5), (18.3, -66.0), (57.5, -152.0))  # island groups: Hawaii-, Caribbean-, Alaska-like


def _geography(rng, params, names: _Names):
    n_states, n_cities = params["states"], params["cities"]
    n_island = min(params["island_states"], max(0, n_states - 1))
    land = _mainland(params["map_extent"])
    counts = _split_cities(rng, n_states, n_cities)
    states = [names.state() for _ in range(n_states)]
    # Islands get small states; big states stay on the mainland.
    order = np.argsort(counts, kind="stable")
    island_idx = set(order[:n_island].tolist())
    centers: list[tuple[float, float]] = []
    radii = [90.0 + 45.0 * math.sqrt(c) for c in counts]
    k_island = 0
    for s in range(n_states):
        if s in island_idx:
            base = ISLANDS[k_island % len(ISLANDS)]
            k_island += 1
            centers.append((base[0] + rng.uniform(-0.5, 0.5), base[1] + rng.uniform(-0.5, 0.5)))
            continue
        sep = 1.0
        for attempt in range(5000):
            if attempt and attempt % 300 == 0:
                sep *= 0.85
            c = (rng.uniform(land[0], land[1]), rng.uniform(land[2], land[3]))
            ok = True
            for t, c2 in enumerate(centers):
                if t in island_idx:
                    continue
                if haversine_miles(c[0], c[1], c2[0], c2[1]) * KM_PER_MILE < sep * (radii[s] + radii[t]):
                    ok = False
                    break
            if ok:
                break
        centers.append(c)
    city_rows: list[tuple[str, str, float, float, bool]] = []  # name, state, lat, lon, island
    for s, (state, c, k) in enumerate(zip(states, centers, counts)):
        island = s in island_idx
        radius = 60.0 + 25.0 * math.sqrt(k) if island else radii[s]
        box = (c[0] - 3, c[0] + 3, c[1] - 4, c[1] + 4) if island else land
        for lat, lon in _place(rng, k, c, radius, 40.0 if island else 60.0, box):
            city_rows.append((names.city(), state, lat, lon, island))
    return states, city_rows


# --- value formats -------------------------------------------------------------------------------------
def format_km(km: float) -> str:
    """Google-style distance text: '41.7 km', '693 km', '1,144 km'."""
    if km < 100:
        return f"{km:.1f} km"
    return f"{int(round(km)):,} km"


def format_duration(minutes: float) -> str:
    """Google-style duration text: '45 mins', '1 hour 1 min', '10 hours 55 mins', '1 day 2 hours'."""
    m = int(round(minutes))
    if m >= 24 * 60:
        d, h = divmod(int(round(m / 60.0)), 24)
        return f"{d} day{'s' if d != 1 else ''} {h} hour{'s' if h != 1 else ''}"
    h, mm = divmod(max(m, 1), 60)
    mins = f"{mm} min{'s' if mm != 1 else ''}"
    if h == 0:
        return mins
    return f"{h} hour{'s' if h != 1 else ''} {mins}"


# --- tables ------------------------------------------------------------------------------------------------
def _count(rng, spec) -> int:
    lo, hi = spec[0], spec[1]
    if len(spec) > 2 and rng.random() < spec[2]:
        return int(hi)
    return int(rng.integers(lo, hi + 1))


def _house_rules(rng) -> str:
    k = int(rng.choice([1, 2, 3], p=[0.5, 0.33, 0.17]))
    return " & ".join(HOUSE_RULES[i] for i in rng.choice(5, size=k, replace=False))


def _accommodations(rng, city: str, n: int, forced: bool) -> list[tuple]:
    rows = []
    # Slots 0-3 make typical queries feasible: entire homes and private rooms, 1-night minimum,
    # with pairwise different single house rules (any one rule a query needs is allowed somewhere).
    rules_perm = [HOUSE_RULES[i] for i in rng.permutation(5)]
    for k in range(n):
        if forced and k < 4:
            room = ROOM_TYPES[k % 2]
            rules = rules_perm[k]
            min_nights = 1.0
            occ = int(rng.integers(4, 9)) if room == ROOM_TYPES[0] else 2
        else:
            room = ROOM_TYPES[int(rng.choice(3, p=[0.52, 0.455, 0.025]))]
            rules = _house_rules(rng)
            min_nights = float(
                rng.choice([1, 2, 3, 4, 5, 7, 10, 14, 30], p=[0.26, 0.26, 0.17, 0.08, 0.055, 0.045, 0.015, 0.01, 0.105])
            )
            occ = (
                int(min(11, 2 + rng.geometric(0.35) - 1))
                if room == ROOM_TYPES[0]
                else int(rng.integers(1, 3))
                if room == ROOM_TYPES[1]
                else 1
            )
        price = float(int(rng.integers(50, 1201)))
        review = float(rng.choice([1, 2, 3, 4, 5], p=[0.11, 0.215, 0.225, 0.225, 0.225]))
        rows.append((_acc_name(rng, room, city), price, room, rules, min_nights, occ, review, city, True))
    return rows


def _acc_name(rng, room: str, city: str) -> str:
    unit = _ACC_UNIT[room][int(rng.integers(len(_ACC_UNIT[room])))].format(n=int(rng.integers(1, 5)))
    where = _ACC_WHERE[int(rng.integers(len(_ACC_WHERE)))].format(city=city)
    adj = _ACC_ADJ[int(rng.integers(len(_ACC_ADJ)))]
    u = rng.random()
    if u < 0.2:
        return f"{adj} {unit}, {where}"  # commas in names, as in the real table
    if u < 0.3:
        return f"{adj.upper()} {unit.upper()}!"
    return f"{adj} {unit} {where}"


def _restaurants(rng, city: str, n: int, names: set[str]) -> list[tuple]:
    rows = []
    labels = [CUISINES[i] for i in rng.permutation(len(CUISINES))]
    cursor = 0
    for _ in range(n):
        k = int(rng.choice([2, 3, 4, 5, 6], p=[0.08, 0.25, 0.34, 0.25, 0.08]))
        chosen: list[str] = []
        while len(chosen) < k:  # round-robin first, so the city covers every label it can
            lab = labels[cursor % len(labels)] if cursor < len(labels) else CUISINES[int(rng.integers(len(CUISINES)))]
            cursor += 1
            if lab not in chosen:
                chosen.append(lab)
        rng.shuffle(chosen)
        u = rng.random()
        if u < 0.06:
            name = _CHAINS[int(rng.integers(len(_CHAINS)))]  # chains repeat across (and within) cities
        else:
            for _ in range(50):
                v = rng.random()
                if v < 0.35:
                    name = f"{_SURNAMES[int(rng.integers(len(_SURNAMES)))]}'s {_FOOD_KIND[int(rng.integers(len(_FOOD_KIND)))]}"
                elif v < 0.7:
                    name = f"The {_FOOD_ADJ[int(rng.integers(len(_FOOD_ADJ)))]} {_FOOD_NOUN[int(rng.integers(len(_FOOD_NOUN)))]}"
                else:
                    name = f"{_FOOD_NOUN[int(rng.integers(len(_FOOD_NOUN)))]} & {_FOOD_NOUN[int(rng.integers(len(_FOOD_NOUN)))]}"
                if (name, city) not in names:
                    break
        names.add((name, city))
        cost = int(rng.integers(10, 101)) if rng.random() < 0.985 else int(rng.integers(101, 251))
        rating = 0.0 if rng.random() < 0.22 else float(np.clip(round(rng.normal(3.35, 0.5), 1), 1.8, 4.9))
        rows.append((name, cost, ", ".join(chosen), rating, city))
    return rows


def _attractions(rng, city: str, state_code: str, lat: float, lon: float, n: int, area: int) -> list[tuple]:
    rows = []
    seen: set[str] = set()
    for _ in range(n):
        for _ in range(50):
            pat = _ATTR_PATTERNS[int(rng.integers(len(_ATTR_PATTERNS)))]
            name = pat.format(
                city=city,
                root=_ROOT_A[int(rng.integers(len(_ROOT_A)))] + _ROOT_B[int(rng.integers(len(_ROOT_B)))],
                topic=_TOPICS[int(rng.integers(len(_TOPICS)))],
            )
            if name not in seen:
                break
        seen.add(name)
        a_lat = round(lat + rng.normal(0, 0.04), 7)
        a_lon = round(lon + rng.normal(0, 0.05), 7)
        street = f"{int(rng.integers(1, 9999))} {_STREETS[int(rng.integers(len(_STREETS)))]} {_STREET_KIND[int(rng.integers(len(_STREET_KIND)))]}"
        address = f"{street}, {city}, {state_code} {int(rng.integers(10000, 99999)):05d}, USA"
        phone = (
            "Unknown"
            if rng.random() < 0.21
            else f"({area}) {int(rng.integers(200, 1000))}-{int(rng.integers(0, 10000)):04d}"
        )
        slug = "".join(ch for ch in name.lower() if ch.isalnum())[:24]
        website = (
            "Unknown"
            if rng.random() < 0.2
            else f"https://www.{slug}.org/"
            if rng.random() < 0.5
            else f"http://{slug}.com/"
        )
        rows.append((name, a_lat, a_lon, address, phone, website, city))
    return rows


def _distance_rows(rng, params, names: list[str], state_of: dict[str, str], lat, lon, island) -> list[tuple]:
    n = len(names)
    gc_km = haversine_miles(lat[:, None], lon[:, None], lat[None, :], lon[None, :]) * KM_PER_MILE
    ratio = rng.uniform(1.15, 1.45, size=(n, n))
    ratio = np.triu(ratio, 1) + np.triu(ratio, 1).T
    road = gc_km * ratio * (1 + rng.normal(0, 0.002, size=(n, n)))  # directions differ a little
    speed = rng.uniform(95, 112, size=(n, n))
    speed = np.where(road < 60, speed * 0.7, speed)
    minutes = road / speed * 60.0 * (1 + rng.normal(0, 0.01, size=(n, n)))
    same_state = np.array([[state_of[a] == state_of[b] for b in names] for a in names])
    np.fill_diagonal(same_state, False)

    all_pairs = n * (n - 1)
    target = params["distance_rows"]
    unique_target = all_pairs if target is None else min(all_pairs, max(0, target - params["duplicate_distance_rows"]))
    chosen = np.zeros((n, n), dtype=bool)
    if unique_target >= all_pairs:
        chosen[:] = True
        np.fill_diagonal(chosen, False)
    else:
        chosen |= same_state
        # every city gets its nearest neighbours across state lines, then random pairs fill up
        k = max(1, min(n - 1, int(0.35 * unique_target / n)))
        order = np.argsort(gc_km + np.eye(n) * 1e9, axis=1, kind="stable")[:, :k]
        rows_idx = np.repeat(np.arange(n), k)
        chosen[rows_idx, order.ravel()] = True
        chosen[order.ravel(), rows_idx] = True
        np.fill_diagonal(chosen, False)
        free = np.flatnonzero(~chosen.ravel() & ~np.eye(n, dtype=bool).ravel())
        need = unique_target - int(chosen.sum())
        if need > 0:
            chosen.ravel()[rng.choice(free, size=min(need, len(free)), replace=False)] = True
    rows: list[tuple] = []
    for i in range(n):
        js = np.flatnonzero(chosen[i])
        rng.shuffle(js)
        for j in js.tolist():
            if island[i] != island[j] or (island[i] and state_of[names[i]] != state_of[names[j]]):
                rows.append((names[i], names[j], None, None))  # no road across the sea
            else:
                rows.append((names[i], names[j], format_duration(minutes[i, j]), format_km(road[i, j])))
    # Duplicates appended later in the file; a few conflict (the first row is the one tools use).
    n_dup = min(params["duplicate_distance_rows"], len(rows))
    if n_dup:
        picks = rng.choice(len(rows), size=n_dup, replace=False)
        n_conf = min(params["conflicting_duplicates"], n_dup)
        for t, p in enumerate(picks.tolist()):
            o, d, dur, dist = rows[p]
            if t < n_conf and dist is not None:
                i, j = names.index(o), names.index(d)
                dist = format_km(road[i, j] * 1.03 + 1)
                dur = format_duration(minutes[i, j] * 1.04 + 2)
            rows.append((o, d, dur, dist))
    return rows


def generate_world(size: str | dict[str, Any] = "tiny", seed: int = 0) -> SyntheticWorld:
    """Every table but the flights (generated on the fly by the builder) of a synthetic world."""
    label, params = resolve_size(size)
    rng = np.random.default_rng([seed, 11])
    names = _Names(np.random.default_rng([seed, 12]))
    states, city_rows = _geography(rng, params, names)
    codes = _state_codes(states)

    # Extra cities: in the tables, not in the city set (like the real accommodation table's extras).
    extra_rows = []
    for _ in range(params["extra_cities"]):
        host = city_rows[int(rng.integers(len(city_rows)))]
        extra_rows.append(
            (names.city(), host[1], host[2] + rng.uniform(-0.8, 0.8), host[3] + rng.uniform(-0.8, 0.8), host[4])
        )
    n_real = len(city_rows)
    unsearchable = set(rng.choice(n_real, size=min(params["unsearchable_cities"], n_real), replace=False).tolist())
    # Hubs: the most populous cities (random populations); they get spokes to everywhere.
    pop = rng.lognormal(0, 0.7, n_real)
    hub_count = max(1, int(round(params["hub_share"] * n_real)))
    hub_idx = np.argsort(-pop, kind="stable")[:hub_count]
    hubs = {city_rows[i][0]: float(5 + 5 * rng.random()) for i in hub_idx.tolist()}
    for i in range(n_real):
        hubs.setdefault(city_rows[i][0], float(np.clip(pop[i], 0.3, 3.0)))

    cities = [City(r[0], r[1], i not in unsearchable) for i, r in enumerate(city_rows)]
    all_rows = city_rows + extra_rows
    coords = {r[0]: (r[2], r[3]) for r in all_rows}
    world = SyntheticWorld(params=params | {"label": label}, cities=cities, coords=coords, hubs=hubs)

    no_attr = set()
    k_no_attr = min(params["cities_without_attractions"], n_real)
    if k_no_attr:
        no_attr = set(rng.choice(n_real, size=k_no_attr, replace=False).tolist())
    rest_names: set[tuple[str, str]] = set()
    area_codes = rng.choice(np.arange(201, 990), size=len(all_rows), replace=len(all_rows) > 789)
    for i, (city, state, lat, lon, _island) in enumerate(all_rows):
        extra = i >= n_real
        n_acc = _count(rng, params["accommodations"])
        n_rest = _count(rng, params["restaurants"])
        n_attr = 0 if i in no_attr else _count(rng, params["attractions"])
        if extra:
            n_acc, n_rest, n_attr = max(1, n_acc // 3), max(1, n_rest // 3), 0
        world.accommodations += _accommodations(rng, city, n_acc, forced=not extra)
        world.restaurants += _restaurants(rng, city, n_rest, rest_names)
        world.attractions += _attractions(rng, city, codes[state], lat, lon, n_attr, int(area_codes[i]))

    # Invisible rows: extra rows with an empty field (the loaders' dropna hides them from tools),
    # so every city keeps its generated visible rows.
    real = all_rows[:n_real]

    def pick_city():
        return real[int(rng.integers(n_real))]

    def make_acc():
        c = pick_city()
        return _accommodations(rng, c[0], 1, forced=False)[0]

    def make_rest():
        c = pick_city()
        return (*_restaurants(rng, c[0], 1, rest_names)[0], True)

    def make_attr():
        c = pick_city()
        return (*_attractions(rng, c[0], codes[c[1]], c[2], c[3], 1, 555)[0], True)

    world.accommodations = _add_invisible(
        rng, world.accommodations, params["invisible_accommodations"], make_acc, (0, 1, 3, 4, 6)
    )
    world.restaurants = _add_invisible(
        rng, [(*r, True) for r in world.restaurants], params["invisible_restaurants"], make_rest, (0, 2, 3)
    )
    world.attractions = _add_invisible(
        rng, [(*r, True) for r in world.attractions], params["invisible_attractions"], make_attr, (3, 4, 5)
    )
    # Interleave cities a little, as real files are not grouped by city; restaurants keep their
    # source row number (`src_index`) like the official file's unnamed index column.
    world.accommodations = _shuffle_blocks(rng, world.accommodations)
    world.restaurants = [(i, *r) for i, r in enumerate(_shuffle_blocks(rng, world.restaurants))]

    lat = np.array([r[2] for r in all_rows])
    lon = np.array([r[3] for r in all_rows])
    island = np.array([r[4] for r in all_rows])
    state_of = {r[0]: r[1] for r in all_rows}
    world.distances = _distance_rows(rng, params, [r[0] for r in all_rows], state_of, lat, lon, island)
    return world


def _shuffle_blocks(rng, rows: list[tuple]) -> list[tuple]:
    """Keep rows mostly grouped by city but swap some neighbours (file order looks organic)."""
    rows = list(rows)
    for i in range(1, len(rows)):
        if rng.random() < 0.1:
            rows[i - 1], rows[i] = rows[i], rows[i - 1]
    return rows


def _add_invisible(rng, rows: list[tuple], k: int, make, fields: tuple[int, ...]) -> list[tuple]:
    """Insert k generated rows, each with one empty field and visible=False, at random positions."""
    out = list(rows)
    for _ in range(max(0, k)):
        row = list(make())
        row[fields[int(rng.integers(len(fields)))]] = None
        row[-1] = False
        out.insert(int(rng.integers(len(out) + 1)), tuple(row))
    return out


def iter_flights(world: SyntheticWorld, seed: int) -> Iterator[tuple]:
    """Flight table tuples (with `visible`) for a synthetic world, a few made invisible."""
    from services.sandbox.world.flights import expected_rows, plan_routes, synthesize_flights

    params = world.params
    dates = date_range(*params["dates"]) if params.get("dates") else list(MARCH_2022)
    scale = params["flights_per_day"] / OFFICIAL_DAILY
    plan = plan_routes(world.cities, world.distances, seed=seed, coords=world.coords, hubs=world.hubs, scale=scale)
    k = params["invisible_flights"]
    blank: set[int] = set()
    if k:
        bound = max(1, int(0.9 * expected_rows(plan, len(dates))))
        blank = set(np.random.default_rng([seed, 13]).choice(bound, size=min(k, bound), replace=False).tolist())
    for i, f in enumerate(synthesize_flights(world.cities, world.distances, seed=seed, dates=dates, plan=plan)):
        if i in blank:
            yield (f[0], None, *f[2:], False)  # an empty price: dropped by the official loader's dropna
        else:
            yield (*f, True)
