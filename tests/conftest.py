"""Shared fixtures: real data location, real Redis, real PostgreSQL, built worlds."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import re
import socket
import subprocess
import uuid
from collections import Counter
from pathlib import Path

# OpenMP threads that finish a parallel region spin, waiting for the next, by default: with test processes
# side by side (pytest-xdist workers, servers and ranks that tests start) they spin on the CPU the others
# need. Two copies of a learner test took 174 s each side by side against 51 s alone; sleeping instead,
# 69 s (and 50 s alone). Set before torch loads its libgomp, here and in every process the tests start.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# each xdist worker (and what it starts) draws free ports from a slice of its own: no two workers pick the same one
if os.environ.get("PYTEST_XDIST_WORKER", "").startswith("gw") and os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    os.environ.setdefault(
        "STAR_PORT_SLICE", f"{os.environ['PYTEST_XDIST_WORKER'][2:]}/{os.environ['PYTEST_XDIST_WORKER_COUNT']}"
    )

import pytest
import redis as redis_lib

from services.common.redis import EmbeddedRedis
from services.common.settings import DEFAULT_TRAVELPLANNER_DIR

TRAVELPLANNER_DIR = Path(os.environ.get("STAR_TRAVELPLANNER_DIR", DEFAULT_TRAVELPLANNER_DIR))
# the rows the tests' queries need, cut from the public data by tests/fixtures/cut_travelplanner.py
FIXTURE_DIR = Path(__file__).resolve().parent / "fixtures" / "travelplanner"
PG_URL = os.environ.get("STAR_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("STAR_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
DATA_MARK = "travelplanner_data"
# The unit tier (`scripts/test --fast`): tests that reach no server, start no process and build no model engine
# (DeepSpeed, vLLM, a tiny model trained or scored), so the tier runs in minutes. A test is in it unless it requests
# a fixture below (directly or through another fixture), its module's source names a way to start a process, reach
# a server or build an engine (_OUTSIDE_WORDS), or it is marked slow, gpu, postgres or integration. Under the fast
# lane (STAR_TEST_TIER=unit) a unit test that starts a subprocess or opens an internet socket fails, naming the
# fix: mark it (or its module) `integration`.
UNIT_MARK = "unit"
TIER_ENV = "STAR_TEST_TIER"
SERVER_FIXTURES = {
    "redis_server_url",
    "redis_client",
    "pg_url",
    "loop",
    "module_loop",
    "tiny_model",
    "encoder",
    "index",
    "index_dir",
}
NOT_UNIT_MARKS = ("slow", "gpu", "postgres", "integration")
# Tests the rules above cannot tell from their source (the code they call starts the process or opens the socket),
# found by the lane's guard: a module, or one test of it. A test whose module cannot say so itself goes here.
NOT_UNIT_TESTS = (
    "tests/common/test_tracking.py",  # wandb's offline run starts its service process
    "tests/learner/test_fleet_sync.py",
    "tests/learner/test_nccl_master.py",
    "tests/learner/test_weights_nccl.py",
    "tests/learner/test_vocab_head.py::test_compiled_kernels_agree_with_eager",  # torch.compile's worker processes
    "tests/pipeline/test_colocation_placement.py::test_a_colocated_stage_starts_one_sleeping_engine_a_gpu_serving",
    "tests/pipeline/test_config.py::test_the_nccl_timeout_reaches_the_learner_from_the_recipe",
    "tests/pipeline/test_fleet_stop.py",
    "tests/pipeline/test_validation.py",
    "tests/pipeline/test_placement.py::test_star_train_refuses_a_layout_the_machine_cannot_hold_before_starting",
    "tests/pipeline/test_placement.py::test_a_validation_process_gets_its_devices_from_the_placement",
    "tests/pipeline/test_weight_sync.py::test_rl_config_over_nccl_names_the_workers_and_a_master_port",
    "tests/pipeline/test_weight_sync.py::test_star_train_refuses_nccl_on_a_one_gpu_box_before_starting",
    "tests/pipeline/test_weight_sync.py::test_workers_get_an_http_port_and_an_nccl_engine_only_over_nccl",
    "tests/rollout/test_agent.py::test_unreachable_sandbox_is_an_engine_error_after_retries",
    "tests/reliability/test_stream_outage.py",
    "tests/reliability/test_fuzz_short.py",
)
_OUTSIDE_WORDS = re.compile(
    r"\b(subprocess|Popen|uvicorn|multiprocessing|torch\.distributed|torchrun|mp\.spawn|"
    r"ServiceProcess|EmbeddedRedis|redis_lib|Redis\.from_url|FakeOpenAI|AsyncLLM|"
    r"socket\.socket|create_server|start_server|"
    r"deepspeed|LearnerEngine|make_engine|build_engine|from_pretrained|tiny_model|"
    r"scored_batch)\b"
)
_LIBC_NAME = ctypes.util.find_library("c")
_MALLOC_TRIM = getattr(ctypes.CDLL(_LIBC_NAME), "malloc_trim", None) if _LIBC_NAME else None  # glibc only


def train_position(records: list[dict], org: str, dest: str) -> int:
    """Where the train query from `org` to `dest` is in `records`. The fixture keeps some of the 45 train
    queries, in their order, so a test names a query by its route: the same query in both data sets."""
    return next(i for i, r in enumerate(records) if (r["org"], r["dest"]) == (org, dest))


def _has_data(directory: Path) -> bool:
    return (directory / "database" / "background" / "citySet_with_states.txt").is_file()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{DATA_MARK}: reads TravelPlanner data (the full data or the fixture)")
    config.addinivalue_line("markers", f"{UNIT_MARK}: the unit tier, no servers and no processes (set by conftest)")
    config.addinivalue_line("markers", "integration: not in the unit tier (starts a process or reaches a server)")
    if hasattr(config.option, "loadscopereorder"):
        # xdist hands files out in the order collected (below: the slow ones first), not by test count,
        # which would leave the few long end-to-end files for last and one worker running them alone
        config.option.loadscopereorder = False


def pytest_report_header(config: pytest.Config) -> str:
    if _has_data(TRAVELPLANNER_DIR):
        return f"TravelPlanner data: {TRAVELPLANNER_DIR}"
    return (
        f"TravelPlanner data: the test fixture {FIXTURE_DIR} (no data at {TRAVELPLANNER_DIR}; "
        "the full-data checks skip)"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test that reads the data, so `-m travelplanner_data` runs exactly those. Under xdist,
    files with more tests marked slow come first (each file in its own order): the long ones start early
    and the short ones even out the workers' ends."""
    for item in items:
        if {"travelplanner_dir", "full_travelplanner_dir"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(DATA_MARK)
        if is_unit(item):
            item.add_marker(UNIT_MARK)
    if os.environ.get("PYTEST_XDIST_WORKER"):

        def file_of(item: pytest.Item) -> str:
            return item.nodeid.split("::", 1)[0]

        slow = Counter(file_of(item) for item in items if item.get_closest_marker("slow"))
        items.sort(key=lambda item: -slow[file_of(item)])  # stable: collection order otherwise


_module_reaches_out: dict[str, bool] = {}


def _reaches_out(path: Path) -> bool:
    """Whether a test module's source names a way to start a process or reach a server."""
    key = str(path)
    if key not in _module_reaches_out:
        try:
            _module_reaches_out[key] = bool(_OUTSIDE_WORDS.search(path.read_text(encoding="utf-8")))
        except OSError:
            _module_reaches_out[key] = True
    return _module_reaches_out[key]


def is_unit(item: pytest.Item) -> bool:
    """Whether a collected test belongs to the unit tier (see UNIT_MARK)."""
    if any(item.get_closest_marker(mark) for mark in NOT_UNIT_MARKS):
        return False
    if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
        return False
    if item.nodeid.startswith(NOT_UNIT_TESTS):
        return False
    return not _reaches_out(Path(str(item.path)))


def _refuse(what: str):
    def refuse(*_args, **_kwargs):
        raise RuntimeError(
            f"a unit-tier test {what}: mark it (or its module, `pytestmark`) "
            "`pytest.mark.integration` so the fast lane leaves it to the full suite"
        )

    return refuse


@pytest.fixture(autouse=True)
def _unit_tier_guard(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """Under the fast lane, a unit test that starts a process or opens an internet socket fails: the tier stays
    what it says. Unix sockets and socket pairs (an asyncio loop's own wake-up) stay allowed."""
    if os.environ.get(TIER_ENV) == UNIT_MARK and request.node.get_closest_marker(UNIT_MARK):
        monkeypatch.setattr(subprocess.Popen, "__init__", _refuse("started a subprocess"))
        for name in ("connect", "connect_ex", "bind"):
            original = getattr(socket.socket, name)

            def guarded(sock, address, *rest, _original=original, _name=name):
                if sock.family in (socket.AF_INET, socket.AF_INET6):
                    _refuse(f"opened an internet socket ({_name} {address!r})")()
                return _original(sock, address, *rest)

            monkeypatch.setattr(socket.socket, name, guarded)
    yield


@pytest.fixture(scope="session")
def travelplanner_dir() -> Path:
    """The TravelPlanner data: the full data where it is (STAR_TRAVELPLANNER_DIR, default
    ../shared/travelplanner), otherwise the fixture cut from it."""
    return TRAVELPLANNER_DIR if _has_data(TRAVELPLANNER_DIR) else FIXTURE_DIR


@pytest.fixture(scope="session")
def full_travelplanner_dir() -> Path:
    """The full data, for the checks the fixture cannot make (every city, the whole validation file)."""
    if not _has_data(TRAVELPLANNER_DIR):
        pytest.skip(
            f"needs the full TravelPlanner data, not found at {TRAVELPLANNER_DIR}: set "
            "STAR_TRAVELPLANNER_DIR to a copy of the benchmark's files (docs/development.md#data)"
        )
    return TRAVELPLANNER_DIR


@pytest.fixture(scope="module", autouse=True)
def _release_module_memory():
    """After each module, collect its cycles and hand freed heap pages back to the system: models,
    engines and worlds that a module built would otherwise keep the suite's process large."""
    yield
    gc.collect()
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


@pytest.fixture
def data_env(travelplanner_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """STAR_TRAVELPLANNER_DIR set to the tests' data for code that reads the settings in-process."""
    from services.common.settings import get_settings

    monkeypatch.setenv("STAR_TRAVELPLANNER_DIR", str(travelplanner_dir))
    get_settings.cache_clear()
    yield travelplanner_dir
    get_settings.cache_clear()


@pytest.fixture(scope="session")
def official_world_url(travelplanner_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The real tables plus generated flights (with the train reference flights merged), in SQLite."""
    from services.sandbox.world.build import build_official_world

    url = f"sqlite:///{tmp_path_factory.mktemp('world') / 'official.sqlite'}"
    build_official_world(
        url, travelplanner_dir / "database", seed=0, ref_info=[travelplanner_dir / "train" / "train_ref_info.jsonl"]
    )
    return url


@pytest.fixture(scope="session")
def official_world(official_world_url: str):
    from services.sandbox.world import World

    world = World(official_world_url)
    yield world
    world.close()


@pytest.fixture(scope="session")
def reference_world(travelplanner_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The real tables with exactly the train reference flights (loaded as a user's flights CSV):
    no generated rows, so every flight answer is one the reference information shows."""
    import csv

    from services.sandbox.world import World, loader
    from services.sandbox.world.build import build_official_world

    tmp = tmp_path_factory.mktemp("reference-world")
    flights_csv = tmp / "flights.csv"
    rows, _ = loader.reference_flights(travelplanner_dir / "train" / "train_ref_info.jsonl")
    with open(flights_csv, "w", newline="", encoding="utf-8") as fh:
        out = csv.writer(fh)
        out.writerow(loader.FLIGHT_COLUMNS)
        out.writerows(rows)
    url = f"sqlite:///{tmp / 'world.sqlite'}"
    build_official_world(url, travelplanner_dir / "database", flights_csv=flights_csv)
    world = World(url)
    yield world
    world.close()


@pytest.fixture(scope="session")
def redis_server_url() -> str:
    """CI's Redis at 127.0.0.1:6379 when it answers, otherwise an embedded real server."""
    try:
        redis_lib.Redis.from_url(REDIS_URL, socket_connect_timeout=0.5).ping()
        yield REDIS_URL
    except redis_lib.ConnectionError:
        with EmbeddedRedis() as server:
            yield server.url


@pytest.fixture
def redis_client(redis_server_url: str):
    client = redis_lib.Redis.from_url(redis_server_url)
    prefix = f"test:{uuid.uuid4().hex[:8]}:"
    yield client, prefix
    for key in client.scan_iter(match=prefix + "*"):
        client.delete(key)


@pytest.fixture(scope="session")
def pg_url() -> str:
    from sqlalchemy import create_engine, text

    try:
        engine = create_engine(PG_URL)
        with engine.connect() as conn:
            conn.execute(text("select 1"))
        engine.dispose()
    except Exception as exc:  # noqa: BLE001
        message = f"PostgreSQL not reachable at {PG_URL}: {exc}"
        if os.environ.get("STAR_REQUIRE_SERVICES"):
            pytest.fail(message + " (STAR_REQUIRE_SERVICES is set, as in CI)")
        pytest.skip(message)
    return PG_URL


def _loop_in_thread():
    """An asyncio loop running in a thread of its own, as a rollout worker's engine loop runs."""
    import asyncio
    import threading

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


@pytest.fixture
def loop():
    yield from _loop_in_thread()


@pytest.fixture(scope="module")
def module_loop():
    """The same, for a module's engines (an AsyncLLM stays bound to the loop that first used it)."""
    yield from _loop_in_thread()
