"""The learner's launch: torchrun for several ranks, refusals with numbers, ranks that stop together."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.learner.launch import RankError, resolve_ranks, worker_argv

ROOT = Path(__file__).resolve().parents[2]


def test_one_rank_is_a_plain_process_several_go_under_torchrun(tmp_path):
    assert worker_argv("sft", tmp_path / "c.json", 1)[1:] == [
        "-m",
        "services.learner.worker",
        "sft",
        str(tmp_path / "c.json"),
    ]
    argv = worker_argv("rl", "c.json", 4, max_steps=3)
    assert argv[1:3] == ["-m", "services.learner.launch"]  # torchrun, with the stop signals ours
    assert argv[argv.index("--nproc_per_node") + 1] == "4"
    assert argv[-5:] == ["-m", "services.learner.worker", "rl", "c.json", "3"]


def test_ranks_default_to_the_gpus_and_more_than_the_gpus_are_refused():
    assert resolve_ranks(None, gpus=0) == 1
    assert resolve_ranks(None, gpus=8) == 8
    assert resolve_ranks(3, gpus=0) == 3  # gloo ranks on CPU
    assert resolve_ranks(2, gpus=2) == 2
    with pytest.raises(RankError, match="asks for 4 ranks, one GPU each, but this machine shows 2 GPUs"):
        resolve_ranks(4, gpus=2)


def test_runs_api_refuses_more_ranks_than_gpus(tmp_path, tiny_model, monkeypatch):
    from services.learner import launch
    from services.learner.runs import RunConfigError, RunManager, RunRequest

    monkeypatch.setattr(launch, "visible_gpus", lambda: 1)
    manager = RunManager(tmp_path)
    request = RunRequest(kind="rl", config={"model": str(tiny_model), "engine": {"ranks": 2}})
    with pytest.raises(RunConfigError, match="asks for 2 ranks.*shows 1 GPU"):
        manager.start(request)
    assert list(tmp_path.iterdir()) == []  # nothing started, no run folder


def test_star_sft_refuses_more_ranks_than_gpus(tmp_path, tiny_model):
    data = tmp_path / "chats.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n')
    config = tmp_path / "sft.json"
    config.write_text(
        f'{{"model": "{tiny_model}", "data": "{data}", "output_dir": "{tmp_path / "out"}", "engine": {{"ranks": 2}}}}'
    )
    # this machine has no GPU (CPU ranks are allowed): the CLI runs in a process that sees one
    code = (
        "import sys; from services.learner import launch; launch.visible_gpus = lambda: 1; "
        "from services.cli import app; sys.argv = ['star', 'sft', sys.argv[1]]; app()"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(config)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "asks for 2 ranks" in done.stderr and "shows 1 GPU" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_star_sft_runs_two_ranks_under_torchrun(tmp_path, tiny_model):
    import json
    import os

    from services.learner.trainer import read_status

    data = tmp_path / "chats.jsonl"
    data.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"plan a trip {i}"},
                        {"role": "assistant", "content": f"day {i}"},
                    ]
                }
            )
            + "\n"
            for i in range(8)
        )
    )
    config = tmp_path / "sft.json"
    config.write_text(
        json.dumps(
            {
                "model": str(tiny_model),
                "data": str(data),
                "output_dir": str(tmp_path / "out"),
                "batch_size": 4,
                "engine": {"ranks": 2, "micro_batch_tokens": 64},
            }
        )
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "sft", str(config), "--max-steps", "2"],
        cwd=ROOT,
        env={**env, "DS_ACCELERATOR": "cpu"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "sft: 2 ranks under torchrun" in done.stderr
    status = read_status(tmp_path / "out")
    assert status["state"] == "finished" and status["step"] == 2
    assert (Path(status["export"]) / "config.json").is_file()


# ---------------------------------------------------------------------------------------------
# A multi-node learner: one torchrun per node at node 0's c10d rendezvous; node 0 asks the others to join.
# ---------------------------------------------------------------------------------------------


def test_a_multi_node_learner_runs_one_torchrun_per_node_at_node_0s_rendezvous():
    from services.learner.launch import Nodes, worker_env

    nodes = [Nodes(2, rank, "star-learner-0.star-learner-headless:29400") for rank in (0, 1)]
    argvs = [worker_argv("rl", "c.json", 8, nodes=n, run_id="run-1") for n in nodes]
    for rank, argv in enumerate(argvs):
        opts = dict(zip(argv[3 : argv.index("--max_restarts")][::2], argv[4 : argv.index("--max_restarts")][::2]))
        assert opts == {
            "--nnodes": "2",
            "--rdzv_backend": "c10d",
            "--rdzv_id": "run-1",
            "--rdzv_endpoint": "star-learner-0.star-learner-headless:29400",
            "--rdzv_conf": f"is_host={int(rank == 0)}",
            "--nproc_per_node": "8",
        }
        assert "--standalone" not in argv
        assert argv[-3:] == ["services.learner.worker", "rl", "c.json"]
    # one rank per node is still a torchrun (it must meet the other nodes)
    assert "services.learner.launch" in worker_argv("sft", "c.json", 1, nodes=nodes[1], run_id="r")
    assert worker_env(1, nodes[1])["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]
    with pytest.raises(ValueError, match="run id"):
        worker_argv("rl", "c.json", 8, nodes=nodes[0])
    with pytest.raises(ValueError, match="STAR_LEARNER_RENDEZVOUS"):
        Nodes(2, 0, None)
    with pytest.raises(ValueError, match="rank 2 of 2"):
        Nodes(2, 2, "h:1")


def _two_nodes(tmp_path, monkeypatch, spawned: list, refuse: bool = False):
    """Node 0's RunManager, whose join requests reach node 1's app (in-process) over a shared runs folder."""
    from fastapi.testclient import TestClient

    from services.common.settings import Settings
    from services.learner import launch, runs
    from services.learner.app import create_app
    from services.learner.launch import Nodes

    def fake_spawn(cmd, **kwargs):
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        spawned.append((cmd, kwargs["log_path"].name, proc))
        return proc

    monkeypatch.setattr(runs, "spawn", fake_spawn)
    monkeypatch.setattr(launch, "visible_gpus", lambda: 0)
    node1 = TestClient(
        create_app(
            Settings(
                home=tmp_path,
                log_json=False,
                api_token="tok",
                learner_nodes=2,
                learner_node_rank=1,
                learner_rendezvous="n0:29400",
            ),
            runs_root=tmp_path / "runs",
        )
    )

    def post(url, json, headers, timeout):
        assert url.startswith("http://n1:8000/runs/")  # node 1's URL, from the peer list
        if refuse:
            headers = {"authorization": "Bearer wrong"}
        return node1.post(url.removeprefix("http://n1:8000"), json=json, headers=headers)

    monkeypatch.setattr(runs.httpx, "post", post)
    return runs.RunManager(tmp_path / "runs", Nodes(2, 0, "n0:29400"), ["http://n1:8000"], "tok"), node1


def test_node_0_starts_a_run_on_every_node(tmp_path, tiny_model, monkeypatch):
    from services.learner.runs import RunRequest

    spawned: list = []
    manager, node1 = _two_nodes(tmp_path, monkeypatch, spawned)
    run = manager.start(RunRequest(kind="rl", config={"model": str(tiny_model)}))
    try:
        (cmd0, log0, _), (cmd1, log1, _) = spawned
        assert (log0, log1) == ("log.txt", "log.node1.txt")
        for rank, cmd in enumerate((cmd0, cmd1)):
            assert cmd[cmd.index("--rdzv_id") + 1] == run.id
            assert cmd[cmd.index("--rdzv_conf") + 1] == f"is_host={int(rank == 0)}"
            assert cmd[cmd.index("--nnodes") + 1] == "2" and cmd[cmd.index("--nproc_per_node") + 1] == "1"
        # node 1 takes no runs of its own, and joins only runs in the shared folder
        assert (
            node1.post(
                "/runs",
                json={"kind": "rl", "config": {"model": str(tiny_model)}},
                headers={"authorization": "Bearer tok"},
            ).status_code
            == 422
        )
        assert (
            node1.post("/runs/nope/join", json={"kind": "rl"}, headers={"authorization": "Bearer tok"}).status_code
            == 404
        )
        # a repeated join (a retried request) starts nothing more
        again = node1.post(f"/runs/{run.id}/join", json={"kind": "rl"}, headers={"authorization": "Bearer tok"})
        assert again.status_code == 201 and again.json()["pid"] == spawned[1][2].pid and len(spawned) == 2
    finally:
        for *_, proc in spawned:
            proc.kill()


def test_a_node_that_does_not_join_stops_the_run(tmp_path, tiny_model, monkeypatch):
    from services.learner.runs import JoinError, RunRequest

    spawned: list = []
    manager, _ = _two_nodes(tmp_path, monkeypatch, spawned, refuse=True)
    with pytest.raises(JoinError, match="learner node 1 .* did not join: 401"):
        manager.start(RunRequest(kind="rl", config={"model": str(tiny_model)}))
    (run,) = manager.runs.values()
    assert run.process.poll() is not None and len(spawned) == 1  # node 0's part stopped, node 1 never started
    assert manager.describe(run.id)["state"] == "failed"


def test_a_run_whose_process_is_gone_reads_failed_not_running(tmp_path, tiny_model):
    """A learner pod restarted: its runs' folders stay on the volume, their processes do not."""
    from services.learner.runs import GONE, RunManager
    from services.learner.trainer import write_status

    folder = tmp_path / "r1"
    folder.mkdir()
    write_status(folder, state="running", step=3)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (folder / "run.json").write_text(f'{{"id": "r1", "kind": "rl", "pid": {dead.pid}, "started": 1}}')
    described = RunManager(tmp_path).describe("r1")
    assert described["state"] == "failed" and described["error"] == GONE and described["step"] == 3


