"""The preemption flag and the requeue decision (the Slurm side runs in tests/launch/test_slurm.py)."""
import os
import signal
import subprocess

import pytest

from marin.train import preempt


@pytest.fixture(autouse=True)
def clean_flag():
    old = {s: signal.getsignal(s) for s in preempt.SIGNALS + preempt.STOP_SIGNALS}
    preempt.reset()
    yield
    preempt.reset()
    for s, handler in old.items():
        signal.signal(s, handler)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR2])
def test_signal_sets_the_flag_and_nothing_else(sig):
    preempt.install()
    assert not preempt.requested()
    os.kill(os.getpid(), sig)  # would end the process without the handler
    assert preempt.requested()


def test_outside_slurm_requeue_only_stops(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert preempt.requeue() is False


def test_under_slurm_process_zero_requeues_then_exits(monkeypatch):
    calls = []
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: calls.append(cmd))
    preempt.install(max_requeues=3)
    with pytest.raises(SystemExit) as exit_:
        preempt.requeue()
    assert exit_.value.code == 0
    assert calls == [["scontrol", "requeue", "4242"]]


def test_requeues_are_bounded(monkeypatch):
    calls = []
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "3")
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: calls.append(cmd))
    preempt.install(max_requeues=3)
    with pytest.raises(SystemExit) as exit_:
        preempt.requeue()
    assert exit_.value.code == 1 and calls == []


def test_ctrl_c_stops_and_a_second_one_stops_at_once(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")   # even under Slurm, Ctrl-C is a stop, not a requeue
    preempt.install()
    os.kill(os.getpid(), signal.SIGINT)          # would raise KeyboardInterrupt without the handler
    assert preempt.poll() == (signal.SIGINT, False)
    assert not preempt.requeues(signal.SIGINT) and preempt.requeues(signal.SIGTERM)
    assert preempt.exit_code(signal.SIGINT) == 130 and preempt.exit_code(signal.SIGTERM) == 143
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)


def test_poll_passes_the_rolling_checkpoint_decision():
    assert preempt.poll(time_due=True) == (0, True)
    assert preempt.poll(time_due=False) == (0, False)
