"""The agent loop's semantics, with a scripted engine replaying model outputs and the real tools."""

from __future__ import annotations

import asyncio

from services.common.schemas import SamplingParams
from services.rollout.agent import SUMMARY_REQUEST, Agent, Limits
from services.rollout.engines.base import EngineError
from services.rollout.engines.scripted import ScriptedEngine, scripted_logprob
from services.rollout.protocol import format_answer, format_tool_call, tool_response
from services.rollout.tools import HttpToolClient

QUERY = "Plan a 3-day trip from Sarasota to Chicago for 1 person, March 22-24 2022, budget $1900."
CITY_CALL = format_tool_call("SearchCity", {"state": "Illinois"}, think="which cities")
REST_CALL = format_tool_call("SearchRestaurant", {"city": "Rockford"}, think="food")
ANSWER = format_answer("Day 1:\nCurrent City: Chicago", think="done")


def run(agent, sampling=None, limits=None, **kw):
    return asyncio.run(agent.run(QUERY, sampling or SamplingParams(seed=7), limits, **kw))


def make(tokenizer, tools, script, **kw):
    engine = ScriptedEngine(tokenizer, script, **kw)
    return Agent(engine, tools), engine


def test_tool_call_then_answer_keeps_sampled_ids_mask_and_logprobs(tokenizer, local_tools, toolbox):
    agent, engine = make(tokenizer, local_tools, [CITY_CALL, ANSWER])
    traj = run(agent)
    assert traj.finish_reason == "answer" and traj.answer == "Day 1:\nCurrent City: Chicago"
    assert traj.tool_calls == 1
    assert len(traj.token_ids) == len(traj.loss_mask) == len(traj.logprobs)
    # Each engine call received exactly the sequence so far (prefix growth, no re-rendering).
    first, second = engine.calls
    assert traj.token_ids[: second["prompt_len"]] == second["prompt_ids"]
    assert second["prompt_ids"][: first["prompt_len"]] == first["prompt_ids"]
    # Mask 1 exactly on the sampled ids; their log-probs are the engine's, at their positions.
    sampled = [i for i, m in enumerate(traj.loss_mask) if m]
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    call_ids = tokenizer.encode(CITY_CALL, add_special_tokens=False) + [im_end]
    answer_ids = tokenizer.encode(ANSWER, add_special_tokens=False) + [im_end]
    assert [traj.token_ids[i] for i in sampled] == call_ids + answer_ids
    assert all(traj.logprobs[i] == scripted_logprob(i) for i in sampled)
    assert all(traj.logprobs[i] is None for i, m in enumerate(traj.loss_mask) if not m)
    # What the environment appended (mask 0) is the ChatML user turn with the real tool text.
    tool_text = toolbox.call("SearchCity", {"state": "Illinois"}).text
    env = [t for t, m in zip(traj.token_ids[first["prompt_len"] :], traj.loss_mask[first["prompt_len"] :]) if not m]
    assert tokenizer.decode(env) == f"\n<|im_start|>user\n{tool_response(tool_text)}<|im_end|>\n<|im_start|>assistant\n"
    assert [m["role"] for m in traj.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert traj.messages[3]["content"] == tool_response(tool_text)
    assert traj.timings["turns"] == 2 and traj.timings["tool_s"] > 0


def test_canonical_outputs_match_a_rendering_of_the_chat(tokenizer, local_tools):
    """When the model happens to sample the canonical tokenization, our ids equal the chat template's."""
    agent, _ = make(tokenizer, local_tools, [CITY_CALL, ANSWER])
    traj = run(agent)
    chat = [{"role": m["role"], "content": m["content"]} for m in traj.messages]
    rendered = tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]
    assert traj.token_ids == rendered[: len(traj.token_ids)]
    assert len(rendered) - len(traj.token_ids) == 1  # only the template's trailing "\n" after <|im_end|>


