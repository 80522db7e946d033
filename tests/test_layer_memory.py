"""bench/layer_memory.py: the per-layer figures from runs at two layer counts, its record's Markdown, its CLI
errors, and a CPU run of the record path end to end."""

from __future__ import annotations

import json

import pytest

from bench import layer_memory as m


def run(layers, peak, resident):
    return {"layers": layers, "peak_gib": peak, "resident_gib": resident, "activation_gib": round(peak - resident, 2)}


def test_per_layer_memory_is_the_difference_between_the_fewest_and_most_layers():
    got = m.per_layer([run(4, 40.0, 16.0), run(2, 26.0, 10.0)], full_layers=28)
    assert got["between_layers"] == [2, 4]
    assert got["per_layer"] == {"resident_gib": 3.0, "activation_gib": 4.0, "peak_gib": 7.0}
    assert got["projected_peak_gib"] == 26.0 + 7.0 * 26 and got["projected_activation_gib"] == 16.0 + 4.0 * 26


def test_runs_without_figures_give_no_per_layer_rate():
    assert m.per_layer([run(2, 26.0, 10.0), {"layers": 4, "error": "OOM"}], full_layers=28) == {}
    assert m.per_layer([{"layers": 1, "peak_gib": None, "resident_gib": None}] * 2, full_layers=2) == {}


def test_the_markdown_shows_every_run_and_each_options_rate():
    runs = [run(2, 26.0, 10.0), {"layers": 4, "error": "OOM: CUDA out of memory"}]
    rec = {
        "shape": "7b", "device": "GPU", "command": "python bench/layer_memory.py", "row_tokens": 32768,
        "card_gib": 80.0, "full_layers": 28,
        "options": {"lean": {"runs": runs}, "lean+mlp": {"runs": [run(2, 20.0, 10.0), run(4, 30.0, 16.0)],
                                                        **m.per_layer([run(2, 20.0, 10.0), run(4, 30.0, 16.0)], 28)}},
    }  # fmt: skip
    md = m.markdown(rec)
    assert "| lean | 2 | 26.00 | 10.00 | 16.00 |" in md and "| lean | 4 | OOM: CUDA out of memory" in md
    assert "| lean+mlp | 3.000 | 2.000 | 150.0 | 62.0 |" in md and "| lean | – | – | – | – |" in md


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--layers", "2"], "at least two"),
        (["--layers", "2,x"], "whole numbers"),
        (["--layers", "2,40"], "has 28 layers"),
        (["--options", "lean,sideways"], "--options: unknown"),
    ],
)
def test_bad_arguments_are_cli_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        m.parse_args(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_a_cpu_run_writes_the_record(tmp_path, monkeypatch):
    monkeypatch.setattr(m, "ROOT", tmp_path)  # the record under this test's folder, not bench/results
    name = "layer_memory_cpu_test"
    argv = ["--shape", "tiny", "--device", "cpu", "--layers", "1,2", "--options", "lean+mlp", "--row-tokens", "512",
            "--steps", "1", "--workdir", str(tmp_path), "--name", name]  # fmt: skip
    assert m.main(argv) == 0
    rec = json.loads((tmp_path / "bench" / "results" / f"{name}.json").read_text())
    runs = rec["options"]["lean+mlp"]["runs"]
    assert [r["layers"] for r in runs] == [1, 2] and all(r["error"] is None and r["tokens_per_s"] > 0 for r in runs)
    assert rec["device"] == "cpu" and runs[0]["peak_gib"] is None  # no GPU, no memory figures, no rate
    assert "per_layer" not in rec["options"]["lean+mlp"]
    assert (tmp_path / "bench" / "results" / f"{name}.md").is_file()
