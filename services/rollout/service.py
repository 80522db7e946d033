"""The rollout service's domain: one engine, one sandbox client, groups in, trajectories out.

Shared by the HTTP app (`app.py`), the stream worker (`worker.py`) and the CLI. Also the server's side
of weight updates (files, NCCL, CUDA IPC): what it refuses, with the HTTP status of a `WeightsError`,
and what a failed or stuck transfer does to the process; the transports themselves are
services/weights/.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel, Field

from services.common.metrics import Metrics
from services.common.model_shape import model_shape
from services.common.schemas import (
    EvalMode,
    GenerateRequest,
    GenerateResult,
    IpcWeights,
    PreferencePenalty,
    RewardKind,
    RolloutTask,
    SamplingParams,
    SleepRequest,
    ToolResult,
    Trajectory,
    TravelQuery,
    WakeRequest,
    WeightsBroadcast,
    WeightsGroup,
    WeightsUpdate,
)
from services.common.settings import Settings, get_settings
from services.rollout import sleep as sleep_mode
from services.rollout.agent import Agent
from services.rollout.config import RolloutConfig
from services.rollout.engines import Engine, TurnParams, build_engine
from services.rollout.engines.base import EngineError, OlderVersion
from services.rollout.group import ArpoConfig, EpisodeSlots, GroupMeta, sample_group
from services.rollout.sleep import SleepError, SleepState
from services.rollout.tools import HttpToolClient, LocalToolClient, ToolClient
from services.weights.manifest import WeightsError, check_weights
from services.weights.nccl import weight_ranks

log = logging.getLogger(__name__)
ABORT_TIMEOUT_S = 10.0  # an abort of the requests in flight that takes longer is given up (they are refused anyway)
# a weight transfer not over this long after its deadline (its clean-up included) has wedged the process
# itself (e.g. the event loop blocked in a call into the engine): the watchdog thread ends the process
STUCK_GRACE_S = ABORT_TIMEOUT_S + 5.0
# the exit status of a rollout process ended because a weight transfer left its engine stuck
# (EX_TEMPFAIL, as the learner's `services.weights.nccl.STUCK_EXIT`): restart it, it loads the newest files
STUCK_EXIT = 75
TOOL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class RolloutRequest(BaseModel):
    """`POST /rollouts`: one query, G samples."""

    model_config = {"extra": "forbid"}

    query: TravelQuery
    group_size: int = Field(1, ge=1, le=64)
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    arpo: ArpoConfig | None = None
    run_id: str = Field("adhoc", min_length=1, max_length=128)
    task_id: str | None = Field(None, max_length=256)
    prompt_id: str | None = Field(None, max_length=256)
    epoch: int = Field(1, ge=1)
    reward_kind: RewardKind = "sum"
    preference_penalty: PreferencePenalty = 0.0
    eval_mode: EvalMode = "strict"


class RolloutMetrics:
    def __init__(self) -> None:
        m = self.registry = Metrics("rollout")
        self.trajectories = m.counter(
            "trajectories_total", "Finished trajectories by finish reason", ("finish_reason",)
        )
        self.sampled_tokens = m.counter("sampled_tokens_total", "Tokens sampled by the engine")
        self.tokens_per_second = m.gauge("tokens_per_second", "Sampled tokens per second over the last minute")
        self.in_flight = m.gauge("in_flight_trajectories", "Trajectories being sampled now")
        self.tool_seconds = m.histogram(
            "tool_seconds", "Sandbox call latency seen by the agent", ("tool",), buckets=TOOL_BUCKETS
        )
        self.tool_calls = m.counter("tool_calls_total", "Tool calls by outcome", ("tool", "outcome"))
        self.weight_version = m.gauge("weight_version", "Policy version of the loaded weights")
        self.weight_updates = m.counter("weight_updates_total", "Weight updates by outcome", ("outcome",))
        self._window: deque[tuple[float, int]] = deque()

    def observe(self, trajectories: list[Trajectory]) -> None:
        now = time.monotonic()
        for t in trajectories:
            self.trajectories.labels(t.finish_reason).inc()
            n = sum(t.loss_mask)
            self.sampled_tokens.inc(n)
            self._window.append((now, n))
        while self._window and now - self._window[0][0] > 60:
            self._window.popleft()
        if self._window:
            span = max(1.0, now - self._window[0][0])
            self.tokens_per_second.set(sum(n for _, n in self._window) / span)


class TimedTools:
    """A ToolClient that reports each call's latency and outcome to the metrics."""

    def __init__(self, inner: ToolClient, metrics: RolloutMetrics) -> None:
        self.inner = inner
        self.metrics = metrics

    async def call(self, name: str, arguments: dict[str, Any], *, fault_key: str | None = None) -> ToolResult:
        t0 = time.perf_counter()
        try:
            result = await self.inner.call(name, arguments, fault_key=fault_key)
        except Exception:
            self.metrics.tool_calls.labels(name, "unavailable").inc()
            raise
        self.metrics.tool_seconds.labels(name).observe(time.perf_counter() - t0)
        outcome = "fault" if result.fault_injected else ("ok" if result.ok else "error")
        self.metrics.tool_calls.labels(name, outcome).inc()
        return result

    async def reachable(self) -> bool:
        return await self.inner.reachable()

    async def close(self) -> None:
        await self.inner.close()


