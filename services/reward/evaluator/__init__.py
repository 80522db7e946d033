"""The TravelPlanner evaluator: 8 commonsense checks, 5 hard constraints, per-plan scores and
split metrics, in two modes.

`official` reproduces the official evaluator (OSU-NLP-Group/TravelPlanner, evaluation/*.py)
verdict for verdict, quirks included, and the official fixed denominators of each split, so
numbers compare with published ones. `strict` fixes the quirks, for training signals that a
policy cannot game. Spec: ../shared/spec/travelplanner.md §6–§8 (cited below as §x).

Differences between the modes, one per line (id: official → strict [spec]):

| id  | official (quirk reproduced)                                         | strict                                                                | spec        |
|-----|---------------------------------------------------------------------|-----------------------------------------------------------------------|-------------|
| D1  | venue names match by case-sensitive substring; the first match gives cost and attributes ("a, Rockford" is a restaurant) | exact name after whitespace normalisation; attributes from that row | §6.1, §8.2-1 |
| D2  | the last `;`-item of `attraction` is dropped (never validated, never repeats) | every item checked (sandbox, current city, diversity)           | §6.3-C/G, §8.2-2 |
| D3  | a stay day's city is iterated character by character (venues of any city pass Within Current City) | venues must be in the day's city (a stay day's attraction may be in another city of the same state, a day trip, as gold plan train #41 does); a stay day has no transportation | §6.3-F, §8.2-3 |
| D4  | flights are checked by number and route only; date, times ignored   | the flight must fly on that day's query date, at the times written    | §6.3-G, §8.2-4 |
| D5  | a 3-day trip may visit any city                                     | a 3-day trip must visit `query.dest`                                  | §6.3-A, §8.2-5 |
| D6  | transport modes by exact keywords: "Drive …" / "Train …" / "flight" without "Flight Number" escape the sandbox, conflict, preference and cost | keywords normalised (drive/driving/car → self-driving, cab → taxi, plane/flight/F-number → flight); an unknown mode fails Within Sandbox | §6.3-E/G, §8.2-6, issue #51 |
| D7  | preference checks are case-sensitive ("self-driving" escapes "no self-driving") | case-insensitive, on the normalised mode                     | §6.4, §8.2-6 |
| D8  | "flight number:" in another case, or text the official code cannot parse, crashes it; here the crashing check fails | parsed leniently (case-insensitive labels) and judged on content | §6.7 |
| D9  | an origin-city meal skips the rest of that day's meals for Cuisine  | only that meal is skipped                                              | §6.4, §8.2-7 |
| D10 | minimum nights checked only when exactly one row matches; runs split on any string difference | checked on the exact-name rows (fails when every such row needs more nights); runs compare normalised names | §6.3-D, §8.2-8 |
| D11 | travel-day transportation must merely contain both city names       | its "from A to B", when written, must be the day's route              | §6.3-F |
| D12 | repeated meals compare raw strings ("X, C" ≠ "X,C")                 | repeats compare the parsed (name, city)                                | §6.3-B |
| D13 | day 1 without "from" skips the origin check of the route            | day 1 must be "from <org> to …"                                       | §6.3-A |
| D14 | `None` values count as filled for Complete Information              | `None`, '' and '-' are all absent; a non-text value or missing key fails Complete Information | §6.3-H, §6.7 |
| D15 | days after `query.days` are ignored                                 | a non-empty day after the last one fails Complete Information         | §5, §6.8 |
| D16 | the 50% fill ratio counts every key, `day` and `current_city` included | it counts the six plan fields only                                 | §6.3-H |
| D17 | split metrics use the hard-coded denominators of the named split    | denominators computed from the queries (8N, Σ 1 + constraints)        | §6.6, issue #16 |
| D18 | a plan that names nothing (every plan field '-') passes the checks that look for faults (5 of 8) | it fails every check: nothing was planned | issue #35 |

Shared by both modes: hard constraints run only when Complete Information and Within Sandbox
pass (§6.2, §8.2-10); a gated-off applicable constraint is reported as failed ("not checked")
and counts 0, as in the official micro and macro rates; a constraint the query does not ask for
is `None` ("not applicable"). Official-mode inputs on which the official code raises (§6.7) fail
the check that would raise, with a reason; a value that is not a plan at all raises `PlanError`.
"""

from services.reward.evaluator.aggregate import (
    OFFICIAL_DENOMINATORS,
    Evaluation,
    SplitCounts,
    SplitMetrics,
    aggregate,
    hard_denominator,
)
from services.reward.evaluator.commonsense import COMMONSENSE_CHECKS
from services.reward.evaluator.core import Evaluator, evaluate_split
from services.reward.evaluator.hard import HARD_CHECKS
from services.reward.evaluator.lookup import WorldIndex
from services.reward.evaluator.plan import PlanError

MODE_DIFFERENCES = tuple(f"D{i}" for i in range(1, 19))

__all__ = [
    "COMMONSENSE_CHECKS",
    "HARD_CHECKS",
    "MODE_DIFFERENCES",
    "OFFICIAL_DENOMINATORS",
    "Evaluation",
    "Evaluator",
    "PlanError",
    "SplitCounts",
    "SplitMetrics",
    "WorldIndex",
    "aggregate",
    "evaluate_split",
    "hard_denominator",
]
