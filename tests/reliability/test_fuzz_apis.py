"""Every HTTP API fuzzed from its own OpenAPI document (schemathesis), over real HTTP: valid and
invalid inputs for every operation, and not one 5xx, dropped connection or message-less 4xx in
reply. The services start as in tests/reliability/fuzzing.py (`start_service`); bench/fuzz.py
runs the same at 10,000 requests per service."""

from __future__ import annotations

import contextlib

import pytest

from tests.reliability.fuzzing import AUTH, SERVICES, FuzzReport, fuzz_url, start_service

pytestmark = pytest.mark.slow
EXAMPLES = 25


def _assert_clean(name: str, report: FuzzReport) -> None:
    print(f"{name}: {report.summary()}")
    assert report.calls > 0, f"{name}: nothing was sent"
    assert not report.failures, f"{name}: {len(report.failures)} bad replies:\n" + "\n".join(report.failures[:20])


@pytest.mark.parametrize("name", SERVICES)
def test_api(name, official_world_url, tmp_path):
    with contextlib.ExitStack() as stack:
        url = start_service(name, tmp_path, stack, world_url=official_world_url)
        _assert_clean(name, fuzz_url(url, headers=AUTH, max_examples=EXAMPLES))
