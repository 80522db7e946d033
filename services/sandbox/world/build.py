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
    progress: Progress = _quiet,
) -> dict[str, Any]:
    """Load the real tables; flights from `flights_csv`, the directory's own file, or generated.

    Generated flights cover the real cities, agree with the distance table, and include the real
    flight rows of every `ref_info` file (so the official gold plans stay valid).
    """
    t0 = time.monotonic()
    layout = loader.OfficialLayout.find(directory)
    writer = WorldWriter(url)
    writer.reset()

    cities = loader.read_cities(layout)
    writer.insert("cities", cities)
    progress("cities", len(cities))
    for table, rows in (
        ("accommodations", loader.read_accommodations(layout.accommodations)),
        ("restaurants", loader.read_restaurants(layout.restaurants)),
        ("attractions", loader.read_attractions(layout.attractions)),
    ):
        progress(table, writer.insert(table, rows))
    distance_rows = list(loader.read_distances(layout.distances))
    progress("distances", writer.insert("distances", distance_rows))

    real_csv = flights_csv or layout.flights
    if real_csv is not None:
        flight_source = f"csv:{Path(real_csv).name}"
        n = writer.insert("flights", _report(loader.read_flights_csv(Path(real_csv)), "flights", progress))
    elif synthesize_flights:
        from services.sandbox.world.flights import synthesize_flights as generate

        fixed, covered = [], set()
        for path in ref_info:
            rows, triples = loader.reference_flights(Path(path))
            fixed.extend(rows)
            covered |= triples
        flight_source = f"synthetic(seed={seed}) + {len(fixed)} reference rows"
        stream = (tuple(f) + (True,) for f in generate(cities, distance_rows, seed=seed, fixed=fixed, covered=covered))
        n = writer.insert("flights", _report(stream, "flights", progress))
    else:
        flight_source, n = "none", 0

    meta = {
        "kind": "official",
        "source": str(layout.root.resolve()),
        "flights": flight_source,
        "flight_rows": n,
        "seed": seed,
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
