"""The reward worker's own settings file: `star reward worker --config FILE`, STAR_REWARD_* under it, the flags
over it, and a bad file a clear command-line error."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from services.cli import app
from services.reward.config import RewardConfig, load_reward_config, write_reward_config

runner = CliRunner()


def test_a_written_file_reads_back_with_the_environment_under_it(tmp_path, monkeypatch):
    monkeypatch.setenv("STAR_REWARD_BATCH", "5")
    monkeypatch.setenv("STAR_REWARD_CONSUMER", "from-env")
    path = write_reward_config(tmp_path / "reward" / "worker-0.json", RewardConfig.model_construct(consumer="reward-0"))
    assert json.loads(path.read_text()) == {"consumer": "reward-0"}
    config = load_reward_config(path)
    assert (config.consumer, config.batch, config.threads) == ("reward-0", 5, 1)
    assert RewardConfig(consumer="r", threads=3).consumers("x") == ["r-0", "r-1", "r-2"]


def test_a_bad_file_is_a_cli_error_naming_the_field(tmp_path, monkeypatch):
    monkeypatch.setenv("STAR_REDIS_URL", "redis://127.0.0.1:1/0")  # never reached: the file is refused first
    path = tmp_path / "reward.json"
    path.write_text(json.dumps({"threads": 0}))
    result = runner.invoke(app, ["reward", "worker", "--config", str(path)])
    assert result.exit_code == 2 and "threads" in result.output and "reward config" in result.output
    assert "Traceback" not in result.output
    path.write_text(json.dumps({"mode": "strict"}))  # scoring settings travel in each trajectory
    result = runner.invoke(app, ["reward", "worker", "--config", str(path)])
    assert result.exit_code == 2 and "unknown reward settings mode" in result.output
