"""The ReAct agent loop, token-in/token-out.

A trajectory is one growing id sequence: the prompt (system + user + assistant header, rendered
once by the chat template), then for every turn the ids the engine sampled (loss mask 1, their
log-probs) and the ids of what the environment adds (mask 0): the end of the assistant message
when the engine stopped without it, the user message carrying the tool response, and the next
assistant header. Only that new segment is tokenized; the chat is never re-rendered, so the
learner trains on exactly the tokens that were sampled (a re-tokenisation of the text can differ:
see tests/rollout/test_agent.py).

Budgets and how a trajectory ends (`finish_reason`):
- `answer`: a turn carried `<answer>…</answer>` (or a lone `<answer>`).
- `tool_budget`: the model tried to call a tool after `max_tool_calls` calls. Every attempted
  call counts, malformed or unknown ones too (they cost a turn and context like any other).
- `context_limit`: the next turn would have no room, a turn was cut by the room left, or a tool
  response does not fit. Context is `len(token_ids)`, i.e. real template tokens. Each turn may
  sample at most `min(max_tokens_per_turn, context left)` tokens.
  With `summarize_at_limit` (the public STAR agent's ending, spec/agent-star.md §1.2 step 5), the
  last message is replaced instead by a user message asking for a summarizing plan
  (`SUMMARY_REQUEST`) and one more call is made; its reply is the answer (the text inside
  `<answer>` tags when it has them, else the whole reply, as the reference takes it), the
  trajectory ends as `answer` and `timings["summarized_at_limit"]` is 1. "The last message" is
  the tool response that does not fit, or else the last environment message (a cut turn goes
  with it), whichever leaves room for the request.
- `format_error`: format-error policy. As in the public agent, a turn with neither a tool call nor
  an answer is burned: nothing is fed back, the assistant message is closed and a new assistant
  turn begins. After `max_format_errors` such turns in a row the trajectory ends as
  `format_error` (a policy that keeps rambling is not going to answer; the reward is 0 either way).
- `engine_error`: the engine or the sandbox failed; `error` says how. The worker retries a task
  whose every sample ended this way.
- Forced episodes (`SamplingParams.forced_turns`, benchmarking only): each turn samples a fixed
  number of tokens with stop tokens ignored; the first `tool_calls` turns are read as calls of real
  sandbox tools (`forced_call`: arguments from the query), the next one is the answer, whatever the
  text says. A random-init model's rollouts then cost what a trained agent's do. With `shape: teacher` the
  numbers are drawn per episode (and per turn) from the teacher's trajectories (episode_shapes.py).
- `deadline`: the episode ran past its wall-clock limit (`Limits.episode_timeout_s`, or its group's
  deadline), or one turn past `Limits.turn_timeout_s`: the turn in flight is cancelled, which aborts
  its request in the engine, and what was sampled before it stays.
"""

from __future__ import annotations

import asyncio
import copy
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from services.common.schemas import ForcedTurns, SamplingParams, Trajectory, TravelQuery
from services.rollout.chat import Chat, ChatOptions, ChatTemplateError
from services.rollout.engines.base import Engine, EngineError, Generation, TurnParams, normalized_entropy
from services.rollout.episode_shapes import EpisodeShape, draw_episode, draw_turn, shape_rng
from services.rollout.protocol import FORMAT_ERROR, Turn, parse_turn, system_prompt, tool_response, user_message
from services.rollout.tools import ToolClient, ToolServiceError
from services.sandbox.tools.registry import tool_names

# The public STAR agent's words when the conversation outgrows its context (spec/agent-star.md §1.2).
SUMMARY_REQUEST = (
    "The conversation has reached the token limit. Please summarize the conversation to generate a travel plan."
)


@dataclass(frozen=True)
class Limits:
    max_tool_calls: int = 60
    max_context_tokens: int = 30_000
    max_tokens_per_turn: int = 8192
    max_format_errors: int = 3
    summarize_at_limit: bool = False
    turn_timeout_s: float | None = None  # wall-clock limits (None: none)
    episode_timeout_s: float | None = None

    @classmethod
    def from_sampling(cls, sampling: SamplingParams, max_format_errors: int = 3) -> Limits:
        return cls(
            sampling.max_tool_calls,
            sampling.max_context_tokens,
            sampling.max_tokens_per_turn,
            max_format_errors,
            sampling.summarize_at_limit,
            sampling.turn_timeout_s,
            sampling.episode_timeout_s,
        )


