"""Each run tool the README shows as `python -m marin.<tool>` is also a console command,
`marin-<tool>` (issue 42): installed into the environment by scripts/setup.sh, running the same main()."""
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_run_tool_in_the_readme_is_a_console_command_that_runs():
    tools = sorted(set(re.findall(r"python -m marin\.(\w+)(?![.\w])", (ROOT / "README.md").read_text())))
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert tools and all(scripts.get(f"marin-{tool}") == f"marin.{tool}:main" for tool in tools), (tools, scripts)
    done = subprocess.run([str(Path(sys.executable).parent / "marin-status"), "--help"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "usage" in done.stdout.lower(), done.stderr[-2000:]
