"""docs/cookbook.md runs: every ```bash block, in order, at tiny size, in a folder of its own.

Each `python launch.py …` line gets the tiny override set (`model=micro`, 6 steps, checkpoints
every 2, sequences of 32 …; the keys it sets are taken out of the line first) and the output
folder; each `python -m marin.<tool> …` line gets `--out-dir`; the step numbers of the day (a
fork at 200 of 400, an A/B of 100 steps) are scaled to the tiny run's (`SCALE`). Other lines
(writing a config file with a heredoc) run in bash. A line's exit status must be 0, or the one
its comment gives (`# exit status 1: …`). Blocks in other languages (`sh`: commands that need a
running run or a cluster) are shown, not run.

The lines run in the test's process where that is the same code as the command's own process
(`in_process`): a `launch.py` line of overrides through launch.py's dispatch, a `python -m
marin.<tool>` line through the tool's `main` (its `__main__` is `sys.exit(main())`). A process
each cost every line an interpreter, JAX, Hydra and MLflow imports and a tracking process: about
half of the test's CPU (101 CPU-s, 53 in-process). A line with Hydra's own flags (`-m`,
`--config-dir`: Hydra's command-line parser) and a shell line run in a process of their own.
"""
import importlib
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COOKBOOK = ROOT / "docs" / "cookbook.md"
TINY = {"model": "micro", "train.steps": "6", "train.checkpoint.every_steps": "2", "train.checkpoint.keep_last": "3", "train.seq_len": "32",
        "train.global_batch": "4", "train.eval_every": "0", "train.eval_batches": "1"}
SCALE = {"@200": "@2", "@400": "@6", "--steps 100": "--steps 2", "--every 50": "--every 2",
         "--max-new-tokens 32": "--max-new-tokens 4"}


def commands(text: str) -> list[tuple[str, int]]:
    """(command, expected exit status) of every ```bash block, in order; a heredoc is one command."""
    out = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M):
        lines = block.splitlines()
        while lines:
            line = lines.pop(0)
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            if "<<'EOF'" in line:
                body = [line]
                while lines and body[-1] != "EOF":
                    body.append(lines.pop(0))
                out.append(("\n".join(body), 0))
                continue
            command, _, comment = line.partition("  #")
            expected = re.search(r"exit status (\d)", comment)
            out.append((command.strip(), int(expected.group(1)) if expected else 0))
    return out


def tiny(command: str, out_dir: Path) -> list[str] | None:
    """The argv a cookbook line runs as here (None: a shell line)."""
    for big, small in SCALE.items():
        command = command.replace(big, small)
    words = shlex.split(command)
    if words[:2] == ["python", "launch.py"]:
        args = [w for w in words[2:] if w.split("=", 1)[0] not in TINY]
        return [sys.executable, str(ROOT / "launch.py"), *args, *(f"{k}={v}" for k, v in TINY.items()),
                f"run.out_dir={out_dir}"]
    if words[:2] == ["python", "-m"]:
        return [sys.executable, "-m", *words[2:], "--out-dir", str(out_dir)]
    return None


def in_process(argv: list[str]) -> int | None:
    """The exit status of `argv` (from `tiny`) run in this process, or None for a line that needs
    a process of its own (Hydra's command-line flags, a module that is not a marin tool)."""
    from tests.helpers import launch_here

    if argv[1] == str(ROOT / "launch.py"):
        return None if any(a.startswith("-") for a in argv[2:]) else launch_here(*argv[2:])
    if argv[1] != "-m" or not argv[2].startswith("marin."):
        return None
    try:
        code = importlib.import_module(argv[2]).main(argv[3:])
    except SystemExit as end:
        code = end.code
    return code if isinstance(code, int) else (0 if code is None else 1)


def test_cookbook_commands_are_parsed():
    found = commands(COOKBOOK.read_text())
    assert len(found) >= 15 and any(c.startswith("python -m marin.ab ") for c, _ in found), found
    assert ("python -m marin.diff lr_try/lr=0.002 lr_try/lr=0.004", 1) in found
    argv = tiny("python launch.py model=tiny run.name=first train.steps=400", Path("/o"))
    assert argv[2:] == ["run.name=first", *(f"{k}={v}" for k, v in TINY.items()), "run.out_dir=/o"]


@pytest.mark.slow
def test_the_cookbook_runs(tmp_path, monkeypatch):
    out_dir = tmp_path / "outputs"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    monkeypatch.chdir(tmp_path)  # where the lines run in this process run, as in a process of their own
    began = time.monotonic()
    for command, expected in commands(COOKBOOK.read_text()):
        argv = tiny(command, out_dir)
        print(f"$ {command}", flush=True)  # -s shows the day as it ran
        code = None if argv is None else in_process(argv)
        said = ""
        if code is None:
            shell = ["bash", "-c", command] if argv is None else argv
            done = subprocess.run(shell, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
            code, said = done.returncode, done.stderr[-3000:]
            print(f"{done.stdout}{done.stderr}", flush=True)
        assert code == expected, f"{command}: exit status {code}\n{said}"
    print(f"the cookbook ran in {time.monotonic() - began:.0f} s")
