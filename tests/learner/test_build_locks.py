"""A JIT build lock left by a killed builder is removed; one a live builder holds is not."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from services.learner.build_locks import clear_stale_build_locks, extensions_root

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="open files are read from /proc")


def hold_open(path) -> subprocess.Popen:
    """A process that creates `path` as torch's FileBaton does and keeps it open, as a builder would."""
    code = (
        "import os, sys, time; os.open(sys.argv[1], os.O_CREAT | os.O_EXCL); print('held', flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def age(path, seconds: float) -> None:
    os.utime(path, (time.time() - seconds, time.time() - seconds))


def test_a_lock_no_process_holds_is_removed_and_a_held_one_stays(tmp_path):
    killed = tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock"
    live = tmp_path / "py311_cpu" / "fused_adam" / "lock"
    for lock in (killed, live):
        lock.parent.mkdir(parents=True)
    builder = hold_open(killed)
    builder.kill()  # as SIGKILL leaves it: the file stays, nobody holds it
    builder.wait()
    assert killed.exists()
    assert clear_stale_build_locks(tmp_path) == []  # a fresh one may be a live lock between its steps
    holder = hold_open(live)
    age(killed, 60)
    age(live, 60)
    try:
        assert clear_stale_build_locks(tmp_path) == [killed]
        assert not killed.exists() and live.exists()
        assert clear_stale_build_locks(tmp_path) == []
    finally:
        holder.kill()
        holder.wait()
    assert clear_stale_build_locks(tmp_path) == [live]


def test_the_root_follows_torch_extensions_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert extensions_root() == tmp_path
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    assert extensions_root().name == "torch_extensions"
