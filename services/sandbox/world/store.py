"""Reading and writing the travel world in SQL.

`World` is the read API the tools and the evaluator share; `WorldWriter` bulk-loads tables
(used by the loaders and generators). Both work on SQLite files and PostgreSQL URLs.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, bindparam as _bind, create_engine, event, func, select

from services.sandbox.world import schema
from services.sandbox.world.rows import Accommodation, Attraction, City, Distance, Flight, Restaurant


def make_engine(url: str, *, for_write: bool = False) -> Engine:
    """An engine tuned for the world's access pattern: many tiny indexed reads, rare bulk writes."""
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"check_same_thread": False})

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn, _record) -> None:  # noqa: ANN001
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA cache_size=-65536")  # 64 MiB page cache per connection
            cur.execute("PRAGMA mmap_size=1073741824")
            if for_write:
                cur.execute("PRAGMA journal_mode=OFF")
                cur.execute("PRAGMA synchronous=OFF")
            cur.close()

        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=8, max_overflow=8)


# No city, state, name, flight number or date in any world is this long; longer keys skip the database.
MAX_KEY_CHARS = 1024


def searchable(value: Any) -> bool:
    """Whether `value` could equal a stored text key at all. SQL drivers are less forgiving than
    a DataFrame's `==`: PostgreSQL rejects NUL bytes and UTF-8 encoding fails on lone surrogates,
    so such values are answered "no rows" without asking the database."""
    if not isinstance(value, str) or len(value) > MAX_KEY_CHARS or "\x00" in value:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates
        return False
    return True