@pytest.mark.slow
def test_two_learner_nodes_train_one_sft_run_together(tmp_path, tiny_model, monkeypatch):
    """Two learner nodes on this machine (one gloo rank each): node 0 takes the run, node 1 joins over HTTP,
    their torchruns meet at node 0's rendezvous and train it as one world of two ranks."""
    import json
    import time

    from fastapi.testclient import TestClient

    from services.common.redis import free_port
    from services.common.settings import Settings
    from services.learner import runs
    from services.learner.app import create_app
    from services.learner.launch import Nodes
    from services.learner.trainer import read_status

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    rendezvous = f"127.0.0.1:{free_port()}"
    node1 = TestClient(
        create_app(
            Settings(
                home=tmp_path, log_json=False, learner_nodes=2, learner_node_rank=1, learner_rendezvous=rendezvous
            ),
            runs_root=tmp_path / "runs",
        )
    )
    monkeypatch.setattr(
        runs.httpx,
        "post",
        lambda url, json, headers, timeout: node1.post(url.removeprefix("http://node1"), json=json, headers=headers),
    )
    launched = []
    real_spawn = runs.spawn
    monkeypatch.setattr(runs, "spawn", lambda cmd, **kw: launched.append(real_spawn(cmd, **kw)) or launched[-1])
    manager = runs.RunManager(tmp_path / "runs", Nodes(2, 0, rendezvous), ["http://node1"])
    data = tmp_path / "chats.jsonl"
    data.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"plan a trip {i}"},
                        {"role": "assistant", "content": f"day {i}"},
                    ]
                }
            )
            + "\n"
            for i in range(8)
        )
    )
    run = manager.start(
        runs.RunRequest(
            kind="sft",
            config={
                "model": str(tiny_model),
                "data": str(data),
                "batch_size": 4,
                "epochs": 1,
                "engine": {"micro_batch_tokens": 64},
            },
        )
    )
    deadline = time.time() + 600
    while time.time() < deadline and manager.describe(run.id)["state"] in ("starting", "running"):
        time.sleep(2)
    described = manager.describe(run.id)
    logs = "".join(p.read_text()[-2000:] for p in sorted(run.folder.glob("log*.txt")))
    # a rendezvous of exactly 2 nodes: node 0 alone could not have started, let alone finished
    assert described["state"] == "finished", logs
    assert read_status(run.folder)["step"] == 2  # 8 chats, batch 4, one epoch
    assert len(launched) == 2 and [p.wait(60) for p in launched] == [0, 0], logs
    assert (run.folder / "log.node1.txt").is_file()


