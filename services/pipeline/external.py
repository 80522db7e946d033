"""An external fleet's address and what a run asks of it: one `star train` did not start (Compose, Helm, `star up`).

The controller finds it through the settings its services read (STAR_REDIS_URL, STAR_SANDBOX_URL,
STAR_LEARNER_URL, STAR_ROLLOUT_URLS, STAR_REWARD_URL, STAR_STREAM_PREFIX) and refuses to start while a
part of it is unreachable. The RL stage's view of it, which owns the learner run, is
services/controller/external_fleet.py.

One world and one model for a run: the run takes the fleet's world (its sandbox and scorer must read
the same one, and so must the controller) and refuses a recipe naming another, and refuses a starting
model the fleet's engines cannot load. The model work goes where the fleet's accelerators are: SFT to
the learner service, eval episodes to the rollout servers.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from typing import Any

import httpx
import redis

from services.common.heartbeat import ALIVE_S, live_consumers
from services.common.model_shape import model_shape, shape_differences
from services.common.redis import redact
from services.common.settings import Settings
from services.common.streams import StreamNames
from services.pipeline.config import ControllerSpec, WorldSpec
from services.pipeline.stage import StageFailed, console

WAIT_SAID_EVERY_S = 30.0  # how often a controller waiting for the fleet says what it waits on
ACTIVE = ("starting", "running")


class FleetUnreachable(StageFailed):
    """A part of the external fleet does not answer; the message names each part and its address."""


@dataclass(frozen=True)
class FleetAddress:
    """Where the parts of an external fleet answer, from the STAR_* settings its services share, and how long
    the controller waits for a part still starting (`wait_s`: the recipe's controller.fleet_wait_s)."""

    redis_url: str | None
    sandbox_url: str | None
    learner_url: str | None
    rollout_urls: tuple[str, ...] = ()
    reward_url: str | None = None
    api_token: str | None = None
    stream_prefix: str = "star"
    wait_s: float = ControllerSpec.model_fields["fleet_wait_s"].default

    @classmethod
    def from_settings(cls, settings: Settings, wait_s: float | None = None) -> FleetAddress:
        def base(url: str | None) -> str | None:
            return url.rstrip("/") if url else None

        return cls(
            settings.redis_url,
            base(settings.sandbox_url),
            base(settings.learner_url),
            tuple(settings.rollout_url_list),
            base(settings.reward_url),
            settings.api_token,
            settings.stream_prefix,
            **({} if wait_s is None else {"wait_s": wait_s}),
        )

    @property
    def names(self) -> StreamNames:
        return StreamNames(self.stream_prefix)

    def services(self) -> dict[str, str | None]:
        """The HTTP services the RL stage needs (None: not configured) and those it checks when set."""
        out: dict[str, str | None] = {
            "sandbox (STAR_SANDBOX_URL)": self.sandbox_url,
            "learner (STAR_LEARNER_URL)": self.learner_url,
        }
        out.update({f"rollout server (STAR_ROLLOUT_URLS) {i}": url for i, url in enumerate(self.rollout_urls)})
        if self.reward_url:
            out["reward (STAR_REWARD_URL)"] = self.reward_url
        return out

    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_token}"} if self.api_token else {}


