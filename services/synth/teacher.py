"""Teacher trajectories for SFT, in our agent protocol (services/rollout/protocol.py).

Oracle teacher: the oracle's plan retold as the ReAct episode of a careful agent. It lists the
destination state's cities (5/7-day trips), then for every leg searches the flight and/or the
road it takes, and in every city it stays in searches accommodations, restaurants and
attractions; each call runs against the real sandbox (the `ToolBox` in-process, or the sandbox
service over HTTP) and its real text is the tool response. A short thought in our own words
precedes each call; it restates the request's transport, room and cuisine preferences where the
agent acts on them ("by road since flights are ruled out", "(Private room)", "For Thai: …").
The last turn carries the plan in the structured form (`services/formatter/structured.py`)
inside `<answer>`. Every trajectory is checked before it is kept: its answer is parsed back with
`parse_plan` and must score success under the strict evaluator.

LLM teacher: any OpenAI-compatible model runs through the rollout agent loop
(`services.rollout.agent.Agent` with the `OpenAIEngine`); only trajectories whose answer parses
and scores success under the strict evaluator are kept (rejection sampling, as the paper does).

Both write SFT data as chat JSONL: one `{"messages": [{"role", "content"}, ...], ...}` per line,
which our learner, TRL (`messages` column) and LLaMA-Factory (sharegpt, `dataset_info.json`) read.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx

from services.common.schemas import LocalConstraint, Score, TravelQuery
from services.formatter.structured import PlanTextError, parse_plan, render_plan
from services.reward import Evaluator
from services.rollout.protocol import (
    format_answer,
    format_tool_call,
    parse_turn,
    system_prompt,
    tool_response,
    user_message,
)
from services.synth.index import Eatery, Stay
from services.synth.language import money, record_of
from services.synth.oracle import Leg, Oracle, Solution


class TeacherError(RuntimeError):
    pass


# =============================================================================================
# tools
# =============================================================================================


class ToolRunner(Protocol):
    def __call__(self, name: str, arguments: dict[str, Any]) -> str: ...


class InProcessTools:
    """The sandbox's `ToolBox`, called directly (no faults: a teacher shows clean episodes)."""

    def __init__(self, toolbox) -> None:
        self.toolbox = toolbox

    def __call__(self, name: str, arguments: dict[str, Any]) -> str:
        return self.toolbox.call(name, arguments, fault_rate=0.0).text


class HttpTools:
    """The sandbox service: `POST {url}/tools/call`."""

    def __init__(self, base_url: str, *, timeout: float = 30.0, dialect: str | None = None) -> None:
        self.client = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout)
        self.dialect = dialect

    def __call__(self, name: str, arguments: dict[str, Any]) -> str:
        body: dict[str, Any] = {"name": name, "arguments": arguments, "fault_rate": 0.0}
        if self.dialect:
            body["dialect"] = self.dialect
        reply = self.client.post("/tools/call", json=body)
        if reply.status_code != 200:
            raise TeacherError(f"sandbox answered HTTP {reply.status_code} to {name}: {reply.text[:200]}")
        return reply.json()["text"]

    def close(self) -> None:
        self.client.close()


# =============================================================================================
# oracle teacher
# =============================================================================================


@dataclass
class TeacherSample:
    """One kept trajectory: the chat, its tool calls, and the evaluator's verdict."""

    id: str
    query: TravelQuery
    messages: list[dict[str, str]]
    calls: list[tuple[str, dict[str, Any]]]
    score: Score
    teacher: str
    cost: float | None = None

    def record(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "teacher": self.teacher,
            "messages": self.messages,
            "query": {"id": self.query.id, **record_of(self.query)},
            "tool_calls": len(self.calls),
            "cost": self.cost,
            "success": self.score.success,
            "score": self.score.model_dump(),
        }


def _think(rng: random.Random, options: Sequence[str], **facts: Any) -> str:
    return rng.choice(options).format(**facts)


