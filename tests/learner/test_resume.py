"""Exact resume: a learner killed with SIGKILL between its checkpoint and its acknowledgement
resumes, skips what it already trained on, and its next step's loss equals the uninterrupted run's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import redis

from services.common.streams import StreamNames, publish
from services.learner.config import EngineConfig, FilterConfig, RLConfig
from services.learner.runlog import read_metrics
from services.learner.trainer import read_status

from .conftest import scored_batch

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3


def _config(tmp: Path, name: str, model: Path, redis_url: str, prefix: str, **kw) -> Path:
    cfg = RLConfig(
        model=str(model),
        output_dir=str(tmp / name),
        group_size=2,
        batch_prompts=2,
        lr=1e-3,
        total_steps=10,
        redis_url=redis_url,
        stream_prefix=prefix,
        wait_timeout_s=60,
        read_block_ms=200,
        weights_dir=str(tmp / name / "weights"),
        keep_versions=2,
        engine=EngineConfig(micro_batch_tokens=64),
        **kw,
    )
    path = tmp / f"{name}.json"
    path.write_text(cfg.model_dump_json())
    return path


def _run(config: Path, steps: int, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services.learner.worker", "rl", str(config), str(steps)],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.mark.slow
def test_sigkill_between_checkpoint_and_ack_resumes_exactly(tmp_path, tiny_model, redis_server_url):
    client = redis.Redis.from_url(redis_server_url)
    # each step's groups were sampled by the policy version the learner has reached by then (on-policy)
    trajs = [t for step in range(STEPS) for t in scored_batch(tiny_model, 2, 2, seed=step, version=step)]
    prefixes = {name: f"test:{uuid.uuid4().hex[:8]}" for name in ("straight", "killed")}
    try:
        for prefix in prefixes.values():
            for t in trajs:
                publish(client, StreamNames(prefix).scored, t)
        straight = _config(tmp_path, "straight", tiny_model, redis_server_url, prefixes["straight"])
        done = _run(straight, STEPS)
        assert done.returncode == 0, done.stderr[-3000:]
        reference = read_metrics(tmp_path / "straight")
        assert [m["step"] for m in reference] == [1, 2, 3]

        killed = _config(tmp_path, "killed", tiny_model, redis_server_url, prefixes["killed"], save_every=1)
        crash = _run(killed, STEPS, {"STAR_LEARNER_CRASH_AFTER_CHECKPOINT": "2"})
        assert crash.returncode == -9, crash.stderr[-3000:]
        assert read_status(tmp_path / "killed")["step"] == 1  # step 2 was checkpointed, never reported
        group = client.xpending(StreamNames(prefixes["killed"]).scored, "learner")
        assert group["pending"] > 0  # step 2's messages were trained on but not acknowledged

        resumed = _run(killed, STEPS)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        after = read_metrics(tmp_path / "killed")
        last = after[-1]
        assert last["step"] == 3
        # same data (step 2's messages skipped by id, not trained twice) and the same loss (up to the roundoff
        # an on-policy loss cancels to) and gradient
        assert last["samples_in"] == 4
        assert last["loss"] == pytest.approx(reference[2]["loss"], rel=1e-6, abs=1e-6)
        assert last["grad_norm"] == pytest.approx(reference[2]["grad_norm"], rel=1e-5)
        assert client.xpending(StreamNames(prefixes["killed"]).scored, "learner")["pending"] == 0
        # step 2's weights, checkpointed but never published before the kill, were published on resume
        # (else the killed run would keep v1 and v3)
        kept = sorted(p.name for p in (tmp_path / "killed" / "weights").iterdir() if p.name.startswith("v"))
        assert kept == ["v2", "v3"]
        assert json.loads(client.get(f"{prefixes['killed']}:weights:latest"))["version"] == 3

        # the published weights: version 3 is the latest in Redis, only the last 2 are kept
        latest = json.loads(client.get(f"{prefixes['straight']}:weights:latest"))
        assert latest["version"] == 3
        kept = sorted(p.name for p in (tmp_path / "straight" / "weights").iterdir() if p.name.startswith("v"))
        assert kept == ["v2", "v3"]
        assert (tmp_path / "straight" / "tensorboard").is_dir()
    finally:
        for prefix in prefixes.values():
            for key in client.scan_iter(match=prefix + "*"):
                client.delete(key)


@pytest.mark.slow
def test_a_stale_batch_counts_as_a_step_and_the_learner_finishes(tmp_path, tiny_model, redis_server_url):
    """The controller publishes exactly the schedule's batches: one whose samples are all too stale
    to train is still one of them, so the learner counts it and finishes, instead of waiting for a
    batch that never comes."""
    client = redis.Redis.from_url(redis_server_url)
    prefix = f"test:{uuid.uuid4().hex[:8]}"
    # step 2's groups were sampled by version 0, but the learner is at version 1 by then (max_staleness 0)
    versions = [0, 0, 1]
    trajs = [t for step, v in enumerate(versions) for t in scored_batch(tiny_model, 2, 2, seed=step, version=v)]
    try:
        for t in trajs:
            publish(client, StreamNames(prefix).scored, t)
        config = _config(tmp_path, "stale", tiny_model, redis_server_url, prefix)
        done = _run(config, STEPS)
        assert done.returncode == 0, done.stderr[-3000:]
        status = read_status(tmp_path / "stale")
        assert status["state"] == "finished"
        assert int(client.get(StreamNames(prefix).learner_batches)) == 3
        metrics = read_metrics(tmp_path / "stale")
        assert [m.get("skipped", 0.0) for m in metrics] == [0.0, 1.0, 0.0]
        # the skipped batch repeats the step (the version it left unchanged) but has its own batch
        assert [(m["step"], m["batch"]) for m in metrics] == [(1, 1), (1, 2), (2, 3)]
        assert json.loads(client.get(StreamNames(prefix).weights_latest))["version"] == 2
    finally:
        for key in client.scan_iter(match=prefix + "*"):
            client.delete(key)


@pytest.mark.slow
def test_a_batch_is_counted_only_once_its_weights_are_published(tmp_path, tiny_model, redis_server_url):
    """The controller sends the next step out when it sees the count, asking for the weights it
    reads then: a count seen before its step's weights would let those samples be a version stale."""
    client = redis.Redis.from_url(redis_server_url)
    prefix = f"test:{uuid.uuid4().hex[:8]}"
    names = StreamNames(prefix)
    trajs = [t for step in range(2) for t in scored_batch(tiny_model, 2, 2, seed=step, version=step)]
    try:
        for t in trajs:
            publish(client, names.scored, t)
        config = _config(tmp_path, "order", tiny_model, redis_server_url, prefix)
        learner = subprocess.Popen(
            [sys.executable, "-m", "services.learner.worker", "rl", str(config), "2"],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        seen: dict[int, int] = {}  # batch count → the weights version read right after it
        while True:
            exited = learner.poll() is not None  # one more read after the exit catches the last count
            counted = client.get(names.learner_batches)
            if counted and int(counted) not in seen:
                latest = client.get(names.weights_latest)
                seen[int(counted)] = json.loads(latest)["version"] if latest else 0
            if exited:
                break
        assert learner.wait(timeout=60) == 0, learner.stderr.read()[-3000:]
        assert seen and all(version >= count for count, version in seen.items()), seen
        assert max(seen) == 2
    finally:
        for key in client.scan_iter(match=prefix + "*"):
            client.delete(key)


@pytest.mark.slow
def test_mini_batches_update_several_times_per_batch_and_count_one_step(tmp_path, tiny_model, redis_server_url):
    """With mini_batches 2 each batch takes two optimizer steps (checkpoint tags count them), while
    the step, the weights version and the controller's batch count still advance once per batch."""
    client = redis.Redis.from_url(redis_server_url)
    prefix = f"test:{uuid.uuid4().hex[:8]}"
    trajs = [t for step in range(2) for t in scored_batch(tiny_model, 2, 2, seed=step, version=step)]
    try:
        for t in trajs:
            publish(client, StreamNames(prefix).scored, t)
        config = _config(tmp_path, "mini", tiny_model, redis_server_url, prefix, mini_batches=2)
        done = _run(config, 2)
        assert done.returncode == 0, done.stderr[-3000:]
        metrics = read_metrics(tmp_path / "mini")
        assert [m["step"] for m in metrics] == [1, 2]
        assert [m["optimizer_steps"] for m in metrics] == [2.0, 2.0]
        assert [m["samples_in"] for m in metrics] == [4, 4]
        assert read_status(tmp_path / "mini")["step"] == 2
        assert int(client.get(StreamNames(prefix).learner_batches)) == 2
        assert json.loads(client.get(StreamNames(prefix).weights_latest))["version"] == 2
        tags = sorted(p.name for p in (tmp_path / "mini" / "checkpoints").iterdir() if p.name.startswith("step"))
        assert tags[-1] == "step0000004-b0000002"  # 4 optimizer steps over 2 batches
        # samples.jsonl: each step's groups, one whole trajectory each (the default keeps up to 4)
        samples = [json.loads(line) for line in (tmp_path / "mini" / "samples.jsonl").read_text().splitlines()]
        assert [(s["step"], s["batch"], s["sample_index"]) for s in samples] == [
            (1, 1, 0),
            (1, 1, 0),
            (2, 2, 0),
            (2, 2, 0),
        ]
        sent = {(t.group_id, t.sample_index): t.reward for t in trajs}
        assert all(s["reward"] == sent[(s["group_id"], 0)] for s in samples)
    finally:
        for key in client.scan_iter(match=prefix + "*"):
            client.delete(key)


@pytest.mark.slow
def test_a_batch_dapo_shrank_makes_fewer_updates_of_whole_groups(tmp_path, tiny_model, redis_server_url):
    """DAPO drops a flat group out of a batch of two: the one group left is one update, not two
    halves of a group whose advantages do not balance (which collapsed the policy on a GPU run)."""
    client = redis.Redis.from_url(redis_server_url)
    prefix = f"test:{uuid.uuid4().hex[:8]}"
    # two batches of two groups, each sampled by the version that trains it
    trajs = [t for step in range(2) for t in scored_batch(tiny_model, 2, 2, seed=step, version=step)]
    flat = trajs[0].group_id
    trajs = [t.model_copy(update={"reward": 1.0}) if t.group_id == flat else t for t in trajs]
    try:
        for t in trajs:
            publish(client, StreamNames(prefix).scored, t)
        config = _config(tmp_path, "dapo", tiny_model, redis_server_url, prefix, algorithm="dapo", mini_batches=2)
        done = _run(config, 2)
        assert done.returncode == 0, done.stderr[-3000:]
        metrics = read_metrics(tmp_path / "dapo")
        assert [m["groups_dropped_flat"] for m in metrics] == [1.0, 0.0]
        assert [m["optimizer_steps"] for m in metrics] == [1.0, 2.0]
    finally:
        for key in client.scan_iter(match=prefix + "*"):
            client.delete(key)


@pytest.mark.slow
def test_a_batch_waits_for_its_own_steps_slow_groups_instead_of_taking_a_later_steps(
    tmp_path, tiny_model, redis_server_url
):
    """Asynchronous RL (max_staleness 1): step 2's groups, sampled by version 1, arrive before
    step 1's slow ones, sampled by version 0. Batch 1 waits for step 1's; taking step 2's would
    leave step 1's to batch 2, two versions old by then, and drop them."""
    client = redis.Redis.from_url(redis_server_url)
    prefix = f"test:{uuid.uuid4().hex[:8]}"
    arrival = [(0, 0), (2, 1), (1, 0)]  # (step, version that sampled it), in stream order
    try:
        for step, version in arrival:
            for t in scored_batch(tiny_model, 2, 2, seed=step, version=version, step=step):
                publish(client, StreamNames(prefix).scored, t)
        config = _config(tmp_path, "order", tiny_model, redis_server_url, prefix, filters=FilterConfig(max_staleness=1))
        done = _run(config, 3)
        assert done.returncode == 0, done.stderr[-3000:]
        metrics = read_metrics(tmp_path / "order")
        assert [m["samples_stale"] for m in metrics] == [0.0, 0.0, 0.0]
        assert [m["samples_trained"] for m in metrics] == [4.0, 4.0, 4.0]
    finally:
        for key in client.scan_iter(match=prefix + "*"):
            client.delete(key)


@pytest.mark.slow
def test_a_sample_delivered_twice_is_trained_once(tmp_path, tiny_model, redis_server_url):
    """A task that ran twice publishes its samples twice: a group must not grow past its size
    with copies (batches of 72-96 samples for 64 were trained that way)."""
    client = redis.Redis.from_url(redis_server_url)
    prefix = f"test:{uuid.uuid4().hex[:8]}"
    trajs = scored_batch(tiny_model, 2, 2, seed=0)
    try:
        for t in trajs[:2] + trajs[:2] + trajs[2:]:  # the first group's samples twice, then the second group
            publish(client, StreamNames(prefix).scored, t)
        done = _run(_config(tmp_path, "dup", tiny_model, redis_server_url, prefix), 1)
        assert done.returncode == 0, done.stderr[-3000:]
        (metrics,) = read_metrics(tmp_path / "dup")
        assert metrics["samples_in"] == 4
        assert client.xpending(StreamNames(prefix).scored, "learner")["pending"] == 0  # the copies acknowledged
    finally:
        for key in client.scan_iter(match=prefix + "*"):
            client.delete(key)


@pytest.mark.slow
def test_a_group_rolled_out_again_after_it_was_trained_is_dropped_even_after_a_restart(
    tmp_path, tiny_model, redis_server_url
):
    """A task that ran twice can publish its second copy after the first was trained (new message
    ids): it must not be trained again, nor take a fresh group's place in a batch. The trained
    group ids live in the checkpoint, so a restarted learner still knows them."""
    client = redis.Redis.from_url(redis_server_url)
    prefix = f"test:{uuid.uuid4().hex[:8]}"
    scored = StreamNames(prefix).scored
    first, later = scored_batch(tiny_model, 2, 2, seed=0), scored_batch(tiny_model, 2, 2, seed=1, version=1)
    try:
        for t in first:
            publish(client, scored, t)
        config = _config(tmp_path, "rerun", tiny_model, redis_server_url, prefix, save_every=1)
        done = _run(config, 1)
        assert done.returncode == 0, done.stderr[-3000:]
        for t in first[:2] + later:  # the first group again, then two fresh groups
            publish(client, scored, t)
        done = _run(config, 2)
        assert done.returncode == 0, done.stderr[-3000:]
        metrics = read_metrics(tmp_path / "rerun")
        assert [m["samples_trained"] for m in metrics] == [4.0, 4.0]
        assert metrics[1]["samples_duplicate"] == 2.0
        assert client.xpending(scored, "learner")["pending"] == 0  # both fresh groups trained, the copy acked
    finally:
        for key in client.scan_iter(match=prefix + "*"):
            client.delete(key)


@pytest.mark.slow
def test_a_step_goes_without_a_group_whose_rollout_task_was_dead_lettered(tmp_path, tiny_model, redis_server_url):
    """A task that failed on every attempt never yields its group: the step must not wait for it
    (it waited `straggler_wait_s`, 10 minutes, and the fleet with it), and the next step is whole."""
    from services.common.schemas import RolloutTask, SamplingParams, TravelQuery
    from services.common.streams import StreamConsumer

    client = redis.Redis.from_url(redis_server_url)
    prefix = f"test:{uuid.uuid4().hex[:8]}"
    names = StreamNames(prefix)
    step0, step1 = (scored_batch(tiny_model, 2, 2, seed=s, version=s, step=s) for s in (0, 1))
    query = TravelQuery(
        org="Sarasota",
        dest="Chicago",
        days=3,
        visiting_city_number=1,
        date=["2022-03-22", "2022-03-23", "2022-03-24"],
        people_number=1,
        budget=1900,
        query="A 3-day trip.",
    )
    lost = RolloutTask(
        run_id="test",
        task_id=step0[2].group_id,
        prompt_id="p",
        query=query,
        group_size=2,
        sampling=SamplingParams(),
        step=0,
    )
    try:
        publish(client, names.tasks, lost)
        tasks = StreamConsumer(client, names.tasks, "rollout", "w", max_deliveries=1)
        (msg,) = tasks.read(count=1, block_ms=100)
        assert tasks.fail(msg, "every sample failed: CUDA error")  # dead-lettered
        for t in step0[:2] + step1:  # step 0's other group, then step 1 whole
            publish(client, names.scored, t)
        config = _config(
            tmp_path,
            "lost",
            tiny_model,
            redis_server_url,
            prefix,
            filters=FilterConfig(max_staleness=1),
            straggler_wait_s=600.0,
        )
        done = _run(config, 2)
        assert done.returncode == 0, done.stderr[-3000:]
        metrics = read_metrics(tmp_path / "lost")
        assert [m["samples_trained"] for m in metrics] == [2.0, 4.0]
        assert [m["groups_lost"] for m in metrics] == [1.0, 0.0]
        assert all(m["time_wait_s"] < 60 for m in metrics)
    finally:
        for key in client.scan_iter(match=prefix + "*"):
            client.delete(key)


@pytest.mark.slow
def test_kill_between_checkpoints_replays_the_batches_since_exactly(tmp_path, tiny_model, redis_server_url):
    """Checkpoints every 3 steps: a learner killed after step 2 (no checkpoint yet holds it) replays steps 1
    and 2 from the stream, with the same batches, publishes nothing twice, logs each step once, and its
    later steps equal the uninterrupted run's."""
    steps = 4
    client = redis.Redis.from_url(redis_server_url)
    trajs = [t for step in range(steps) for t in scored_batch(tiny_model, 2, 2, seed=step, version=step)]
    prefixes = {name: f"test:{uuid.uuid4().hex[:8]}" for name in ("straight", "killed")}
    try:
        for prefix in prefixes.values():
            for t in trajs:
                publish(client, StreamNames(prefix).scored, t)
        straight = _config(tmp_path, "straight", tiny_model, redis_server_url, prefixes["straight"], save_every=3)
        done = _run(straight, steps)
        assert done.returncode == 0, done.stderr[-3000:]
        reference = read_metrics(tmp_path / "straight")
        assert [m["step"] for m in reference] == [1, 2, 3, 4]
        assert reference[2].get("time_checkpoint_s") and reference[3].get("time_checkpoint_s")
        assert not reference[0].get("time_checkpoint_s") and not reference[1].get("time_checkpoint_s")

        killed = _config(tmp_path, "killed", tiny_model, redis_server_url, prefixes["killed"], save_every=3)
        crash = _run(killed, steps, {"STAR_LEARNER_CRASH_AFTER_STEP": "2"})
        assert crash.returncode == -9, crash.stderr[-3000:]
        assert not (tmp_path / "killed" / "checkpoints" / "latest").exists()  # no checkpoint was due yet
        names = StreamNames(prefixes["killed"])
        assert client.xpending(names.scored, "learner")["pending"] == 8  # both steps' messages held
        assert json.loads(client.get(f"{prefixes['killed']}:weights:latest"))["version"] == 2

        resumed = _run(killed, steps)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        after = read_metrics(tmp_path / "killed")
        assert [m["step"] for m in after] == [1, 2, 3, 4]  # steps 1 and 2 replayed, not logged twice
        for mine, theirs in zip(after, reference):
            assert mine["samples_in"] == theirs["samples_in"] == 4
            # an on-policy step's loss cancels to roundoff (about 1e-8), whose last bits follow the order the
            # CPU's math library sums in under load; the gradient norm is where a different batch would show
            assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-6, abs=1e-6), mine["step"]
            assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5), mine["step"]
        assert client.xpending(names.scored, "learner")["pending"] == 0  # acknowledged at the checkpoints
        assert int(client.get(names.learner_batches)) == 4
        assert json.loads(client.get(f"{prefixes['killed']}:weights:latest"))["version"] == 4
    finally:
        for prefix in prefixes.values():
            for key in client.scan_iter(match=f"{prefix}*"):
                client.delete(key)
