"""NcclPublisher's group across failures and restarts, and FleetSync's bookkeeping, with the vLLM
calls and the rollout servers faked (the broadcast itself runs on GPUs: bench/weight_sync_gpu.py)."""

from __future__ import annotations

import json

import pytest
import torch

from services.weights import nccl as weights_module
from services.weights.buckets import sent_parameters
from services.weights.files import StorePublisher
from services.weights.manifest import WeightsError
from services.weights.nccl import FleetSync, NcclPublisher

A, B = "http://a:1", "http://b:1"


class Fleet:
    """Rollout servers as the publisher sees them over HTTP: GET /weights, the group join, a broadcast."""

    def __init__(self, *urls: str) -> None:
        self.state = {u: {"version": 0, "weight_group": None, "weight_ranks": 1, "broken": None} for u in urls}
        self.down: set[str] = set()
        self.failing: set[str] = set()  # their next broadcast fails
        self.joins: list[tuple[str, str]] = []  # (server, group id)
        self.ports: list[int] = []  # the group port each join was told

    def info(self, url: str):
        return None if url in self.down else dict(self.state[url])

    def post(self, url: str, path: str, body):
        s = self.state[url]
        if path == "/weights/group":
            s["weight_group"] = body["group_id"]
            self.joins.append((url, body["group_id"]))
            self.ports.append(body["master_port"])
            return {"joined": True}
        if url in self.failing:
            self.failing.discard(url)
            s["broken"], s["weight_group"] = "failed", None
            raise WeightsError(f"{url}/weights/broadcast: HTTP 503")
        s["version"] = body["version"]
        return {"version": body["version"]}

    def restart(self, url: str) -> None:
        self.state[url] = {"version": 0, "weight_group": None, "weight_ranks": 1, "broken": None}


@pytest.fixture
def fleet(monkeypatch):
    fleet = Fleet(A, B)
    fleet.inits = []  # world sizes of the groups formed
    fleet.sent = []  # tensors per broadcast
    monkeypatch.setattr(NcclPublisher, "_info", lambda self, url: fleet.info(url))
    monkeypatch.setattr(NcclPublisher, "_post", lambda self, url, path, body: fleet.post(url, path, body))
    monkeypatch.setattr(NcclPublisher, "_trainer_init", lambda self, port, world: fleet.inits.append(world) or object())

    def send(self, tensors) -> None:
        fleet.sent.append(sum(1 for _ in tensors))

    monkeypatch.setattr(NcclPublisher, "_trainer_send", send)
    return fleet


LAYOUT = {"names": ["w"], "dtype_names": ["float32"], "shapes": [[2]]}


def _tensors(n: int = 3):
    return iter([(f"w{i}", torch.zeros(2)) for i in range(n)])


def test_a_failed_broadcast_drops_the_group_and_the_next_one_forms_a_new_group(fleet):
    pub = NcclPublisher([A, B], master_port=29777, timeout_s=5)
    pub.publish(1, LAYOUT, _tensors())
    first = pub.group_id
    assert fleet.inits == [3] and pub.members == [A, B] and pub.missed == []
    assert {g for _, g in fleet.joins} == {first} and fleet.ports == [29777, 29777]
    fleet.failing.add(B)
    with pytest.raises(WeightsError, match="did not load on 1 server"):
        pub.publish(2, LAYOUT, _tensors())
    assert pub.group is None and pub.group_id is None and pub.missed == [B]
    pub.publish(3, LAYOUT, _tensors())
    assert fleet.inits == [3, 3]  # formed again, every server joining
    assert pub.group_id not in (None, first) and pub.missed == []
    assert [u for u, g in fleet.joins if g == pub.group_id] == [A, B]
    assert fleet.state[A]["version"] == fleet.state[B]["version"] == 3
    # on another port: the dropped group's may still be bound
    assert fleet.ports[2] == fleet.ports[3] == pub.group_port != 29777


def test_a_broadcast_that_never_ends_ends_the_learner_instead_of_hanging(fleet, monkeypatch):
    """NCCL waits forever for a member that died mid-transfer: past the deadline `on_stuck` is called
    (in the learner it ends the process, so the stage fails with the reason)."""
    import threading

    stuck = threading.Event()
    reasons: list[str] = []

    def hang(self, tensors) -> None:
        assert stuck.wait(10), "the deadline never fired"

    def on_stuck(message: str) -> None:
        reasons.append(message)
        stuck.set()  # what os._exit does for the real learner: nothing waits on the broadcast any more

    pub = NcclPublisher([A, B], timeout_s=0.3, on_stuck=on_stuck)
    pub.publish(1, LAYOUT, _tensors())  # a broadcast within its deadline: on_stuck is not called
    assert reasons == []
    monkeypatch.setattr(NcclPublisher, "_trainer_send", hang)
    pub.publish(2, LAYOUT, _tensors())
    assert len(reasons) == 1
    assert "the NCCL broadcast of version 2 did not finish within 0.3 s" in reasons[0] and A in reasons[0]


