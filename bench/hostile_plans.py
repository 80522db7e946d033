"""Hostile plans: the time to score plans whose fields are built to make the official regular
expressions backtrack, with the linear-time parsers against the regexes themselves (the
baseline, measured in the same run on the same plans).

    .venv/bin/python bench/hostile_plans.py

Target (issue 35): scoring time linear in the plan's size, so that no single request can stall
the service (the regexes took 0.8 s on one 4,000-character field and 5.9 s on a 112 KB plan).
Results: bench/results/hostile_plans.json and .md.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.common.schemas import TravelQuery  # noqa: E402
from services.common.settings import get_settings  # noqa: E402
from services.reward.evaluator import (  # noqa: E402
    Evaluator,  # noqa: E402
    commonsense,
    cost,
    hard,
    parsing,
)
from services.sandbox.world import World  # noqa: E402
from services.sandbox.world.build import build_official_world  # noqa: E402

FIELD = 4000  # the evaluator's per-field limit (services/reward/evaluator/plan.py)
PATTERNS = {
    "many 'from'": "from a " * (FIELD // 7),
    "long whitespace run": "from a" + " " * (FIELD - 8) + "x,",
    "commas": "x, " * (FIELD // 3),
    "no comma": "a" * (FIELD - 1) + ",",
    "parentheses": "(" * FIELD,
}


def regex_parsers():
    """The official regexes, as the evaluator used them before the linear parsers."""

    def before_paren(text):
        m = parsing._BEFORE_PAREN.search(text)
        return m.group(1) if m else text

    def from_to(text):
        m = parsing._FROM_TO.search(text)
        return (m.group(1), m.group(2)) if m else (None, None)

    def name_city(text):
        m = parsing._NAME_CITY.search(text)
        if not m:
            return "-", "-"
        return m.group(1).strip(), before_paren(m.group(2).strip()).strip()

    def leg_endpoints(transportation, current_city):
        o, d = from_to(transportation)
        if o is None or d is None:
            o, d = from_to(current_city)
        return o, d

    return {"before_paren": before_paren, "from_to": from_to, "name_city": name_city, "leg_endpoints": leg_endpoints}


def use(parsers: dict) -> None:
    for module in (parsing, commonsense, cost, hard):
        for name, fn in parsers.items():
            if hasattr(module, name):
                setattr(module, name, fn)
    cost._bp = parsers["before_paren"]


def hostile_plan(text: str, days: int = 7) -> list[dict]:
    keys = ("current_city", "transportation", "breakfast", "attraction", "lunch", "dinner", "accommodation")
    return [dict({k: text for k in keys}, days=i + 1) for i in range(days)]


def main() -> int:
    data = get_settings().travelplanner_dir
    record = json.loads((data / "train" / "train.json").read_text(encoding="utf-8"))[30]
    query = TravelQuery(**record).model_copy(update={"days": 7, "date": [f"2022-03-{10 + i}" for i in range(7)]})
    linear = {name: getattr(parsing, name) for name in ("before_paren", "from_to", "name_city", "leg_endpoints")}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{tmp}/world.sqlite"
        build_official_world(url, data / "database", seed=0, ref_info=[data / "train" / "train_ref_info.jsonl"])
        world = World(url)
        for label, text in PATTERNS.items():
            plan = hostile_plan(text)
            size = len(json.dumps(plan))
            row = {"pattern": label, "plan_bytes": size}
            for impl, parsers in (("regex", regex_parsers()), ("linear", linear)):
                use(parsers)
                for mode in ("official", "strict"):
                    evaluator = Evaluator(world, mode)  # fresh caches: nothing memoised between runs
                    started = time.perf_counter()
                    evaluator.evaluate(query, plan)
                    row[f"{impl}_{mode}_s"] = round(time.perf_counter() - started, 4)
            use(linear)
            rows.append(row)
            print(
                f"{label:22} {size / 1024:6.1f} KB  regex official {row['regex_official_s']:.3f} s  "
                f"linear official {row['linear_official_s']:.4f} s  strict {row['regex_strict_s']:.3f} -> "
                f"{row['linear_strict_s']:.4f} s",
                flush=True,
            )
        world.close()
    out = ROOT / "bench" / "results" / "hostile_plans.json"
    out.write_text(json.dumps({"query_days": 7, "field_chars": FIELD, "rows": rows}, indent=2) + "\n")
    lines = [
        "# Hostile plans: linear-time parsers against the official regexes",
        "",
        f"7-day plans whose every field is the same {FIELD}-character text (the evaluator's limit), "
        "built to make the official regexes backtrack; each scored once by a fresh evaluator "
        "(no memoised parse), in both modes. Baseline: the official regexes, same run, same plans. The strict "
        "mode reads the plan with its own parsers (linear in both columns; its regexes are not swapped).",
        "",
        "| pattern | plan KB | regex official (s) | linear official (s) | regex strict (s) | linear strict (s) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['pattern']} | {r['plan_bytes'] / 1024:.1f} | {r['regex_official_s']:.3f} | "
            f"{r['linear_official_s']:.4f} | {r['regex_strict_s']:.3f} | {r['linear_strict_s']:.4f} |"
        )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