RANK = """
import os, signal, sys, time
from pathlib import Path

mode, folder = sys.argv[1], Path(sys.argv[2])
stop = []
signal.signal(signal.SIGTERM, signal.SIG_IGN if mode == "deaf" else lambda *_: stop.append(1))
(folder / os.environ["RANK"]).touch()
while not stop:
    time.sleep(0.05)
sys.exit(0 if mode == "clean" else 3)
"""


def _stop_two_ranks(tmp_path: Path, mode: str, grace_s: int = 60) -> tuple[int, float, str]:
    """Two ranks running RANK under the learner's launcher, SIGTERM to the launcher once both run:
    its exit status, how long it took to end, its output."""
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    argv = worker_argv("rl", "c.json", 2)
    argv = argv[: argv.index("-m", 3)] + [str(script), mode, str(tmp_path)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    proc = subprocess.Popen(
        argv,
        cwd=ROOT,
        env={**env, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(grace_s)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not ((tmp_path / "0").exists() and (tmp_path / "1").exists()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.1)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
        return proc.returncode, time.monotonic() - t0, out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_ranks_that_stop_cleanly_on_sigterm_make_the_launcher_exit_0(tmp_path):
    rc, _, out = _stop_two_ranks(tmp_path, "clean")
    assert rc == 0, out[-3000:]


def test_a_rank_that_fails_its_stop_makes_the_launcher_exit_non_zero(tmp_path):
    rc, _, out = _stop_two_ranks(tmp_path, "failing")
    assert rc != 0, out[-3000:]
    assert "exitcode  : 3" in out, out[-3000:]  # torchrun's summary names the rank's failure


def test_ranks_that_ignore_sigterm_are_killed_after_the_grace(tmp_path):
    rc, took, out = _stop_two_ranks(tmp_path, "deaf", grace_s=3)
    assert rc != 0, out[-3000:]
    assert took < 60, out[-3000:]
    assert "did not stop within 3 s" in out, out[-3000:]