def test_a_broadcast_whose_member_died_ends_the_learner_without_waiting_out_the_deadline(fleet, monkeypatch):
    """A member killed mid-receive breaks its HTTP request at once, while NCCL on rank 0 waits for it forever:
    `on_stuck` is called a short grace after that failure, long before `timeout_s`."""
    import threading
    import time

    stuck = threading.Event()
    reasons: list[str] = []
    post = Fleet.post

    def dies(url, path, body):
        if path == "/weights/broadcast" and url == B:
            raise ConnectionError("connection reset by peer")
        return post(fleet, url, path, body)

    def hang(self, tensors) -> None:
        assert stuck.wait(10), "on_stuck never fired"

    def on_stuck(message: str) -> None:
        reasons.append(message)
        stuck.set()

    pub = NcclPublisher([A, B], timeout_s=60, member_grace_s=0.2, on_stuck=on_stuck)
    monkeypatch.setattr(NcclPublisher, "_post", lambda self, url, path, body: dies(url, path, body))
    monkeypatch.setattr(NcclPublisher, "_trainer_send", hang)
    t0 = time.monotonic()
    with pytest.raises(WeightsError, match="did not load"):
        pub.publish(1, LAYOUT, _tensors())
    assert time.monotonic() - t0 < 5
    assert len(reasons) == 1 and "a member's receive failed while it ran" in reasons[0] and B in reasons[0]


def test_a_member_that_fails_after_the_send_ended_does_not_end_the_learner(fleet):
    reasons: list[str] = []
    fleet.failing.add(B)  # its load fails, reported after the collective
    pub = NcclPublisher([A, B], timeout_s=60, member_grace_s=0.2, on_stuck=reasons.append)
    with pytest.raises(WeightsError, match="did not load on 1 server"):
        pub.publish(1, LAYOUT, _tensors())
    assert reasons == []


def test_a_restarted_server_makes_the_group_form_again_before_anything_is_sent(fleet):
    pub = NcclPublisher([A, B], timeout_s=5)
    pub.publish(1, LAYOUT, _tensors())
    fleet.restart(B)  # a new process: it no longer reports the group
    pub.publish(2, LAYOUT, _tensors())
    assert fleet.inits == [3, 3] and len(fleet.sent) == 2
    assert fleet.state[B]["version"] == 2 and pub.missed == []
    pub.publish(3, LAYOUT, _tensors())
    assert fleet.inits == [3, 3]  # nothing changed: the same group


def test_a_server_that_does_not_answer_is_left_out_then_taken_back(fleet):
    pub = NcclPublisher([A, B], timeout_s=5)
    fleet.down.add(B)
    pub.publish(1, LAYOUT, _tensors())
    assert fleet.inits == [2] and pub.members == [A] and pub.missed == [B]
    fleet.down.discard(B)
    pub.publish(2, LAYOUT, _tensors())
    assert fleet.inits == [2, 3] and pub.members == [A, B] and pub.missed == []


def test_servers_ahead_of_the_version_keep_theirs_and_the_others_get_it(fleet):
    """A learner resumed from a checkpoint older than what it published sends its version to a server that
    restarted behind it; a server holding a newer number keeps it (no number gets a second set of
    weights) and is not sent the version as files either (`missed`)."""
    pub = NcclPublisher([A, B], timeout_s=5)
    fleet.state[B]["version"] = 7
    pub.publish(3, LAYOUT, _tensors())
    assert fleet.inits == [2] and pub.members == [A] and fleet.sent == [3] and pub.missed == []
    assert fleet.state[A]["version"] == 3 and fleet.state[B]["version"] == 7
    fleet.state[A]["version"] = 7
    assert pub.publish(3, LAYOUT, _tensors()) == {} and pub.missed == []  # every server ahead: nothing sent


def test_no_server_answering_sends_nothing(fleet):
    pub = NcclPublisher([A, B], timeout_s=5)
    fleet.down.update({A, B})
    with pytest.raises(WeightsError, match="no rollout server answers"):
        pub.publish(1, LAYOUT, _tensors())
    assert fleet.sent == [] and pub.missed == [A, B]


# ---- FleetSync: files, Redis records, the gathers ---------------------------------------------------


def _model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            tie_word_embeddings=True,
        )
    )