class World:
    """Read-only view of a built world. All lookups are exact, case-sensitive equality."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.engine = make_engine(url)
        c, f, a, r, t, d = (
            schema.cities,
            schema.flights,
            schema.accommodations,
            schema.restaurants,
            schema.attractions,
            schema.distances,
        )
        self._q_state = select(c.c.city).where(c.c.state == _bind("state")).order_by(c.c.id)
        self._q_flights = (
            select(
                f.c.flight_number,
                f.c.price,
                f.c.dep_time,
                f.c.arr_time,
                f.c.elapsed,
                f.c.flight_date,
                f.c.origin,
                f.c.dest,
                f.c.distance,
            )
            .where(
                f.c.origin == _bind("origin"),
                f.c.dest == _bind("dest"),
                f.c.flight_date == _bind("date"),
                f.c.visible.is_(True),
            )
            .order_by(f.c.id)
        )
        self._q_flight_number = (
            select(
                f.c.flight_number,
                f.c.price,
                f.c.dep_time,
                f.c.arr_time,
                f.c.elapsed,
                f.c.flight_date,
                f.c.origin,
                f.c.dest,
                f.c.distance,
            )
            .where(f.c.flight_number == _bind("number"), f.c.visible.is_(True))
            .order_by(f.c.id)
        )
        self._q_acc = (
            select(
                a.c.name,
                a.c.price,
                a.c.room_type,
                a.c.house_rules,
                a.c.minimum_nights,
                a.c.maximum_occupancy,
                a.c.review_rate,
                a.c.city,
            )
            .where(a.c.city == _bind("city"), a.c.visible.is_(True))
            .order_by(a.c.id)
        )
        self._q_rest = (
            select(r.c.src_index, r.c.name, r.c.average_cost, r.c.cuisines, r.c.rating, r.c.city)
            .where(r.c.city == _bind("city"), r.c.visible.is_(True))
            .order_by(r.c.id)
        )
        self._q_attr = (
            select(t.c.name, t.c.latitude, t.c.longitude, t.c.address, t.c.phone, t.c.website, t.c.city)
            .where(t.c.city == _bind("city"), t.c.visible.is_(True))
            .order_by(t.c.id)
        )
        self._q_dist = (
            select(d.c.origin, d.c.destination, d.c.duration, d.c.distance)
            .where(d.c.origin == _bind("origin"), d.c.destination == _bind("destination"))
            .order_by(d.c.id)
            .limit(1)
        )

    # --- background -------------------------------------------------------------------------
    def cities(self) -> list[City]:
        c = schema.cities.c
        with self.engine.connect() as conn:
            rows = conn.execute(select(c.city, c.state, c.searchable, c.set_order).order_by(c.id))
            return [City(*row) for row in rows]

    def city_set(self) -> list[str]:
        """The cities an agent may search, in citySet.txt order (world order where it has none)."""
        return [
            c.city
            for c in sorted(
                (c for c in self.cities() if c.searchable), key=lambda c: -1 if c.set_order is None else c.set_order
            )
        ]

    def cities_in_state(self, state: str) -> list[str]:
        with self.engine.connect() as conn:
            return [row[0] for row in conn.execute(self._q_state, {"state": state})]

    # --- the tool lookups -------------------------------------------------------------------
    def flights(self, origin: str, dest: str, date: str) -> list[Flight]:
        with self.engine.connect() as conn:
            return [
                Flight(*row) for row in conn.execute(self._q_flights, {"origin": origin, "dest": dest, "date": date})
            ]

    def flight_by_number(self, number: str) -> list[Flight]:
        with self.engine.connect() as conn:
            return [Flight(*row) for row in conn.execute(self._q_flight_number, {"number": number})]

    def accommodations(self, city: str) -> list[Accommodation]:
        with self.engine.connect() as conn:
            return [Accommodation(*row) for row in conn.execute(self._q_acc, {"city": city})]

    def restaurants(self, city: str) -> list[Restaurant]:
        with self.engine.connect() as conn:
            return [Restaurant(*row) for row in conn.execute(self._q_rest, {"city": city})]

    def attractions(self, city: str) -> list[Attraction]:
        with self.engine.connect() as conn:
            return [Attraction(*row) for row in conn.execute(self._q_attr, {"city": city})]

    def distance(self, origin: str, destination: str) -> Distance | None:
        """The first row for the ordered pair, as the official tool reads it (duplicates ignored)."""
        with self.engine.connect() as conn:
            row = conn.execute(self._q_dist, {"origin": origin, "destination": destination}).first()
            return Distance(*row) if row else None

    # --- bookkeeping ------------------------------------------------------------------------
    def meta(self) -> dict[str, Any]:
        with self.engine.connect() as conn:
            return {
                k: json.loads(v) for k, v in conn.execute(select(schema.world_meta.c.key, schema.world_meta.c.value))
            }

    def identity(self) -> dict[str, Any]:
        """Which world this is: `world_identity` of its build metadata."""
        return world_identity(self.meta())

    def counts(self) -> dict[str, int]:
        """Visible rows per table (what the tools can see)."""
        out: dict[str, int] = {}
        with self.engine.connect() as conn:
            for name, table in schema.TABLES.items():
                stmt = select(func.count()).select_from(table)
                if "visible" in table.c:
                    stmt = stmt.where(table.c.visible.is_(True))
                out[name] = conn.execute(stmt).scalar_one()
        return out

    def problem(self) -> str | None:
        """Why this world cannot be served (None when it can): absent, unreachable, or stale."""
        try:
            meta = self.meta()
        except Exception as exc:  # noqa: BLE001 - any DB error means "not ready"
            return f"no world at {self._safe_url()} ({type(exc).__name__}); run `star world build`"
        if not meta:
            return f"the world at {self._safe_url()} is empty or half-built; run `star world build`"
        version = meta.get("schema_version")
        if version != schema.WORLD_SCHEMA_VERSION:
            return (
                f"the world at {self._safe_url()} has schema version {version}, this code needs "
                f"{schema.WORLD_SCHEMA_VERSION}; rebuild it with `star world build`"
            )
        return None

    def is_ready(self) -> bool:
        return self.problem() is None

    def _safe_url(self) -> str:
        return self.engine.url.render_as_string(hide_password=True)

    def close(self) -> None:
        self.engine.dispose()


class WorldWriter:
    """Bulk loader: drop and recreate tables, stream rows in, then index and stamp metadata."""

    BATCH = 20_000

    def __init__(self, url: str) -> None:
        self.url = url
        self.engine = make_engine(url, for_write=True)
        self._next_id: dict[str, int] = {}

    def reset(self) -> None:
        if self.engine.dialect.name == "sqlite" and self.engine.url.database not in (None, "", ":memory:"):
            # Unlinking a big world file is instant; DROP TABLE on it takes seconds.
            self.engine.dispose()
            Path(self.engine.url.database).unlink(missing_ok=True)
        schema.metadata.drop_all(self.engine)
        for ix in schema.INDEXES:
            ix.drop(self.engine, checkfirst=True)
        schema.metadata.create_all(self.engine)
        self._next_id = {name: 0 for name in schema.TABLES}

    def insert(self, table: str, rows: Iterable[Sequence[Any]]) -> int:
        """Append rows (tuples in column order, without `id`); ids continue the table's order."""
        tbl = schema.TABLES[table]
        cols = [c.name for c in tbl.columns]
        n = 0
        start = self._next_id.get(table, 0)
        raw = self.engine.raw_connection()
        try:
            cur = raw.cursor()
            if self.engine.dialect.name == "postgresql":
                with cur.copy(f"COPY {table} ({', '.join(cols)}) FROM STDIN") as copy:
                    for i, row in enumerate(rows):
                        copy.write_row((start + i, *row))
                        n += 1
            else:
                ph = ", ".join("?" for _ in cols)
                sql = f"INSERT INTO {table} ({', '.join(cols)}) VALUES ({ph})"
                for batch in _batched(((start + i, *row) for i, row in enumerate(rows)), self.BATCH):
                    cur.executemany(sql, batch)
                    n += len(batch)
            raw.commit()
        finally:
            raw.close()
        self._next_id[table] = start + n
        return n

    def finish(self, meta: dict[str, Any]) -> None:
        meta = {**meta, "schema_version": schema.WORLD_SCHEMA_VERSION}
        for ix in schema.INDEXES:
            ix.create(self.engine, checkfirst=True)
        with self.engine.begin() as conn:
            conn.execute(schema.world_meta.delete())
            conn.execute(schema.world_meta.insert(), [{"key": k, "value": json.dumps(v)} for k, v in meta.items()])
            conn.exec_driver_sql("ANALYZE")
        self.engine.dispose()