def test_non_canonical_sampled_ids_are_kept_where_re_rendering_would_change_them(tokenizer, local_tools):
    """A model may sample a word piece by piece ("Sear"+"ch"+"City") or spaces one at a time;
    decoding and re-encoding the text merges them. The trajectory keeps what was sampled."""
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pieces = []
    for chunk in CITY_CALL.replace("SearchCity", "\0").split("\0"):
        pieces.append(tokenizer.encode(chunk, add_special_tokens=False))
    odd = pieces[0] + [t for ch in "SearchCity" for t in tokenizer.encode(ch, add_special_tokens=False)] + pieces[1]
    odd += tokenizer.encode("  ", add_special_tokens=False)[:0] + tokenizer.encode(" ", add_special_tokens=False) * 2
    odd.append(im_end)
    assert tokenizer.decode(odd[:-1]) == CITY_CALL + "  "
    canonical = tokenizer.encode(CITY_CALL + "  ", add_special_tokens=False)
    assert odd[:-1] != canonical  # the same text, other ids

    agent, engine = make(tokenizer, local_tools, [odd, ANSWER])
    traj = run(agent)
    assert traj.finish_reason == "answer" and traj.tool_calls == 1  # the call was understood
    start = engine.calls[0]["prompt_len"]
    assert traj.token_ids[start : start + len(odd)] == odd
    chat = [{"role": m["role"], "content": m["content"]} for m in traj.messages]
    rendered = tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]
    assert rendered[: len(traj.token_ids)] != traj.token_ids  # re-rendering would have trained on other tokens


def test_format_error_burns_the_turn_and_three_in_a_row_end_the_trajectory(tokenizer, local_tools):
    agent, engine = make(tokenizer, local_tools, ["I think I will plan.", "Still thinking.", "Hmm."])
    traj = run(agent)
    assert traj.finish_reason == "format_error" and traj.answer is None and traj.tool_calls == 0
    # Burned turn: nothing fed back, just a new assistant turn after the closed one.
    a, b = engine.calls[0], engine.calls[1]
    appended = b["prompt_ids"][a["prompt_len"] :]
    said = tokenizer.encode("I think I will plan.", add_special_tokens=False) + [
        tokenizer.convert_tokens_to_ids("<|im_end|>")
    ]
    assert appended[: len(said)] == said
    assert tokenizer.decode(appended[len(said) :]) == "\n<|im_start|>assistant\n"
    assert [m["role"] for m in traj.messages[2:]] == ["assistant"] * 3


def test_a_valid_turn_resets_the_format_error_count(tokenizer, local_tools):
    agent, _ = make(tokenizer, local_tools, ["oops", "oops", CITY_CALL, "oops", "oops", ANSWER])
    traj = run(agent)
    assert traj.finish_reason == "answer" and traj.tool_calls == 1


def test_unknown_tool_and_bad_json_answer_with_errors_and_count_as_calls(tokenizer, toolbox):
    calls = []

    class Recording:
        async def call(self, name, arguments, *, fault_key=None):
            calls.append(name)
            return toolbox.call(name, arguments)

    script = [
        '<think>x</think><tool_call>{"name": "BookHotel", "arguments": {}}</tool_call>',
        "<think>x</think><tool_call>{oops}</tool_call>",
        ANSWER,
    ]
    agent, _ = make(tokenizer, Recording(), script)
    traj = run(agent)
    assert calls == [] and traj.tool_calls == 2 and traj.finish_reason == "answer"
    responses = [m["content"] for m in traj.messages if m["role"] == "user"][1:]
    assert responses == [
        tool_response("Tool BookHotel not found, please rethink your tool call and try again."),
        tool_response(
            "Error calling tool: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"
        ),
    ]


def test_tool_budget_stops_before_running_the_call_over_budget(tokenizer, local_tools):
    agent, engine = make(tokenizer, local_tools, [CITY_CALL, REST_CALL, CITY_CALL, ANSWER])
    traj = run(agent, SamplingParams(max_tool_calls=2, seed=1))
    assert traj.finish_reason == "tool_budget" and traj.tool_calls == 2 and len(engine.calls) == 3
    assert traj.token_ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")  # the over-budget turn is kept, closed


