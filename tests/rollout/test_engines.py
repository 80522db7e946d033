"""The transformers engine for real on a tiny Qwen2: seeds, the sampler's log-probs, batching, weight reload."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from services.rollout.engines.base import EngineError, TurnParams
from services.rollout.engines.hf import TransformersEngine


@pytest.fixture(scope="module")
def engine(tiny_model):
    return TransformersEngine(tiny_model, max_model_len=2048)


PROMPT = [151644, 872, 198, 6023, 151645, 198, 151644, 77091, 198]


def gen(engine, *params, prompt=PROMPT):
    async def go():
        return await asyncio.gather(*(engine.generate(prompt, p) for p in params))

    return asyncio.run(go())


def test_same_seed_same_ids_other_seed_other_ids_and_batched(engine):
    before = len(engine.batches)
    a, b, c = gen(
        engine, TurnParams(max_tokens=12, seed=1), TurnParams(max_tokens=12, seed=1), TurnParams(max_tokens=12, seed=2)
    )
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids
    assert engine.batches[before:] == [3]  # one batch for the three concurrent requests
    assert len(a.token_ids) == 12 and a.finish == "length"


def _forward_logits(engine, prompt: list[int], sampled: list[int]) -> torch.Tensor:
    """The model's (HF forward) logits at the positions that sampled `sampled` after `prompt`."""
    with torch.inference_mode():
        logits = engine.model(torch.tensor([prompt + sampled])).logits[0].float()
    return logits[len(prompt) - 1 : -1]


def _of(logprobs: torch.Tensor, ids: list[int]) -> torch.Tensor:
    return logprobs.gather(1, torch.tensor(ids)[:, None])[:, 0]


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_logprobs_are_of_the_tempered_distribution_the_tokens_were_drawn_from(engine, temperature):
    (g,) = gen(engine, TurnParams(max_tokens=16, seed=3, temperature=temperature, top_logprobs=5))
    logits = _forward_logits(engine, PROMPT, g.token_ids)
    tempered = torch.log_softmax(logits / temperature, -1)
    got = torch.tensor(g.logprobs)
    assert (got - _of(tempered, g.token_ids)).abs().max() < 1e-4
    if temperature != 1.0:  # the check tells the two apart: the untempered log-probs are far off
        assert (got - _of(torch.log_softmax(logits, -1), g.token_ids)).abs().max() > 1e-2
    # the alternatives are that distribution's five most probable ids with their log-probs
    values, ids = tempered[0].topk(5)
    assert sorted(g.top_logprobs[0]) == sorted(ids.tolist())
    assert [g.top_logprobs[0][i] for i in ids.tolist()] == pytest.approx(values.tolist(), abs=1e-4)
    assert max(g.top_logprobs[0].values()) >= g.logprobs[0]


def test_a_top_p_cut_records_the_renormalized_nucleus_and_greedy_the_models_own(engine):
    cut, greedy = gen(
        engine,
        TurnParams(max_tokens=16, seed=3, temperature=0.7, top_p=0.3, top_logprobs=20),
        TurnParams(max_tokens=8, temperature=0.0),
    )
    tempered = torch.log_softmax(_forward_logits(engine, PROMPT, cut.token_ids) / 0.7, -1)
    probs, order = tempered.exp().sort(-1, descending=True)
    kept = probs.cumsum(-1) - probs < 0.3  # the nucleus: tokens with less than top_p before them
    mass = (probs * kept).sum(-1)
    assert (torch.tensor(cut.logprobs) - (_of(tempered, cut.token_ids) - mass.log())).abs().max() < 1e-4
    assert all(len(row) == int(k) for row, k in zip(cut.top_logprobs, kept.sum(-1).clamp(max=20)))
    assert sorted(cut.top_logprobs[0]) == sorted(order[0, : int(kept[0].sum())].tolist()[:20])
    raw = torch.log_softmax(_forward_logits(engine, PROMPT, greedy.token_ids), -1)
    assert greedy.token_ids == raw.argmax(-1).tolist()
    assert (torch.tensor(greedy.logprobs) - _of(raw, greedy.token_ids)).abs().max() < 1e-4


