"""vLLM on a GPU: in-flight weight loads and sampler/learner agreement. Marked `gpu`: they run on a
GPU machine with vLLM installed (`bench/gpu_device.sh`), and skip elsewhere, CI included."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("vllm")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.gpu_shapes import model_folder  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return model_folder(tmp_path_factory.mktemp("gpu-model") / "smollm", "smollm", max_positions=8192)


@pytest.fixture(scope="module")
def engine(folder):
    from transformers import AutoTokenizer

    from services.common.schemas import VllmArgs
    from services.rollout.engines.vllm_engine import VllmEngine

    loop = asyncio.new_event_loop()
    eng = VllmEngine(
        folder,
        max_model_len=8192,
        args=VllmArgs(compile=False, gpu_memory_utilization=0.3),
        tokenizer=AutoTokenizer.from_pretrained(folder),
    )
    yield eng, loop
    loop.run_until_complete(eng.close())
    loop.close()


def test_weights_load_while_turns_are_in_flight(engine, folder):
    from services.rollout.engines.base import TurnParams

    eng, loop = engine

    async def scenario():
        turns = [asyncio.ensure_future(eng.generate([100 + i] * 512, TurnParams(max_tokens=600))) for i in range(16)]
        await asyncio.sleep(0.3)
        in_flight = eng.in_flight
        timing = await eng.update_weights(folder, 1)
        gens = await asyncio.gather(*turns)
        after = await eng.generate([7] * 64, TurnParams(max_tokens=4))
        return in_flight, timing, gens, after

    in_flight, timing, gens, after = loop.run_until_complete(scenario())
    assert in_flight > 0, "the load should have met turns in flight"
    assert timing["drain_s"] < 0.05  # paused in place, not drained
    assert all(len(g.token_ids) == 600 or g.finish == "stop" for g in gens)
    assert all(g.policy_version == 0 for g in gens)  # a turn counts as the version it started under
    assert sum(g.stats["updated_mid_turn"] for g in gens) > 0
    assert after.policy_version == 1 and after.stats["updated_mid_turn"] == 0


def test_sampled_logprobs_match_a_bf16_forward(engine, folder):
    from transformers import AutoModelForCausalLM

    from services.rollout.engines.base import TurnParams

    eng, loop = engine
    prompt = [(31 * j) % 40000 + 3 for j in range(300)]
    gen = loop.run_until_complete(eng.generate(prompt, TurnParams(max_tokens=32, seed=1)))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
    ids = torch.tensor([prompt + gen.token_ids], device="cuda")
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    ours = torch.log_softmax(logits, -1).gather(-1, torch.tensor(gen.token_ids, device="cuda")[:, None])[:, 0]
    diff = (ours - torch.tensor(gen.logprobs, device="cuda")).abs()
    assert diff.mean().item() < 0.05 and diff.max().item() < 0.5, diff
