"""The teacher's episode shapes, fitted: what `ForcedTurns.shape: teacher` draws (services/rollout/episode_shapes.py).

    python bench/episode_shapes.py            # about a minute on 2 cores; writes bench/results/episode_shapes.json

Builds the official world (the TravelPlanner database beside the project, flights generated at 0.15 of the
official density plus the train split's real rows), synthesizes 300 feasible queries of the benchmark's mix
(easy:medium:hard 4:3:3), runs the oracle teacher on them (`star synth teacher`: real tools, every trajectory
checked by the strict evaluator) and tokenizes each episode with the Qwen2.5 tokenizer: tool calls an episode,
tokens of each tool turn (thought and call), of the answer, and of each tool reply. Recorded: the teacher's
quantiles, and the log-normal fit (mean and spread of the logarithm) of the first three, which
services/rollout/episode_shapes.py carries as constants (tests/rollout/test_episode_shapes.py checks they agree).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DATA = ROOT.parent / "shared" / "travelplanner"
QUANTILES = (0, 10, 25, 50, 75, 90, 95, 99, 100)


def star(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)


def teacher_trajectories(work: Path, n: int, seed: int) -> Path:
    db = f"sqlite:///{work / 'world.sqlite'}"
    star(
        "world",
        "build",
        "--from",
        str(DATA / "database"),
        "--db",
        db,
        "--flight-scale",
        "0.15",
        "--ref-info",
        str(DATA / "train" / "train_ref_info.jsonl"),
        "--if-missing",
    )
    star(
        "synth",
        "queries",
        "--n",
        str(n),
        "--mix",
        "4:3:3",
        "--splits",
        "1:0:0",
        "--seed",
        str(seed),
        "--out",
        str(work / "queries"),
        "--workers",
        "1",
        "--db",
        db,
    )
    star(
        "synth",
        "teacher",
        "--queries",
        str(work / "queries" / "queries.jsonl"),
        "--out",
        str(work / "teacher"),
        "--db",
        db,
        "--seed",
        str(seed),
    )
    return work / "teacher" / "sft.jsonl"


def episode_numbers(sft: Path, tokenizer) -> dict[str, list[int]]:
    """Per episode its tool calls and answer tokens; per tool turn its tokens; per tool reply its tokens."""
    out: dict[str, list[int]] = {"tool_calls": [], "turn_tokens": [], "answer_tokens": [], "reply_tokens": []}
    count = lambda text: len(tokenizer(text)["input_ids"])  # noqa: E731
    for line in sft.read_text().splitlines():
        row = json.loads(line)
        assistant = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        replies = [m["content"] for m in row["messages"] if m["role"] in ("user", "tool")][1:]  # after the query
        out["tool_calls"].append(row["tool_calls"])
        out["turn_tokens"] += [count(t) for t in assistant[:-1]]
        out["answer_tokens"].append(count(assistant[-1]))
        out["reply_tokens"] += [count(r) for r in replies]
    return out


def quantiles(values: list[int]) -> dict[str, float]:
    ordered = sorted(values)
    q = {f"p{p}": ordered[min(len(ordered) - 1, p * len(ordered) // 100)] for p in QUANTILES}
    return {**q, "max": ordered[-1], "mean": round(statistics.mean(ordered), 1), "n": len(ordered)}


def lognormal_fit(values: list[int]) -> dict[str, float]:
    logs = [math.log(v) for v in values if v > 0]
    mu, sigma = statistics.mean(logs), statistics.pstdev(logs)
    return {"mu": round(mu, 4), "sigma": round(sigma, 4), "median": round(math.exp(mu), 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--queries", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", default="/tmp/episode-shapes")
    ap.add_argument("--tokenizer", default=str(ROOT / ".qwen-tok"), help="a saved Qwen2.5 tokenizer folder")
    ap.add_argument("--out", default=str(RESULTS / "episode_shapes.json"))
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    numbers = episode_numbers(
        teacher_trajectories(work, args.queries, args.seed), AutoTokenizer.from_pretrained(args.tokenizer)
    )
    record = {
        "source": f"oracle teacher, {args.queries} synthesized queries (mix 4:3:3, seed {args.seed}) on the "
        "official database, Qwen2.5 tokens",
        "teacher": {k: quantiles(v) for k, v in numbers.items()},
        "fit": {k: lognormal_fit(numbers[k]) for k in ("tool_calls", "turn_tokens", "answer_tokens")},
        "paper_teacher": {"tool_calls_mean": 9.2, "tokens_mean": 10300},
    }
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record["fit"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