@pytest.fixture
def sync(fleet, redis_client, tmp_path, monkeypatch):
    client, prefix = redis_client
    store = StorePublisher(tmp_path / "weights", redis_client=client, key_prefix=prefix.rstrip(":"), keep=5)
    store.posted = []
    monkeypatch.setattr(
        store, "notify", lambda update: store.posted.append((update.version, list(store.servers))) or {}
    )
    model = _model()

    def publish(version: int) -> dict[str, float]:
        from services.learner.engine import iter_weight_buckets

        return fs.publish(
            version,
            model,
            zero3=False,
            buckets=lambda: iter_weight_buckets(model, dtype=torch.bfloat16),
            config=model.config,
            source_dir=None,
        )

    fs = FleetSync(store, NcclPublisher([A, B], timeout_s=5), files_every=4)
    return fs, store, client, publish, model


def test_a_broadcast_version_is_recorded_in_redis_without_files(sync):
    fs, store, client, publish, _ = sync
    metrics = publish(1)
    assert "sync_nccl_failed" not in metrics and metrics["sync_nccl_missed"] == 0
    assert store.versions() == [] and client.get(store.key) is None  # `weights:latest` means "has files"
    assert int(client.get(store.version_key)) == 1
    publish(4)  # files_every
    assert store.versions() == [4] and json.loads(client.get(store.key))["version"] == 4
    assert store.posted == [(4, [])]  # every server has it already


def test_the_servers_a_broadcast_missed_get_files_and_only_they(sync, fleet):
    fs, store, client, publish, _ = sync
    publish(1)
    fleet.failing.add(B)
    metrics = publish(2)
    assert metrics["sync_nccl_failed"] == 1.0
    assert store.versions() == [2] and store.posted == [(2, [B])]
    assert store.servers == []  # the store's own list is kept
    assert int(client.get(store.version_key)) == 2 and json.loads(client.get(store.key))["version"] == 2
    publish(3)  # a new group, both servers
    assert fleet.inits == [3, 3] and store.versions() == [2]


def test_a_send_that_stops_early_still_walks_every_parameter(sync, fleet, monkeypatch):
    """Under ZeRO-3 every rank gathers each parameter group: rank 0 stopping early would hang the others."""
    fs, store, client, publish, model = sync
    walked = []
    real = weights_module.iter_full_parameters

    def counting(*args, **kw):
        for item in real(*args, **kw):
            walked.append(item[0])
            yield item

    def send(self, tensors) -> None:
        next(iter(tensors))
        raise RuntimeError("NCCL error: unhandled system error")

    monkeypatch.setattr(weights_module, "iter_full_parameters", counting)
    monkeypatch.setattr(NcclPublisher, "_trainer_send", send)
    metrics = publish(1)
    assert metrics["sync_nccl_failed"] == 1.0 and fs.nccl.group is None
    assert walked == [n for n, _ in sent_parameters(model)]
    assert store.versions() == [1] and store.posted == [(1, [A, B])]


def test_the_last_version_gets_files_once(sync):
    fs, store, client, publish, model = sync
    from services.learner.engine import iter_weight_buckets

    publish(1)
    kwargs = dict(
        buckets=lambda: iter_weight_buckets(model, dtype=torch.bfloat16), config=model.config, source_dir=None
    )
    fs.write_files(1, **kwargs)
    assert store.versions() == [1] and json.loads(client.get(store.key))["version"] == 1
    (store.root / "v1" / "manifest.json").unlink()
    fs.write_files(1, **kwargs)  # written already by this process: not again
    assert store.versions() == []


# ---- a restarted server asks for the weights ----------------------------------------------------------


def test_the_collector_stops_waiting_when_a_server_asks_for_the_weights(redis_client, tmp_path):
    from services.learner.config import RLConfig
    from services.learner.groups import GroupCollector, TrainedRecord, WeightsWanted

    client, prefix = redis_client
    cfg = RLConfig(
        model="m",
        output_dir=str(tmp_path),
        stream_prefix=prefix.rstrip(":"),
        group_size=2,
        batch_prompts=1,
        read_block_ms=50,
        wait_timeout_s=5.0,
    )
    collector = GroupCollector(cfg, client, TrainedRecord())
    plan = {"groups": ["g"], "lost": []}
    collector.replay[3] = plan  # a journaled batch to replay: still there after the interruption
    collector.weights_wanted = lambda: True
    with pytest.raises(WeightsWanted):
        collector.collect(3, version=5)
    assert collector.replay[3] == plan


