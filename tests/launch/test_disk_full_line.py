"""launch.py on a full disk: one line naming the checkpoint lost and where a resume starts, not
the tracebacks of every write that fails after it (issue 42's probe)."""
import errno

import pytest

from marin.track.errors import DiskFull


def test_launch_prints_one_line_for_a_full_disk(monkeypatch):
    from marin.launch import entry

    def train(cfg, job_overrides):
        try:
            raise DiskFull("checkpoint 2 not saved: no space left on device in /x; resume= starts from checkpoint 1")
        except DiskFull:
            raise OSError(errno.ENOSPC, "No space left on device")

    said = []

    def fail(message, code=2):   # marin.cli.fail: `error: <message>` on stderr, then exit
        said.append((message, code))
        raise SystemExit(code)

    monkeypatch.setattr(entry, "_dispatch", train)
    monkeypatch.setattr(entry, "fail", fail)
    monkeypatch.setattr(entry, "keep_run_references", lambda *a: None)
    monkeypatch.setattr(entry, "setup_logging", lambda: None)   # it wraps stderr (masking)
    with pytest.raises(SystemExit):
        entry._guarded({}, [])
    assert said == [("checkpoint 2 not saved: no space left on device in /x; resume= starts from checkpoint 1", 1)]
