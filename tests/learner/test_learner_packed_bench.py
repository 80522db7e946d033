"""The packed-rows learner benchmark (bench/learner_packed.py): its targets, spreads, the recipe's memory option,
the Liger side's fallback from a compiled loss that fails to eager, and the record path end to end on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import learner_multigpu as lm, learner_packed as lp


def figures(rates: list[float], tokens: int = 1000, **more) -> dict:
    """A side's result as the runs return it: steps of `tokens` tokens at the given rates."""
    steps = [tokens / r for r in rates]
    return {
        "steps_s": steps,
        "tokens_per_step": [tokens] * len(rates),
        "tokens_per_s": tokens * len(rates) / sum(steps),
        **more,
    }


def test_targets_follow_the_figures():
    record = {
        "sides": {
            "single": figures([100, 100], mfu=0.54),
            "ours": figures([90, 110], mfu=0.50, peak_gib=70.0),
            "liger": figures([80, 80]),
        }
    }
    lp.finish(record)
    t = record["targets"]
    assert record["speedup_vs_baseline"] == pytest.approx(record["tokens_per_s"] / 80, abs=1e-3)
    assert t["mfu_vs_single"]["pass"] and t["mfu_vs_single"]["value"] == pytest.approx(0.50 / 0.54, abs=1e-3)
    assert t["mfu"]["pass"] and t["peak_gib"]["pass"] and t["speedup_vs_baseline"]["pass"]
    assert record["targets_missed"] == []
    # slower than 1.15x the baseline, below 0.9x the single row's MFU and past the card: each one fails
    record["sides"]["liger"] = figures([95, 95])
    record["sides"]["ours"] = figures([90, 110], mfu=0.47, peak_gib=80.5)
    lp.finish(record)
    assert record["targets_missed"] == ["mfu_vs_single", "mfu", "speedup_vs_baseline", "peak_gib"]


def test_a_side_that_did_not_run_leaves_its_targets_open():
    record = {
        "sides": {"single": figures([100]), "ours": figures([100]), "liger": {"skipped": "liger-kernel unavailable"}}
    }
    lp.finish(record)
    assert record["baseline_tokens_per_s"] is None and record["speedup_vs_baseline"] is None
    assert all(t["pass"] is None for t in record["targets"].values()) and record["targets_missed"] == []


def test_step_rates_give_each_step_and_the_spread():
    out = lp.step_rates(figures([100, 200, 300]))
    assert out["tokens_per_s_by_step"] == [100.0, 200.0, 300.0]
    assert out["spread"]["min"] == 100.0 and out["spread"]["max"] == 300.0 and out["spread"]["stdev"] == 100.0
    assert out["spread"]["cv"] == 0.5
    assert lp.step_rates({"error": "x"}) == {}


@pytest.mark.parametrize(
    "learner, option",
    [
        ("gradient_checkpointing: true", "layers"),
        ("recompute_mlp: true", "mlp"),
        ("micro_batch_tokens: 32768", "none"),
        ("activation_memory: lean\n  recompute_mlp: true\n  recompute_mlp_layers: 14", "lean+mlp14"),
    ],
)
def test_ours_runs_the_recipe_memory_option_first(tmp_path, learner, option):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"learner:\n  {learner}\n")
    assert lp.recipe_recompute(recipe) == option
    order = lp.recompute_order(lp.parse_args(["--recipe", str(recipe)])).split(",")
    assert order[0] == option and set(lm.RECOMPUTE) <= set(order) and len(set(order)) == len(order)
    assert lm.memory_option(option) is not None
    assert lp.recompute_order(lp.parse_args(["--recompute", "mlp"])) == "mlp"


