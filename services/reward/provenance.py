"""Where a score comes from: the world (its flights table above all) and the evaluation mode.

The validation and test plans of the benchmark name real flights; a world whose flights are
generated holds none of them (0 of the 187 legs of the validation example submission pass the
sandbox check), so their scores would be meaningless. Such an evaluation is refused unless the
caller insists, and then the reply says so.
"""

from __future__ import annotations

from typing import Any

from services.common.schemas import Provenance
from services.sandbox.world.store import world_hash

REAL_FLIGHTS_SPLITS = ("validation", "test")
LOAD_REAL_FLIGHTS = (
    "load the real flights file (clean_Flights_2022.csv of the official TravelPlanner "
    "database) with `star world build --flights-csv PATH` and serve that world "
    "(STAR_DB_URL), or insist with allow_synthetic_flights (the reply is then marked)"
)


def flights_kind(meta: dict[str, Any]) -> str:
    """real | synthetic | synthetic+train_rows | none | unknown, from the world's build metadata."""
    if meta.get("kind") == "synthetic":
        return "synthetic"
    source = str(meta.get("flights", ""))
    if source.startswith("csv:"):
        return "real"
    if source.startswith("synthetic"):
        reference = source.rsplit("+", 1)[-1].strip().split(" ", 1)[0] if "+" in source else "0"
        return "synthetic+train_rows" if reference.isdigit() and int(reference) > 0 else "synthetic"
    if source == "none":
        return "none"
    return "unknown"


def world_provenance(meta: dict[str, Any], mode: str) -> Provenance:
    kind = meta.get("kind")
    if meta.get("kind") == "synthetic":
        source = f"synthetic world {meta.get('size', '?')} (seed {meta.get('seed', '?')})"
    else:
        source = str(meta.get("flights", "unknown"))
    return Provenance(
        mode=mode,
        world=kind if kind in ("official", "synthetic") else "unknown",  # type: ignore[arg-type]
        flights=flights_kind(meta),
        flights_source=source,  # type: ignore[arg-type]
        world_hash=world_hash(meta),
    )


def refusal(provenance: Provenance, split: str | None) -> str | None:
    """Why a split cannot be scored on this world (None when it can)."""
    if split not in REAL_FLIGHTS_SPLITS or provenance.flights == "real":
        return None
    return (
        f"the {split} split names real flights, but this world's flights are {provenance.flights} "
        f"({provenance.flights_source}), so its flight legs would fail the sandbox check; {LOAD_REAL_FLIGHTS}"
    )