_T_START = [
    "{who} from {org} to {where}, {start} to {end}, budget {budget}{extras}. {first}",
    "The request: {days} days from {org} to {where} ({start}–{end}) for {who_short}, at most {budget}{extras}. {first}",
]
_T_STATE = [
    "First I need the cities of {state} to choose {k} of them.",
    "Let me see which cities {state} offers before picking {k}.",
]
_T_FIRST_CITY = [
    "First I check how to get from {o} to {d} on {date}{how}.",
    "I start with the way from {o} to {d} on {date}{how}.",
]
_T_CITIES = [
    "{state} has {n} cities. I will try {route}, which keeps the legs short and the stays cheap; "
    "now the way from {o} to {d} on {date}{how}.",
    "Candidates in {state}: {n} cities. My route: {route}. Next, travel from {o} to {d} on {date}{how}.",
]
_T_FLIGHT_TAXI = [
    "{flight_note} A taxi may be cheaper for {people}; let me check the road from {o} to {d}.",
    "{flight_note} I compare with a taxi from {o} to {d}.",
]
_T_AFTER_LEG = [
    "{leg_note} Now places to stay in {city} for {nights} night(s){room}.",
    "{leg_note} Next I look for accommodation in {city} ({nights} night(s){room}).",
]
_T_REST = ["{stay_note} Now restaurants in {city}{cuisine}.", "{stay_note} Next, where to eat in {city}{cuisine}."]
_T_SIGHTS = ["{meal_note} Now the attractions of {city}.", "{meal_note} Let me find things to see in {city}."]
_T_NEXT_LEG = [
    "{sight_note} Then I move on: from {o} to {d} on {date}{how}.",
    "{sight_note} Next leg: {o} to {d} on {date}{how}.",
]
# The transport preference, restated where the agent decides how to travel. With the bare
# two-word constraint in the request, the 135 M SFT model flew on "no flight" trips; with these, it
# drove on half of them (docs/results.md).
_TRANSPORT_RULE = {
    "no flight": "No flights are allowed, so every leg goes by road.",
    "no self-driving": "Self-driving is not allowed, so I fly or take a taxi.",
}
_TRAVEL_BY = {
    "no flight": ", by road since flights are ruled out",
    "no self-driving": ", by air or taxi since I may not drive",
}
_T_ANSWER = [
    "All parts are found. Transport {transport}, stays {stays}, meals {meals}: total {total}, within {budget}.",
    "Everything is booked: transport {transport} + accommodation {stays} + meals {meals} = {total} (budget {budget}).",
]


