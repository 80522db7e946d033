"""Fixtures of the rollout tests: the real Qwen2.5 tokenizer, a tiny Qwen2, the real tools."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tokenizer():
    from services.models import qwen_tokenizer

    return qwen_tokenizer()


@pytest.fixture(scope="session")
def tiny_model():
    from services.models import tiny_qwen2

    return tiny_qwen2()


@pytest.fixture(scope="session")
def toolbox(official_world):
    from services.sandbox.tools.toolbox import ToolBox

    return ToolBox(official_world, dialect="star", cache_size=0)


@pytest.fixture
def local_tools(toolbox):
    from services.rollout.tools import LocalToolClient

    return LocalToolClient(toolbox)