def test_ours_runs_under_each_packed_attention_and_the_fastest_is_kept(monkeypatch):
    """Each --packed-attention value runs ours in its own processes (the option reaching the learner's config);
    the fastest run is ours, one that failed is an attempt only, and a bad value is refused."""
    seen = []

    def side_in_processes(argv, side, work, options):
        attention = argv[argv.index("--packed-attention") + 1]
        seen.append((attention, lp.side_args(lp.parse_args(argv), "ours", False).packed_attention))
        if attention == "per-sequence":
            return {"error": "boom"}, [{"packed_attention": attention, "error": "boom"}]
        rate = {"varlen": [100, 100], "varlen-gqa": [120, 120]}[attention]
        return {**figures(rate), "packed_attention": attention}, [{"packed_attention": attention}]

    monkeypatch.setattr(lp, "side_in_processes", side_in_processes)
    argv = ["--packed-attention", "varlen,per-sequence,varlen-gqa"]
    args = lp.parse_args(argv)
    result, attempts = lp.ours_by_attention(argv, Path("."), ("none",), args.packed_attention)
    assert seen == [("varlen", "varlen"), ("per-sequence", "per-sequence"), ("varlen-gqa", "varlen-gqa")]
    assert result["packed_attention"] == "varlen-gqa" and len(attempts) == 3
    assert lp.side_args(lp.parse_args([]), "ours", False).packed_attention is None  # the learner's own default
    with pytest.raises(SystemExit):
        lp.parse_args(["--packed-attention", "fastest"])


def test_the_shipped_1p5b_recipe_is_the_default_and_readable():
    assert lp.RECIPE.is_file() and lp.recipe_recompute(lp.RECIPE) in lm.MEMORY_OPTIONS


def test_a_compiled_liger_loss_that_fails_falls_back_to_eager(monkeypatch):
    """The control flow around the real runs (which need Liger's Triton kernels, GPU only): compiled variants
    that fail are recorded with their reason, the row that does not fit without checkpointing is tried
    without it once, and eager is the baseline."""
    calls = []

    def run_baseline(largs, model_dir, rank, world, on_gpu, checkpointing, side):
        calls.append((largs.liger_compile, checkpointing))
        if not checkpointing:
            return {"oom": True, "error": "OOM: CUDA out of memory"}
        if largs.liger_compile == "on":
            raise IndexError("list index out of range")
        return {**figures([50, 60]), "gradient_checkpointing": True}

    monkeypatch.setattr(lm, "liger_kernels", lambda on_gpu: (object, [], None))
    monkeypatch.setattr(lm, "run_baseline", run_baseline)
    args = lp.parse_args(["--liger-variants", ",".join(lp.LIGER_VARIANTS)])  # auto's choice on GPU
    largs = lp.side_args(args, "liger", on_gpu=False)
    result, attempts = lp.run_liger(args, largs, Path("."), on_gpu=False)
    assert calls == [("on", False), ("on", True), ("on", True), ("off", True)]
    assert [(a["variant"], a.get("gradient_checkpointing")) for a in attempts] == [
        ("compiled-static", False),
        ("compiled-static", None),
        ("compiled-dynamic", None),
        ("eager", True),
    ]
    assert "IndexError: list index out of range" in attempts[1]["error"]
    assert result["variant"] == "eager" and result["tokens_per_s"] == pytest.approx(54.5, abs=0.1)


def test_a_compiled_variant_that_runs_is_recorded_beside_eager_and_the_faster_is_the_baseline(monkeypatch):
    def run_baseline(largs, model_dir, rank, world, on_gpu, checkpointing, side):
        return figures([120, 120] if largs.liger_compile == "on" else [100, 100])

    monkeypatch.setattr(lm, "liger_kernels", lambda on_gpu: (object, [], None))
    monkeypatch.setattr(lm, "run_baseline", run_baseline)
    args = lp.parse_args(["--baseline-checkpointing", "off", "--liger-variants", ",".join(lp.LIGER_VARIANTS)])
    result, attempts = lp.run_liger(args, lp.side_args(args, "liger", on_gpu=False), Path("."), on_gpu=False)
    assert [a["variant"] for a in attempts] == ["compiled-static", "eager"]
    assert result["variant"] == "compiled-static" and set(result["variants"]) == {"compiled-static", "eager"}


def test_without_liger_the_side_says_so():
    if lm.liger_kernels(False)[0] is not None:
        pytest.skip("liger-kernel is installed here")
    args = lp.parse_args([])
    result, attempts = lp.run_liger(args, lp.side_args(args, "liger", on_gpu=False), Path("."), on_gpu=False)
    assert result["skipped"].startswith("liger-kernel unavailable") and attempts == []


