"""Fixtures of the reliability tests: a STAR_HOME of their own (the tiny model built once)."""

from __future__ import annotations

import pytest

from services.common.settings import get_settings


@pytest.fixture
def star_home(tmp_path_factory, monkeypatch):
    home = tmp_path_factory.getbasetemp() / "reliability-home"  # the tiny model is built once per session
    monkeypatch.setenv("STAR_HOME", str(home))
    monkeypatch.setenv("STAR_LOG_JSON", "false")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    for key in ("STAR_REDIS_URL", "STAR_DB_URL", "STAR_SANDBOX_URL", "STAR_MODEL", "STAR_STREAM_PREFIX"):
        monkeypatch.delenv(key, raising=False)
    get_settings.cache_clear()
    yield home
    get_settings.cache_clear()