def test_turn_size_is_the_room_left_and_a_cut_turn_is_a_context_limit(tokenizer, local_tools):
    agent, engine = make(tokenizer, local_tools, [CITY_CALL, "<think>" + "long " * 3000])
    prompt_len = len(agent.start(QUERY).token_ids)
    limit = prompt_len + 350  # room for the call and the Illinois city list, not for a long reply
    traj = run(agent, SamplingParams(max_context_tokens=limit, max_tokens_per_turn=300, seed=3))
    assert engine.calls[0]["params"].max_tokens == 300  # the cap, while the room is larger
    second = engine.calls[1]
    assert second["params"].max_tokens == limit - second["prompt_len"] < 300  # the room, once smaller
    assert traj.finish_reason == "context_limit" and len(traj.token_ids) == limit


def test_a_tool_response_that_does_not_fit_ends_with_context_limit(tokenizer, local_tools):
    agent, engine = make(tokenizer, local_tools, [REST_CALL, ANSWER])
    prompt_len = len(agent.start(QUERY).token_ids)
    traj = run(agent, SamplingParams(max_context_tokens=prompt_len + 100, seed=3))
    assert traj.finish_reason == "context_limit" and len(engine.calls) == 1
    assert len(traj.token_ids) <= prompt_len + 100 and traj.messages[-1]["role"] == "user"


def test_at_the_limit_the_reference_ending_asks_for_a_summary_and_scores_its_answer(tokenizer, local_tools):
    # the restaurant list does not fit: it is replaced by the request, and one more call answers it
    agent, engine = make(tokenizer, local_tools, [REST_CALL, ANSWER])
    prompt_len = len(agent.start(QUERY).token_ids)
    limit = prompt_len + 160
    traj = run(agent, SamplingParams(max_context_tokens=limit, seed=3, summarize_at_limit=True))
    assert traj.finish_reason == "answer" and traj.answer == "Day 1:\nCurrent City: Chicago"
    assert traj.timings["summarized_at_limit"] == 1.0 and len(engine.calls) == 2
    assert [m["role"] for m in traj.messages[2:]] == ["assistant", "user", "assistant"]
    assert traj.messages[3]["content"] == SUMMARY_REQUEST
    second = engine.calls[1]
    env = tokenizer.decode(second["prompt_ids"][engine.calls[0]["prompt_len"] :])
    assert env.endswith(f"<|im_end|>\n<|im_start|>user\n{SUMMARY_REQUEST}<|im_end|>\n<|im_start|>assistant\n")
    assert second["params"].max_tokens == limit - second["prompt_len"]
    # the summary's tokens are the policy's: mask 1, with their log-probs; the request's are not
    answer_ids = tokenizer.encode(ANSWER, add_special_tokens=False)
    assert traj.token_ids[second["prompt_len"] : second["prompt_len"] + len(answer_ids)] == answer_ids
    assert all(traj.loss_mask[second["prompt_len"] :]) and not any(
        traj.loss_mask[second["prompt_len"] - 10 : second["prompt_len"]]
    )
    # off (the default), the same episode ends with no answer
    agent, engine = make(tokenizer, local_tools, [REST_CALL, ANSWER])
    traj = run(agent, SamplingParams(max_context_tokens=limit, seed=3))
    assert traj.finish_reason == "context_limit" and traj.answer is None and len(engine.calls) == 1


def test_a_cut_turn_goes_with_the_message_before_it_and_an_untagged_summary_is_the_answer(tokenizer, local_tools):
    plan = "Day 1:\nCurrent City: from Sarasota to Chicago"
    agent, engine = make(tokenizer, local_tools, [CITY_CALL, "<think>" + "long " * 3000, plan])
    prompt_len = len(agent.start(QUERY).token_ids)
    limit = prompt_len + 350
    traj = run(
        agent, SamplingParams(max_context_tokens=limit, max_tokens_per_turn=300, seed=3, summarize_at_limit=True)
    )
    assert traj.finish_reason == "answer" and traj.answer == plan  # no tags: the whole reply, as the reference
    assert len(engine.calls) == 3
    # the city list and the cut turn are gone: the request follows the tool call directly
    third = tokenizer.decode(engine.calls[2]["prompt_ids"])
    assert "long long" not in third and "Rockford" not in third
    assert third.endswith(
        f"</tool_call><|im_end|>\n<|im_start|>user\n{SUMMARY_REQUEST}<|im_end|>\n<|im_start|>assistant\n"
    )
    assert len(traj.token_ids) <= limit
    assert [m["role"] for m in traj.messages[2:]] == ["assistant", "user", "assistant"]


