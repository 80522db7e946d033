"""bench/packed_attention.py on CPU with tiny shapes: every packed variant runs on new lengths each pass and
is exact against the unpacked rows (fp32)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_fresh_lengths_bench_records_every_variant_exact_on_cpu(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import packed_attention as bench
    finally:
        sys.path.remove(str(ROOT / "bench"))
    assert (
        bench.main(
            [
                "--hidden",
                "64",
                "--heads",
                "4",
                "--kv-heads",
                "2",
                "--intermediate",
                "128",
                "--layers",
                "1",
                "--lengths",
                "24,16,9",
                "--fresh-lengths",
                "--warmup",
                "0",
                "--repeat",
                "2",
                "--out",
                str(tmp_path),
                "--name",
                "smoke",
            ]
        )
        == 0
    )
    record = json.loads((tmp_path / "smoke.json").read_text())
    packed = [n for n in record["variants"] if n != "alone"]
    assert {"packed varlen", "packed varlen, GQA native", "packed per-sequence, plans at start"} <= set(packed)
    assert all(record["exact"][n] for n in packed), record["exact"]
    assert record["fastest_exact"] in packed and len(record["fresh_lengths"]) == 2
    assert "largest difference from unpacked" in (tmp_path / "smoke.md").read_text()


def test_the_record_names_the_variant_auto_runs_for_its_lengths():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import packed_attention as bench
    finally:
        sys.path.remove(str(ROOT / "bench"))

    assert bench.auto_pick([12000, 9000, 11768], True, "packed per-sequence") == "packed per-sequence"
    assert bench.auto_pick([512] * 64, True, "packed per-sequence") == "packed varlen"
    assert bench.auto_pick([512] * 64, False, "packed per-sequence") == "packed per-sequence"