class OracleTeacher:
    """Oracle plans → checked ReAct trajectories."""

    def __init__(
        self, oracle: Oracle, tools: ToolRunner, evaluator: Evaluator, *, seed: int = 0, system: str | None = None
    ) -> None:
        if evaluator.mode != "strict":
            evaluator = evaluator.with_mode("strict")
        self.oracle = oracle
        self.tools = tools
        self.evaluator = evaluator
        self.seed = seed
        self.system = system if system is not None else system_prompt()

    def trajectory(self, q: TravelQuery, *, sample_id: str | None = None) -> TeacherSample:
        """The checked trajectory of `q`; `TeacherError` when the query has no plan."""
        result = self.oracle.solve(q)
        if not result.feasible:
            raise TeacherError(f"no plan: {result.constraint}: {result.reason}")
        sol = result.solution
        rng = random.Random(f"{self.seed}:{q.id}:{q.org}:{q.dest}:{q.date[0]}")
        episode = _Episode(self, q, rng)
        for name, arguments, think in self._script(q, sol, rng):
            episode.call(name, arguments, think)
        plan = sol.plan()
        text = render_plan(plan)
        b = sol.breakdown
        final = _think(
            rng,
            _T_ANSWER,
            transport=money_f(b["transport"]),
            stays=money_f(b["accommodation"]),
            meals=money_f(b["meals"]),
            total=money_f(sol.cost),
            budget=money(q.budget),
        )
        episode.messages.append({"role": "assistant", "content": format_answer(text, final)})
        score = self.check(q, text)
        return TeacherSample(
            id=sample_id or f"{q.id or 'query'}-oracle",
            query=q,
            messages=episode.messages,
            calls=episode.calls,
            score=score,
            teacher="oracle",
            cost=sol.cost,
        )

    def check(self, q: TravelQuery, answer_text: str) -> Score:
        """Parse the answer as the scorer does and require strict success."""
        try:
            plan = parse_plan(answer_text, days=q.days)
        except PlanTextError as exc:
            raise TeacherError(f"the answer does not parse: {exc}") from None
        score = self.evaluator.score(q, plan)
        if score.success != 1.0:
            bad = {k: v.reason for k, v in {**score.commonsense, **score.hard}.items() if v.passed is False}
            raise TeacherError(f"the plan fails the strict evaluator: {bad}")
        return score

    # --- the calls a careful agent makes --------------------------------------------------------
    def _script(self, q: TravelQuery, sol: Solution, rng: random.Random):
        lc = q.local_constraint
        P = q.people_number
        who = "One traveller" if P == 1 else f"{P} travellers"
        where = q.dest if q.days == 3 else f"{q.visiting_city_number} cities in {q.dest}"
        extras = []
        if lc.house_rule:
            extras.append(f"a place allowing {lc.house_rule}")
        if lc.room_type:
            extras.append(("an " if lc.room_type[0] in "aeiou" else "a ") + lc.room_type)
        if lc.cuisine:
            extras.append(f"{', '.join(lc.cuisine)} food")
        if lc.transportation:
            extras.append(lc.transportation)
        extra_text = ("; wants " + ", ".join(extras)) if extras else ""
        first_leg = sol.legs[0]
        facts = dict(
            org=q.org,
            where=where,
            start=q.date[0],
            end=q.date[-1],
            budget=money(q.budget),
            days=q.days,
            who=who,
            who_short="1 person" if P == 1 else f"{P} people",
            extras=extra_text,
        )
        route = " → ".join([q.org, *sol.route, q.org])
        rule = _TRANSPORT_RULE.get(lc.transportation or "", "")
        how = _TRAVEL_BY.get(lc.transportation or "", "")
        first = (
            _think(rng, _T_FIRST_CITY, o=first_leg.origin, d=first_leg.dest, date=first_leg.date, how=how)
            if q.days == 3
            else _think(rng, _T_STATE, state=q.dest, k=q.visiting_city_number)
        )
        facts["first"] = f"{rule} {first}" if rule else first
        if q.days == 3:
            pending = _think(rng, _T_START, **facts)
        else:
            yield "SearchCity", {"state": q.dest}, _think(rng, _T_START, **facts)
            n_cities = len(self.oracle.index.state_cities.get(q.dest, []))
            pending = _think(
                rng,
                _T_CITIES,
                state=q.dest,
                n=n_cities,
                route=route,
                o=first_leg.origin,
                d=first_leg.dest,
                date=first_leg.date,
                how=how,
            )
        for i, leg in enumerate(sol.legs):
            for name, arguments, note in self._leg_calls(q, leg, rng):
                yield name, arguments, pending
                pending = note
            if i == len(sol.legs) - 1:
                break
            stop = sol.stops[i]
            room = f", {lc.room_type}" if lc.room_type else ""
            if lc.house_rule:
                room += f", allowing {lc.house_rule}"
            yield (
                "SearchAccommodation",
                {"city": stop.city},
                _think(rng, _T_AFTER_LEG, leg_note=pending, city=stop.city, nights=stop.nights, room=room),
            )
            stay_note = (
                f"{stop.stay.name}{_stay_fit(stop.stay, lc)} costs {money_f(stop.stay.price)} a night"
                + (f" ({stop.stay.units(P)} units for {P})" if stop.stay.units(P) > 1 else "")
                + f" and allows {stop.nights} night(s)."
            )
            cuisine = f", looking for {', '.join(lc.cuisine)}" if lc.cuisine else ""
            yield (
                "SearchRestaurant",
                {"city": stop.city},
                _think(rng, _T_REST, stay_note=stay_note, city=stop.city, cuisine=cuisine),
            )
            meals = [*stop.meals, *stop.extras]
            meal_note = (
                f"I pick {len(meals)} different places, e.g. {meals[0].name} ({money_f(meals[0].cost)})."
                if meals
                else "No meal is needed here besides travel days."
            ) + _cuisine_fit(meals, lc)
            if stop.stay_days or any(c == stop.city for day in sol.travel_sights.values() for _, c in day):
                yield (
                    "SearchAttraction",
                    {"city": stop.city},
                    _think(rng, _T_SIGHTS, meal_note=meal_note, city=stop.city),
                )
                sights = [n for day in stop.sights for n in day]
                sight_note = f"I will visit {', '.join(sights[:3])}." if sights else "Few sights are needed here."
            else:
                sight_note = meal_note
            nxt = sol.legs[i + 1]
            pending = _think(rng, _T_NEXT_LEG, sight_note=sight_note, o=nxt.origin, d=nxt.dest, date=nxt.date, how=how)

    def _leg_calls(self, q: TravelQuery, leg: Leg, rng: random.Random):
        """(tool, arguments, what was learnt) for one leg."""
        P = q.people_number
        if leg.mode == "self-driving":
            note = (
                f"Driving {leg.origin} → {leg.dest} costs {money_f(leg.road.drive)} per car"
                + (f", {-(-P // 5)} cars for {P}" if P > 5 else "")
                + "."
            )
            yield "GoogleDistanceMatrix", {"departure": leg.origin, "destination": leg.dest, "mode": "driving"}, note
            return
        flight = self.oracle.index.flight(leg.origin, leg.dest, leg.date)
        if leg.mode == "flight":
            note = (
                f"Cheapest flight: {leg.flight.flight_number} at {money_f(leg.flight.price)} per person, "
                f"{leg.flight.dep_time}–{leg.flight.arr_time}."
            )
            yield "SearchFlight", {"departure": leg.origin, "destination": leg.dest, "date": leg.date}, note
            return
        # taxi
        if q.local_constraint.transportation != "no flight":
            flight_note = (
                f"The cheapest flight is {money_f(flight.price)} per person."
                if flight
                else f"There is no flight from {leg.origin} to {leg.dest} that day."
            )
            yield (
                "SearchFlight",
                {"departure": leg.origin, "destination": leg.dest, "date": leg.date},
                _think(
                    rng,
                    _T_FLIGHT_TAXI,
                    flight_note=flight_note,
                    people=f"{P} people" if P > 1 else "one person",
                    o=leg.origin,
                    d=leg.dest,
                ),
            )
        note = (
            f"A taxi {leg.origin} → {leg.dest} costs {money_f(leg.road.taxi)}"
            + (f" each, {-(-P // 4)} taxis" if P > 4 else "")
            + "; I take it."
        )
        yield "GoogleDistanceMatrix", {"departure": leg.origin, "destination": leg.dest, "mode": "taxi"}, note