@dataclass
class Episode:
    """The live state of one trajectory; `fork` copies it for an ARPO branch."""

    sample_index: int
    seed: int | None
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float | None]
    messages: list[dict[str, Any]]
    prompt_len: int
    tool_calls: int = 0
    turns: int = 0
    format_errors_in_row: int = 0
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    answer: str | None = None
    error: str | None = None
    timings: dict[str, float] = field(default_factory=lambda: {"generate_s": 0.0, "tool_s": 0.0})
    initial_entropy: float | None = None
    last_entropy: float | None = None
    parent: int | None = None
    branch_token: int | None = None
    # where the last environment segment begins (token index, message count before it) and whether
    # the turn before it was closed by the engine: what `summarize_at_limit` replaces
    env_start: int | None = None
    env_messages: int = 0
    env_closed: bool = True
    started: float = field(default_factory=time.perf_counter)
    query: TravelQuery | str | None = None  # what forced turns read their tool arguments from
    forced_cities: list[str] = field(default_factory=list)  # a forced multi-city episode's SearchCity result
    forced_shape: EpisodeShape | None = None  # a forced episode of the teacher's shape: its draws (episode_shapes)
    forced_rng: random.Random | None = None
    last_tool_output: str | None = None  # the last tool call's reply (what a forced episode reads cities from)
    deadline: float | None = None  # time.monotonic() at which the episode ends as `deadline`
    turn_timeout_s: float | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def arm(self, limits: Limits, group_deadline: float | None = None) -> None:
        """Start the episode's clock: its deadline is its own limit from now, or its group's if sooner."""
        ends = [] if group_deadline is None else [group_deadline]
        if limits.episode_timeout_s is not None:
            ends.append(time.monotonic() + limits.episode_timeout_s)
        self.deadline = min(ends) if ends else None
        self.turn_timeout_s = limits.turn_timeout_s

    def turn_budget(self) -> float | None:
        """Seconds the next turn may take (None: unbounded); ≤ 0 once the deadline has passed."""
        left = [] if self.turn_timeout_s is None else [self.turn_timeout_s]
        if self.deadline is not None:
            left.append(self.deadline - time.monotonic())
        return min(left) if left else None

    def cut(self, why: str) -> None:
        """End the episode at its deadline, keeping what it sampled so far."""
        self.finish_reason, self.error = "deadline", why

    def fork(self, sample_index: int, seed: int | None) -> Episode:
        child = copy.deepcopy(self)
        child.sample_index, child.seed = sample_index, seed
        child.parent, child.branch_token = self.sample_index, len(self.token_ids)
        return child


def turn_seed(seed: int | None, turn: int) -> int | None:
    """A distinct, reproducible seed per (sample, turn); sample i's base seed is `seed + i`."""
    return None if seed is None else (seed * 1_000_003 + turn) % (2**31 - 1)


