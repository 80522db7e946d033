"""The live episode server of tests/support/episode_plans.py, for every test here."""

from tests.support.episode_plans import episode_server  # noqa: F401
