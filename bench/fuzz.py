"""Fuzz campaign: every HTTP service (sandbox, reward, formatter, rollout, learner, qa) fuzzed
from its own OpenAPI document by schemathesis, over real HTTP, with /healthz probed throughout.

    .venv/bin/python bench/fuzz.py [--requests 10000] [--services reward,sandbox]

Targets (issue 35): at least 10,000 requests per service, 0 responses >= 500 (or no reply), and
/healthz answering within 1 s throughout. The baseline, measured in the same run, is /healthz of
the idle service just before its campaign. Results: bench/results/fuzz.json (per service:
`requests`, `server_errors`, `max_healthz_s`, with the status mix and the first failures) and
bench/results/fuzz.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.common.settings import get_settings  # noqa: E402
from tests.reliability.fuzzing import AUTH, SERVICES, campaign, start_service  # noqa: E402

RESULTS = ROOT / "bench" / "results"
HEALTHZ_LIMIT_S = 1.0


def idle_healthz(url: str, n: int = 20) -> float:
    """Median /healthz latency of the idle service (the baseline)."""
    times = []
    with httpx.Client(timeout=5) as client:
        for _ in range(n):
            started = time.monotonic()
            client.get(f"{url}/healthz")
            times.append(time.monotonic() - started)
    return statistics.median(times)


def build_world(tmp: Path) -> str:
    from services.sandbox.world.build import build_official_world

    data = get_settings().travelplanner_dir
    url = f"sqlite:///{tmp / 'world.sqlite'}"
    build_official_world(url, data / "database", seed=0, ref_info=[data / "train" / "train_ref_info.jsonl"])
    return url


def run_service(
    name: str, target: int, world_url: str, tmp: Path, max_examples: int, max_seconds: float | None
) -> dict:
    with contextlib.ExitStack() as stack:
        url = start_service(name, tmp / name, stack, world_url=world_url)
        baseline = idle_healthz(url)
        started = time.monotonic()

        def progress(round_: int, report) -> None:
            print(
                f"  {name} round {round_}: {report.calls} requests, {report.server_errors} server errors, "
                f"{time.monotonic() - started:.0f} s",
                flush=True,
            )

        report, probe = campaign(
            url, target, headers=AUTH, max_examples=max_examples, max_seconds=max_seconds, progress=progress
        )
        seconds = time.monotonic() - started
    result = {
        "requests": report.calls,
        "server_errors": report.server_errors,
        "max_healthz_s": round(probe.worst_s, 4),
        "idle_healthz_s": round(baseline, 4),
        "healthz_probes": probe.probes,
        "healthz_failures": probe.failures,
        "bad_replies": len(report.failures),
        "by_status": {str(k): v for k, v in sorted(report.by_status.items())},
        "seconds": round(seconds, 1),
        "requests_per_s": round(report.calls / seconds, 1) if seconds else None,
        "first_failures": report.failures[:10],
    }
    print(
        f"{name}: {report.summary()}; server errors {result['server_errors']}, bad replies "
        f"{result['bad_replies']}; /healthz worst {probe.worst_s:.3f} s (idle {baseline * 1000:.1f} ms) "
        f"over {probe.probes} probes; {seconds:.0f} s",
        flush=True,
    )
    return result


def write_markdown(results: dict, meta: dict, path: Path) -> None:
    lines = [
        "# Fuzz campaign (schemathesis)",
        "",
        f"Every HTTP service fuzzed from its own OpenAPI document over real HTTP, positive and negative "
        f"cases, in seeded rounds until {meta['target']} requests; /healthz probed every 0.1 s from a "
        f"separate process throughout. Baseline: /healthz of the idle service just before (median of 20). "
        f"Targets: 0 responses >= 500, /healthz within {HEALTHZ_LIMIT_S:g} s.",
        "",
        f"Machine: {meta['machine']}; {meta['date']}; `{meta['command']}`.",
        "",
        "| service | requests | server errors (>= 500 or no reply) | other bad replies | max /healthz (s) "
        "| idle /healthz (ms) | requests/s | statuses | target met |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for name, r in results.items():
        met = r["requests"] >= meta["target"] and r["server_errors"] == 0 and r["max_healthz_s"] < HEALTHZ_LIMIT_S
        statuses = ", ".join(f"{k}: {v}" for k, v in r["by_status"].items())
        lines.append(
            f"| {name} | {r['requests']} | {r['server_errors']} | {r['bad_replies']} | "
            f"{r['max_healthz_s']:.3f} | {r['idle_healthz_s'] * 1000:.1f} | {r['requests_per_s']} | "
            f"{statuses} | {'yes' if met else 'NO'} |"
        )
    failures = [(n, f) for n, r in results.items() for f in r["first_failures"]]
    if failures:
        lines += ["", "## First failures", ""] + [f"- {n}: `{f[:300]}`" for n, f in failures]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=10_000, help="Requests per service.")
    parser.add_argument("--services", default=",".join(SERVICES), help="Comma-separated services.")
    parser.add_argument("--max-examples", type=int, default=30, help="Examples per operation and round.")
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="Time budget per service (the "
        "campaign stops there even short of --requests; the results say how many were sent).",
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "fuzz.json")
    args = parser.parse_args()
    names = [n.strip() for n in args.services.split(",") if n.strip()]
    unknown = sorted(set(names) - set(SERVICES))
    if unknown:
        parser.error(f"unknown services {unknown} (use {', '.join(SERVICES)})")
    results: dict[str, dict] = {}
    if args.out.is_file():  # a campaign over some services keeps the others' last results
        results = json.loads(args.out.read_text(encoding="utf-8")).get("services", {})
    meta = {
        "target": args.requests,
        "machine": f"{platform.node()} ({platform.processor() or platform.machine()})",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "bench/fuzz.py " + " ".join(sys.argv[1:]),
    }
    with tempfile.TemporaryDirectory(prefix="star-fuzz-") as tmp:
        world_url = build_world(Path(tmp))
        for name in names:
            results[name] = run_service(name, args.requests, world_url, Path(tmp), args.max_examples, args.max_seconds)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"meta": meta, "services": results}, indent=2) + "\n", encoding="utf-8")
            write_markdown(results, meta, args.out.with_suffix(".md"))
    ok = all(
        r["requests"] >= args.requests and r["server_errors"] == 0 and r["max_healthz_s"] < HEALTHZ_LIMIT_S
        for r in results.values()
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