def ready(url: str) -> bool:
    """Does the service at `url` answer /readyz with 200?"""
    try:
        return httpx.get(f"{url}/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def problems(address: FleetAddress) -> list[str]:
    """What of the fleet is down or unset, one line each (empty: every part answers)."""
    found: list[str] = []
    if not address.redis_url:
        found.append("redis: STAR_REDIS_URL is not set")
    else:
        try:
            client = redis.Redis.from_url(address.redis_url, socket_connect_timeout=2, socket_timeout=2)
            client.ping()
        except redis.RedisError as exc:
            why = (
                "refused the credentials"
                if isinstance(exc, redis.AuthenticationError)
                else f"does not answer ({type(exc).__name__})"
            )
            found.append(f"redis (STAR_REDIS_URL) at {redact(address.redis_url)}: {why}")
        else:
            names = address.names
            for stream, group, what in (
                (names.tasks, "rollout", "rollout workers"),
                (names.trajectories, "reward", "reward workers"),
            ):
                if not live_consumers(client, stream, group):
                    found.append(
                        f"{what}: none has read {stream} (group {group}) at {redact(address.redis_url)} "
                        f"within {ALIVE_S:.0f} s"
                    )
    for name, url in address.services().items():
        if not url:
            found.append(f"{name}: not set")
        elif not ready(url):
            found.append(f"{name} at {url}: not ready (GET /readyz)")
    return found


def check_reachable(address: FleetAddress, wait_s: float | None = None, poll_s: float = 1.0) -> None:
    """Wait up to `wait_s` (default: the address's) for every part of the fleet to answer (Compose starts them
    together); then refuse, naming each part still down."""
    deadline = time.monotonic() + (address.wait_s if wait_s is None else wait_s)
    said = None
    while True:
        found = problems(address)
        if not found:
            if said is not None:
                console.print("the fleet is ready")
            return
        if time.monotonic() >= deadline:
            raise FleetUnreachable("the external fleet is not reachable:\n  " + "\n  ".join(found))
        if said is None or time.monotonic() - said >= WAIT_SAID_EVERY_S:  # a log that shows what it waits on
            said = time.monotonic()
            console.print(f"waiting (up to {deadline - said:.0f} s more) for the fleet:\n  " + "\n  ".join(found))
        time.sleep(poll_s)


# -- one world and one model for a run --------------------------------------------------------


def _get_json(url: str, wait_s: float) -> dict[str, Any]:
    """GET `url`'s JSON, waiting up to `wait_s` for a service still starting; StageFailed after."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            r = httpx.get(url, timeout=10)
            if r.status_code == 200:
                return r.json()
            why = f"{r.status_code}: {response_detail(r)}"
        except httpx.HTTPError as exc:
            why = f"{type(exc).__name__}: {exc}"
        if time.monotonic() >= deadline:
            raise FleetUnreachable(f"GET {url} failed ({why})")
        time.sleep(1.0)


def recipe_world_mismatch(world: WorldSpec, seed: int, fleet: dict[str, Any]) -> str | None:
    """What of the recipe's `world` the fleet's world (its identity) is not, or None."""
    if world.source == "synthetic":
        want = {"kind": "synthetic", "size": world.synthetic_size, "seed": seed}
    else:
        want = {"kind": "official"}
    wrong = [f"{k} {fleet.get(k)!r} (the recipe: {v!r})" for k, v in want.items() if fleet.get(k) != v]
    return ", ".join(wrong) or None


def fleet_world(address: FleetAddress, world: WorldSpec, seed: int, world_url: str) -> dict[str, Any]:
    """The run's world is the fleet's: the one its sandbox serves, which its scorer must read too, and
    the controller through `world_url` (STAR_DB_URL); a recipe naming another world is refused,
    naming both. Returns the world's identity (hash, source)."""
    from services.sandbox.world import World

    if not address.sandbox_url:
        raise FleetUnreachable("sandbox (STAR_SANDBOX_URL): not set")
    served = _get_json(f"{address.sandbox_url}/world", address.wait_s)
    fleet = {k: served.get(k) for k in ("world_hash", "source", "kind", "size", "seed")}
    where = f"the sandbox at {address.sandbox_url} serves {fleet['source']}, hash {fleet['world_hash']}"
    if address.reward_url:
        scored = _get_json(f"{address.reward_url}/world", address.wait_s)
        if scored.get("world_hash") != fleet["world_hash"]:
            raise StageFailed(
                f"the fleet's services read different worlds: {where}, the scorer at "
                f"{address.reward_url} {scored.get('source')}, hash {scored.get('world_hash')}; "
                "give both the same STAR_DB_URL"
            )
    wrong = recipe_world_mismatch(world, seed, fleet)
    if wrong:
        recipe = (
            f"synthetic world {world.synthetic_size} (seed {seed})"
            if world.source == "synthetic"
            else "the official tables"
        )
        fix = (
            f"--set world.source=synthetic --set world.synthetic_size={fleet['size']}"
            if fleet["kind"] == "synthetic"
            else "--set world.source=official"
        )
        raise StageFailed(
            f"the recipe's world is not the fleet's: the recipe names {recipe}; {where} ({wrong}). "
            f"Train on the fleet's world ({fix}), or rebuild the fleet's world to the recipe's"
        )
    own = World(world_url)
    try:
        ours = own.identity() if own.problem() is None else None
    finally:
        own.close()
    if ours is None or ours["world_hash"] != fleet["world_hash"]:
        mine = f"{ours['source']}, hash {ours['world_hash']}" if ours else "no world"
        raise StageFailed(
            f"the controller's world database (STAR_DB_URL) holds {mine}, but {where}: "
            "give the controller the fleet's STAR_DB_URL"
        )
    return fleet


def engines_take(address: FleetAddress, base_model: str) -> None:
    """Refuse a starting model the fleet's engines cannot load (they load each published version into
    the model they were started on): each rollout server reports that model's shape."""
    ours = model_shape(base_model)
    if ours is None:
        raise StageFailed(f"the run's model {base_model} has no readable config.json")
    for url in address.rollout_urls:
        info = _get_json(f"{url}/weights", address.wait_s)
        theirs = info.get("shape")
        if theirs is None:  # an engine without weights of its own (an OpenAI-compatible API)
            continue
        wrong = shape_differences(ours, theirs)
        if wrong:
            raise StageFailed(
                f"the fleet's engines cannot load this run's model: the rollout server at {url} runs "
                f"{info.get('model')}, and the run starts from {base_model} ({'; '.join(wrong)}). Train the "
                f"fleet's model (--set model.path={info.get('model')} --set model.tiny=null), or start the fleet "
                "with STAR_MODEL of the recipe's shape"
            )


def fleet_weight_states(address: FleetAddress) -> dict[str, dict[str, Any] | None]:
    """Each rollout server's GET /weights (None: it does not answer): whether its engine can join an
    NCCL weight group (`weight_ranks`)."""
    states: dict[str, dict[str, Any] | None] = {}
    for url in address.rollout_urls:
        try:
            states[url] = _get_json(f"{url}/weights", wait_s=10)
        except FleetUnreachable:
            states[url] = None
    return states


def fleet_weights(address: FleetAddress) -> str:
    """What the fleet's rollout servers hold, in words: `v2 (/var/star/weights/v2)` per server."""
    held = []
    for url in address.rollout_urls:
        info = _get_json(f"{url}/weights", address.wait_s)
        held.append(f"v{info.get('version')} ({info.get('path') or info.get('model')})")
    return ", ".join(held) or "nothing (no STAR_ROLLOUT_URLS)"


def foreign_progress(client: redis.Redis, names: StreamNames) -> str | None:
    """RL progress in the fleet's Redis that no run of this folder made, or None. Its rollout workers
    have loaded that run's weights and would not load an older version number."""
    raw = client.get(names.weights_latest)
    batches = client.get(names.learner_batches)
    if not raw and not batches:
        return None
    version = json.loads(raw)["version"] if raw else 0
    return f"weights v{version}, {int(batches) if batches else 0} batches consumed, under prefix {names.prefix!r}"


def train_on_learner(address: FleetAddress, kind: str, config: dict[str, Any], poll_s: float = 2.0) -> dict[str, Any]:
    """A `kind` run (sft) on the fleet's learner service, where the fleet's accelerators are, followed to
    its end (its steps said as they come); returns the finished run, or fails the stage with its error.
    Stopping the controller stops the run."""
    headers = address.headers()
    try:
        r = httpx.post(
            f"{address.learner_url}/runs", json={"kind": kind, "config": config}, headers=headers, timeout=60
        )
    except httpx.HTTPError as exc:
        raise StageFailed(f"the learner at {address.learner_url} did not take the {kind} run: {exc}") from None
    if r.status_code != 201:
        raise StageFailed(
            f"the learner at {address.learner_url} refused the {kind} run ({r.status_code}): {response_detail(r)}"
        )
    run_id = r.json()["id"]
    console.print(f"{kind} run {run_id} started on the learner at {address.learner_url}")
    said = None
    try:
        while True:
            try:
                run = httpx.get(f"{address.learner_url}/runs/{run_id}", headers=headers, timeout=10).json()
            except (httpx.HTTPError, ValueError):
                time.sleep(poll_s)  # the service restarting: its run folder keeps the run
                continue
            if (run.get("state"), run.get("step")) != said:
                said = (run.get("state"), run.get("step"))
                console.print(f"{kind} {run.get('state')} · step {run.get('step', 0)}")
            if run.get("state") == "finished":
                return run
            if run.get("state") not in ACTIVE:
                raise StageFailed(
                    f"{kind} run {run_id} on the learner at {address.learner_url} ended "
                    f"{run.get('state')}: {str(run.get('error') or '')[-2000:]}"
                )
            time.sleep(poll_s)
    except BaseException:
        if said is None or said[0] in ACTIVE:
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(f"{address.learner_url}/runs/{run_id}/stop", headers=headers, timeout=30)
        raise


def response_detail(r: httpx.Response) -> str:
    try:
        detail = r.json().get("detail")
    except ValueError:
        detail = None
    return str(detail if detail is not None else r.text[:500])