def test_the_summary_is_asked_for_once(tokenizer, local_tools):
    # the summarizing turn is itself cut by the limit: the episode ends there, it does not ask again,
    # and the reply, cut as it is, is the answer (the reference scores whatever the last call said)
    agent, engine = make(tokenizer, local_tools, [REST_CALL, "<think>" + "long " * 3000])
    prompt_len = len(agent.start(QUERY).token_ids)
    traj = run(agent, SamplingParams(max_context_tokens=prompt_len + 160, seed=3, summarize_at_limit=True))
    assert len(engine.calls) == 2 and traj.finish_reason == "answer"
    assert traj.answer.startswith("<think>") and traj.timings["summarized_at_limit"] == 1.0


def test_engine_failure_is_an_engine_error_with_its_message(tokenizer, local_tools):
    agent, _ = make(tokenizer, local_tools, [CITY_CALL, EngineError("core died")])
    traj = run(agent)
    assert traj.finish_reason == "engine_error" and "core died" in traj.error and traj.tool_calls == 1


def test_unreachable_sandbox_is_an_engine_error_after_retries(tokenizer):
    from services.common.redis import free_port

    tools = HttpToolClient(f"http://127.0.0.1:{free_port()}", timeout_s=1, retries=1, backoff_s=0.01)
    agent, _ = make(tokenizer, tools, [CITY_CALL, ANSWER])
    traj = run(agent)
    assert traj.finish_reason == "engine_error" and traj.error.startswith("sandbox:") and "2 times" in traj.error


def test_seeds_differ_per_turn_and_per_sample_and_repeat_across_runs(tokenizer, local_tools):
    seeds = []
    for sample in (0, 1, 0):
        agent, engine = make(tokenizer, local_tools, [CITY_CALL, ANSWER])
        run(agent, SamplingParams(seed=11), sample_index=sample)
        seeds.append([c["params"].seed for c in engine.calls])
    assert seeds[0] == seeds[2] and seeds[0] != seeds[1] and len(set(seeds[0])) == 2


def test_max_tokens_per_turn_cut_parses_what_was_sampled(tokenizer, local_tools):
    """A turn cut by the per-turn cap (not by context) is read as it stands; here a format error,
    and the unfinished message is closed with <|im_end|> (mask 0) before the next turn."""
    agent, engine = make(tokenizer, local_tools, ["<think>" + "x " * 50, ANSWER])
    traj = run(agent, SamplingParams(max_tokens_per_turn=20, seed=1), Limits(max_tokens_per_turn=20))
    assert traj.finish_reason == "answer"
    second = engine.calls[1]["prompt_ids"]
    cut_end = engine.calls[0]["prompt_len"] + 20
    assert second[cut_end] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert traj.loss_mask[cut_end] == 0 and traj.loss_mask[cut_end - 1] == 1


def test_a_weight_update_lets_in_flight_turns_finish_and_holds_new_ones_until_loaded(tokenizer):
    from services.rollout.engines.base import TurnParams

    events = []

    class Slow(ScriptedEngine):
        async def _generate(self, prompt_ids, params, request_id):
            events.append(f"start {request_id}")
            await asyncio.sleep(0.2)
            events.append(f"end {request_id}")
            return await super()._generate(prompt_ids, params, request_id)

        async def _load_weights(self, path):
            events.append("load")
            await asyncio.sleep(0.2)
            events.append("loaded")

    engine = Slow(tokenizer, lambda ids, turn: ANSWER)

    async def scenario():
        first = asyncio.create_task(engine.generate([1, 2], TurnParams(max_tokens=64), "a"))
        await asyncio.sleep(0.05)
        update = asyncio.create_task(engine.update_weights("/weights/v1", 1))
        await asyncio.sleep(0.05)
        second = asyncio.create_task(engine.generate([1, 2], TurnParams(max_tokens=64), "b"))
        return await first, await update, await second

    first, timing, second = asyncio.run(scenario())
    assert events == ["start a", "end a", "load", "loaded", "start b", "end b"]
    assert (first.policy_version, second.policy_version, engine.policy_version) == (0, 1, 1)
    assert timing["drain_s"] >= 0.1


