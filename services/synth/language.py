"""Query records → natural language: varied templates per difficulty (offline, the default) and
an LLM back-translation backend over any OpenAI-compatible chat-completions API.

Templates are our own phrasing. Each query draws an opener, a trip sentence, a budget sentence
and one sentence per constraint from small pools, in a seeded order, so 1,000 queries read as
many different requests while every fact of the record is stated exactly once.
"""

from __future__ import annotations

import datetime as dt
import json
import random
import time
from typing import Any

import httpx

from services.common.schemas import TravelQuery

NUMBER_WORDS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight"}


def ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def spoken_date(iso: str) -> str:
    d = dt.date.fromisoformat(iso)
    return f"{d.strftime('%B')} {ordinal(d.day)}"


def money(amount: int) -> str:
    return f"${amount:,}"


def _join(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


# --- pools ---------------------------------------------------------------------------------------

_OPENERS = {
    "solo": [
        "Please plan a trip for me.",
        "I need a travel itinerary.",
        "Could you put together a trip plan for me?",
        "Help me plan a journey.",
        "I'd like an itinerary, please.",
        "",
    ],
    "group": [
        "Please plan a trip for our group.",
        "We need a travel itinerary.",
        "Could you organise a trip for us?",
        "Help us plan a journey.",
        "Our group would like an itinerary.",
        "",
    ],
}
_TRIPS = [
    "{who_cap} {will} leave from {org} for a {days}-day trip to {where}, from {start} to {end}, 2022.",
    "The trip starts in {org} on {start} and ends back there on {end}, 2022: {days} days visiting {where}.",
    "Departure is from {org}; {who} would like {days} days in {where}, {start} through {end}, 2022.",
    "{who_cap} {want} to go from {org} to {where} for {days} days, {start} to {end}, 2022.",
    "Plan {days} days in {where}, starting and ending in {org}, between {start} and {end}, 2022.",
]
_BUDGETS = [
    "The whole trip must stay within {budget}.",
    "Our budget is {budget} in total.",
    "Please keep the total cost under {budget}.",
    "{budget} is all we can spend.",
    "The budget for everything is {budget}.",
]
_SOLO_BUDGETS = [
    "The whole trip must stay within {budget}.",
    "My budget is {budget} in total.",
    "Please keep the total cost under {budget}.",
    "{budget} is all I can spend.",
    "The budget for everything is {budget}.",
]
_RULES = {
    "pets": [
        "{we} travel with pets, so the place must accept them.",
        "Pets come along; the accommodation has to allow pets.",
    ],
    "smoking": [
        "The accommodation must allow smoking.",
        "{we} smoke, so please pick places where smoking is permitted.",
    ],
    "parties": [
        "{we} plan to host a small party, so the accommodation must allow parties.",
        "Parties must be allowed where {we} stay.",
    ],
    "children under 10": [
        "{we} bring children under 10, so the place must welcome them.",
        "The accommodation must allow children under 10.",
    ],
    "visitors": [
        "{we} expect visitors, so the accommodation must allow them.",
        "Visitors must be allowed where {we} stay.",
    ],
}
_ROOMS = {
    "shared room": ["A shared room is fine and preferred.", "{we_cap} would like to stay in a shared room."],
    "not shared room": ["{we_cap} do not want to share a room.", "No shared rooms, please."],
    "private room": ["{we_cap} would like a private room.", "Please book private rooms."],
    "entire room": [
        "{we_cap} want an entire home or apartment to ourselves.",
        "Please book entire homes or apartments.",
    ],
}
_CUISINES = [
    "{we_cap} would like to try {cuisines} food.",
    "Meals should include {cuisines} cuisine.",
    "Please include restaurants serving {cuisines} food.",
]
_TRANSPORT = {
    "no flight": ["{we_cap} do not want to fly.", "Please avoid flights.", "No flights, please."],
    "no self-driving": [
        "{we_cap} will not drive ourselves.",
        "Please do not plan any self-driving.",
        "Self-driving is not an option.",
    ],
}


def template_text(q: TravelQuery, rng: random.Random) -> str:
    """A natural-language request stating every field of `q`, phrased by `rng`."""
    solo = q.people_number == 1
    who = "I" if solo else f"the {NUMBER_WORDS.get(q.people_number, str(q.people_number))} of us"
    we = "I" if solo else "we"
    fill = {
        "org": q.org,
        "days": q.days,
        "start": spoken_date(q.date[0]),
        "end": spoken_date(q.date[-1]),
        "who": who,
        "who_cap": who[0].upper() + who[1:],
        "will": "will",
        "want": "want" if not solo else "want",
        "budget": money(q.budget),
        "we": we,
        "we_cap": we[0].upper() + we[1:],
    }
    fill["where"] = q.dest if q.days == 3 else f"{NUMBER_WORDS[q.visiting_city_number]} cities in {q.dest}"
    parts = [rng.choice(_OPENERS["solo" if solo else "group"]), rng.choice(_TRIPS).format(**fill)]
    tail = [rng.choice(_SOLO_BUDGETS if solo else _BUDGETS).format(**fill)]
    lc = q.local_constraint
    if lc.house_rule:
        tail.append(rng.choice(_RULES[lc.house_rule]).format(**fill))
    if lc.room_type:
        tail.append(rng.choice(_ROOMS[lc.room_type]).format(**fill))
    if lc.cuisine:
        tail.append(rng.choice(_CUISINES).format(cuisines=_join(list(lc.cuisine)), **{k: v for k, v in fill.items()}))
    if lc.transportation:
        tail.append(rng.choice(_TRANSPORT[lc.transportation]).format(**fill))
    rng.shuffle(tail)
    text = " ".join(p for p in parts + tail if p)
    return text[0].upper() + text[1:]


# --- LLM back-translation ------------------------------------------------------------------------

BACKTRANSLATE_SYSTEM = "You turn structured travel requests into one natural request a traveller would write."
BACKTRANSLATE_PROMPT = """Write the travel request described by this JSON as a traveller would, in one paragraph.
State every fact exactly once: origin city, destination, number of days, the dates, the number of
people, the total budget, and each constraint that is not null. Notes:
- "dest" is a city for 3-day trips; for 5 and 7 days it is a state and "visiting_city_number"
  cities in it are visited.
- "house rule" names something the accommodation must allow; "room type" is the kind of room;
  "transportation" rules out flights or driving oneself; "cuisine" lists food to try.
Reply with the request only.

Example JSON: {"org": "Denver", "dest": "Tucson", "days": 3, "date": ["2022-03-02", "2022-03-03", "2022-03-04"], "people_number": 1, "local_constraint": {"house rule": null, "cuisine": null, "room type": null, "transportation": null}, "budget": 1200}
Example request: I'm flying solo from Denver to Tucson for three days, March 2nd to 4th, 2022, and want to keep it under $1,200.

JSON: {record}
Request:"""


class BackTranslationError(RuntimeError):
    pass


class BackTranslator:
    """Back-translation through an OpenAI-compatible `/chat/completions` endpoint."""

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        temperature: float = 0.7,
        top_p: float = 0.95,
        max_tokens: int = 512,
        attempts: int = 3,
        timeout: float = 60.0,
        client: httpx.Client | None = None,
    ) -> None:
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.params = {"temperature": temperature, "top_p": top_p, "max_tokens": max_tokens}
        self.attempts = max(1, attempts)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = client or httpx.Client(timeout=timeout, headers=headers)

    def __call__(self, q: TravelQuery) -> str:
        record = json.dumps(record_of(q, with_text=False), ensure_ascii=False)
        body = {
            "model": self.model,
            **self.params,
            "messages": [
                {"role": "system", "content": BACKTRANSLATE_SYSTEM},
                {"role": "user", "content": BACKTRANSLATE_PROMPT.replace("{record}", record)},
            ],
        }
        last = "no attempt made"
        for attempt in range(self.attempts):
            try:
                resp = self.client.post(self.url, json=body)
                if resp.status_code != 200:
                    last = f"HTTP {resp.status_code}: {resp.text[:200]}"
                else:
                    text = (resp.json()["choices"][0]["message"]["content"] or "").strip()
                    if text:
                        return text
                    last = "empty reply"
            except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            time.sleep(min(0.1 * (attempt + 1), 1.0))
        raise BackTranslationError(f"back-translation failed after {self.attempts} attempts: {last}")

    def close(self) -> None:
        self.client.close()


def record_of(q: TravelQuery, *, with_text: bool = True, layout: str = "json") -> dict[str, Any]:
    """The benchmark's field layout (spec travelplanner.md §4). layout "json": `date` a list and
    `local_constraint` an object with the official keys (Agent-STAR's records); "official": both
    as Python-repr strings, as in the HF TravelPlanner dataset (HF `datasets` then keeps the
    dates as text instead of guessing timestamps)."""
    date: Any = list(q.date)
    constraint: Any = q.local_constraint.to_official()
    if layout == "official":
        date, constraint = repr(date), repr(constraint)
    elif layout != "json":
        raise ValueError(f"layout must be 'json' or 'official', not {layout!r}")
    out: dict[str, Any] = {
        "org": q.org,
        "dest": q.dest,
        "days": q.days,
        "visiting_city_number": q.visiting_city_number,
        "date": date,
        "people_number": q.people_number,
        "local_constraint": constraint,
        "budget": q.budget,
    }
    if with_text:
        out["query"] = q.query
        out["level"] = q.level
    return out