def _batched(it: Iterable[Any], n: int) -> Iterator[list[Any]]:
    batch: list[Any] = []
    for item in it:
        batch.append(item)
        if len(batch) >= n:
            yield batch
            batch = []
    if batch:
        yield batch


def world_hash(meta: dict[str, Any]) -> str:
    """SHA-256 (first 16 hex digits) of a world's build metadata (its build time included): two
    services agree on it only when they read one build of the world."""
    blob = json.dumps({k: v for k, v in meta.items() if k != "seconds"}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def world_source(meta: dict[str, Any]) -> str:
    """A world in words: `synthetic world tiny (seed 0)`, `official tables (flights: ...)`."""
    if meta.get("kind") == "synthetic":
        return f"synthetic world {meta.get('size', '?')} (seed {meta.get('seed', '?')})"
    if meta.get("kind") == "official":
        return f"official tables (flights: {meta.get('flights', 'unknown')})"
    return "unknown world"


def world_identity(meta: dict[str, Any]) -> dict[str, Any]:
    """What services and the controller compare: the hash, the words, and the fields a recipe names."""
    return {
        "world_hash": world_hash(meta),
        "source": world_source(meta),
        "kind": meta.get("kind"),
        "size": meta.get("size"),
        "seed": meta.get("seed"),
    }