def test_rows_of_different_lengths_in_one_batch_match_their_solo_runs(engine):
    short = PROMPT[-3:]
    solo = gen(engine, TurnParams(max_tokens=6, seed=9), prompt=short)[0]

    async def both():
        return await asyncio.gather(
            engine.generate(short, TurnParams(max_tokens=6, seed=9)),
            engine.generate(PROMPT, TurnParams(max_tokens=9, seed=4)),
        )

    batched, other = asyncio.run(both())
    assert batched.token_ids == solo.token_ids and len(other.token_ids) == 9
    assert batched.logprobs == pytest.approx(solo.logprobs, abs=1e-4)


def test_weight_reload_changes_the_policy_and_version(engine, tiny_model, tmp_path):
    from services.models import tiny_qwen2

    other = tiny_qwen2(tmp_path / "v1", seed=1)
    greedy = TurnParams(max_tokens=8, temperature=0.0)
    (before,) = gen(engine, greedy)
    timing = asyncio.run(engine.update_weights(other, 1))
    (after,) = gen(engine, greedy)
    assert engine.policy_version == 1 and after.policy_version == 1 and "load_s" in timing
    assert after.token_ids != before.token_ids
    # the engine's fused projections took the new weights too: its log-probs are the new model's
    sampled = gen(engine, TurnParams(max_tokens=6, seed=4))[0]
    assert torch.allclose(
        torch.tensor(sampled.logprobs), _logprobs_by_forward(engine, PROMPT, sampled.token_ids), atol=1e-4
    )
    asyncio.run(engine.update_weights(tiny_model, 2))
    (back,) = gen(engine, greedy)
    assert back.token_ids == before.token_ids


async def _staggered(engine, first: TurnParams, second: TurnParams, second_prompt: list[int]):
    """Start `first`, wait until it is decoding, then send `second`; returns both and the order
    in which they finished."""
    order: list[str] = []

    async def run(name, prompt, params):
        g = await engine.generate(prompt, params)
        order.append(name)
        return g

    before = len(engine.batches)
    a = asyncio.ensure_future(run("first", PROMPT, first))
    while len(engine.batches) == before:
        await asyncio.sleep(0.001)
    b = asyncio.ensure_future(run("second", second_prompt, second))
    return await a, await b, order


def test_a_request_joins_a_running_batch_finishes_first_and_matches_its_solo_run(engine):
    short = PROMPT[-3:]
    solo = gen(engine, TurnParams(max_tokens=5, seed=11), prompt=short)[0]
    long_params, short_params = TurnParams(max_tokens=60, seed=4), TurnParams(max_tokens=5, seed=11)
    long_gen, joined, order = asyncio.run(_staggered(engine, long_params, short_params, short))
    assert order == ["second", "first"]  # the 5-token turn did not wait for the 60-token one
    assert joined.token_ids == solo.token_ids and joined.logprobs == pytest.approx(solo.logprobs, abs=1e-4)
    alone = gen(engine, long_params)[0]  # and the running row was not disturbed by the join
    assert long_gen.token_ids == alone.token_ids and long_gen.logprobs == pytest.approx(alone.logprobs, abs=1e-4)


def test_static_batching_makes_a_late_request_wait_for_the_batch(tiny_model):
    static = TransformersEngine(tiny_model, max_model_len=2048, continuous=False)
    _, _, order = asyncio.run(
        _staggered(static, TurnParams(max_tokens=60, seed=4), TurnParams(max_tokens=5, seed=11), PROMPT[-3:])
    )
    assert order == ["first", "second"]


@pytest.mark.parametrize("sharpness", [0.1, 3.0, 12.0])
def test_nucleus_from_the_top_candidates_equals_the_full_sort(sharpness):
    from services.rollout.engines.hf import NUCLEUS_CANDIDATES, _nucleus

    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(sharpness * torch.randn(4, 151_936, generator=g), dim=-1)
    # 0.1: flat (full sort); 3.0: the candidates hold ~0.7 (fast path at 0.5, sort at 0.95); 12: peaked
    mass = probs.topk(NUCLEUS_CANDIDATES).values.sum(-1)
    assert bool((mass >= 0.5).all()) == (sharpness > 1)
    for top_p in (0.5, 0.95):
        sorted_p, order = probs.sort(dim=-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < top_p
        full = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, order, keep)
        assert torch.equal(_nucleus(torch, probs, top_p), full)


