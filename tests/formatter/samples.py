"""A query, its plan as JSON days, and the same plan as prose (shared by the formatter tests)."""

import json

from services.common.schemas import TravelQuery

QUERY = TravelQuery(
    org="Sarasota",
    dest="Chicago",
    days=3,
    visiting_city_number=1,
    people_number=1,
    date=["2022-03-16", "2022-03-17", "2022-03-18"],
    budget=1900,
    query="Plan a 3-day trip from Sarasota to Chicago, March 16-18 2022, budget $1,900.",
)
DAYS = [
    {
        "day": 1,
        "current_city": "from Sarasota to Chicago",
        "transportation": "Flight Number: F3573659, from Sarasota to Chicago, Departure Time: 08:04, Arrival Time: 10:20",
        "breakfast": "-",
        "attraction": "-",
        "lunch": "-",
        "dinner": "Coco Bambu, Chicago",
        "accommodation": "Cozy Room in Wicker Park, Chicago",
    },
    {
        "day": 2,
        "current_city": "Chicago",
        "transportation": "-",
        "breakfast": "Dial A Cake, Chicago",
        "attraction": "Millennium Park, Chicago;",
        "lunch": "Flying Mango, Chicago",
        "dinner": "Cafe Southall, Chicago",
        "accommodation": "Cozy Room in Wicker Park, Chicago",
    },
    {
        "day": 3,
        "current_city": "from Chicago to Sarasota",
        "transportation": "Flight Number: F3573120, from Chicago to Sarasota, Departure Time: 19:00, Arrival Time: 22:43",
        "breakfast": "-",
        "attraction": "-",
        "lunch": "-",
        "dinner": "-",
        "accommodation": "-",
    },
]
GOOD = json.dumps(DAYS)
PROSE = (
    "On day 1 I fly F3573659 from Sarasota to Chicago, dine at Coco Bambu and sleep at Cozy Room in "
    "Wicker Park. Day 2 is Millennium Park with meals at Dial A Cake, Flying Mango and Cafe Southall. "
    "Day 3 I fly home on F3573120."
)
