"""The LLM backend against real vLLM on CPU serving a tiny random Qwen2: the transport works end to
end, and a model that cannot write a plan ends in a clear status within the attempt budget."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest

from services.common.redis import free_port
from services.formatter.core import Formatter
from services.formatter.llm import LLMFormatter
from tests.formatter.samples import PROSE, QUERY

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    pytest.importorskip("vllm")
    from services.models import tiny_qwen2

    model = tiny_qwen2()
    port = free_port()
    log = open(tmp_path_factory.mktemp("vllm") / "vllm.log", "wb")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--served-model-name",
            "tiny",
            "--max-model-len",
            "8192",
            "--enforce-eager",
            "--dtype",
            "bfloat16",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM exited with {proc.returncode}; see {log.name}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM not ready within 300 s; see {log.name}")
            time.sleep(1)
        yield f"{url}/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def test_random_model_gets_a_clear_status_within_the_budget(vllm_server):
    models = httpx.get(f"{vllm_server}/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    llm = LLMFormatter(
        vllm_server, "tiny", max_attempts=2, max_tokens=48, request_timeout_s=120, deadline_s=300, backoff_s=0
    )
    started = time.monotonic()
    out = Formatter(llm).format(PROSE, QUERY, "llm")
    assert out.backend == "llm"
    # Random weights write random tokens: never a plan, always a named failure, never a hang.
    assert out.status == "invalid_output", out.error
    assert out.attempts == 2 and llm.calls == 2
    assert "2 attempt(s)" in out.error
    assert time.monotonic() - started < 300


def test_temperature_zero_is_deterministic_and_cached(vllm_server):
    llm = LLMFormatter(vllm_server, "tiny", max_attempts=1, max_tokens=16, request_timeout_s=120, backoff_s=0)
    first = llm.format(QUERY, PROSE + " (again)")
    second = llm.format(QUERY, PROSE + " (again)")
    assert first.status == second.status == "invalid_output"
    assert llm.calls == 2  # failures are not cached: both went to the server
    assert first.history == second.history  # greedy decoding: the same reply, so the same complaint