def test_decoding_runs_outside_cudnn_attention(tiny_model, monkeypatch):
    """cuDNN's SDPA re-plans for every new key length, i.e. every decode step; the engine must
    decode (and prefill) with it switched off, and switch it back on for the rest of the process."""
    engine = TransformersEngine(tiny_model, max_model_len=2048)
    seen: list[bool] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    gen(engine, TurnParams(max_tokens=4, seed=1))
    layers = engine.model.config.num_hidden_layers
    assert len(seen) >= 4 * layers and not any(seen)  # the prefill and every decode step, every layer
    assert torch.backends.cuda.cudnn_sdp_enabled()


TOOL_REPLY = [151644, 872, 198, 9707, 11, 1879, 151645, 198, 151644, 77091, 198]  # user turn, then assistant


async def _two_turns(engine, first: TurnParams, second: TurnParams, reply: list[int]):
    """An agent's two turns, token-in/token-out: the second prompt extends the first turn."""
    one = await engine.generate(PROMPT, first)
    prompt = PROMPT + one.token_ids + reply
    before = engine.prefill_tokens
    two = await engine.generate(prompt, second)
    return one, two, prompt, engine.prefill_tokens - before


def test_a_next_turn_prefills_only_its_new_tokens_and_matches_a_full_prefill(tiny_model):
    kept = TransformersEngine(tiny_model, max_model_len=2048)
    full = TransformersEngine(tiny_model, max_model_len=2048, prefix_cache=0)
    first, second = TurnParams(max_tokens=10, seed=5), TurnParams(max_tokens=10, seed=6, temperature=0.8)
    a1, a2, prompt, ran_kept = asyncio.run(_two_turns(kept, first, second, TOOL_REPLY))
    b1, b2, _, ran_full = asyncio.run(_two_turns(full, first, second, TOOL_REPLY))
    assert a1.token_ids == b1.token_ids and a2.token_ids == b2.token_ids
    assert a2.logprobs == pytest.approx(b2.logprobs, abs=1e-4)
    assert ran_full == len(prompt)
    # the kept cache holds the first prompt and every sampled token but the last
    assert ran_kept == len(prompt) - (len(PROMPT) + len(a1.token_ids) - 1)


def test_agents_extending_caches_of_different_lengths_together_match_full_prefills(tiny_model):
    """Two agents' next turns admitted together: kept caches and new tokens of different lengths
    (the batch's mask has holes), one of them joining a batch that is already decoding."""
    kept = TransformersEngine(tiny_model, max_model_len=2048)
    full = TransformersEngine(tiny_model, max_model_len=2048, prefix_cache=0)

    async def agents(engine):
        a = await engine.generate(PROMPT, TurnParams(max_tokens=4, seed=1))
        b = await engine.generate(PROMPT[2:], TurnParams(max_tokens=11, seed=2))
        runner = asyncio.ensure_future(engine.generate(PROMPT[-4:], TurnParams(max_tokens=40, seed=3)))
        await asyncio.sleep(0.05)
        nxt = await asyncio.gather(
            engine.generate(PROMPT + a.token_ids + TOOL_REPLY, TurnParams(max_tokens=8, seed=4)),
            engine.generate(PROMPT[2:] + b.token_ids + TOOL_REPLY[:5], TurnParams(max_tokens=8, seed=5)),
        )
        return [*nxt, await runner]

    with_kept, with_full = asyncio.run(agents(kept)), asyncio.run(agents(full))
    assert kept.reused_tokens > 0 and full.reused_tokens == 0
    for x, y in zip(with_kept, with_full):
        assert x.token_ids == y.token_ids
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)


def test_new_weights_drop_the_kept_caches(tiny_model, tmp_path):
    from services.models import tiny_qwen2

    engine = TransformersEngine(tiny_model, max_model_len=2048)
    one = gen(engine, TurnParams(max_tokens=6, seed=7))[0]
    asyncio.run(engine.update_weights(tiny_qwen2(tmp_path / "v1", seed=1), 1))
    before = engine.prefill_tokens
    prompt = PROMPT + one.token_ids + TOOL_REPLY
    gen(engine, TurnParams(max_tokens=3, seed=8), prompt=prompt)
    assert engine.prefill_tokens - before == len(prompt)  # the old policy's cache was not reused