class Agent:
    """Runs episodes of one policy (engine) against one sandbox (tool client)."""

    def __init__(
        self,
        engine: Engine,
        tools: ToolClient,
        *,
        tokenizer: Any = None,
        system: str | None = None,
        tool_names_: list[str] | None = None,
        fault_keys: bool = True,
        chat: ChatOptions | None = None,
    ) -> None:
        self.engine = engine
        self.tools = tools
        self.tokenizer = tokenizer if tokenizer is not None else engine.tokenizer
        if engine.token_level and self.tokenizer is None:
            raise ValueError("a token-level engine needs a tokenizer")
        self.tool_names = list(tool_names_) if tool_names_ is not None else tool_names()
        self.fault_keys = fault_keys
        # the model's conversation format (chat.py); a text engine's server applies its own template
        self.chat: Chat | None = None
        if self.tokenizer is not None and engine.token_level:
            self.chat = Chat.for_agent(self.tokenizer, chat, tool_names=self.tool_names, stop_ids=engine.stop_ids)
        self.system = system if system is not None else (self.chat.system_prompt() if self.chat else system_prompt())

    # -- building sequences ----------------------------------------------------------------

    def start(self, query: TravelQuery | str, sample_index: int = 0, seed: int | None = None) -> Episode:
        messages = [{"role": "system", "content": self.system}, {"role": "user", "content": user_message(query)}]
        ids: list[int] = []
        if self.chat is not None:
            messages = self.chat.opening(self.system, user_message(query))
            ids = self.chat.prompt_ids(messages)
        return Episode(
            sample_index=sample_index,
            seed=seed,
            token_ids=ids,
            loss_mask=[0] * len(ids),
            logprobs=[None] * len(ids),
            messages=messages,
            prompt_len=len(ids),
            query=query,
        )

    def segment(
        self, messages: list[dict[str, Any]], closed: bool, new: list[dict[str, Any]]
    ) -> tuple[list[int], list[dict[str, Any]]]:
        """What follows a sampled turn (the last of `messages`), with the messages it carries: the
        `new` environment messages, or, where the template cannot render two assistant turns in a row
        (roles must alternate), a user message saying the turn had no call and no answer."""
        if not new and not self.chat.renders_turns_in_a_row:
            new = [{"role": "user", "content": FORMAT_ERROR}]
        return self.chat.env_ids(messages, closed, new), new

    def context_limit(self, limits: Limits) -> int:
        cap = limits.max_context_tokens
        if self.engine.max_model_len:
            cap = min(cap, self.engine.max_model_len)
        return cap

    # -- one turn ----------------------------------------------------------------------------

    async def step(
        self, ep: Episode, sampling: SamplingParams, limits: Limits, request_id: str, top_logprobs: int | None = None
    ) -> None:
        """Sample one model turn, act on it, and append what the environment returns."""
        if ep.done:
            return
        if ep.deadline is not None and time.monotonic() >= ep.deadline:
            return ep.cut("the episode ran past its deadline")
        if not self.engine.token_level:
            if sampling.forced_turns is not None:
                ep.finish_reason, ep.error = "engine_error", "forced turns need a token-level engine"
                return
            return await self._step_text(ep, sampling, limits, request_id)
        try:
            if sampling.forced_turns is not None:
                return await self._step_forced(ep, sampling, limits, request_id)
            await self._step_tokens(ep, sampling, limits, request_id, top_logprobs)
        except ChatTemplateError as exc:  # a conversation the model's template refuses ends the episode
            ep.finish_reason, ep.error = "engine_error", f"chat template: {exc}"

    async def _step_tokens(
        self, ep: Episode, sampling: SamplingParams, limits: Limits, request_id: str, top_logprobs: int | None
    ) -> None:
        room = self.context_limit(limits) - len(ep.token_ids)
        if room <= 0:
            return await self._at_limit(ep, sampling, limits, request_id)
        max_tokens = min(limits.max_tokens_per_turn, room)
        params = TurnParams(
            max_tokens=max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            seed=turn_seed(ep.seed, ep.turns),
            top_logprobs=sampling.logprobs_top_k if top_logprobs is None else top_logprobs,
        )
        gen = await self._sample(ep, params, request_id)
        if gen is None:
            return
        self._append_sampled(ep, gen)
        closed = bool(gen.token_ids) and gen.token_ids[-1] in self.engine.stop_ids
        text = self.chat.decode(gen.token_ids)
        turn = self.chat.parse(text, self.tool_names)
        message, call_id = self.chat.assistant_message(text, turn, ep.tool_calls)
        ep.messages.append(
            {
                **message,
                "tokens": len(gen.token_ids),
                "policy_version": gen.policy_version,
                "generate_s": gen.stats.get("generate_s", 0.0),
            }
        )
        cut_by_context = gen.finish == "length" and max_tokens == room
        if turn.kind == "answer":
            ep.finish_reason, ep.answer = "answer", turn.answer
            return
        if cut_by_context:
            return await self._at_limit(ep, sampling, limits, request_id)
        if turn.kind == "format_error":
            ep.format_errors_in_row += 1
            if ep.format_errors_in_row >= limits.max_format_errors:
                ep.finish_reason = "format_error"
                return
            if not self._append_env(ep, *self.segment(ep.messages, closed, []), limits, closed):
                await self._at_limit(ep, sampling, limits, request_id, pending=(closed, len(ep.messages)))
            return
        ep.format_errors_in_row = 0
        if ep.tool_calls >= limits.max_tool_calls:
            ep.finish_reason = "tool_budget"
            return
        left = await self._call_tool(ep, turn, call_id, closed, limits)
        if left:
            await self._at_limit(ep, sampling, limits, request_id, pending=(closed, len(ep.messages) - len(left)))

    async def _call_tool(
        self, ep: Episode, turn: Turn, call_id: str | None, closed: bool, limits: Limits
    ) -> list[dict[str, Any]]:
        """Counts the turn's tool call, runs it and appends its reply (loss mask 0). Returns the reply's
        messages when they do not fit the context (kept in the record, not in the tokens), else []."""
        ep.tool_calls += 1
        output = await self._run_tool(ep, turn)
        ep.last_tool_output = output
        if output is None:
            return []
        ids, new = self.segment(ep.messages, closed, [self.chat.tool_message(output, call_id)])
        if self._append_env(ep, ids, new, limits, closed):
            return []
        ep.messages += new  # the record keeps what did not fit
        return new

    async def _step_forced(self, ep: Episode, sampling: SamplingParams, limits: Limits, request_id: str) -> None:
        """One turn of a forced episode (`SamplingParams.forced_turns`): exactly the forced number of
        tokens, then the next forced tool call on the real sandbox, or the answer after the last call."""
        forced = sampling.forced_turns
        room = self.context_limit(limits) - len(ep.token_ids)
        if room <= 0:
            ep.finish_reason = "context_limit"
            return
        calls, answer_tokens, turn_tokens = self._forced_shape(ep, forced, limits)
        answering = ep.tool_calls >= calls
        max_tokens = min(answer_tokens if answering else turn_tokens, limits.max_tokens_per_turn, room)
        params = TurnParams(
            max_tokens=max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            seed=turn_seed(ep.seed, ep.turns),
            top_logprobs=sampling.logprobs_top_k,
            ignore_stop=True,
        )
        gen = await self._sample(ep, params, request_id)
        if gen is None:
            return
        self._append_sampled(ep, gen)
        text = self.chat.decode(gen.token_ids)
        turn = Turn(kind="answer", answer=text) if answering else forced_call(ep.query, ep.tool_calls, ep.forced_cities)
        message, call_id = self.chat.assistant_message(text, turn, ep.tool_calls)
        ep.messages.append(
            {
                **message,
                "tokens": len(gen.token_ids),
                "policy_version": gen.policy_version,
                "generate_s": gen.stats.get("generate_s", 0.0),
                "forced": True,
            }
        )
        if answering:
            ep.finish_reason, ep.answer = "answer", text
            return
        if max_tokens == room:
            ep.finish_reason = "context_limit"
            return
        closed = bool(gen.token_ids) and gen.token_ids[-1] in self.engine.stop_ids
        if await self._call_tool(ep, turn, call_id, closed, limits):
            ep.finish_reason = "context_limit"
        elif turn.name == "SearchCity":
            ep.forced_cities = cities_found(ep.last_tool_output or "")

    def _forced_shape(self, ep: Episode, forced: ForcedTurns, limits: Limits) -> tuple[int, int, int]:
        """This turn's forced numbers: (tool calls, answer tokens, this tool turn's tokens), the recipe's fixed
        ones, or the teacher's shape drawn for the episode (its calls and answer once, each turn anew)."""
        if forced.shape == "fixed":
            return forced.tool_calls, forced.answer_tokens, forced.turn_tokens
        if ep.forced_shape is None:
            query_id = ep.query.id if isinstance(ep.query, TravelQuery) else str(ep.query)
            ep.forced_rng = shape_rng(ep.seed, query_id, ep.sample_index)
            ep.forced_shape = draw_episode(ep.forced_rng, limits.max_tool_calls)
        return ep.forced_shape.tool_calls, ep.forced_shape.answer_tokens, draw_turn(ep.forced_rng)

    async def _at_limit(
        self,
        ep: Episode,
        sampling: SamplingParams,
        limits: Limits,
        request_id: str,
        *,
        pending: tuple[bool, int] | None = None,
    ) -> None:
        """The context is full. Without `summarize_at_limit` the episode ends as context_limit;
        with it, the last message becomes `SUMMARY_REQUEST` and one more turn answers it.

        `pending`: an environment message did not fit after the last turn: (whether the engine
        closed that turn, the messages kept before it); it is the one replaced. Otherwise the last
        environment segment is (and a cut turn after it goes with it)."""
        if not limits.summarize_at_limit or ep.timings.get("summarized_at_limit"):
            ep.finish_reason = "context_limit"
            return
        cap = self.context_limit(limits)
        candidates = []
        if pending is not None:
            candidates.append((len(ep.token_ids), pending[1], pending[0]))
        if ep.env_start is not None:
            candidates.append((ep.env_start, ep.env_messages, ep.env_closed))
        request = [{"role": "user", "content": SUMMARY_REQUEST}]
        for cut, n_messages, closed in candidates:
            ids, _ = self.segment(ep.messages[:n_messages], closed, request)
            if cut + len(ids) < cap:
                break
        else:
            ep.finish_reason = "context_limit"  # not even the request fits
            return
        del ep.token_ids[cut:], ep.loss_mask[cut:], ep.logprobs[cut:]
        del ep.messages[n_messages:]
        ep.messages += request
        ep.token_ids += ids
        ep.loss_mask += [0] * len(ids)
        ep.logprobs += [None] * len(ids)
        ep.timings["summarized_at_limit"] = 1.0
        room = cap - len(ep.token_ids)
        params = TurnParams(
            max_tokens=min(limits.max_tokens_per_turn, room),
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            seed=turn_seed(ep.seed, ep.turns),
            top_logprobs=sampling.logprobs_top_k,
        )
        gen = await self._sample(ep, params, request_id)
        if gen is None:
            return
        self._append_sampled(ep, gen)
        text = self.chat.decode(gen.token_ids)
        ep.messages.append(
            {
                "role": "assistant",
                "content": text,
                "tokens": len(gen.token_ids),
                "policy_version": gen.policy_version,
                "generate_s": gen.stats.get("generate_s", 0.0),
            }
        )
        ep.finish_reason, ep.answer = "answer", summary_answer(text, self.tool_names)

    async def _sample(self, ep: Episode, params: TurnParams, request_id: str) -> Generation | None:
        t0 = time.perf_counter()
        budget = ep.turn_budget()
        if budget is not None and budget <= 0:
            ep.cut("the episode ran past its deadline")
            return None
        try:
            # a turn past its budget is cancelled: the engine aborts its request (vLLM does on cancel)
            gen = await asyncio.wait_for(self.engine.generate(ep.token_ids, params, request_id=request_id), budget)
        except TimeoutError:
            ep.cut(f"a turn ran past its {budget:.1f} s budget and was aborted")
            return None
        except (EngineError, Exception) as exc:  # noqa: BLE001 - any engine failure ends the episode
            ep.finish_reason, ep.error = "engine_error", f"engine: {type(exc).__name__}: {exc}"
            return None
        elapsed = time.perf_counter() - t0
        gen.stats.setdefault("generate_s", elapsed)
        ep.timings["generate_s"] += elapsed
        ep.turns += 1
        ep.versions.append(gen.policy_version)
        if gen.top_logprobs:
            ep.last_entropy = normalized_entropy(gen.top_logprobs)
            if ep.initial_entropy is None:
                ep.initial_entropy = ep.last_entropy
        return gen

    def _append_sampled(self, ep: Episode, gen: Generation) -> None:
        ep.token_ids += gen.token_ids
        ep.loss_mask += [1] * len(gen.token_ids)
        if gen.logprobs is not None and len(gen.logprobs) == len(gen.token_ids):
            ep.logprobs += list(gen.logprobs)
        else:
            ep.logprobs += [None] * len(gen.token_ids)

    def _append_env(self, ep: Episode, ids: list[int], new: list[dict[str, Any]], limits: Limits, closed: bool) -> bool:
        """Append what the environment says after a turn; False (nothing appended) when it does
        not fit or leaves no room to reply to it."""
        if len(ep.token_ids) + len(ids) >= self.context_limit(limits):
            return False
        ep.env_start, ep.env_messages, ep.env_closed = len(ep.token_ids), len(ep.messages), closed
        ep.messages += new
        ep.token_ids += ids
        ep.loss_mask += [0] * len(ids)
        ep.logprobs += [None] * len(ids)
        return True

    async def _run_tool(self, ep: Episode, turn) -> str | None:
        """The tool's output text (or the error the model is told), None when the sandbox failed."""
        if not turn.runnable:
            return turn.error
        t0 = time.perf_counter()
        key = f"{ep.sample_index}/{ep.tool_calls}" if self.fault_keys else None
        try:
            result = await self.tools.call(turn.name, turn.arguments, fault_key=key)
        except ToolServiceError as exc:
            ep.finish_reason, ep.error = "engine_error", f"sandbox: {exc}"
            return None
        ep.timings["tool_s"] += time.perf_counter() - t0
        ep.timings["tool_faults"] = ep.timings.get("tool_faults", 0.0) + float(result.fault_injected)
        return result.text

    # -- text engines (no ids) ----------------------------------------------------------------

    async def _step_text(self, ep: Episode, sampling: SamplingParams, limits: Limits, request_id: str) -> None:
        """Chat-in/text-out: messages are the record; context is counted by rendering them
        with the tokenizer's template when one is available."""
        used = self._count_chat(ep.messages)
        room = limits.max_context_tokens - used
        summary = False
        if room <= 0 and limits.summarize_at_limit and not ep.timings.get("summarized_at_limit") and ep.turns:
            # as the reference: the last message's content becomes the request, one more call answers
            ep.messages[-1] = {**ep.messages[-1], "content": SUMMARY_REQUEST}
            ep.timings["summarized_at_limit"] = 1.0
            summary = True
            room = limits.max_context_tokens - self._count_chat(ep.messages)
        if room <= 0:
            ep.finish_reason = "context_limit"
            return
        params = TurnParams(
            max_tokens=min(limits.max_tokens_per_turn, room),
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            seed=turn_seed(ep.seed, ep.turns),
        )
        t0 = time.perf_counter()
        chat = [{"role": m["role"], "content": m["content"]} for m in ep.messages]
        try:
            gen = await self.engine.generate_chat(chat, params, request_id=request_id)
        except Exception as exc:  # noqa: BLE001
            ep.finish_reason, ep.error = "engine_error", f"engine: {type(exc).__name__}: {exc}"
            return
        ep.timings["generate_s"] += time.perf_counter() - t0
        ep.turns += 1
        text = gen.text or ""
        ep.messages.append({"role": "assistant", "content": text, "policy_version": gen.policy_version})
        turn = parse_turn(text, self.tool_names)
        if summary:
            ep.finish_reason, ep.answer = "answer", summary_answer(text, self.tool_names)
        elif turn.kind == "answer":
            ep.finish_reason, ep.answer = "answer", turn.answer
        elif turn.kind == "format_error":
            ep.format_errors_in_row += 1
            if ep.format_errors_in_row >= limits.max_format_errors:
                ep.finish_reason = "format_error"
        elif ep.tool_calls >= limits.max_tool_calls:
            ep.finish_reason = "tool_budget"
        else:
            ep.format_errors_in_row = 0
            ep.tool_calls += 1
            output = await self._run_tool(ep, turn)
            if output is not None:
                ep.messages.append({"role": "user", "content": tool_response(output)})

    def _count_chat(self, messages: list[dict[str, Any]]) -> int:
        if self.tokenizer is None:
            return sum(len(m["content"]) // 4 for m in messages)  # no tokenizer: a rough 4 chars/token
        chat = [{"role": m["role"], "content": m["content"]} for m in messages]
        return len(
            self.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)[
                "input_ids"
            ]
        )

    # -- whole episodes ----------------------------------------------------------------------

    async def run_episode(
        self, ep: Episode, sampling: SamplingParams, limits: Limits, request_id: str | None = None
    ) -> Episode:
        request_id = request_id or uuid.uuid4().hex
        if ep.deadline is None:
            ep.arm(limits)
        while not ep.done:
            await self.step(ep, sampling, limits, f"{request_id}-{ep.sample_index}")
        return ep

    async def run(
        self,
        query: TravelQuery | str,
        sampling: SamplingParams | None = None,
        limits: Limits | None = None,
        *,
        sample_index: int = 0,
        **meta: Any,
    ) -> Trajectory:
        sampling = sampling or SamplingParams()
        limits = limits or Limits.from_sampling(sampling)
        seed = None if sampling.seed is None else sampling.seed + sample_index
        ep = self.start(query, sample_index, seed)
        await self.run_episode(ep, sampling, limits)
        return to_trajectory(ep, query if isinstance(query, TravelQuery) else None, **meta)


