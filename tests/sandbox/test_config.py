"""The sandbox's own settings file: `star sandbox serve --config FILE`, the STAR_* variables under it, and a
bad file a clear command-line error."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from services.cli import app
from services.common.config_file import ConfigFileError
from services.common.settings import Settings
from services.sandbox.config import SandboxConfig

runner = CliRunner()
VARIABLES = tuple(f"STAR_{name.upper()}" for name in SandboxConfig.model_fields)


@pytest.fixture
def served(monkeypatch):
    """`star sandbox serve` without its server: the environment it hands its workers is restored afterwards."""
    import uvicorn

    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    calls = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: calls.append(app))
    return calls


def _file(tmp_path, data, name="sandbox.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_a_files_fault_rates_reach_the_toolbox(tmp_path, served, official_world_url):
    path = _file(tmp_path, {"fault_rate": 0.25, "fault_seed": 7, "per_tool_fault_rates": {"FlightSearch": 0.5}})
    result = runner.invoke(app, ["sandbox", "serve", "--config", str(path)])
    assert result.exit_code == 0, result.output
    from services.sandbox.app import create_app

    with TestClient(create_app(Settings(db_url=official_world_url))) as c:  # as a worker builds it
        faults = c.get("/faults").json()
    assert faults == {"rate": 0.25, "seed": 7, "per_tool": {"SearchFlight": 0.5}}


def test_the_variables_set_what_the_file_leaves_out_and_flags_go_over_it(tmp_path, served, monkeypatch):
    monkeypatch.setenv("STAR_FAULT_SEED", "9")
    monkeypatch.setenv("STAR_FAULT_RATE", "0.9")
    path = _file(tmp_path, "fault_rate: 0.1\n", name="sandbox.yaml")
    assert SandboxConfig.from_file(path).model_dump(include={"fault_rate", "fault_seed"}) == {
        "fault_rate": 0.1,
        "fault_seed": 9,
    }
    result = runner.invoke(app, ["sandbox", "serve", "--config", str(path), "--dialect", "official"])
    assert result.exit_code == 0, result.output
    assert SandboxConfig().tool_dialect == "official" and SandboxConfig().fault_rate == 0.1


@pytest.mark.parametrize(
    ("data", "named"),
    [
        ({"fault_rate": 1.5}, "fault_rate"),
        ({"tool_dialect": "klingon"}, "tool_dialect"),
        ({"per_tool_fault_rates": {"Teleport": 0.1}}, "per_tool_fault_rates"),
        ({"fault_rat": 0.1}, "fault_rat"),
        ("{not json", "not valid JSON"),
    ],
)
def test_a_bad_file_is_a_cli_error_naming_the_field(tmp_path, served, data, named):
    result = runner.invoke(app, ["sandbox", "serve", "--config", str(_file(tmp_path, data))])
    assert result.exit_code == 2 and named in result.output, result.output
    assert "Traceback" not in result.output and served == []
    assert not isinstance(result.exception, ConfigFileError)


def test_a_missing_file_is_named(tmp_path, served):
    result = runner.invoke(app, ["sandbox", "serve", "--config", str(tmp_path / "none.json")])
    assert result.exit_code == 2 and "no sandbox config file" in result.output
