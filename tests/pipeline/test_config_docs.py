"""docs/configuration.md is generated from the recipe and settings models and kept current."""

from services.pipeline import docs


def test_the_committed_configuration_reference_matches_the_code():
    committed = docs.OUTPUT.read_text()
    assert committed == docs.render(), "docs/configuration.md is stale: run `python -m services.pipeline.docs`"


def test_every_recipe_section_and_setting_is_in_the_reference():
    text = docs.render()
    for key in ("`rl.sampling:`", "`eval.sampling:`", "`model.tiny:`", "`learner:`"):
        assert key in text
    assert "| `STAR_REDIS_URL` |" in text and "| `STAR_ROLLOUT_ENGINE` |" in text


def test_nested_sections_show_the_defaults_their_parent_gives(tmp_path):
    text = docs.render()
    eval_sampling = text.split("### `eval.sampling:`")[1].split("###")[0]
    rl_sampling = text.split("### `rl.sampling:`")[1].split("###")[0]
    assert "| `temperature` | float | `0.6` |" in eval_sampling
    assert "| `temperature` | float | `1.0` |" in rl_sampling
    assert str(docs.PROJECT_ROOT) not in text  # no path of this checkout: the file must match on every machine


def test_check_fails_on_a_stale_file_and_passes_on_a_fresh_one(tmp_path, capsys):
    out = tmp_path / "configuration.md"
    out.write_text("old\n")
    assert docs.main(["--check", "--out", str(out)]) == 1
    assert "stale" in capsys.readouterr().err
    assert docs.main(["--out", str(out)]) == 0
    assert docs.main(["--check", "--out", str(out)]) == 0
