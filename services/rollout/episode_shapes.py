"""Episode shapes drawn from the teacher's (`ForcedTurns.shape: teacher`, benchmarking only).

A forced episode of this shape draws its number of tool calls and its answer's length once, and each tool
turn's length anew, from log-normal distributions fitted to the oracle teacher's trajectories
(bench/episode_shapes.py refits them and records the fit and the teacher's quantiles in
bench/results/episode_shapes.json): 300 feasible queries of the benchmark's mix (easy:medium:hard 4:3:3) on
the official database, their teacher episodes tokenized with the Qwen2.5 tokenizer. The teacher took 5 to 17
calls (mean 8.8; the paper's teacher 9.2), turns of 45 to 166 tokens and answers of 270 to 717. A log-normal's
right tail runs past the teacher's longest (about 4 % of episodes over 17 calls, 0.1 % at 30 or more), so a
step holds the lone long trajectories and slow groups a policy in training makes; draws are clipped to the
recipe's limits (`max_tool_calls`, the context). Draws are seeded by the episode's seed, else by its query
and sample, so a rerun draws the same shapes.
"""

from __future__ import annotations

import math
import random
import zlib
from dataclasses import dataclass


@dataclass(frozen=True)
class LogNormal:
    """exp(N(mu, sigma)): `mu` and `sigma` are the mean and spread of the logarithm of what it draws."""

    mu: float
    sigma: float

    @property
    def median(self) -> float:
        return math.exp(self.mu)

    def draw(self, rng: random.Random, low: int = 1, high: int | None = None) -> int:
        value = max(low, round(math.exp(rng.gauss(self.mu, self.sigma))))
        return value if high is None else min(value, high)


# The fit to the oracle teacher's 300 trajectories (bench/results/episode_shapes.json, `fit`).
TOOL_CALLS = LogNormal(2.0849, 0.4362)  # median 8.0 calls an episode
TURN_TOKENS = LogNormal(4.2586, 0.2564)  # median 71 tokens a tool turn (thought and call)
ANSWER_TOKENS = LogNormal(6.0303, 0.3251)  # median 416 tokens the answer (the structured plan)


@dataclass(frozen=True)
class EpisodeShape:
    """What one forced episode of the teacher's shape samples: its tool calls and its answer's tokens."""

    tool_calls: int
    answer_tokens: int


def shape_rng(seed: int | None, query_id: str, sample_index: int) -> random.Random:
    """The episode's own generator: from its seed, else from its query and sample (stable across runs)."""
    base = seed if seed is not None else zlib.crc32(f"{query_id}:{sample_index}".encode())
    return random.Random(base * 7_919 + 17)


def draw_episode(rng: random.Random, max_tool_calls: int) -> EpisodeShape:
    return EpisodeShape(TOOL_CALLS.draw(rng, 0, max_tool_calls), ANSWER_TOKENS.draw(rng))


def draw_turn(rng: random.Random) -> int:
    return TURN_TOKENS.draw(rng)
