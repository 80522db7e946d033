"""deployment.weight_sync: how `auto` resolves for several layouts, the refusals of an nccl that cannot
work, and what the RL stage's processes are told when weights travel over NCCL (the broadcast itself
runs on GPUs: bench/weight_sync_gpu.py)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from services.common.schemas import VllmArgs
from services.common.streams import StreamNames
from services.learner.config import RLConfig
from services.pipeline.config import DeploymentSpec, load_pipeline_config
from services.pipeline.placement import Placement, PlacementError, nccl_obstacle, plan, weight_sync

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
GPUS4 = ["0", "1", "2", "3"]


def _resolve(engines: int, gpus: list[str], engine: str = "vllm", **deployment):
    spec = DeploymentSpec(**deployment)
    return weight_sync(spec, engine, plan(spec, engines, gpus))


def test_auto_takes_nccl_when_each_engine_has_gpus_of_its_own():
    # the 4-GPU layout: learner ranks on GPUs 0-1, one engine on 2 and one on 3
    choice = _resolve(2, GPUS4, learner_ranks=2)
    assert choice.method == "nccl"
    assert "weight sync: nccl" in choice.describe()
    wide = _resolve(2, [str(i) for i in range(8)], learner_ranks=2, engine_tensor_parallel=2)
    assert wide.method == "nccl"


@pytest.mark.parametrize(
    "engines, gpus, deployment, engine, reason",
    [
        (1, ["0"], {}, "vllm", "engine 0 shares GPU 0 with the learner"),  # a one-GPU box
        (4, GPUS4, {"learner_ranks": 2}, "vllm", "shares GPU 0 with the learner"),  # 2 + 4 > 4: shared
        (3, ["0", "1"], {"share_gpus": True}, "vllm", "engine 1 shares GPU 0 with the learner"),
        (2, [], {}, "vllm", "no CUDA GPUs"),
        (2, GPUS4, {"learner_ranks": 2}, "transformers", "services.engine is transformers"),
        (2, GPUS4, {"learner_ranks": 2, "fleet": "external"}, "vllm", "the fleet is external"),
    ],
)
def test_auto_falls_back_to_files_and_says_why(engines, gpus, deployment, engine, reason):
    choice = _resolve(engines, gpus, engine, **deployment)
    assert choice.method == "files"
    assert reason in choice.reason


def test_engines_sharing_a_gpu_with_each_other_cannot_join_one_group():
    placement = Placement("cuda", 1, ("0",), (("1",), ("2",), ("1",)), 0.45, shared=True)
    assert "engines 0 and 2 share GPU 1" in nccl_obstacle(DeploymentSpec(), "vllm", placement)
    assert nccl_obstacle(DeploymentSpec(), "vllm", Placement("cuda", 1, ("0",), (("1",), ("2",)), 0.9)) is None


@pytest.mark.parametrize(
    "engines, gpus, deployment, engine, reason",
    [
        (1, ["0"], {}, "vllm", "shares GPU 0 with the learner"),
        (2, [], {}, "vllm", "no CUDA GPUs"),
        (2, GPUS4, {"learner_ranks": 2}, "transformers", "only vLLM engines"),
        (2, GPUS4, {"learner_ranks": 2, "fleet": "external"}, "vllm", "external"),
    ],
)
def test_an_explicit_nccl_that_cannot_work_is_refused_naming_why(engines, gpus, deployment, engine, reason):
    with pytest.raises(PlacementError) as err:
        _resolve(engines, gpus, engine, weight_sync="nccl", **deployment)
    assert "deployment.weight_sync nccl cannot work here" in str(err.value) and reason in str(err.value)


def test_explicit_choices_that_can_work_are_kept():
    assert _resolve(2, GPUS4, learner_ranks=2, weight_sync="nccl").method == "nccl"
    # sharing asked for, but one engine fits beside the learner's GPU: it gets GPU 1 alone
    assert _resolve(1, ["0", "1"], share_gpus=True, weight_sync="nccl").method == "nccl"
    assert _resolve(2, GPUS4, learner_ranks=2, weight_sync="files").method == "files"


def test_an_engine_beside_a_rank_other_than_rank_0_still_joins_the_weights_group():
    # two GPUs, a 2-rank learner and one engine: the engine goes beside rank 1, outside the group's rank 0
    spec = DeploymentSpec(learner_ranks=2, weight_sync="nccl")
    placement = plan(spec, 1, ["0", "1"])
    assert placement.shared and placement.engine_devices == (("1",),)
    assert weight_sync(spec, "vllm", placement).method == "nccl"
    # a second engine has nowhere left but rank 0's GPU
    with pytest.raises(PlacementError, match="engine 1 shares GPU 0 with the learner's rank 0"):
        weight_sync(spec, "vllm", plan(spec, 2, ["0", "1"]))


def test_star_train_refuses_nccl_on_a_one_gpu_box_before_starting(tmp_path, monkeypatch):
    from services.controller.train import StageFailed, prepare
    from services.pipeline import placement as placement_module

    monkeypatch.setattr(placement_module, "visible_gpu_ids", lambda: ["0"])
    config = load_pipeline_config(CONFIGS / "tiny.yaml", ["services.engine=vllm", "deployment.weight_sync=nccl"])
    with pytest.raises(StageFailed, match="weight_sync nccl cannot work here: engine 0 shares GPU 0 with the learner"):
        prepare(config, tmp_path / "run")
    assert not (tmp_path / "run" / "config.yaml").exists()


def test_weight_sync_may_change_between_invocations_of_a_run_folder():
    from services.controller.train import recipe_identity

    config = load_pipeline_config(CONFIGS / "tiny.yaml")
    other = load_pipeline_config(CONFIGS / "tiny.yaml", ["deployment.weight_sync=files"])
    assert recipe_identity(config) == recipe_identity(other)


# ---- what the RL stage's processes are told ------------------------------------------------------


def _run(tmp_path: Path, method: str, overrides: list[str] = ()):
    from services.pipeline.placement import WeightSyncChoice
    from services.pipeline.stage import Run

    config = load_pipeline_config(
        CONFIGS / "tiny.yaml",
        ["services.engine=vllm", "deployment.learner_ranks=2", "services.rollout_workers=2", *overrides],
    )
    placement = plan(config.deployment, 2, GPUS4)
    return Run(config, tmp_path, placement=placement, weight_sync=WeightSyncChoice(method, "test"))


def test_rl_config_over_nccl_names_the_workers_and_a_master_port(tmp_path):
    from services.controller.learner_config import rl_config

    servers = ["http://127.0.0.1:4101", "http://127.0.0.1:4102"]
    path = rl_config(_run(tmp_path, "nccl"), "model", StreamNames("t"), None, total_steps=4, servers=servers)
    cfg = RLConfig.model_validate_json(path.read_text())
    assert cfg.weight_sync == "nccl" and cfg.rollout_servers == servers
    host, _, port = cfg.nccl_master.rpartition(":")
    assert host == "127.0.0.1" and 0 < int(port) < 65536
    assert cfg.files_every == 10
    validated = rl_config(
        _run(tmp_path, "nccl", ["rl.val_every=3", "synth.heldout_queries=2"]),
        "model",
        StreamNames("t"),
        None,
        4,
        servers,
    )
    assert RLConfig.model_validate_json(validated.read_text()).files_every == 3  # validations read files


def test_rl_config_with_files_sends_nothing_over_nccl(tmp_path):
    from services.controller.learner_config import rl_config

    path = rl_config(
        _run(tmp_path, "files"), "model", StreamNames("t"), None, total_steps=4, servers=["http://127.0.0.1:4101"]
    )
    cfg = RLConfig.model_validate_json(path.read_text())
    assert cfg.weight_sync == "files" and cfg.rollout_servers == []


def test_nccl_without_worker_addresses_fails_the_stage(tmp_path):
    from services.controller.learner_config import rl_config
    from services.pipeline.stage import StageFailed

    with pytest.raises(StageFailed, match="HTTP addresses"):
        rl_config(_run(tmp_path, "nccl"), "model", StreamNames("t"), None, total_steps=4, servers=[])


class _Sup:
    """The supervisor's `add`, recorded."""

    def __init__(self) -> None:
        self.added: dict[str, dict[str, str]] = {}
        self.configs: dict[str, dict] = {}

    def add(self, name, argv, env=None, log=None, **_):
        self.added[name] = dict(env or {})
        if "--config" in argv:  # a rollout worker's own settings file
            self.configs[name] = json.loads(Path(argv[argv.index("--config") + 1]).read_text())
        return SimpleNamespace(name=name)


