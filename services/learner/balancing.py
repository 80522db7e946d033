"""Packed rows and their dealing to ranks and micro-batches by work, not tokens.

A trajectory of s tokens costs about 6·N·s + 12·L·d·s² FLOPs to train (flops.py): at the recipes'
32K rows attention is a large share, so two rows of equal tokens can differ several times in work.
Under ZeRO-3 every rank gathers each layer's weights together, so each micro-batch runs as slowly as
its slowest rank's. Here rows are filled under the token capacity (the memory bound) with their
costs as even as the capacity allows, and dealt out in rounds: the k-th micro-batch of every rank
comes from one round of rows of neighbouring cost, and within a round the heaviest row goes to the
rank with the least work so far (longest processing time first), so the ranks' totals stay even too.

Everything here reads lengths and costs only (numpy arrays), never tokens, so every rank computes the
same plan cheaply and then builds just its own rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def costed_rows(lengths: np.ndarray, costs: np.ndarray, capacity: int, count: int) -> list[list[int]] | None:
    """`count` rows of at most `capacity` tokens, costliest trajectory first to the cheapest row with room
    (ties: the emptier row, then the first); None when some trajectory finds no row with room.
    Empty trajectories are left out."""
    order = np.lexsort((np.arange(len(costs)), -costs))  # costliest first, ties in input order
    row_cost = np.zeros(count)
    row_tokens = np.zeros(count, dtype=np.int64)
    rows: list[list[int]] = [[] for _ in range(count)]
    for i in order:
        n = int(lengths[i])
        if n == 0:
            continue
        room = row_tokens + n <= capacity
        if not room.any():
            return None
        # cheapest row with room; among equal costs the one with the fewest tokens
        key = np.where(room, row_cost, np.inf)
        best = np.flatnonzero(key == key.min())
        b = int(best[np.argmin(row_tokens[best])])
        rows[b].append(int(i))
        row_cost[b] += costs[i]
        row_tokens[b] += n
    return rows


def _best_exchange(
    a: list[int],
    b: list[int],
    lengths: np.ndarray,
    costs: np.ndarray,
    capacity: int,
    cost_a: float,
    cost_b: float,
    tok_a: int,
    tok_b: int,
) -> tuple[float, int, int] | None:
    """The move of one trajectory from row a to row b, or swap of one of each, that most lowers the
    heavier of the two (strictly), within the capacity: (new max, index in a, index in b or -1)."""
    ca, la = costs[a], lengths[a]
    cb = np.concatenate([costs[b], [0.0]])  # the last column: nothing comes back (a move)
    lb = np.concatenate([lengths[b], [0]])
    delta = ca[:, None] - cb[None, :]  # work leaving a
    new_a, new_b = cost_a - delta, cost_b + delta
    fits = (tok_a - la[:, None] + lb[None, :] <= capacity) & (tok_b + la[:, None] - lb[None, :] <= capacity)
    worst = np.where(fits & (delta > 0), np.maximum(new_a, new_b), np.inf)
    k = int(np.argmin(worst))
    i, j = divmod(k, worst.shape[1])
    if not worst[i, j] < cost_a * (1 - 1e-12):
        return None
    return float(worst[i, j]), i, (j if j < len(b) else -1)


def even_out(
    rows: list[list[int]],
    lengths: np.ndarray,
    costs: np.ndarray,
    capacity: int,
    max_rounds: int = 120,
    partners: int = 8,
) -> list[list[int]]:
    """Rows with their heaviest made lighter: repeatedly the move or swap of trajectories between the
    heaviest row and one of the `partners` lightest (lightest first) that most lowers the heavier of the
    two; a row no exchange helps is left as it is and the next heaviest tried, until none is left.
    The rows' count and capacity stay; a row is never emptied."""
    rows = [list(r) for r in rows]
    row_cost = np.array([costs[r].sum() if r else 0.0 for r in rows])
    row_tokens = np.array([int(lengths[r].sum()) if r else 0 for r in rows], dtype=np.int64)
    stuck = np.zeros(len(rows), dtype=bool)  # rows no exchange makes lighter: the next heaviest is tried
    for _ in range(max_rounds):
        if stuck.all():
            break
        h = int(np.argmax(np.where(stuck, -np.inf, row_cost)))
        if len(rows[h]) < 2:  # a lone trajectory cannot get lighter
            stuck[h] = True
            continue
        for o in np.argsort(row_cost, kind="stable")[: partners + 1]:
            o = int(o)
            if o == h:
                continue
            found = _best_exchange(
                rows[h],
                rows[o],
                lengths,
                costs,
                capacity,
                row_cost[h],
                row_cost[o],
                int(row_tokens[h]),
                int(row_tokens[o]),
            )
            if found is None:
                continue
            _, i, j = found
            out, back = rows[h][i], (rows[o][j] if j >= 0 else None)
            rows[h].pop(i)
            if back is not None:
                rows[o].pop(j)
                rows[h].append(back)
            rows[o].append(out)
            for r in (h, o):
                row_cost[r] = costs[rows[r]].sum()
                row_tokens[r] = int(lengths[rows[r]].sum())
            break
        else:
            stuck[h] = True
    return [sorted(r) for r in rows]


def deal_rounds(row_costs: Sequence[float], world_size: int) -> list[list[int]]:
    """Row ids for each rank, in micro-batch order: rows by cost, costliest first, in rounds of one row a
    rank; within a round the costliest row to the rank with the least work so far (ties: lower rank).
    `len(row_costs)` must be a multiple of `world_size`."""
    costs = np.asarray(row_costs, dtype=np.float64)
    if len(costs) % world_size:
        raise ValueError(f"{len(costs)} rows do not deal evenly to {world_size} ranks")
    order = np.lexsort((np.arange(len(costs)), -costs))
    load = np.zeros(world_size)
    dealt: list[list[int]] = [[] for _ in range(world_size)]
    for start in range(0, len(order), world_size):
        # the round's rows costliest first, the ranks least loaded first
        for row, rank in zip(order[start : start + world_size], np.lexsort((np.arange(world_size), load))):
            dealt[int(rank)].append(int(row))
        for rank in range(world_size):
            load[rank] = costs[dealt[rank]].sum()
    return dealt


def spread(loads: Sequence[float]) -> float:
    """(most - least) / mean of the ranks' work: 0 when even."""
    x = np.asarray(loads, dtype=np.float64)
    mean = x.mean() if len(x) else 0.0
    return float((x.max() - x.min()) / mean) if mean > 0 else 0.0
