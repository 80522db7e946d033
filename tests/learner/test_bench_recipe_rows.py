"""The learner benchmark's recipe rows (bench/learner_multigpu.py): the lengths drawn, the rows every side
trains, the labels the HF baselines get, and the figures a side reports."""

from __future__ import annotations

import math
import random

import pytest
import torch

from bench.learner_multigpu import (
    hf_labels,
    length_location,
    parse_args,
    recipe_lengths,
    recipe_sequences,
    summary,
    without,
)
from services.learner.batching import rank_micro_batches
from services.learner.flops import train_flops


def test_length_location_gives_the_clipped_mean():
    mu = length_location(10300, 0.6, 512, 30000)
    rng = random.Random(0)
    draws = [min(max(math.exp(rng.gauss(mu, 0.6)), 512), 30000) for _ in range(200_000)]
    assert sum(draws) / len(draws) == pytest.approx(10300, rel=0.01)


def test_recipe_lengths_scale_with_the_row():
    args = parse_args(["--row-tokens", "512"])
    assert (args.length_min, args.length_mean, args.length_max) == (8, 161, 469)
    full = parse_args([])
    assert (full.row_tokens, full.length_mean, full.length_max, full.rows_per_rank) == (32768, 10300, 30000, 2)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_rank_gets_the_same_rows_and_exactly_its_share(world):
    args = parse_args(["--row-tokens", "2048", "--rows-per-rank", "2"])
    for step in range(3):
        lengths, _ = recipe_lengths(args, step, world)
        assert lengths == recipe_lengths(args, step, world)[0]  # every side and rank draws the same
        assert max(lengths) <= args.length_max and min(lengths) >= args.length_min
        seqs = recipe_sequences(args, step, world, vocab=1000)
        assert [len(s) for s in seqs] == lengths
        seen = []
        for rank in range(world):
            batches = rank_micro_batches(seqs, args.row_tokens, world, rank, 1, 256)
            assert len(batches) == args.rows_per_rank  # DeepSpeed's accumulation steps of the baselines
            for b in batches:
                assert b.input_ids.shape[1] % 256 == 0 and b.input_ids.shape[1] <= args.row_tokens
                assert (b.seq_index >= 0).any()  # no filler row
                seen += sorted(set(b.seq_index[b.seq_index >= 0].tolist()))
        assert sorted(seen) == list(range(len(seqs)))  # each trajectory trained once, on one rank
    assert recipe_lengths(args, 0, world)[0] != recipe_lengths(args, 1, world)[0]


def test_hf_labels_are_the_learner_targets_shifted_and_stop_at_boundaries():
    args = parse_args(["--row-tokens", "512"])
    seqs = recipe_sequences(args, 0, 1, vocab=1000)
    b = rank_micro_batches(seqs, args.row_tokens, 1, 0, 1, 64)[0]
    labels = hf_labels(b)
    # HF's loss predicts labels[t + 1] at position t
    shifted = labels[:, 1:]
    loss_at = b.mask[:, :-1] > 0
    assert torch.equal(shifted[loss_at], b.targets[:, :-1][loss_at])
    assert (shifted[~loss_at] == -100).all() and labels[0, 0] == -100
    starts = (b.position_ids[0, 1:] == 0).nonzero().flatten() + 1  # a trajectory's first token: no label
    assert len(starts) > 0 and (labels[0, starts] == -100).all()
    assert int((labels != -100).sum()) == int(b.mask.sum())


def test_packed_rows_count_attention_per_trajectory():
    lens = [12000, 9000, 11768]
    assert train_flops(10, 2, 8, lens) == sum(train_flops(10, 2, 8, [n]) for n in lens)
    assert train_flops(10, 2, 8, lens) < train_flops(10, 2, 8, [sum(lens)])


def test_summary_of_steps_of_different_work_uses_their_totals():
    out = summary([1.0, 2.0, 4.0], [100, 400, 400], [10.0, 40.0, 40.0], [5.0, 20.0, 20.0], 2, 10.0, None)
    assert out["tokens_per_s"] == pytest.approx(900 / 7, abs=0.1)
    assert (out["tokens_per_s_min"], out["tokens_per_s_max"]) == (100.0, 200.0)
    assert out["mfu"] == pytest.approx(90 / 7 / 20, abs=1e-4) and out["step_s"] == 2.0
    same = summary([1.0, 3.0, 2.0], [100] * 3, [10.0] * 3, [5.0] * 3, 1, None, None)
    assert same["tokens_per_s"] == 50.0 and same["mfu"] is None  # equal steps: the median step


def test_without_strips_a_flag_and_its_value():
    argv = ["--nproc", "2", "--sides=ours", "--name", "x", "--sides", "liger"]
    assert without(without(argv, "--nproc"), "--sides") == ["--name", "x"]


def test_a_failed_option_is_collected_before_the_next_one_starts():
    """An option that runs out of memory leaves its engine in reference cycles held by the exception's
    traceback; the next option must not start beside it (it did: every later option then ran out too)."""
    import weakref

    from bench.learner_multigpu import attempt

    held: list[weakref.ref] = []

    class Engine:
        def __init__(self) -> None:
            self.me = self  # a cycle, as DeepSpeed's engine and its hooks make
            self.states = torch.zeros(1024)

    def option() -> dict:
        engine = Engine()
        held.append(weakref.ref(engine))
        try:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.16 GiB")
        finally:
            del engine

    import gc

    gc.disable()  # only attempt's own collection may free it
    try:
        result = attempt(option)
        assert held[0]() is None
    finally:
        gc.enable()
    assert result["oom"] and "1.16 GiB" in result["error"]


@pytest.mark.slow
def test_a_rank_out_of_memory_alone_ends_its_launch_and_the_next_option_runs_in_new_processes(tmp_path):
    """Ranks need not run out of memory at the same point: one that went on to the next option while the
    other waited in the last one's collective hung both (a 2-rank 1.5B run printed nothing for 6 minutes).
    Injected on rank 1 only, under recompute none: the launch ends, the attempt is recorded with the
    rank's error, and mlp runs in fresh processes to its figures."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    name = f"test_oom_{os.getpid()}"
    env = {**os.environ, "STAR_BENCH_OOM": "none:1"}
    cmd = [
        sys.executable,
        "bench/learner_multigpu.py",
        "--nproc",
        "2",
        "--shape",
        "tiny",
        "--device",
        "cpu",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--rows",
        "recipe",
        "--sides",
        "ours",
        "--recompute",
        "none,mlp",
        "--row-tokens",
        "1024",
        "--length-mean",
        "300",
        "--length-min",
        "64",
        "--length-max",
        "900",
        "--name",
        name,
    ]
    out = root / "bench" / "results" / f"{name}.json"
    try:
        run = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        record = json.loads(out.read_text())
        none, mlp = record["attempts"]["ours"]
        assert none["recompute"] == "none" and none["oom"] and "injected on rank 1" in none["error"]
        assert mlp["recompute"] == "mlp" and mlp["tokens_per_s"] > 0
        assert record["sides"]["ours"]["tokens_per_s"] == mlp["tokens_per_s"]
        assert not out.with_suffix(".oom").exists()
    finally:
        for suffix in (".json", ".md", ".oom"):
            out.with_suffix(suffix).unlink(missing_ok=True)