@pytest.mark.slow
def test_the_record_path_on_cpu(tmp_path):
    """Tiny shape, 2 timed steps, Liger absent: the job (its own process, as the device runs it) writes its
    JSON, markdown and PNG with the fields the issue names, every side a figure or a reason."""
    name = f"test_learner_packed_{os.getpid()}"
    out = lm.ROOT / "bench" / "results" / f"{name}.json"
    cmd = [
        sys.executable,
        "bench/learner_packed.py",
        "--shape",
        "tiny",
        "--device",
        "cpu",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--row-tokens",
        "512",
        "--single-seq",
        "512",
        "--name",
        name,
        "--workdir",
        str(tmp_path),
    ]
    try:
        run = subprocess.run(cmd, cwd=lm.ROOT, capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        record = json.loads(out.read_text())
        for key in (
            "single_mfu",
            "mfu",
            "baseline_tokens_per_s",
            "tokens_per_s",
            "peak_gib",
            "card_gib",
            "timed_steps",
            "device",
            "targets",
        ):
            assert key in record
        assert record["device"] == "cpu" and record["timed_steps"] == 2 and record["card_gib"] is None
        for side in ("single", "ours"):
            r = record["sides"][side]
            assert len(r["tokens_per_s_by_step"]) == 2 and r["spread"]["min"] <= r["spread"]["max"]
            assert r["tokens_per_s"] > 0
        assert record["tokens_per_s"] == record["sides"]["ours"]["tokens_per_s"]
        assert record["memory_option"] == lp.recipe_recompute(lp.RECIPE)
        ours_rows = record["sides"]["ours"]["tokens_per_step"]
        assert all(t <= 512 for t in ours_rows) and record["sides"]["single"]["tokens_per_step"] == [512, 512]
        if lm.liger_kernels(False)[0] is None:
            assert "liger-kernel unavailable" in record["sides"]["liger"]["skipped"]
        assert set(record["targets"]) == {"mfu_vs_single", "mfu", "speedup_vs_baseline", "peak_gib"}
        md = out.with_suffix(".md").read_text()
        assert "ours, the recipe's packed rows" in md and "| mfu |" in md
        assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    finally:
        for suffix in (".json", ".md", ".png"):
            out.with_suffix(suffix).unlink(missing_ok=True)


@pytest.mark.slow
def test_a_baseline_through_the_registered_varlen_attention_trains_what_the_block_mask_trains(tmp_path):
    """HF's model through star_varlen (the rows' cu_seq_lens handed once per row) and through SDPA's block mask
    from position ids: the same weights give the same loss on the same packed rows (a baseline whose
    attention crossed trajectory boundaries would not), and the baseline takes ours' weight persistence."""
    losses = {}
    for attn in ("star_varlen", "sdpa"):
        name = f"test_varlen_baseline_{attn}_{os.getpid()}"
        out = lm.ROOT / "bench" / "results" / f"{name}.json"
        cmd = [
            sys.executable,
            "bench/learner_multigpu.py",
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
            "plain",
            "--baseline-attn",
            attn,
            "--baseline-checkpointing",
            "off",
            "--row-tokens",
            "512",
            "--name",
            name,
            "--workdir",
            str(tmp_path),
        ]
        try:
            run = subprocess.run(cmd, cwd=lm.ROOT, capture_output=True, text=True, timeout=900)
            assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
            side = json.loads(out.read_text())["sides"]["plain"]
        finally:
            for suffix in (".json", ".md"):
                out.with_suffix(suffix).unlink(missing_ok=True)
        assert side["attn_implementation"] == attn and side["tokens_per_s"] > 0
        ours = lm.ours_ds_config(lm.parse_args([]), on_gpu=False, world=1)["zero_optimization"]
        assert side["persistence"] == {k: ours[k] for k in lm.PERSISTENCE_KEYS if k in ours}
        losses[attn] = side["losses"][0]
    assert losses["star_varlen"] == pytest.approx(losses["sdpa"], rel=1e-4, abs=1e-5)
