"""Build a world database: from the official directory, or fully synthetic.

Builds are deterministic from a seed and report progress through a callback, so the CLI can
draw a progress bar and the services can log.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from services.sandbox.world import loader
from services.sandbox.world.store import WorldWriter

Progress = Callable[[str, int], None]  # (stage, rows just written)
DEFAULT_FLIGHT_SCALE = 0.15  # ~570 K generated flights: the real March 2022 share of the table; builds in seconds


def _quiet(_stage: str, _n: int) -> None:
    pass


def build_official_world(
    url: str,
    directory: Path,
    *,
    seed: int = 0,
    flights_csv: Path | None = None,
    ref_info: list[Path] = (),
    synthesize_flights: bool = True,
    flight_scale: float = DEFAULT_FLIGHT_SCALE,
    flight_dates: list[str] | None = None,
    progress: Progress = _quiet,
) -> dict[str, Any]:
    """Load the real tables; flights from `flights_csv`, the directory's own file, or generated.

    Generated flights cover the real cities, agree with the distance table, and include the real
    flight rows of every `ref_info` file (so the official gold plans stay valid). `flight_scale`
    sets their density: 1.0 is the paper's table size put into March 2022 (~3.8 M rows, 35-50 s to
    build on 2 cores); the default 0.15 (~570 K rows, the real March share) builds in ~6 s.
    `flight_dates` (a list of YYYY-MM-DD) replaces March 2022.
    """
    t0 = time.monotonic()
    layout = loader.OfficialLayout.find(directory)
    writer = WorldWriter(url)
    writer.reset()

    cities = loader.read_cities(layout)
    writer.insert("cities", cities)
    progress("cities", len(cities))
    attraction_rows = list(loader.read_attractions(layout.attractions))
    for table, rows in (
        ("accommodations", loader.read_accommodations(layout.accommodations)),
        ("restaurants", loader.read_restaurants(layout.restaurants)),
        ("attractions", attraction_rows),
    ):
        progress(table, writer.insert(table, rows))
    distance_rows = list(loader.read_distances(layout.distances))
    progress("distances", writer.insert("distances", distance_rows))

    real_csv = flights_csv or layout.flights
    if real_csv is not None:
        flight_source = f"csv:{Path(real_csv).name}"
        n = writer.insert("flights", _report(loader.read_flights_csv(Path(real_csv)), "flights", progress))
    elif synthesize_flights:
        from services.sandbox.world.flights import city_coordinates_from_attractions, synthesize_flights as generate

        fixed, covered, seen = [], set(), set()
        for path in ref_info:
            rows, triples = loader.reference_flights(Path(path))
            fixed.extend(r for r in rows if r.flight_number not in seen)
            seen.update(r.flight_number for r in rows)
            covered |= triples
        flight_source = f"synthetic(seed={seed}, scale={flight_scale}) + {len(fixed)} reference rows"
        coords = city_coordinates_from_attractions(r for r in attraction_rows if r[-1])
        stream = generate(
            cities,
            distance_rows,
            seed=seed,
            fixed=fixed,
            covered=covered,
            dates=flight_dates,
            scale=flight_scale,
            coords=coords,
        )
        n = writer.insert("flights", _report(_visible(stream), "flights", progress))
    else:
        flight_source, n = "none", 0

    meta = {
        "kind": "official",
        "source": str(layout.root.resolve()),
        "flights": flight_source,
        "flight_rows": n,
        "seed": seed,
        "flight_scale": flight_scale if real_csv is None and synthesize_flights else None,
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    progress("indexes", 0)
    writer.finish(meta)
    meta["seconds"] = round(time.monotonic() - t0, 2)
    return meta


def _report(rows, stage: str, progress: Progress, every: int = 50_000):
    n = 0
    for row in rows:
        yield row
        n += 1
        if n % every == 0:
            progress(stage, every)
    progress(stage, n % every)


def _visible(rows):
    """Table tuples (row fields + visible=True) for generated rows."""
    for row in rows:
        yield (*row, True)


def build_synthetic_world(
    url: str,
    *,
    size: str | dict[str, Any] = "tiny",
    seed: int = 0,
    progress: Progress = _quiet,
) -> dict[str, Any]:
    """Write a fully synthetic world (every table, official schema and value domains).

    `size`: a preset name (tiny | small | medium | full) or a dict {"preset": name, **overrides}
    (see services.sandbox.world.synthetic.PRESETS). Deterministic from `seed`.
    """
    from services.sandbox.world import synthetic

    t0 = time.monotonic()
    world = synthetic.generate_world(size, seed=seed)
    writer = WorldWriter(url)
    writer.reset()
    total: dict[str, int] = {}
    for table, rows in (
        ("cities", world.cities),
        ("accommodations", world.accommodations),
        ("restaurants", world.restaurants),
        ("attractions", world.attractions),
        ("distances", world.distances),
    ):
        total[table] = writer.insert(table, rows)
        progress(table, total[table])
    hidden_flights = 0

    def count_hidden(rows):
        nonlocal hidden_flights
        for row in rows:
            hidden_flights += not row[-1]
            yield row

    total["flights"] = writer.insert(
        "flights", _report(count_hidden(synthetic.iter_flights(world, seed)), "flights", progress)
    )

    def visible(rows, flag=-1):
        return sum(1 for r in rows if r[flag])

    label = size if isinstance(size, str) else world.params["label"]
    meta = {
        "kind": "synthetic",
        "size": label,
        "params": {k: v for k, v in world.params.items() if k != "label"},
        "seed": seed,
        "rows": total,
        "visible_rows": {
            "cities": total["cities"],
            "accommodations": visible(world.accommodations),
            "restaurants": visible(world.restaurants),
            "attractions": visible(world.attractions),
            "distances": total["distances"],
            "flights": total["flights"] - hidden_flights,
        },
        "states": len({c.state for c in world.cities}),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    progress("indexes", 0)
    writer.finish(meta)
    meta["seconds"] = round(time.monotonic() - t0, 2)
    return meta
