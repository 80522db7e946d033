"""The `star` command."""

from __future__ import annotations

import typer

from services.pipeline.cli import down_command, status_command, train_command, up_command
from services.sandbox.cli import sandbox_app, tool_command, world_app
from services.synth.cli import synth_app
from services.qa.cli import qa_app
from services.evaluation.cli import eval_app, evaluate_alias
from services.formatter.cli import formatter_app
from services.learner.cli import learner_app, sft as sft_command
from services.reward.cli import reward_app, score_command
from services.rollout.cli import rollout_app

app = typer.Typer(help="The STAR training system: synthesis → SFT → RL on TravelPlanner.", no_args_is_help=True,
                  pretty_exceptions_enable=False)
app.add_typer(world_app, name="world")
app.add_typer(sandbox_app, name="sandbox")
app.add_typer(synth_app, name="synth")
app.add_typer(qa_app, name="qa")
app.add_typer(eval_app, name="eval")
app.add_typer(formatter_app, name="formatter")
app.add_typer(learner_app, name="learner")
app.command("sft")(sft_command)
app.add_typer(reward_app, name="reward")
app.add_typer(rollout_app, name="rollout")
app.command("score")(score_command)
app.command("evaluate", hidden=True)(evaluate_alias)  # old scripts: star eval submission
app.command("tool", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(tool_command)
app.command("up")(up_command)
app.command("down")(down_command)
app.command("status")(status_command)
app.command("train")(train_command)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