def test_the_learner_answers_a_request_for_the_weights_once_in_a_while(redis_client):
    from types import SimpleNamespace

    from services.common.streams import StreamNames
    from services.learner.trainer import RLTrainer

    client, prefix = redis_client
    names = StreamNames(prefix.rstrip(":"))
    learner = SimpleNamespace(version=4, _resent_at=-float("inf"), redis=client, names=names, retrained=lambda: False)
    assert not RLTrainer._weights_wanted(learner)
    client.set(names.weights_wanted, 4, ex=60)
    assert RLTrainer._weights_wanted(learner) and client.get(names.weights_wanted) is None
    client.set(names.weights_wanted, 4, ex=60)
    assert not RLTrainer._weights_wanted(learner)  # answered a moment ago
    learner._resent_at -= 60
    assert RLTrainer._weights_wanted(learner)
    client.set(names.weights_wanted, 0, ex=60)
    assert not RLTrainer._weights_wanted(
        SimpleNamespace(version=0, _resent_at=-float("inf"), redis=client, names=names, retrained=lambda: False)
    )  # nothing trained


def test_a_request_while_collecting_sends_the_weights_then_the_step_is_collected(tmp_path):
    from types import SimpleNamespace

    from services.learner.groups import StepGroups, WeightsWanted
    from services.learner.trainer import RLTrainer

    calls = []

    class Collector:
        def collect(self, batch, version):
            calls.append("collect")
            if calls.count("collect") == 1:
                raise WeightsWanted()
            return StepGroups([], [], ["lost-group"], 0.0)

    learner = SimpleNamespace(
        collector=Collector(),
        batches=2,
        version=5,
        engine=SimpleNamespace(world_size=1),
        publish=lambda: calls.append("publish") or {},
    )
    step = RLTrainer._gather(learner)
    assert calls == ["collect", "publish", "collect"] and step.lost == ["lost-group"]


def test_the_learner_keeps_files_of_its_last_version_and_records_its_own_at_start():
    from types import SimpleNamespace

    from services.learner.trainer import RLTrainer

    written, recorded = [], []
    fleet_sync = SimpleNamespace(write_files=lambda version, **kw: written.append(version) or {"sync_write_s": 1.0})
    engine = SimpleNamespace(bf16=True, iter_weight_buckets=lambda dtype: iter(()), lm_config=None, model_dir=None)
    learner = SimpleNamespace(
        fleet_sync=fleet_sync,
        cfg=SimpleNamespace(publish_weights=True),
        version=7,
        engine=engine,
        rank0=True,
        publisher=SimpleNamespace(record_version=recorded.append),
    )
    learner._store_args = lambda: RLTrainer._store_args(learner)
    assert RLTrainer._keep_last_version(learner) == {"sync_write_s": 1.0} and written == [7]
    learner.version = 0
    assert RLTrainer._keep_last_version(learner) == {} and written == [7]  # nothing trained
    RLTrainer._record_start(learner)
    assert recorded == [0]  # whatever an earlier attempt recorded, the engines can reach this one
    learner.fleet_sync = None  # weights through files: nothing to add
    learner.version = 3
    assert RLTrainer._keep_last_version(learner) == {}
    RLTrainer._record_start(learner)
    assert recorded == [0]


def test_a_resumed_learner_never_sends_a_number_an_earlier_process_published(redis_client):
    """Over NCCL the crashed learner broadcast v11-13 (files up to v10) and checkpointed v12. Resumed, it
    neither sends v12 again (the engines hold v13: they would refuse it, and it went to files instead)
    nor, while it trains steps 13 again, answers a request for the weights with a v13 of other weights."""
    from types import SimpleNamespace

    from services.common.schemas import WeightsUpdate
    from services.common.streams import StreamNames
    from services.learner.trainer import RLTrainer

    client, prefix = redis_client
    names = StreamNames(prefix.rstrip(":"))
    store = StorePublisher("/nonexistent", redis_client=client, key_prefix=prefix.rstrip(":"))
    client.set(store.key, WeightsUpdate(version=10, uri="/w/v10", sha256="0" * 64).model_dump_json())
    store.record_version(13)
    published = []
    learner = SimpleNamespace(
        rank0=True,
        publisher=store,
        fleet_sync=object(),
        version=12,
        published=0,
        start_version=0,
        cfg=SimpleNamespace(publish_start=False),
        engine=SimpleNamespace(world_size=1),
        redis=client,
        names=names,
        _resent_at=-float("inf"),
        publish=lambda: published.append(learner.version),
    )
    _bind(learner, "_record_start", "retrained", "_highest_published", "_engines_highest")
    RLTrainer._publish_unannounced(learner)
    assert published == [] and learner.published == 13 and learner.start_version == 12
    # a restarted server asks for the weights: v12 is the checkpoint's, exactly the weights v12 named
    client.set(names.weights_wanted, 12, ex=60)
    assert RLTrainer._weights_wanted(learner)
    learner.version, learner._resent_at = 13, -float("inf")  # step 13 trained again: other weights than v13
    client.set(names.weights_wanted, 12, ex=60)
    assert not RLTrainer._weights_wanted(learner) and learner.retrained()
    learner.version = 14  # a new number: published as usual
    assert not learner.retrained() and RLTrainer._weights_wanted(learner)