@pytest.mark.parametrize("method", ["nccl", "files"])
def test_workers_get_an_http_port_and_an_nccl_engine_only_over_nccl(tmp_path, method):
    from services.controller.embedded_fleet import EmbeddedFleet, _start_workers

    f = EmbeddedFleet(_Sup(), "redis://x", sandbox_url="http://127.0.0.1:9")
    _start_workers(_run(tmp_path, method), f, "model", {}, tmp_path / "logs")
    envs = [f.sup.added[f"rollout-{i}"] for i in range(2)]
    configs = [f.sup.configs[f"rollout-{i}"] for i in range(2)]
    engines = [VllmArgs.model_validate(c["vllm"]) for c in configs]
    if method == "nccl":
        ports = [c["http_port"] for c in configs]
        assert len(set(ports)) == 2
        assert f.rollout_urls == [f"http://127.0.0.1:{p}" for p in ports]
        assert all(e.weight_transfer == "nccl" for e in engines)
        assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["2", "3"]
    else:
        assert not any("http_port" in c for c in configs) and f.rollout_urls == []
        assert all(e.weight_transfer == "files" for e in engines)


def test_the_controller_asks_for_the_newest_version_files_or_not(redis_client):
    from services.common.schemas import WeightsUpdate
    from services.controller.loop import learner_progress, weights_version

    client, prefix = redis_client
    names = StreamNames(prefix.rstrip(":"))
    assert weights_version(client, names) == 0
    client.set(names.weights_latest, WeightsUpdate(version=10, uri="/w/v10", sha256="0" * 64).model_dump_json())
    assert weights_version(client, names) == 10
    client.set(names.weights_version, 13)  # v11-13 were broadcast, no files written
    assert weights_version(client, names) == 13 and learner_progress(client, names) == 13
    client.set(names.weights_version, 9)  # a learner resumed from an older checkpoint
    assert weights_version(client, names) == 10
    assert json.loads(client.get(names.weights_latest))["version"] == 10


