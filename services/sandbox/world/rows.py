"""Typed rows of the travel world, with the official column types (spec travelplanner.md §2).

Field order is the order the tools print columns in. `None` appears only in invisible rows,
which the read API never returns.
"""

from __future__ import annotations

from typing import NamedTuple


class City(NamedTuple):
    city: str
    state: str
    searchable: bool  # listed in citySet.txt (the two-stage agent's validation set)
    set_order: int | None = None  # line number in citySet.txt, whose order the official error text shows


class Flight(NamedTuple):
    flight_number: str  # "F" + 7 digits
    price: int  # per person, USD
    dep_time: str  # HH:MM local
    arr_time: str  # HH:MM local
    elapsed: str  # "<h> hours <m> minutes"
    flight_date: str  # YYYY-MM-DD
    origin: str
    dest: str
    distance: float  # miles


class Accommodation(NamedTuple):
    name: str
    price: float  # per night per room/unit
    room_type: str  # Entire home/apt | Private room | Shared room
    house_rules: str  # " & "-joined subset of No pets / No smoking / ...
    minimum_nights: float
    maximum_occupancy: int
    review_rate: float
    city: str


class Restaurant(NamedTuple):
    src_index: int  # row number in the official CSV (shown by old reference tables)
    name: str
    average_cost: int  # per person per meal
    cuisines: str  # ", "-joined
    rating: float
    city: str


class Attraction(NamedTuple):
    name: str
    latitude: float
    longitude: float
    address: str
    phone: str
    website: str
    city: str


class Distance(NamedTuple):
    origin: str
    destination: str
    duration: str | None  # "10 hours 55 mins"; None when the source cell is empty
    distance: str | None  # "1,144 km"; None when the source cell is empty
