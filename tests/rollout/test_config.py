"""A rollout process's settings from the config file the controller writes (`--config`), with STAR_ROLLOUT_*
for the fields the file leaves out; a file that cannot be used is a command-line error, not a traceback."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from services.common.schemas import VllmArgs
from services.rollout import worker as worker_module
from services.rollout.chat import ChatOptions
from services.rollout.cli import rollout_app
from services.rollout.config import RolloutConfig, RolloutConfigError, load_rollout_config, write_rollout_config

runner = CliRunner()


@pytest.fixture(autouse=True)
def no_rollout_env(monkeypatch):
    """No STAR_ROLLOUT_* from the shell the tests run in."""
    import os

    for name in [n for n in os.environ if n.startswith("STAR_ROLLOUT_")]:
        monkeypatch.delenv(name)


def _file(tmp_path, data, name="rollout.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return path


def test_a_file_gives_the_json_valued_settings_without_any_environment_variable(tmp_path):
    path = _file(
        tmp_path,
        {
            "engine": "transformers",
            "vllm": {"max_num_seqs": 48, "enable_prefix_caching": False},
            "chat": {"style": "chatml", "tool_format": "react", "thinking": False},
            "max_inflight_episodes": 24,
            "consumer": "rollout-3",
        },
    )
    config = RolloutConfig.from_file(path)
    assert config.vllm == VllmArgs(max_num_seqs=48, enable_prefix_caching=False)
    assert config.chat == ChatOptions(style="chatml", tool_format="react", thinking=False)
    assert (config.engine, config.max_inflight_episodes, config.consumer) == ("transformers", 24, "rollout-3")


def test_the_file_wins_for_what_it_sets_and_the_environment_sets_the_rest(tmp_path, monkeypatch):
    monkeypatch.setenv("STAR_ROLLOUT_ENGINE", "openai")
    monkeypatch.setenv("STAR_ROLLOUT_CLAIM_IDLE_MS", "5000")
    monkeypatch.setenv("STAR_ROLLOUT_CHAT", '{"tool_format": "mistral"}')
    config = RolloutConfig.from_file(_file(tmp_path, {"engine": "transformers", "max_model_len": 4096}))
    assert (config.engine, config.max_model_len) == ("transformers", 4096)
    assert config.claim_idle_ms == 5000 and config.chat.tool_format == "mistral"
    assert load_rollout_config(None).engine == "openai"  # no file: the environment alone


def test_a_written_config_reads_back_whole_and_keeps_the_secret_out(tmp_path):
    config = RolloutConfig(
        engine="vllm",
        vllm=VllmArgs(max_num_seqs=8),
        chat=ChatOptions(thinking=True),
        http_port=8123,
        openai_api_key="sk-secret",
    )
    path = write_rollout_config(tmp_path / "run" / "rollout-0.json", config)
    assert "sk-secret" not in path.read_text()
    assert RolloutConfig.from_file(path) == config.model_copy(update={"openai_api_key": None})


@pytest.mark.parametrize(
    "text, message",
    [
        (None, "no rollout config file"),
        ("{not json", "is not valid JSON"),
        ("[1, 2]", "must hold a mapping"),
        ('{"engin": "vllm"}', "unknown rollout settings engin"),
        ('{"max_model_len": 10}', "max_model_len"),
        ('{"vllm": {"max_num_seqs": "many"}}', "vllm.max_num_seqs"),
    ],
)
def test_a_bad_file_is_a_clear_error(tmp_path, text, message):
    path = tmp_path / "rollout.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(RolloutConfigError, match=message):
        RolloutConfig.from_file(path)


def test_a_yaml_file_reads_too(tmp_path):
    path = _file(tmp_path, "engine: transformers\nchat: {style: chatml}\n", name="rollout.yaml")
    assert RolloutConfig.from_file(path).chat.style == "chatml"


def test_the_worker_commands_start_on_the_files_settings(tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(worker_module, "main", lambda settings=None, config=None: started.append(config))
    path = _file(tmp_path, {"engine": "transformers", "vllm": {"max_num_seqs": 12}})
    result = runner.invoke(rollout_app, ["worker", "--config", str(path)])
    assert result.exit_code == 0, result.output
    worker_module.cli(["--config", str(path)])  # python -m services.rollout.worker --config FILE
    assert [c.vllm.max_num_seqs for c in started] == [12, 12]


def test_a_worker_given_a_bad_file_ends_with_a_message_and_no_traceback(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(worker_module, "main", lambda **_: pytest.fail("a worker started on a bad file"))
    path = _file(tmp_path, '{"engine": "tpu"}')
    result = runner.invoke(rollout_app, ["worker", "--config", str(path)])
    assert result.exit_code == 2 and "is not a valid rollout config" in result.output
    assert "Traceback" not in result.output and not isinstance(result.exception, RolloutConfigError)
    with pytest.raises(SystemExit) as ended:
        worker_module.cli(["--config", str(tmp_path / "missing.json")])
    err = capsys.readouterr().err
    assert ended.value.code == 2 and "no rollout config file" in err and "Traceback" not in err


def test_the_server_is_built_on_the_files_settings(tmp_path, monkeypatch):
    import uvicorn

    served = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: served.append(app))
    path = _file(tmp_path, {"engine": "transformers", "chat": {"style": "chatml"}})
    result = runner.invoke(rollout_app, ["serve", "--config", str(path), "--port", "8999"])
    assert result.exit_code == 0, result.output
    assert served[0].state.rollout.config.chat.style == "chatml"
