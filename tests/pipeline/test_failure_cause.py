"""What `star train` says when a process of the run fails: the error a rank raised, read from the end of
its log, not the launcher's summary and not only "exited (1)"."""

from __future__ import annotations

import sys
import time

from services.pipeline.stage import failure_cause, log_tail

TORCHRUN_LOG = """\
[rank1]:   File "/src/services/learner/engine.py", line 133, in forward
[rank1]:     return vocab_logprobs(hidden.flatten(0, 1), self.head_weight, targets.flatten(), chunk=self.chunk_tokens,
[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.16 GiB. GPU 1 has a total capacity of 139.80 GiB
W1128 09:20:26.628000 8614 torch/distributed/elastic/multiprocessing/api.py:1012] Sending process 8695 closing signal SIGTERM
Traceback (most recent call last):
  File "/opt/torch/.venv/bin/torchrun", line 8, in <module>
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
services.learner.cli FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-28_09:20:26
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 8695)
============================================================
"""


def test_the_cause_is_the_ranks_error_not_the_launchers_summary(tmp_path):
    log = tmp_path / "learner.log"
    log.write_text(TORCHRUN_LOG)
    assert failure_cause(log) == (
        "[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.16 GiB. "
        "GPU 1 has a total capacity of 139.80 GiB"
    )


def test_a_plain_traceback_and_a_log_without_an_error(tmp_path):
    log = tmp_path / "x.log"
    log.write_text(
        'loading\nTraceback (most recent call last):\n  File "a.py", line 1\n'
        "services.learner.colocate.ColocationError: rollout server http://127.0.0.1:9 did not sleep\n"
    )
    assert failure_cause(log).startswith("services.learner.colocate.ColocationError: rollout server")
    log.write_text("step 1\nstep 2\n")
    assert failure_cause(log) is None
    assert failure_cause(tmp_path / "missing.log") is None


def test_the_tail_reads_only_the_end_of_a_long_log(tmp_path):
    log = tmp_path / "big.log"
    log.write_text("x" * 2_000_000 + "\n\nlast but one\n\nlast\n")
    assert log_tail(log, 2, max_bytes=4096) == ["last but one", "last"]


def test_star_train_says_why_the_learner_exited_each_time(tmp_path, capsys):
    from services.common.supervisor import RestartPolicy, Supervisor
    from services.controller.embedded_fleet import EmbeddedFleet
    from services.controller.fleet import LearnerReport

    sup = Supervisor()
    script = "import sys; print('step 0'); sys.exit('RuntimeError: the learner could not sleep its engines')"
    child = sup.add(
        "learner", [sys.executable, "-c", script], log=tmp_path / "learner.log", policy=RestartPolicy(backoff_s=0.0)
    )
    try:
        fleet = EmbeddedFleet(sup=sup, redis_url="redis://unused", learner=child)
        deadline = time.monotonic() + 30
        while child.exited() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        fleet.learner_ended(LearnerReport("failed", running=False, exit_code=child.exited()))
        said = capsys.readouterr().err
        assert "learner exited (1, failed); resuming from its checkpoint" in said
        assert "RuntimeError: the learner could not sleep its engines" in " ".join(said.split())
        assert str(tmp_path / "learner.log") in said.replace("\n", "")
    finally:
        sup.stop_all()
