"""SQL tables of the travel world (SQLAlchemy Core; SQLite by default, PostgreSQL by URL).

Every table keeps source order in `id` (tools print rows in file order) and a `visible`
flag: rows with an empty field exist for the record but are invisible to tools and evaluator,
as in the official loaders' `dropna()`. Indexes cover exactly the lookups the tools make.
"""

from __future__ import annotations

from sqlalchemy import Boolean, Column, Float, Index, Integer, MetaData, String, Table, Text

metadata = MetaData()

# Bumped whenever a table changes; a world built under another version must be rebuilt.
WORLD_SCHEMA_VERSION = 2

cities = Table(
    "cities",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=False),
    Column("city", Text, nullable=False),
    Column("state", Text, nullable=False),
    Column("searchable", Boolean, nullable=False),
    Column("set_order", Integer),
)

flights = Table(
    "flights",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=False),
    Column("flight_number", String(16)),
    Column("price", Integer),
    Column("dep_time", String(8)),
    Column("arr_time", String(8)),
    Column("elapsed", String(32)),
    Column("flight_date", String(10)),
    Column("origin", Text),
    Column("dest", Text),
    Column("distance", Float),
    Column("visible", Boolean, nullable=False),
)

accommodations = Table(
    "accommodations",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=False),
    Column("name", Text),
    Column("price", Float),
    Column("room_type", Text),
    Column("house_rules", Text),
    Column("minimum_nights", Float),
    Column("maximum_occupancy", Integer),
    Column("review_rate", Float),
    Column("city", Text),
    Column("visible", Boolean, nullable=False),
)

restaurants = Table(
    "restaurants",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=False),
    Column("src_index", Integer),
    Column("name", Text),
    Column("average_cost", Integer),
    Column("cuisines", Text),
    Column("rating", Float),
    Column("city", Text),
    Column("visible", Boolean, nullable=False),
)

attractions = Table(
    "attractions",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=False),
    Column("name", Text),
    Column("latitude", Float),
    Column("longitude", Float),
    Column("address", Text),
    Column("phone", Text),
    Column("website", Text),
    Column("city", Text),
    Column("visible", Boolean, nullable=False),
)

distances = Table(
    "distances",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=False),
    Column("origin", Text, nullable=False),
    Column("destination", Text, nullable=False),
    Column("duration", Text),
    Column("distance", Text),
)

world_meta = Table(
    "world_meta",
    metadata,
    Column("key", String(64), primary_key=True),
    Column("value", Text, nullable=False),
)

# Every lookup the tools and the evaluator make. `create_all` builds them with the tables:
# dropping them during bulk loads was measured to save nothing (3.8 M flights: 45 s either way).
INDEXES = [
    Index("ix_cities_state", cities.c.state, cities.c.id),
    Index("ix_cities_city", cities.c.city),
    Index("ix_flights_route_date", flights.c.origin, flights.c.dest, flights.c.flight_date, flights.c.id),
    Index("ix_flights_number", flights.c.flight_number),
    Index("ix_accommodations_city", accommodations.c.city, accommodations.c.id),
    Index("ix_restaurants_city", restaurants.c.city, restaurants.c.id),
    Index("ix_attractions_city", attractions.c.city, attractions.c.id),
    Index("ix_distances_pair", distances.c.origin, distances.c.destination, distances.c.id),
]

TABLES = {t.name: t for t in (cities, flights, accommodations, restaurants, attractions, distances)}
