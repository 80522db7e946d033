"""Choosing restaurants: the cheapest distinct meals of a city, under a cuisine constraint.

A city on the route needs `required` meals (three per stay day) and may take up to `extra` more
on the travel days next to it. The cuisine constraint asks that the meals eaten outside the
origin together serve every required cuisine, so the choice of one city depends on the others.
`coverage` answers, for one city, "what is the cheapest set of meals that covers at least this
subset of the cuisines?" for every subset; `combine` then picks one subset per city so that
together they cover everything, at the least total cost. With at most a handful of required
cuisines the subsets are few (2^4 = 16), so both steps are exact and small.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.synth.index import Eatery

INF = float("inf")
Choice = tuple[float, tuple[int, ...]]  # (cost per person, indices into the city's eateries)


def cuisine_mask(eatery: Eatery, required: Sequence[str]) -> int:
    return sum(1 << i for i, c in enumerate(required) if c in eatery.cuisines)


def coverage(eateries: Sequence[Eatery], required_meals: int, extra: int, cuisines: Sequence[str]) -> dict[int, Choice]:
    """For each cuisine mask m (bit i = cuisines[i]): the cheapest selection of between
    `required_meals` and `required_meals + extra` distinct eateries whose cuisines cover m.
    Masks no selection can cover are absent. `eateries` must be sorted by cost."""
    top = required_meals + extra
    if len(eateries) < required_meals:
        return {}
    masks = [cuisine_mask(e, cuisines) for e in eateries]
    # Exchange argument: among eateries with the same mask only the `top` cheapest can matter
    # (eateries come sorted by cost), which keeps the table small in big cities.
    kept: list[int] = []
    per_mask: dict[int, int] = {}
    for j, m in enumerate(masks):
        if per_mask.get(m, 0) < top:
            per_mask[m] = per_mask.get(m, 0) + 1
            kept.append(j)
    # dp[k][mask] = cheapest k eateries whose union of cuisines is exactly `mask`
    dp: list[dict[int, Choice]] = [dict() for _ in range(top + 1)]
    dp[0][0] = (0.0, ())
    for j in kept:
        cost, m = eateries[j].cost, masks[j]
        for k in range(min(top - 1, len(kept)), -1, -1):
            row = dp[k]
            if not row:
                continue
            nxt = dp[k + 1]
            for mask, (c, chosen) in list(row.items()):
                new_mask, new_cost = mask | m, c + cost
                best = nxt.get(new_mask)
                if best is None or new_cost < best[0]:
                    nxt[new_mask] = (new_cost, chosen + (j,))
    out: dict[int, Choice] = {}
    for k in range(required_meals, top + 1):
        for mask, choice in dp[k].items():
            # a selection covering `mask` also covers every subset of it
            sub = mask
            while True:
                best = out.get(sub)
                if best is None or choice[0] < best[0]:
                    out[sub] = choice
                if sub == 0:
                    break
                sub = (sub - 1) & mask
    return out


def combine(tables: Sequence[dict[int, Choice]], n_cuisines: int) -> tuple[float, list[Choice]] | None:
    """One choice per city whose masks together cover all cuisines, at the least total cost
    (min-plus over OR): None when no combination covers them."""
    full = (1 << n_cuisines) - 1
    acc: dict[int, tuple[float, list[Choice]]] = {0: (0.0, [])}
    for table in tables:
        nxt: dict[int, tuple[float, list[Choice]]] = {}
        for m1, (c1, picks) in acc.items():
            for m2, choice in table.items():
                m, c = m1 | m2, c1 + choice[0]
                best = nxt.get(m)
                if best is None or c < best[0]:
                    nxt[m] = (c, picks + [choice])
        acc = nxt
        if not acc:
            return None
    return acc.get(full)


def cheapest(eateries: Sequence[Eatery], count: int) -> Choice | None:
    """The `count` cheapest distinct eateries (no cuisine constraint)."""
    if len(eateries) < count:
        return None
    return float(sum(e.cost for e in eateries[:count])), tuple(range(count))