def _bind(learner, *methods: str) -> None:
    """Give a stand-in learner the RLTrainer methods named, bound to it."""
    from services.learner.trainer import RLTrainer

    for name in methods:
        setattr(learner, name, getattr(RLTrainer, name).__get__(learner))


def _resumed_learner(client, store, version: int, *, engines: dict | None = None):
    """A rank-0 learner resumed at `version` over NCCL, whose fleet's engines report `engines`."""
    from types import SimpleNamespace

    nccl = SimpleNamespace(survey=lambda: engines or {})
    learner = SimpleNamespace(
        rank0=True,
        publisher=store,
        fleet_sync=SimpleNamespace(nccl=nccl),
        version=version,
        published=0,
        start_version=0,
        cfg=SimpleNamespace(publish_start=False, publish_weights=True),
        engine=SimpleNamespace(world_size=1),
        redis=client,
        published_as=[],
    )
    learner.publish = lambda: learner.published_as.append(learner.version) or {}
    _bind(learner, "_record_start", "retrained", "_highest_published", "_engines_highest", "_number_past_the_fleet")
    return learner


def test_a_learner_restarted_twice_still_knows_the_highest_number_published(redis_client):
    """The first restart records its checkpoint's version (12) as the one the fleet needs, lower than
    the 13 the crashed process broadcast; restarted again before publishing anything, the learner must
    still know that 13 was published, or it would send a 13 of other weights."""
    from services.learner.trainer import RLTrainer

    client, prefix = redis_client
    store = StorePublisher("/nonexistent", redis_client=client, key_prefix=prefix.rstrip(":"))
    store.record_version(13)
    RLTrainer._publish_unannounced(_resumed_learner(client, store, 12))
    assert store.recorded_version() == 12  # what the fleet must hold to take tasks: the checkpoint's version
    again = _resumed_learner(client, store, 12)
    RLTrainer._publish_unannounced(again)
    assert again.published == 13 and again.published_as == []


def test_versions_only_the_engines_hold_count_as_published(redis_client):
    """Killed between a broadcast and its record, the learner left v9 in the engines alone."""
    from services.learner.trainer import RLTrainer

    client, prefix = redis_client
    store = StorePublisher("/nonexistent", redis_client=client, key_prefix=prefix.rstrip(":"))
    store.record_version(8)
    learner = _resumed_learner(client, store, 8, engines={"http://a": {"version": 9}, "http://b": None})
    RLTrainer._publish_unannounced(learner)
    assert learner.published == 9 and learner.published_as == []


def test_a_learner_behind_the_fleet_publishes_its_weights_above_every_number_before_a_new_batch(redis_client, tmp_path):
    """Resumed from a checkpoint (v5) older than what was published (v13: a later checkpoint lost, or
    no journal of those steps): replayed batches keep their numbers and are not sent; before the first
    new batch the learner publishes its weights as v14, so the fleet samples on them again and no number
    names two sets of weights. The store's folders count as published too."""
    from services.learner.trainer import RLTrainer

    client, prefix = redis_client
    store = StorePublisher(tmp_path, redis_client=client, key_prefix=prefix.rstrip(":"))
    (tmp_path / "v13").mkdir()
    (tmp_path / "v13" / "manifest.json").write_text("{}")  # written, then killed before its announcement
    store.record_version(10)
    learner = _resumed_learner(client, store, 5)
    RLTrainer._publish_unannounced(learner)
    assert learner.published == 13 and learner.published_as == []
    assert RLTrainer._number_past_the_fleet(learner, replayed=True) == {} and learner.version == 5
    learner.version = 6  # a replayed step: its number is the earlier process's, not sent again
    assert learner.retrained()
    RLTrainer._number_past_the_fleet(learner, replayed=False)
    assert learner.published_as == [14] and learner.version == 14 and not learner.retrained()
    assert store.highest_version() == 13  # the stand-in publish wrote nothing; a real one records 14
    store.record_version(14)
    store.record_version(7)  # a later restart records its own, lower version: the highest stays
    assert store.highest_version() == 14
