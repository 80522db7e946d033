"""The travel world: SQL tables, loaders for real data, synthetic generators, and the read API."""

from services.sandbox.world.rows import Accommodation, Attraction, Distance, Flight, Restaurant
from services.sandbox.world.store import World

__all__ = ["Accommodation", "Attraction", "Distance", "Flight", "Restaurant", "World"]
