"""The `star` command: world build/info, tool calls, and clear errors instead of tracebacks."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from services.cli import app

runner = CliRunner()


def test_world_build_synthetic_then_tool(tmp_path):
    db = f"sqlite:///{tmp_path / 'tiny.sqlite'}"
    r = runner.invoke(app, ["world", "build", "--synthetic", "tiny", "--db", db, "--seed", "3"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["world", "info", "--db", db])
    assert r.exit_code == 0 and '"kind": "synthetic"' in r.output
    from services.sandbox.world import World

    city = next(c for c in World(db).cities() if c.searchable)
    r = runner.invoke(app, ["tool", "SearchRestaurant", "--db", db, "--city", city.city])
    assert r.exit_code == 0, r.output
    assert r.output.startswith(f"A SearchRestaurant for city {city.city} found the following ")
    r = runner.invoke(app, ["tool", "SearchCity", "--db", db, f"--state={city.state}", "--dialect", "official"])
    assert r.exit_code == 0 and r.output.startswith("[") and repr(city.city) in r.output


@pytest.mark.usefixtures("full_travelplanner_dir")
def test_world_build_from_real_directory(travelplanner_dir, tmp_path):
    db = f"sqlite:///{tmp_path / 'real.sqlite'}"
    r = runner.invoke(
        app, ["world", "build", "--from", str(travelplanner_dir / "database"), "--db", db, "--flight-scale", "0.01"]
    )
    assert r.exit_code == 0, r.output
    assert "4,285" in r.output  # visible accommodations
    r = runner.invoke(
        app,
        [
            "tool",
            "GoogleDistanceMatrix",
            "--db",
            db,
            "--departure",
            "Detroit",
            "--destination",
            "Norfolk",
            "--mode",
            "taxi",
        ],
    )
    assert r.output.strip().endswith(
        "taxi, from Detroit to Norfolk, duration: 10 hours 55 mins, distance: 1,144 km, cost: $1144"
    )


def test_errors_are_messages_not_tracebacks(tmp_path):
    db = f"sqlite:///{tmp_path / 'none.sqlite'}"
    r = runner.invoke(app, ["world", "build", "--from", str(tmp_path), "--db", db])
    assert r.exit_code == 2 and "not a TravelPlanner database" in r.output and "Traceback" not in r.output
    r = runner.invoke(app, ["world", "build", "--synthetic", "gigantic", "--db", db])
    assert r.exit_code == 2 and "unknown world size" in r.output
    r = runner.invoke(app, ["tool", "SearchCity", "--db", db, "--state", "Ohio"])
    assert r.exit_code == 2 and "star world build" in r.output
    runner.invoke(app, ["world", "build", "--synthetic", "tiny", "--db", db])
    r = runner.invoke(app, ["tool", "BookHotel", "--db", db, "--city", "X"])
    assert r.exit_code == 2 and "unknown tool" in r.output
    r = runner.invoke(app, ["tool", "SearchCity", "--db", db, "Ohio"])
    assert r.exit_code == 2 and "expected --name value" in r.output


def _visible_commands(command, path="star"):
    """(path, click command) for `star` and every sub-command `--help` shows."""
    if getattr(command, "hidden", False):
        return
    yield path, command
    for name, sub in (getattr(command, "commands", None) or {}).items():
        yield from _visible_commands(sub, f"{path} {name}")


def test_every_command_and_option_says_what_it_is_for():
    import typer

    missing = []
    for path, command in _visible_commands(typer.main.get_command(app)):
        if not (command.help or command.short_help):
            missing.append(path)
        missing += [
            f"{path} {'/'.join(p.opts)}"
            for p in command.params
            if p.param_type_name == "option" and not p.hidden and not p.help
        ]
    assert missing == []


def test_one_flag_name_for_one_thing_across_commands():
    """Sampling budgets and the sandbox's address have one spelling wherever they appear."""
    import typer

    names = set()
    for _, command in _visible_commands(typer.main.get_command(app)):
        names |= {opt for p in command.params if not getattr(p, "hidden", False) for opt in p.opts}
    assert {"--max-context", "--max-tool-calls", "--sandbox-url", "--top-p"} <= names
    assert not names & {"--context", "--tool-budget", "--sandbox", "--max-context-tokens"}


def test_commands_are_grouped_by_role_and_old_names_still_answer():
    r = runner.invoke(app, ["--help"], env={"COLUMNS": "120"})
    assert r.exit_code == 0
    for panel in ("Run the recipe", "World and data", "Score and evaluate", "Train by hand", "Services and workers"):
        assert panel in r.output
    import typer

    top = typer.main.get_command(app).commands
    assert "demo" not in top and {"evaluate", "sft"} <= {name for name, c in top.items() if c.hidden}
    for old, new in (
        (["sft", "--help"], ["learner", "sft", "--help"]),
        (["evaluate", "--help"], ["eval", "submission", "--help"]),
    ):
        assert runner.invoke(app, old).exit_code == 0 and runner.invoke(app, new).exit_code == 0
    assert runner.invoke(app, ["demo"]).exit_code == 2  # gone: `star up` and `star tool` do what it did


def _serve_ports() -> dict[str, int]:
    """`star … serve` command → the default of its --port."""
    import typer

    return {
        path: next(p.default for p in command.params if "--port" in p.opts)
        for path, command in _visible_commands(typer.main.get_command(app))
        if path.endswith(" serve") and any("--port" in p.opts for p in command.params)
    }


def test_every_service_listens_on_its_own_default_port():
    ports = _serve_ports()
    assert {
        "star sandbox serve",
        "star formatter serve",
        "star reward serve",
        "star rollout serve",
        "star learner serve",
        "star qa serve",
    } <= set(ports)
    assert len(set(ports.values())) == len(ports), ports


def test_a_default_port_is_the_host_port_compose_publishes_the_service_on():
    """A service that Compose publishes on the host is published on its `star … serve` default, so
    `curl localhost:PORT` reaches it the same way under `star … serve` and under Compose."""
    from pathlib import Path

    import yaml

    compose = yaml.safe_load((Path(__file__).resolve().parents[1] / "compose.yaml").read_text())
    published: dict[str, set[int]] = {}
    for service in compose["services"].values():
        command = service.get("command") or []
        if command[:1] == ["star"] and "serve" in command:
            path = " ".join(command[: command.index("serve") + 1])
            published.setdefault(path, set()).update(int(p.split(":")[-2]) for p in service.get("ports", []))
    assert published  # the file still starts its services with `star … serve`
    ports = _serve_ports()
    for path, hosts in published.items():
        assert not hosts or ports[path] in hosts, (path, ports[path], hosts)


def test_world_build_if_missing_keeps_a_world_already_built(tmp_path):
    from services.sandbox.world import World

    db = f"sqlite:///{tmp_path / 'w.sqlite'}"
    r = runner.invoke(app, ["world", "build", "--synthetic", "tiny", "--db", db, "--if-missing"])
    assert r.exit_code == 0, r.output
    first = World(db).identity()
    assert first["source"] == "synthetic world tiny (seed 0)"
    r = runner.invoke(app, ["world", "build", "--synthetic", "small", "--db", db, "--if-missing"])
    assert r.exit_code == 0 and "kept the world" in r.output and first["world_hash"] in r.output
    assert World(db).identity() == first  # not rebuilt
    r = runner.invoke(app, ["world", "build", "--synthetic", "small", "--db", db])
    assert r.exit_code == 0 and World(db).identity()["size"] == "small"  # without it: rebuilt