def test_new_weights_load_between_steps_without_waiting_for_turns_in_flight(tiny_model, tmp_path):
    """An asynchronous run's engine is never idle: an update must not wait for the longest turn.
    The turn in flight keeps its start version (the oldest that sampled it) and goes on under the
    new weights; the next turn carries the new version."""
    import threading

    from services.models import tiny_qwen2

    engine = TransformersEngine(tiny_model, max_model_len=2048)
    greedy = TurnParams(max_tokens=400, temperature=0.0)
    (old_only,) = gen(engine, greedy)
    other = tiny_qwen2(tmp_path / "v1", seed=1)
    # every tick and the weight copy run on the engine's one thread (a new thread means a new
    # cuBLAS handle and workspace, which a full GPU could not give)
    threads: set[int] = set()
    tick, load_state = engine._tick, engine.model.load_state_dict

    def on_thread(fn):
        def run(*a, **kw):
            threads.add(threading.get_ident())
            return fn(*a, **kw)

        return run

    engine._tick, engine.model.load_state_dict = on_thread(tick), on_thread(load_state)

    async def swap_mid_turn():
        before = len(engine.batches)
        turn = asyncio.ensure_future(engine.generate(PROMPT, greedy))
        while len(engine.batches) == before:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.05)  # some tokens decoded under the old weights
        timing = await engine.update_weights(other, 1)
        in_flight = not turn.done()
        return await turn, timing, in_flight

    mixed, timing, in_flight = asyncio.run(swap_mid_turn())
    assert in_flight, f"the update waited for the turn ({timing})"
    assert mixed.policy_version == 0 and len(mixed.token_ids) == 400
    agree = next(i for i, (a, b) in enumerate(zip(mixed.token_ids, old_only.token_ids)) if a != b)
    assert agree > 0  # the old weights sampled the start, the new ones the rest
    (after,) = gen(engine, TurnParams(max_tokens=4, temperature=0.0))
    assert after.policy_version == 1
    assert len(threads) == 1 and threading.get_ident() not in threads


def test_the_engine_logs_where_its_time_goes(tiny_model, monkeypatch, caplog):
    import logging

    from services.rollout.engines import hf

    monkeypatch.setattr(hf, "STATS_EVERY_S", 0.0)  # a line after every tick
    engine = TransformersEngine(tiny_model, max_model_len=2048)
    with caplog.at_level(logging.INFO, logger=hf.__name__):
        gen(engine, TurnParams(max_tokens=6, seed=1), TurnParams(max_tokens=6, seed=2))
    lines = [r for r in caplog.records if r.getMessage().startswith("transformers engine: ")]
    assert lines
    first = lines[0]
    assert first.admitted == 2 and first.rows_mean == 2.0  # both rows admitted together, then decoded
    assert "decode_ms_per_step=" in first.getMessage() and first.decode_ms_per_step > 0
    assert sum(r.admitted for r in lines) == 2
    assert "kept_caches=" in first.getMessage() and first.cache_capacity > 0


# -- the slot pool: chunked prefill, growth, eviction, architectures ----------------------------


def _logprobs_by_forward(engine, prompt: list[int], sampled: list[int], temperature: float = 1.0) -> torch.Tensor:
    """The model's own (HF forward) log-probs of `sampled` after `prompt` at `temperature`."""
    return _of(torch.log_softmax(_forward_logits(engine, prompt, sampled) / temperature, -1), sampled)


def test_a_prompt_longer_than_a_prefill_chunk_matches_the_models_forward(tiny_model):
    from services.rollout.engines import hf

    engine = TransformersEngine(tiny_model, max_model_len=2048)
    long = (PROMPT * 200)[: hf.PREFILL_CHUNK * 2 + 37]  # three chunks, the last one partial
    short = PROMPT[:5]
    both = asyncio.run(
        _gather(engine, (long, TurnParams(max_tokens=6, seed=1)), (short, TurnParams(max_tokens=6, seed=2)))
    )
    for prompt, g in zip((long, short), both):
        assert torch.allclose(torch.tensor(g.logprobs), _logprobs_by_forward(engine, prompt, g.token_ids), atol=1e-4)


