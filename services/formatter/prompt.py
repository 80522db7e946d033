"""The extraction prompt of the LLM formatter: free-text plan → the benchmark's JSON day list.

Written in our own words; the format rules are the benchmark's (spec travelplanner.md §5,
agent-star.md §4.3). Bump `PROMPT_VERSION` whenever the text changes: it is part of the cache key.
"""

from __future__ import annotations

import json

from services.common.schemas import TravelQuery

PROMPT_VERSION = "fmt-2026-11-23.1"

SYSTEM = (
    "You convert travel plans written in free text into a strict JSON array. "
    "You copy information; you never invent, correct or complete it."
)

RULES = """\
Turn the travel plan below into a JSON array with one object per day of the trip, in day order.

Every object has exactly these keys:
  "day"            the day number, starting at 1
  "current_city"   "from <City A> to <City B>" on a day the traveller moves between cities, else "<City>"
  "transportation" how the traveller moves that day, or "-"
  "breakfast", "lunch", "dinner"   "<Restaurant name>, <City>" or "-"
  "attraction"     the day's sights as "<Name>, <City>;" items, each ending with ";" (e.g. "A, X;B, X;"), or "-"
  "accommodation"  "<Lodging name>, <City>" for the night, or "-"

How values are written:
- Keep names exactly as the plan spells them. Do not translate, shorten or fix them.
- A flight is "Flight Number: <F-number>, from <A> to <B>, Departure Time: <HH:MM>, Arrival Time: <HH:MM>".
- Driving is "Self-driving, from <A> to <B>, duration: <...>, distance: <...>, cost: <...>"; a taxi is
  "Taxi, from <A> to <B>, duration: <...>, distance: <...>, cost: <...>". Leave out parts the plan does not give.
- Write "-" for anything missing, vague ("a local cafe", "explore the city") or not needed.
- Drop currency signs ("$120" becomes "120").
- The last day usually has no accommodation: write "-" unless the plan names one.
- If the plan has fewer days than the trip, output only the days it has. Never add days.

Reply with the JSON array only: no explanation, no markdown fences, nothing before "[" or after "]"."""

EXAMPLE_QUERY = (
    "A 3-day trip for 2 people from Dallas to Peoria, March 4th to 6th 2022, budget $1,900, no flights please."
)
EXAMPLE_PLAN = """\
Here's what I put together for you.
Day 1 (March 4): Drive from Dallas to Peoria (self-driving, about 12 hours 30 mins, 1,345 km, cost $67).
Dinner at Tandoor Palace in Peoria, then check in at Lakeview Studio Apartment, Peoria.
Day 2: Stay in Peoria. Breakfast at Sunrise Bagels, Peoria. Visit the Peoria Riverfront Museum and
Glen Oak Park. Lunch at Taco Loco, Peoria; dinner at Nonna's Kitchen, Peoria. Same apartment.
Day 3: Breakfast somewhere near the hotel, see the Wildlife Prairie Park, Peoria, then drive back
to Dallas (self-driving, 12 hours 31 mins, 1,346 km, cost $67)."""
EXAMPLE_JSON = [
    {
        "day": 1,
        "current_city": "from Dallas to Peoria",
        "transportation": "Self-driving, from Dallas to Peoria, duration: 12 hours 30 mins, distance: 1,345 km, cost: 67",
        "breakfast": "-",
        "attraction": "-",
        "lunch": "-",
        "dinner": "Tandoor Palace, Peoria",
        "accommodation": "Lakeview Studio Apartment, Peoria",
    },
    {
        "day": 2,
        "current_city": "Peoria",
        "transportation": "-",
        "breakfast": "Sunrise Bagels, Peoria",
        "attraction": "Peoria Riverfront Museum, Peoria;Glen Oak Park, Peoria;",
        "lunch": "Taco Loco, Peoria",
        "dinner": "Nonna's Kitchen, Peoria",
        "accommodation": "Lakeview Studio Apartment, Peoria",
    },
    {
        "day": 3,
        "current_city": "from Peoria to Dallas",
        "transportation": "Self-driving, from Peoria to Dallas, duration: 12 hours 31 mins, distance: 1,346 km, cost: 67",
        "breakfast": "-",
        "attraction": "Wildlife Prairie Park, Peoria;",
        "lunch": "-",
        "dinner": "-",
        "accommodation": "-",
    },
]

EXAMPLE2_QUERY = "A 2-day trip from Sarasota to Chicago on March 16th-17th 2022 for one person, budget $1,200."
EXAMPLE2_PLAN = """\
**Day 1** — fly Sarasota → Chicago on F3573659 (leaves 08:04, lands 10:20). Dinner: Coco Bambu, Chicago.
Sleep at Cozy Room in Wicker Park, Chicago.
**Day 2** — Chicago. Lunch at Flying Mango, Chicago. Return flight F3573120 from Chicago to Sarasota at 19:00,
arriving 22:43."""
EXAMPLE2_JSON = [
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
        "current_city": "from Chicago to Sarasota",
        "transportation": "Flight Number: F3573120, from Chicago to Sarasota, Departure Time: 19:00, Arrival Time: 22:43",
        "breakfast": "-",
        "attraction": "-",
        "lunch": "Flying Mango, Chicago",
        "dinner": "-",
        "accommodation": "-",
    },
]


def describe_query(query: TravelQuery | None) -> str:
    if query is None:
        return "(not given)"
    text = query.query.strip() or (
        f"A {query.days}-day trip from {query.org} to {query.dest} for {query.people_number}, budget {query.budget}."
    )
    return f"{text}\nDates: {', '.join(query.date)}"


def _task(query_text: str, plan_text: str) -> str:
    return f"{RULES}\n\nTravel request:\n{query_text}\n\nTravel plan:\n{plan_text}"


def messages(query: TravelQuery | None, plan_text: str) -> list[dict[str, str]]:
    """The chat: system, two worked examples as earlier turns, then the real task."""
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": _task(EXAMPLE_QUERY, EXAMPLE_PLAN)},
        {"role": "assistant", "content": json.dumps(EXAMPLE_JSON, ensure_ascii=False)},
        {"role": "user", "content": _task(EXAMPLE2_QUERY, EXAMPLE2_PLAN)},
        {"role": "assistant", "content": json.dumps(EXAMPLE2_JSON, ensure_ascii=False)},
        {"role": "user", "content": _task(describe_query(query), plan_text)},
    ]


def repair_message(problem: str) -> str:
    """What we tell the model after a reply we could not use."""
    return (
        f"That reply could not be used: {problem}. Send the plan again as a JSON array of day objects "
        "with the keys day, current_city, transportation, breakfast, attraction, lunch, dinner, "
        'accommodation (string values, "-" for nothing), and nothing else.'
    )
