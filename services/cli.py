"""The `star` command: one entry point, its commands grouped by role in `star --help`.

Renamed commands and flags keep their old names as hidden aliases (`star evaluate`, `star sft`,
`star rollout --context`), so that scripts written against them keep working.
"""

from __future__ import annotations

import typer

from services.controller.cli import down_command, status_command, train_command, up_command
from services.episodes.cli import episodes_app
from services.evaluation.cli import eval_app, evaluate_alias
from services.formatter.cli import formatter_app
from services.learner.cli import learner_app, sft as sft_command
from services.qa.cli import qa_app
from services.reward.cli import reward_app, score_command
from services.rollout.cli import rollout_app
from services.sandbox.cli import sandbox_app, tool_command, world_app
from services.synth.cli import synth_app

RUN = "Run the recipe"
DATA = "World and data"
SCORE = "Score and evaluate"
TRAIN = "Train by hand"
SERVE = "Services and workers"

app = typer.Typer(
    help="The STAR training system: synthesis → SFT → RL on TravelPlanner.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.command("train", rich_help_panel=RUN)(train_command)
app.command("up", rich_help_panel=RUN)(up_command)
app.command("status", rich_help_panel=RUN)(status_command)
app.command("down", rich_help_panel=RUN)(down_command)

app.add_typer(world_app, name="world", rich_help_panel=DATA)
app.command("tool", context_settings={"allow_extra_args": True, "ignore_unknown_options": True}, rich_help_panel=DATA)(
    tool_command
)
app.add_typer(synth_app, name="synth", rich_help_panel=DATA)

app.command("score", rich_help_panel=SCORE)(score_command)
app.add_typer(eval_app, name="eval", rich_help_panel=SCORE)
app.add_typer(qa_app, name="qa", rich_help_panel=SCORE)

learner_app.command("sft")(sft_command)
app.add_typer(learner_app, name="learner", rich_help_panel=TRAIN)
app.add_typer(rollout_app, name="rollout", rich_help_panel=TRAIN)

app.add_typer(sandbox_app, name="sandbox", rich_help_panel=SERVE)
app.add_typer(formatter_app, name="formatter", rich_help_panel=SERVE)
app.add_typer(reward_app, name="reward", rich_help_panel=SERVE)
app.add_typer(episodes_app, name="episodes", rich_help_panel=SERVE)

# old names, hidden: `star eval submission` and `star learner sft` replace them
app.command("evaluate", hidden=True)(evaluate_alias)
app.command("sft", hidden=True)(sft_command)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