async def _gather(engine, *requests):
    return await asyncio.gather(*(engine.generate(p, params) for p, params in requests))


def test_a_long_joiner_grows_the_pool_without_disturbing_running_rows(tiny_model):
    engine = TransformersEngine(tiny_model, max_model_len=2048)
    solo = gen(engine, TurnParams(max_tokens=30, seed=11))[0]
    fresh = TransformersEngine(tiny_model, max_model_len=2048)

    async def run():
        runner = asyncio.ensure_future(fresh.generate(PROMPT, TurnParams(max_tokens=30, seed=11)))
        await asyncio.sleep(0.05)
        capacity = fresh._pool.capacity
        joiner = await fresh.generate((PROMPT * 60)[:500], TurnParams(max_tokens=4, seed=12))
        return await runner, joiner, capacity

    ran, joiner, before = asyncio.run(run())
    assert fresh._pool.capacity > before  # the joiner needed more columns than the pool had
    assert ran.token_ids == solo.token_ids and ran.logprobs == pytest.approx(solo.logprobs, abs=1e-4)
    assert len(joiner.token_ids) == 4


def test_more_agents_than_slots_evict_kept_caches_and_still_match_full_prefills(tiny_model):
    """Two slots, four agents of two turns each: kept caches are evicted (least recent first) and
    the agents whose cache survived prefill only their new tokens; every answer matches an engine
    that keeps nothing."""
    kept = TransformersEngine(tiny_model, max_model_len=2048, max_batch=2)
    full = TransformersEngine(tiny_model, max_model_len=2048, max_batch=2, prefix_cache=0)

    async def agents(engine):
        firsts = [await engine.generate(PROMPT[i:], TurnParams(max_tokens=5, seed=i)) for i in range(4)]
        # agent 3's cache is the most recent: its next turn comes first and finds it
        return firsts + [
            await engine.generate(PROMPT[i:] + firsts[i].token_ids + TOOL_REPLY, TurnParams(max_tokens=5, seed=10 + i))
            for i in (3, 0, 2, 1)
        ]

    with_kept, with_full = asyncio.run(agents(kept)), asyncio.run(agents(full))
    assert kept.reused_tokens > 0 and full.reused_tokens == 0
    for x, y in zip(with_kept, with_full):
        assert x.token_ids == y.token_ids
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)
    assert len(kept._kept) + len(kept._free) == 2  # every slot accounted for once the batch is empty


def test_a_llama_model_decodes_with_the_models_own_logprobs(tiny_model, tmp_path):
    """SmolLM2 is Llama-shaped (no q/k/v bias, its own rotary settings): the engine's layer loop
    must give the model's own log-probs there too."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    qwen = TransformersEngine(tiny_model, max_model_len=2048)
    folder = tmp_path / "llama"
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=qwen.model.config.vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    for f in tiny_model.iterdir():
        if "token" in f.name or f.name == "vocab.json" or f.name == "merges.txt":
            shutil.copy(f, folder / f.name)
    llama = TransformersEngine(folder, max_model_len=2048)
    g = gen(llama, TurnParams(max_tokens=8, seed=3, temperature=0.9))[0]
    assert torch.allclose(torch.tensor(g.logprobs), _logprobs_by_forward(llama, PROMPT, g.token_ids, 0.9), atol=1e-4)

    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(
        json.dumps({**config, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    )
    with pytest.raises(EngineError, match="runs llama, qwen2 models, not .gpt2"):
        TransformersEngine(folder, max_model_len=2048)


def test_the_rollout_service_refuses_the_removed_decode_modes(tiny_model, monkeypatch):
    """GPU decoding is vLLM's: the transformers engine has one decode step, and a setting from before
    is refused by name rather than ignored."""
    from services.pipeline.config import ServicesSpec

    with pytest.raises(ValueError, match="decode"):
        ServicesSpec(engine="transformers", decode="graphs")
    with pytest.raises(TypeError, match="decode"):
        TransformersEngine(tiny_model, max_model_len=2048, decode="graphs")
