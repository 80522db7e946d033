"""Every HTTP API fuzzed from its own OpenAPI document (schemathesis), over real HTTP: valid and
invalid inputs for every operation, and not one 5xx or message-less 4xx in reply.

Services run as real uvicorn processes (sandbox, formatter, reward, learner, qa); the rollout
service runs in a uvicorn thread around a scripted engine, so fuzzed `/rollouts` requests (up to 64
samples of up to 30K tokens) cost milliseconds instead of CPU-minutes of decoding, while the agent
loop, the tools (the real sandbox ToolBox) and the HTTP layer are the real ones.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from services.embedded import ServiceProcess
from tests.reliability.fuzzing import FuzzReport, fuzz_url

pytestmark = pytest.mark.slow
TOKEN = "fuzz-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
EXAMPLES = 25


def _assert_clean(name: str, report: FuzzReport) -> None:
    print(f"{name}: {report.summary()}")
    assert report.calls > 0, f"{name}: nothing was sent"
    assert not report.failures, f"{name}: {len(report.failures)} bad replies:\n" + "\n".join(report.failures[:20])


@pytest.fixture
def service(tmp_path):
    started: list[ServiceProcess] = []

    def start(name: str, factory: str, env: dict[str, str], timeout: float = 120.0) -> str:
        env = {"STAR_LOG_LEVEL": "WARNING", "STAR_LOG_JSON": "false", "STAR_API_TOKEN": TOKEN,
               "STAR_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1", **env}
        proc = ServiceProcess(name, factory, env, tmp_path / "logs").start(timeout=timeout)
        started.append(proc)
        return proc.url

    yield start
    for proc in started:
        proc.stop()


def test_sandbox_api(service, official_world_url):
    url = service("sandbox", "services.sandbox.app:create_app", {"STAR_DB_URL": official_world_url})
    _assert_clean("sandbox", fuzz_url(url, headers=AUTH, max_examples=EXAMPLES))


def test_formatter_api(service):
    # The LLM backend is a real chat-completions server whose replies rotate through a good plan,
    # prose that is no JSON, and an upstream 500: none of them may surface as a 5xx of ours.
    from tests.formatter.samples import GOOD
    from tests.support.fake_openai import FakeOpenAI, Reply

    replies = [Reply(f"```json\n{GOOD}\n```"), Reply("I could not find a plan."), Reply(status=500)]
    counter = iter(range(10**9))
    with FakeOpenAI(lambda _body: replies[next(counter) % len(replies)], api_key="sk-fuzz") as llm:
        url = service("formatter", "services.formatter.app:create_app",
                      {"STAR_FORMATTER_LLM_URL": llm.base_url, "STAR_FORMATTER_LLM_MODEL": "fmt",
                       "STAR_FORMATTER_LLM_API_KEY": "sk-fuzz", "STAR_FORMATTER_MAX_ATTEMPTS": "2",
                       "STAR_FORMATTER_TIMEOUT_S": "5"})
        report = fuzz_url(url, headers=AUTH, max_examples=EXAMPLES)
        assert llm.requests, "the LLM backend was never reached"
    _assert_clean("formatter", report)


def test_reward_api(service, official_world_url):
    url = service("reward", "services.reward.app:create_app",
                  {"STAR_DB_URL": official_world_url, "STAR_FORMATTER_LLM_URL": ""})
    _assert_clean("reward", fuzz_url(url, headers=AUTH, max_examples=EXAMPLES))


def test_learner_api(service, tmp_path):
    # Fuzzed run configs name no model folder that exists, so no training process is started;
    # what is checked is that every bad config is a 422 with the reason.
    url = service("learner", "services.learner.app:create_app", {})
    _assert_clean("learner", fuzz_url(url, headers=AUTH, max_examples=EXAMPLES))


@pytest.fixture
def qa_index(tmp_path):
    from services.qa.retriever import Encoder, build_index, encoder_preset
    from tests.qa.conftest import write_corpus

    encoder = Encoder(encoder_preset("minilm"))
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    return build_index(corpus, tmp_path / "qa-index", encoder.config, encoder=encoder, progress=False)


def test_qa_api(service, qa_index):
    url = service("qa", "services.qa.app:create_app", {"STAR_QA_INDEX": str(qa_index)}, timeout=180)
    _assert_clean("qa", fuzz_url(url, headers=AUTH, max_examples=EXAMPLES))


@pytest.fixture
def rollout_url(official_world, tmp_path):
    import uvicorn

    from services.models import tiny_qwen2
    from services.common.settings import Settings
    from services.rollout.app import create_app
    from services.rollout.engines.scripted import ScriptedEngine
    from services.rollout.protocol import format_answer, format_tool_call
    from services.rollout.service import RolloutConfig, RolloutService
    from services.rollout.tools import LocalToolClient
    from services.sandbox.tools.toolbox import ToolBox
    from transformers import AutoTokenizer
    from services.common.redis import free_port

    model = tiny_qwen2()
    tokenizer = AutoTokenizer.from_pretrained(model)
    # A model that looks one thing up, then answers: every fuzzed query runs the real agent loop.
    call = format_tool_call("search_accommodations", {"city": "Chicago"})

    def script(_ids, turn):
        return call if turn == 0 else format_answer("Day 1:\nCurrent City: Chicago")

    settings = Settings(home=tmp_path / "home", api_token=TOKEN, weights_root=tmp_path / "weights",
                        log_json=False, log_level="WARNING")
    service = RolloutService(ScriptedEngine(tokenizer, script, max_model_len=32768),
                             LocalToolClient(ToolBox(official_world, dialect="star", cache_size=0)),
                             settings=settings, config=RolloutConfig(engine="transformers", model=str(model)))
    app = create_app(settings, service=service)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           access_log=False, lifespan="on"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.1)
    yield url
    server.should_exit = True
    thread.join(10)


def test_rollout_api(rollout_url):
    _assert_clean("rollout", fuzz_url(rollout_url, headers=AUTH, max_examples=EXAMPLES))