class RolloutService:
    def __init__(
        self,
        engine: Engine,
        tools: ToolClient,
        *,
        settings: Settings | None = None,
        config: RolloutConfig | None = None,
        metrics: RolloutMetrics | None = None,
    ) -> None:
        self.settings = settings or get_settings()
        self.config = config or RolloutConfig()
        self.metrics = metrics or RolloutMetrics()
        self.engine = engine
        self.tools = TimedTools(tools, self.metrics)
        self.agent = Agent(engine, self.tools, chat=self.config.chat)
        self.loaded_at = time.time()
        self.metrics.weight_version.set(engine.policy_version)
        self._weights_sha: str | None = None
        # the published version last loaded (files or broadcast); None while the engine holds only the model it
        # was started with, which is no published version even where its number (0) matches one
        self.loaded_version: int | None = None
        self._broken: str | None = None  # set while a failed load may have left mixed weights
        self._failed_loads = 0  # loads that failed so far: a rollout that saw this change is refused
        # set once the engine is stuck or its state unknown (a weight receive or join timed out or
        # failed): nothing in this process mends it, so the process must end (`on_fatal`)
        self.fatal: str | None = None
        self.on_fatal: Callable[[str], None] | None = None  # the host's way to end the process
        self._weight_group: str | None = None  # the learner's NCCL group this engine has joined
        # the transfer under way (version, path, start), None between transfers: a server found receiving
        # long after its learner stopped sending is one a dead sender left paused
        self.receiving: dict[str, Any] | None = None
        # the model the engine was started on: what a published version must match to load
        self.base_model = self.config.model or self.settings.model
        self.base_shape = model_shape(self.base_model) if self.base_model and engine.token_level else None
        self.sleep_state = SleepState()  # colocated with the learner: asleep while it trains

    @classmethod
    def from_settings(cls, settings: Settings | None = None, config: RolloutConfig | None = None) -> RolloutService:
        settings = settings or get_settings()
        config = config or RolloutConfig()
        return cls(make_engine(settings, config), make_tools(settings, config), settings=settings, config=config)

    async def rollout(
        self, request: RolloutRequest | RolloutTask, slots: EpisodeSlots | None = None
    ) -> list[Trajectory]:
        """The group's G trajectories; `slots`: the worker's episode budget its episodes wait for."""
        if self._broken:
            raise WeightsError(self._broken, status=503)
        failed_loads = self._failed_loads
        if isinstance(request, RolloutTask):
            group, arpo = request.group_size, request.arpo
            task_id = request.task_id
        else:
            group, arpo = request.group_size, request.arpo
            task_id = request.task_id or f"{request.run_id}-{int(time.time() * 1000)}"
        prompt_id = getattr(request, "prompt_id", None) or request.query.id or task_id
        meta = GroupMeta(
            run_id=request.run_id,
            task_id=task_id,
            prompt_id=prompt_id,
            epoch=request.epoch,
            step=getattr(request, "step", None),
            reward_kind=request.reward_kind,
            preference_penalty=request.preference_penalty,
            eval_mode=request.eval_mode,
        )
        self.metrics.in_flight.inc(group)
        try:
            from services.rollout.agent import Limits

            limits = Limits.from_sampling(request.sampling, self.config.max_format_errors)
            trajectories = await sample_group(
                self.agent, request.query, group, request.sampling, limits, arpo=arpo, meta=meta, slots=slots
            )
        finally:
            self.metrics.in_flight.dec(group)
        if self._failed_loads != failed_loads:
            # a load failed while the group ran: some of its tokens may come from half-updated weights
            raise WeightsError(
                f"a weight load failed while this group was sampled: "
                f"{self._broken or 'mixed weights'}; the group is not kept",
                status=503,
            )
        self.metrics.observe(trajectories)
        return trajectories

    # -- weights ---------------------------------------------------------------------------

    @property
    def broken(self) -> str | None:
        """Why the server must not sample now (a load failed halfway), or None."""
        return self._broken

    @property
    def healthy(self) -> bool:
        """False once this process cannot serve again (the engine broke, or a weight transfer left it
        stuck): its host ends it and a fresh one loads the newest files."""
        return self.fatal is None and self.engine.healthy

    async def _load_failed(self, reason: str) -> None:
        """A load failed partway: no sampling on these weights (until a whole version loads), and the
        requests in flight, which may have sampled on them already, are aborted."""
        self._broken = reason
        self._failed_loads += 1
        self.metrics.weight_updates.labels("failed").inc()
        try:
            await within(self.engine.abort_in_flight(), ABORT_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - the rollouts are refused anyway (`rollout` checks)
            log.warning("could not abort the requests in flight", extra={"error": f"{type(exc).__name__}: {exc}"})

    def _end_process(self, reason: str) -> None:
        """The engine may be stuck inside a collective (NCCL has no timeout) or hold weights nobody can
        name: mark the process fatal and ask its host to end it. Its tasks' claims lapse and other
        workers take them; its supervisor starts a fresh process, which loads the newest files."""
        self.fatal = reason
        log.error("weight transfer failed; ending the process", extra={"error": reason[:500]})
        if self.on_fatal is not None:
            self.on_fatal(reason)

    @contextlib.contextmanager
    def _watchdog(self, what: str):
        """Ends the process (`_end_process`, from a thread of its own) if the block has not finished
        `STUCK_GRACE_S` after the transfer's deadline: the deadline itself runs on the event loop, which
        an engine call blocked in a collective may hold too, and then nothing on the loop ever fires."""
        done = threading.Event()
        limit = self.config.weights_timeout_s + STUCK_GRACE_S

        def watch() -> None:
            if not done.wait(limit) and self.fatal is None:
                reason = f"{what} had not returned {limit:g} s after it began, its deadline long passed"
                self._broken = self._broken or reason
                self._end_process(reason)

        threading.Thread(target=watch, name="weights-watchdog", daemon=True).start()
        try:
            yield
        finally:
            done.set()

    @contextlib.contextmanager
    def _receiving(self, version: int, via: str):
        """Marks `version` as arriving (by `via`: files, nccl or ipc) for the block's duration."""
        self.receiving = {"version": version, "via": via, "since": time.time()}
        try:
            yield
        finally:
            self.receiving = None

    def weights_info(self) -> dict[str, Any]:
        return {
            "version": self.engine.policy_version,
            "path": self.engine.weights_path,
            "sha256": self._weights_sha,
            "engine": self.engine.name,
            "loaded_at": self.loaded_at,
            "in_flight": self.engine.in_flight,
            "receiving": self.receiving,
            # NCCL ranks this engine takes in the learner's weight group (0: it cannot join one)
            "weight_ranks": weight_ranks(self.engine),
            "weight_group": self._weight_group,
            "broken": self._broken,
            "model": self.base_model,
            "shape": self.base_shape,
            "can_sleep": self.engine.supports_sleep,
            "sleep": self.sleep_state.info(),
        }

    async def update_weights(self, update: WeightsUpdate) -> dict[str, Any]:
        if not self.engine.token_level:
            raise WeightsError(
                f"the {self.engine.name} engine serves a remote model; it has no weights to load", status=409
            )
        self._refuse_asleep()
        try:
            # off the event loop: hashing a version's files takes long enough to stall every agent
            folder = await asyncio.to_thread(
                check_weights, update, self.settings.weights_dir, self.config.rehash_weights
            )
        except WeightsError:
            self.metrics.weight_updates.labels("rejected").inc()
            raise
        self._refuse_older(update.version)
        if update.version == self.engine.policy_version and update.sha256 == self._weights_sha and not self._broken:
            return {**self.weights_info(), "reloaded": False}
        try:
            with self._receiving(update.version, "files"):
                timing = await self.engine.update_weights(folder, update.version)
        except OlderVersion as exc:  # a broadcast of a newer version landed while this load waited
            self.metrics.weight_updates.labels("rejected").inc()
            raise WeightsError(str(exc), status=409) from None
        except Exception as exc:  # noqa: BLE001 - tensors may have loaded before the failure: mixed weights
            reason = f"loading version {update.version} failed: {type(exc).__name__}: {exc}"
            await self._load_failed(reason)
            if not self.engine.healthy:  # it cannot load a whole version again in this process
                self._end_process(reason)
            raise WeightsError(
                f"could not load {folder}: {type(exc).__name__}: {exc}; this server will "
                "not sample until a full version loads",
                status=422,
            ) from exc
        return self._loaded(update.version, update.sha256, timing)

    def _refuse_asleep(self) -> None:
        if self.sleep_state.asleep:
            self.metrics.weight_updates.labels("rejected").inc()
            raise WeightsError(
                "the engine is asleep (colocated with the learner): its weights arrive with the wake, by CUDA IPC",
                status=409,
            )

    def _refuse_older(self, version: int) -> None:
        if version < self.engine.policy_version:
            self.metrics.weight_updates.labels("rejected").inc()
            raise WeightsError(
                f"version {version} is older than the loaded version {self.engine.policy_version}", status=409
            )

    def _loaded(self, version: int, sha256: str | None, timing: dict[str, float]) -> dict[str, Any]:
        """A whole version is in place (from files, or a broadcast: `sha256` None): the server samples again."""
        self._weights_sha = sha256
        self._broken = None
        self.loaded_version = version
        self.loaded_at = time.time()
        self.metrics.weight_version.set(version)
        self.metrics.weight_updates.labels("loaded").inc()
        return {**self.weights_info(), "reloaded": True, **timing}

    async def join_weight_group(self, group: WeightsGroup) -> dict[str, Any]:
        """Join the learner's NCCL group (engines started with `weight_transfer: nccl`)."""
        join = getattr(self.engine, "join_weight_group", None)
        if join is None:
            raise WeightsError(f"the {self.engine.name} engine cannot receive weights over NCCL", status=409)
        self._weight_group = None  # whatever group it was in is left now
        with self._watchdog(f"joining the weight group at {group.master_address}:{group.master_port}"):
            try:
                await within(
                    join(group.master_address, group.master_port, group.rank_offset, group.world_size),
                    self.config.weights_timeout_s,
                )
            except TimeoutError:
                reason = (
                    f"the learner's group at {group.master_address}:{group.master_port} did not form within "
                    f"{self.config.weights_timeout_s:g} s"
                )
                self._end_process(f"{reason}; the engine may still wait for it")  # its core is blocked in the join
                raise WeightsError(f"{reason}; this server ends and restarts", status=504) from None
            except Exception as exc:  # noqa: BLE001 - reported to the learner, which falls back to files
                raise WeightsError(f"could not join the weight group: {type(exc).__name__}: {exc}", status=422) from exc
        self._weight_group = group.group_id or f"{group.master_address}:{group.master_port}"
        return {
            "joined": True,
            "rank_offset": group.rank_offset,
            "world_size": group.world_size,
            "weight_group": self._weight_group,
        }

    async def receive_weights(
        self, broadcast: WeightsBroadcast, sender_gone: Callable[[], Awaitable[bool]] | None = None
    ) -> dict[str, Any]:
        """Receive `broadcast.version` from the learner's NCCL broadcast and load it in place. `sender_gone`
        (the learner's request was disconnected: its process died) ends the receive at once, as a failure:
        NCCL would wait for the dead sender until the deadline."""
        self._refuse_asleep()
        receive = getattr(self.engine, "receive_weights", None)
        if receive is None:
            raise WeightsError(f"the {self.engine.name} engine cannot receive weights over NCCL", status=409)
        self._refuse_older(broadcast.version)
        with self._watchdog(f"a broadcast of version {broadcast.version}"), self._receiving(broadcast.version, "nccl"):
            try:
                timing = await within(
                    receive(broadcast.names, broadcast.dtype_names, broadcast.shapes, broadcast.version),
                    self.config.weights_timeout_s,
                    gone=sender_gone,
                )
            except Exception as exc:  # noqa: BLE001 - the engine may hold part of a version, or be stuck receiving
                what = (
                    f"did not finish within {self.config.weights_timeout_s:g} s"
                    if isinstance(exc, TimeoutError)
                    else f"failed: {type(exc).__name__}: {exc}"
                )
                reason = f"a broadcast of version {broadcast.version} {what}"
                self._weight_group = None  # the group's state is unknown: the learner forms a new one
                await self._load_failed(reason)
                self._end_process(reason)
                raise WeightsError(f"{reason}; this server will not sample again and restarts", status=503) from exc
        return self._loaded(broadcast.version, None, timing)

    # -- colocated with the learner: sleep, wake, weights by CUDA IPC (services/rollout/sleep.py) -----

    async def sleep(self, request: SleepRequest) -> dict[str, Any]:
        try:
            return await sleep_mode.sleep(self.engine, self.sleep_state, request)
        except SleepError as exc:
            raise WeightsError(exc.message, status=exc.status) from None

    async def wake(self, request: WakeRequest) -> dict[str, Any]:
        try:
            return await sleep_mode.wake(self.engine, self.sleep_state, request)
        except SleepError as exc:
            if exc.fatal:
                self._broken = exc.message
                self._end_process(exc.message)
                raise WeightsError(f"{exc.message}; this server ends and restarts", status=exc.status) from None
            raise WeightsError(exc.message, status=exc.status) from None
        except Exception as exc:  # noqa: BLE001 - memory that did not come back: this process cannot serve
            reason = f"waking the engine failed: {type(exc).__name__}: {exc}"
            self._end_process(reason)
            raise WeightsError(f"{reason}; this server ends and restarts", status=503) from exc

    async def receive_ipc(self, chunk: IpcWeights) -> dict[str, Any]:
        """One chunk of a version by CUDA IPC; the last one makes the version the engine's."""
        self._refuse_older(chunk.version)
        with self._watchdog(f"a CUDA IPC load of version {chunk.version}"), self._receiving(chunk.version, "ipc"):
            try:
                out = await within(
                    sleep_mode.receive_ipc(self.engine, self.sleep_state, chunk), self.config.weights_timeout_s
                )
            except SleepError as exc:
                raise WeightsError(exc.message, status=exc.status) from None
            except Exception as exc:  # noqa: BLE001 - some tensors may have loaded: mixed weights
                what = (
                    f"did not finish within {self.config.weights_timeout_s:g} s"
                    if isinstance(exc, TimeoutError)
                    else f"failed: {type(exc).__name__}: {exc}"
                )
                reason = f"a CUDA IPC load of version {chunk.version} {what}"
                self.sleep_state.loading = None
                await self._load_failed(reason)
                self._end_process(reason)
                raise WeightsError(f"{reason}; this server will not sample again and restarts", status=503) from exc
        if not chunk.last:
            return out
        return {**self._loaded(chunk.version, None, {k: v for k, v in out.items() if isinstance(v, float)}), **out}

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """One model turn on the token ids given (token-in/token-out clients and sync checks)."""
        if not self.engine.token_level:
            raise WeightsError(f"the {self.engine.name} engine takes chat messages, not token ids", status=409)
        if self._broken:
            raise WeightsError(self._broken, status=503)
        gen = await self.engine.generate(
            request.prompt_ids,
            TurnParams(
                max_tokens=request.max_tokens, temperature=request.temperature, top_p=request.top_p, seed=request.seed
            ),
        )
        return GenerateResult(
            token_ids=gen.token_ids, logprobs=gen.logprobs, finish=gen.finish, policy_version=gen.policy_version
        )

    async def parameter_digests(self) -> dict[str, Any]:
        digests = getattr(self.engine, "parameter_digests", None)
        if digests is None:
            raise WeightsError(f"the {self.engine.name} engine cannot report parameter digests", status=409)
        try:
            return await digests()
        except EngineError as exc:
            raise WeightsError(str(exc), status=409) from None

    async def close(self) -> None:
        await self.tools.close()
        await self.engine.close()


class SenderGone(Exception):
    """The other side of a transfer went away while it ran."""


async def within(
    work: Awaitable[Any], timeout_s: float, *, gone: Callable[[], Awaitable[bool]] | None = None, poll_s: float = 1.0
) -> Any:
    """`work`'s result, or TimeoutError after `timeout_s` (SenderGone as soon as `gone()` says so, asked
    every `poll_s`) without waiting for `work` to wind down: a weight transfer cancelled while the engine
    core is blocked in a collective would wait on that core for ever in its clean-up (`asyncio.wait_for`
    awaits the cancellation). It is cancelled and left."""
    task = asyncio.ensure_future(work)
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while True:
        left = end - loop.time()
        if left <= 0:
            why: Exception = TimeoutError(f"did not finish within {timeout_s:g} s")
            break
        done, _ = await asyncio.wait({task}, timeout=min(left, poll_s) if gone is not None else left)
        if done:
            return task.result()
        if gone is not None and await gone():
            why = SenderGone("the sender's connection closed while the transfer ran (its process died)")
            break
    task.cancel()
    task.add_done_callback(lambda t: t.cancelled() or t.exception())  # nobody awaits it: no warning
    raise why


def make_engine(settings: Settings, config: RolloutConfig) -> Engine:
    model = config.model or settings.model
    if config.engine == "openai":
        return build_engine("openai", model, base_url=config.openai_base_url, api_key=config.openai_api_key)
    options: dict[str, Any] = {"max_model_len": config.max_model_len}
    if config.dtype:
        options["dtype"] = config.dtype
    if config.engine == "transformers":
        options["max_batch"] = config.max_batch
    if config.engine == "vllm":
        placed = {
            k: v
            for k, v in (
                ("gpu_memory_utilization", config.gpu_memory_utilization),
                ("tensor_parallel_size", config.tensor_parallel_size),
                ("kv_cache_from_share", config.kv_cache_from_share),
            )
            if v is not None
        }
        options["args"] = config.vllm.model_copy(update=placed)
    return build_engine(config.engine, model, **options)


def make_tools(settings: Settings, config: RolloutConfig) -> ToolClient:
    if config.tools == "local":
        from services.sandbox.tools.toolbox import ToolBox
        from services.sandbox.world import World

        world = World(settings.world_url)
        problem = world.problem()
        if problem:
            raise RuntimeError(f"travel world not usable: {problem}")
        return LocalToolClient(ToolBox.from_settings(world, settings))
    if not settings.sandbox_url:
        raise RuntimeError("STAR_SANDBOX_URL is not set (or set STAR_ROLLOUT_TOOLS=local)")
    return HttpToolClient(settings.sandbox_url, timeout_s=config.tool_timeout_s, retries=config.tool_retries)
