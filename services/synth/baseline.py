"""A naive planner: enumerate every route, night split, per-leg mode and accommodation.

No bounds, no arrays, no pruning: each combination is priced on its own. It is the baseline the
benchmark compares the oracle with, and a cross-check of the oracle's optimality in the tests
(it shares only the per-item prices, which come straight from the index). Meals take the
cheapest distinct restaurants; with a cuisine constraint it uses the same exact meal choice as
the oracle (`meals.coverage`), so it is only a check of the route search.
"""

from __future__ import annotations

import itertools
import math

from services.common.schemas import TravelQuery
from services.synth import meals as meal_choice
from services.synth.index import SynthIndex
from services.synth.oracle import INF, ROOM_OK, RULE_TEXT, night_splits

MODES = ("flight", "taxi", "self-driving")


def _allowed(modes: tuple[str, ...], pref: str | None) -> bool:
    kinds = set(modes)
    if "self-driving" in kinds and kinds & {"flight", "taxi"}:
        return False  # the non-conflict rule
    if pref == "no flight" and "flight" in kinds:
        return False
    if pref == "no self-driving" and "self-driving" in kinds:
        return False
    return True


def naive_cheapest(index: SynthIndex, q: TravelQuery) -> float:
    """The least cost of a strict-valid plan (inf when there is none), by full enumeration."""
    lc, P = q.local_constraint, q.people_number
    k = q.visiting_city_number
    if q.days == 3:
        pool = [q.dest] if q.dest in index.cities and q.dest != q.org else []
    else:
        pool = [c for c in index.state_cities.get(q.dest, []) if c != q.org]
    best = INF
    for route in itertools.permutations(pool, k):
        for split in night_splits(q.days, k):
            days = [0] + list(itertools.accumulate(split))
            stops = [q.org, *route, q.org]
            leg_options = []
            for i, t in enumerate(days):
                o, d = stops[i], stops[i + 1]
                opts = {}
                f = index.flight(o, d, q.date[t])
                if f:
                    opts["flight"] = f.price * P
                r = index.road(o, d)
                if r:
                    opts["taxi"] = r.taxi * math.ceil(P / 4)
                    opts["self-driving"] = r.drive * math.ceil(P / 5)
                leg_options.append(opts)
            for modes in itertools.product(MODES, repeat=len(days)):
                if not _allowed(modes, lc.transportation):
                    continue
                if any(m not in opts for m, opts in zip(modes, leg_options)):
                    continue
                transport = sum(opts[m] for m, opts in zip(modes, leg_options))
                city_costs = []
                for city, n in zip(route, split):
                    info = index.cities[city]
                    if len(info.sights) < n - 1 or len(info.eateries) < 3 * (n - 1):
                        city_costs = None
                        break
                    stays = [
                        s.night_cost(P) * n
                        for s in info.stays
                        if s.min_nights <= n
                        and not (lc.room_type and not ROOM_OK[lc.room_type](s.room_type))
                        and not (lc.house_rule and RULE_TEXT[lc.house_rule] in s.house_rules)
                    ]
                    if not stays:
                        city_costs = None
                        break
                    city_costs.append(min(stays))
                if city_costs is None:
                    continue
                if lc.cuisine:
                    tables = [
                        meal_choice.coverage(
                            index.cities[c].eateries, 3 * (n - 1), 3 + (3 if i == k - 1 else 0), lc.cuisine
                        )
                        for i, (c, n) in enumerate(zip(route, split))
                    ]
                    combined = meal_choice.combine(tables, len(lc.cuisine))
                    if combined is None:
                        continue
                    food = combined[0] * P
                else:
                    food = P * sum(index.cities[c].meal_prefix[3 * (n - 1)] for c, n in zip(route, split))
                best = min(best, transport + sum(city_costs) + food)
    return best