def forced_call(query: TravelQuery | str | None, index: int, cities: list[str] | None = None) -> Turn:
    """The `index`-th tool call of a forced episode: the tools a planner would use for the query, in turn.
    One city: flights, lodging, restaurants, sights, driving. A state (multi-city): its cities first,
    then for each city found (`cities`, from that search) flights to it, lodging, restaurants and
    sights, so the replies are as long as a planner's are; with no city found, the state again."""
    if not isinstance(query, TravelQuery):
        return Turn(kind="tool_call", name="SearchCity", arguments={"state": str(query or "")})
    if query.visiting_city_number > 1:
        if index == 0 or not cities:
            return Turn(kind="tool_call", name="SearchCity", arguments={"state": query.dest})
        city = cities[((index - 1) // 4) % len(cities)]
        calls = (
            ("SearchFlight", {"departure": query.org, "destination": city, "date": query.date[0]}),
            ("SearchAccommodation", {"city": city}),
            ("SearchRestaurant", {"city": city}),
            ("SearchAttraction", {"city": city}),
        )
        name, arguments = calls[(index - 1) % len(calls)]
        return Turn(kind="tool_call", name=name, arguments=arguments)
    calls = (
        ("SearchFlight", {"departure": query.org, "destination": query.dest, "date": query.date[0]}),
        ("SearchAccommodation", {"city": query.dest}),
        ("SearchRestaurant", {"city": query.dest}),
        ("SearchAttraction", {"city": query.dest}),
        ("GoogleDistanceMatrix", {"departure": query.org, "destination": query.dest, "mode": "driving"}),
    )
    name, arguments = calls[index % len(calls)]
    return Turn(kind="tool_call", name=name, arguments=arguments)


def cities_found(reply: str) -> list[str]:
    """The cities a SearchCity reply lists ("… found the following N cities:\nA, B, C"); none when it
    found nothing or reads otherwise."""
    head, sep, names = reply.rpartition(":")
    if not sep or "cit" not in head:
        return []
    return [c.strip() for c in names.replace("\n", ",").split(",") if c.strip()]


def summary_answer(text: str, tools: list[str]) -> str:
    """The answer of a summarizing turn: inside `<answer>` tags when it has them (as any answer),
    else the whole reply, as the reference takes it."""
    turn = parse_turn(text, tools)
    return turn.answer if turn.kind == "answer" and turn.answer is not None else text.strip()


def to_trajectory(
    ep: Episode,
    query: TravelQuery | None = None,
    *,
    run_id: str = "adhoc",
    task_id: str = "adhoc",
    prompt_id: str = "adhoc",
    group_id: str | None = None,
    epoch: int = 1,
    step: int | None = None,
    reward_kind: str = "sum",
    preference_penalty: float = 0.0,
    eval_mode: str = "strict",
    policy_version: int | None = None,
) -> Trajectory:
    timings = dict(ep.timings)
    timings["total_s"] = time.perf_counter() - ep.started
    timings["ended_at"] = time.time()  # wall clock: the learner splits a step's wait by it (timesplit.py)
    timings["turns"] = float(ep.turns)
    timings["prompt_tokens"] = float(ep.prompt_len)
    timings["sampled_tokens"] = float(sum(ep.loss_mask))
    if ep.versions:
        timings["policy_version_last"] = float(max(ep.versions))
    if ep.parent is not None:
        timings["arpo_parent"] = float(ep.parent)
        timings["arpo_branch_token"] = float(ep.branch_token or 0)
    # The oldest weights that sampled any turn: what staleness is measured against.
    version = min(ep.versions) if ep.versions else (policy_version or 0)
    return Trajectory(
        run_id=run_id,
        task_id=task_id,
        prompt_id=prompt_id,
        group_id=group_id or prompt_id,
        sample_index=ep.sample_index,
        policy_version=version,
        messages=ep.messages,
        token_ids=ep.token_ids,
        loss_mask=ep.loss_mask,
        logprobs=ep.logprobs,
        finish_reason=ep.finish_reason or "engine_error",
        tool_calls=ep.tool_calls,
        answer=ep.answer,
        timings=timings,
        query=query,
        epoch=epoch,
        step=step,
        reward_kind=reward_kind,
        preference_penalty=preference_penalty,
        eval_mode=eval_mode,
        error=ep.error,
    )
