"""The controller: `star train`'s run of the stages, the RL loop and the fleets it trains with.

`train.py` prepares the run and runs the stages in order (the synth, SFT and eval stages are
services/pipeline/stages.py's); `loop.py` is the RL stage, `validation.py` the versions it evaluates
beside the fleet, `preflight.py` its notes and dependency checks, `learner_config.py` the learner's
RLConfig. `fleet.py` is the one fleet interface, with an embedded (`embedded_fleet.py`) and an external
(`external_fleet.py`) implementation; `launcher.py` starts the local processes for the embedded fleet
and for `star up` (`local.py`).
"""