def test_forced_turns_take_the_set_shape_with_real_tools_whatever_is_sampled(tokenizer, local_tools, toolbox):
    """A benchmark's forced episode: every turn exactly its tokens (the engine's stop ignored), the first
    turns read as the query's tool calls on the real sandbox, the last as the answer."""
    from services.common.schemas import ForcedTurns, TravelQuery
    from services.rollout.agent import forced_call

    query = TravelQuery(
        org="Sarasota",
        dest="Chicago",
        days=3,
        visiting_city_number=1,
        date=["2022-03-22", "2022-03-23", "2022-03-24"],
        people_number=1,
        budget=1900,
    )
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    engine = ScriptedEngine(tokenizer, lambda ids, turn: [im_end] * 50, append_stop=False)
    agent = Agent(engine, local_tools)
    sampling = SamplingParams(seed=7, forced_turns=ForcedTurns(tool_calls=3, turn_tokens=20, answer_tokens=30))
    traj = asyncio.run(agent.run(query, sampling))
    assert traj.finish_reason == "answer" and traj.tool_calls == 3
    assert [c["params"].max_tokens for c in engine.calls] == [20, 20, 20, 30]
    assert all(c["params"].ignore_stop for c in engine.calls)
    assert sum(traj.loss_mask) == 3 * 20 + 30
    call = forced_call(query, 1)
    assert (call.name, call.arguments) == ("SearchAccommodation", {"city": "Chicago"})
    tool_text = toolbox.call(call.name, call.arguments).text
    assert tool_response(tool_text) in [m["content"] for m in traj.messages if m["role"] != "assistant"]


def test_a_forced_multi_city_episode_searches_the_cities_its_state_search_found(tokenizer, local_tools, toolbox):
    """A state's cities first, then flights, lodging, restaurants and sights for each city found: replies as
    long as a planner's, not the 'nothing matched' a state name gets from a city search."""
    from services.common.schemas import ForcedTurns, TravelQuery
    from services.rollout.agent import cities_found

    query = TravelQuery(
        org="Sarasota",
        dest="Texas",
        days=5,
        visiting_city_number=2,
        date=["2022-03-22", "2022-03-23", "2022-03-24", "2022-03-25", "2022-03-26"],
        people_number=1,
        budget=4000,
    )
    cities = cities_found(toolbox.call("SearchCity", {"state": "Texas"}).text)
    assert len(cities) >= 2 and all(c and "," not in c for c in cities)
    engine = ScriptedEngine(tokenizer, lambda ids, turn: [1] * 8, append_stop=False)
    sampling = SamplingParams(seed=7, forced_turns=ForcedTurns(tool_calls=6, turn_tokens=8, answer_tokens=8))
    traj = asyncio.run(Agent(engine, local_tools).run(query, sampling))
    replies = [m["content"] for m in traj.messages if m["role"] not in ("assistant", "system")][1:]  # after the query
    assert traj.finish_reason == "answer" and traj.tool_calls == 6
    assert len(replies) == 6 and "found the following" in replies[0]
    first, second = cities[0], cities[1]
    expected = [
        ("SearchFlight", {"departure": "Sarasota", "destination": first, "date": "2022-03-22"}),
        ("SearchAccommodation", {"city": first}),
        ("SearchRestaurant", {"city": first}),
        ("SearchAttraction", {"city": first}),
        ("SearchFlight", {"departure": "Sarasota", "destination": second, "date": "2022-03-22"}),
    ]
    assert replies[1:] == [tool_response(toolbox.call(name, args).text) for name, args in expected]
    assert cities_found("There is no city in Atlantis.") == []


def test_without_forced_turns_the_stop_token_ends_the_turn(tokenizer, local_tools):
    agent, engine = make(tokenizer, local_tools, [CITY_CALL, ANSWER])
    run(agent)
    assert not any(c["params"].ignore_stop for c in engine.calls)
