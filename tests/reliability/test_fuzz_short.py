"""A short schemathesis run in every test pass: the reward and sandbox APIs (the ones researchers
call) fuzzed from their OpenAPI documents, a few examples per operation, /healthz probed
throughout. The full campaign (10,000 requests per service) is bench/fuzz.py."""

from __future__ import annotations

import contextlib

import pytest

from tests.reliability.fuzzing import AUTH, campaign, start_service


@pytest.mark.parametrize("name", ["reward", "sandbox"])
def test_short_fuzz(name, official_world_url, tmp_path):
    with contextlib.ExitStack() as stack:
        url = start_service(name, tmp_path, stack, world_url=official_world_url)
        report, probe = campaign(url, 150, headers=AUTH, max_examples=5, max_rounds=3)
    print(f"{name}: {report.summary()}, worst /healthz {probe.worst_s:.3f} s")
    assert report.calls >= 100
    assert not report.failures, "\n".join(report.failures[:20])
    assert probe.probes > 0 and probe.failures == 0 and probe.worst_s < 1.0