def _stay_fit(stay: Stay, lc: LocalConstraint) -> str:
    """The chosen stay's facts that the request asks about, e.g. ' (Entire home/apt, pets allowed)'."""
    facts = ([stay.room_type] if lc.room_type else []) + ([f"{lc.house_rule} allowed"] if lc.house_rule else [])
    return f" ({', '.join(facts)})" if facts else ""


def _cuisine_fit(meals: Sequence[Eatery], lc: LocalConstraint) -> str:
    """Which chosen restaurant here serves each requested cuisine, e.g. ' For Chinese: Golden Wok.'."""
    named = ((c, next((m.name for m in meals if c in m.cuisines), None)) for c in lc.cuisine or [])
    return "".join(f" For {c}: {name}." for c, name in named if name is not None)


class _Episode:
    def __init__(self, teacher: OracleTeacher, q: TravelQuery, rng: random.Random) -> None:
        self.teacher = teacher
        self.messages: list[dict[str, str]] = [
            {"role": "system", "content": teacher.system},
            {"role": "user", "content": user_message(q)},
        ]
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def call(self, name: str, arguments: dict[str, Any], think: str) -> None:
        text = self.teacher.tools(name, arguments)
        self.messages.append({"role": "assistant", "content": format_tool_call(name, arguments, think)})
        self.messages.append({"role": "user", "content": tool_response(text)})
        self.calls.append((name, arguments))


def money_f(amount: float) -> str:
    return f"${amount:,.0f}" if float(amount).is_integer() else f"${amount:,.2f}"


# =============================================================================================
# LLM teacher (rejection sampling through the rollout agent loop)
# =============================================================================================


class _AsyncTools:
    """Adapts a synchronous `ToolRunner` to the rollout's `ToolClient`."""

    def __init__(self, tools: ToolRunner) -> None:
        self.tools = tools

    async def call(self, name: str, arguments: dict[str, Any], *, fault_key: str | None = None):
        from services.common.schemas import ToolResult

        text = await asyncio.to_thread(self.tools, name, arguments)
        return ToolResult(name=name, text=text, ok=True)

    async def close(self) -> None:
        return None


@dataclass
class LLMTeacherReport:
    tried: int = 0
    kept: int = 0
    rejected: Counter = field(default_factory=Counter)


