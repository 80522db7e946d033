"""Shared by the adapter tests, which run in each library's own virtual environment (`scripts/test-adapters`).

The libraries' environments hold the adapters and the episode client but not our servers' dependencies, so the
suite's root conftest is not loaded there (`--confcutdir tests/environments`); what those tests need from it is
here: the data folder, and the live episode API that `adapter_server.served_episodes` starts with the main
environment's Python. In the main environment the adapter tests skip (their library is absent), saying where
they run.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.environments.adapter_server import ServedEpisodes, main_python_problem, served_episodes

ROOT = Path(__file__).resolve().parents[2]
# The fixture's train queries: the parity cases are theirs, whichever data the rest of the suite reads.
FIXTURE_DIR = ROOT / "tests" / "fixtures" / "travelplanner"


def library_or_skip(module: str, venv: str) -> None:
    """Skips the calling test module unless `module` imports here, naming the environment it runs in."""
    if importlib.util.find_spec(module) is None:
        pytest.skip(
            f"{module} is not installed here: this test runs in {venv} (scripts/install with "
            f"STAR_ENV_ADAPTERS=1 creates it; scripts/test-adapters runs it)",
            allow_module_level=True,
        )


@pytest.fixture(scope="session")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedEpisodes]:
    """The episode API over the fixture's train queries, with every plan case and its `star score` rewards."""
    problem = main_python_problem()
    if problem is not None:
        pytest.fail(problem)
    limit = int(os.environ.get("STAR_ADAPTER_QUERIES", "0"))
    with served_episodes(tmp_path_factory.mktemp("served"), FIXTURE_DIR, limit=limit) as server:
        yield server