# ---- an external fleet: decided from what its rollout servers report --------------------------------

NCCL_SERVER = {"version": 0, "engine": "vllm", "weight_ranks": 2, "weight_group": None}
FILES_SERVER = {"version": 0, "engine": "vllm", "weight_ranks": 0}


@pytest.mark.parametrize("requested", ["auto", "nccl"])
def test_an_external_fleet_whose_engines_all_receive_takes_nccl(requested):
    from services.pipeline.placement import external_weight_sync

    spec = DeploymentSpec(fleet="external", weight_sync=requested)
    choice = external_weight_sync(
        spec, {"http://a:8080": NCCL_SERVER, "http://b:8080": {**NCCL_SERVER, "weight_ranks": 1}}
    )
    assert choice.method == "nccl" and "2 rollout server(s), 3 engine rank(s)" in choice.describe()


@pytest.mark.parametrize(
    "infos, reason",
    [
        ({"http://a:8080": NCCL_SERVER, "http://b:8080": FILES_SERVER}, "the engine of http://b:8080"),
        ({"http://a:8080": NCCL_SERVER, "http://b:8080": None}, "http://b:8080 do not answer"),
        ({}, "no rollout server"),
        # the engine a server reports running decides, whatever the recipe's services.engine says
        (
            {"http://a:8080": NCCL_SERVER, "http://b:8080": {**NCCL_SERVER, "engine": "openai"}},
            "http://b:8080 (openai) run another engine",
        ),
    ],
)
def test_an_external_fleet_that_cannot_receive_gets_files_or_refuses_nccl(infos, reason):
    from services.pipeline.placement import external_weight_sync

    auto = external_weight_sync(DeploymentSpec(fleet="external"), infos)
    assert auto.method == "files" and reason in auto.reason
    with pytest.raises(PlacementError, match="cannot work here"):
        external_weight_sync(DeploymentSpec(fleet="external", weight_sync="nccl"), infos)
    files = external_weight_sync(DeploymentSpec(fleet="external", weight_sync="files"), {"http://a:8080": NCCL_SERVER})
    assert files.method == "files"


def test_rl_config_for_an_external_fleet_over_nccl_lets_the_learner_announce(tmp_path, monkeypatch):
    from services.common.settings import get_settings
    from services.controller.learner_config import rl_config

    urls = ["http://rollout-0:8080", "http://rollout-1:8080"]
    monkeypatch.setenv("STAR_ROLLOUT_URLS", ",".join(urls))
    get_settings.cache_clear()
    try:
        nccl = rl_config(_run(tmp_path, "nccl", ["deployment.fleet=external"]), "model", StreamNames("t"), None, 4)
        cfg = RLConfig.model_validate_json(nccl.read_text())
        assert (cfg.weight_sync, cfg.nccl_master, cfg.rollout_servers) == ("nccl", "auto", urls)
        files = rl_config(_run(tmp_path, "files", ["deployment.fleet=external"]), "model", StreamNames("t"), None, 4)
        cfg = RLConfig.model_validate_json(files.read_text())
        assert (cfg.weight_sync, cfg.rollout_servers) == ("files", urls)
    finally:
        get_settings.cache_clear()