class LLMTeacher:
    """Runs an OpenAI-compatible model as the agent; keeps strict successes only."""

    def __init__(
        self,
        base_url: str,
        model: str,
        tools: ToolRunner,
        evaluator: Evaluator,
        *,
        api_key: str | None = None,
        samples: int = 1,
        temperature: float = 0.6,
        top_p: float = 0.95,
        max_tool_calls: int = 60,
        max_context_tokens: int = 32_768,
        concurrency: int = 4,
    ) -> None:
        self.base_url, self.model, self.api_key = base_url, model, api_key
        self.tools = tools
        self.evaluator = evaluator if evaluator.mode == "strict" else evaluator.with_mode("strict")
        self.samples = samples
        self.temperature, self.top_p = temperature, top_p
        self.max_tool_calls, self.max_context_tokens = max_tool_calls, max_context_tokens
        self.concurrency = max(1, concurrency)
        self.report = LLMTeacherReport()

    def run(
        self, queries: Sequence[TravelQuery], *, on_done: Callable[[bool], None] | None = None
    ) -> list[TeacherSample]:
        return asyncio.run(self._run(queries, on_done))

    async def _run(self, queries: Sequence[TravelQuery], on_done) -> list[TeacherSample]:
        from services.common.schemas import SamplingParams
        from services.rollout.agent import Agent
        from services.rollout.engines.openai_engine import OpenAIEngine

        engine = OpenAIEngine(self.base_url, self.model, api_key=self.api_key)
        agent = Agent(engine, _AsyncTools(self.tools))
        sampling = SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            max_tool_calls=self.max_tool_calls,
            max_context_tokens=self.max_context_tokens,
            max_tokens_per_turn=4096,
        )
        gate = asyncio.Semaphore(self.concurrency)
        kept: list[TeacherSample | None] = [None] * (len(queries) * self.samples)

        async def one(i: int, q: TravelQuery, k: int) -> None:
            async with gate:
                sample = await self._sample(agent, q, sampling, k)
            kept[i * self.samples + k] = sample
            if on_done:
                on_done(sample is not None)

        try:
            await asyncio.gather(*(one(i, q, k) for i, q in enumerate(queries) for k in range(self.samples)))
        finally:
            await engine.close()
        return [s for s in kept if s is not None]

    async def _sample(self, agent, q: TravelQuery, sampling, k: int) -> TeacherSample | None:
        self.report.tried += 1
        try:
            traj = await agent.run(q, sampling, sample_index=k)
        except Exception as exc:  # noqa: BLE001 - one failed episode must not stop the batch
            self.report.rejected[f"engine: {type(exc).__name__}"] += 1
            return None
        if traj.finish_reason != "answer" or not traj.answer:
            self.report.rejected[traj.finish_reason] += 1
            return None
        try:
            plan = parse_plan(traj.answer, days=q.days)
        except PlanTextError:
            self.report.rejected["unparseable answer"] += 1
            return None
        score = self.evaluator.score(q, plan)
        if score.success != 1.0:
            self.report.rejected["not a strict success"] += 1
            return None
        self.report.kept += 1
        turns = [parse_turn(m["content"]) for m in traj.messages if m["role"] == "assistant"]
        calls = [(t.name or "", t.arguments) for t in turns if t.kind == "tool_call"]
        return TeacherSample(
            id=f"{q.id or 'query'}-{self.model}-{k}",
            query=q,
            messages=[{"role": m["role"], "content": m["content"]} for m in traj.messages],
            calls=calls,
            score=score,
            teacher=f"openai:{self.model}",
        )


# =============================================================================================
# files
# =============================================================================================

LLAMA_FACTORY_ENTRY = {
    "formatting": "sharegpt",
    "columns": {"messages": "messages"},
    "tags": {
        "role_tag": "role",
        "content_tag": "content",
        "user_tag": "user",
        "assistant_tag": "assistant",
        "system_tag": "system",
    },
}


def write_sft(out: Path, samples: Iterable[TeacherSample], *, name: str = "star_sft") -> int:
    """`sft.jsonl` (chat records) and a LLaMA-Factory `dataset_info.json` beside it."""
    out.mkdir(parents=True, exist_ok=True)
    n = 0
    with open(out / "sft.jsonl", "w", encoding="utf-8") as fh:
        for s in samples:
            fh.write(json.dumps(s.record(), ensure_ascii=False) + "\n")
            n += 1
    info = {name: {"file_name": "sft.jsonl", **LLAMA_FACTORY_ENTRY}}
    (out / "dataset_info.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    return n
