"""Every tool answers `--help` with its usage and exit status 0 (issue 42: `python -m
marin.track.tracker --help` printed a traceback): each module with a `__main__` entry, run as
`python -m` runs it, in one interpreter."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# not tools of their own: the tracking process, started by the trainer, reads its requests on
# stdin; marin.launch.prepare is what `python -m marin.data.prepare` runs (its tool layer)
NOT_TOOLS = {"marin.track.worker", "marin.launch.prepare"}

PROBE = """
import contextlib, io, runpy, sys, warnings
warnings.simplefilter("ignore", RuntimeWarning)  # runpy: a module run again after an earlier one imported it
for module in sys.argv[1:]:
    out = io.StringIO()
    sys.argv = [module, "--help"]
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as end:
        code = end.code or 0
    except BaseException as err:
        code = f"{type(err).__name__}: {err}"
    text = out.getvalue()
    print(f"{module}\\t{code}\\t{text!r}\\t{'exit status' in text}", file=sys.__stdout__)
"""


def tools() -> list[str]:
    found = []
    for path in sorted((ROOT / "marin").rglob("*.py")):
        if re.search(r'^if __name__ == "__main__":', path.read_text(), re.M):
            found.append(".".join(path.relative_to(ROOT).with_suffix("").parts))
    return [m for m in found if m not in NOT_TOOLS]


def test_every_tool_prints_its_usage_and_exits_0():
    modules = tools()
    assert {"marin.status", "marin.diff", "marin.ui", "marin.track.tracker"} <= set(modules), modules
    done = subprocess.run([sys.executable, "-c", PROBE, *modules], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    rows = {line.split("\t")[0]: line.split("\t")[1:] for line in done.stdout.splitlines() if "\t" in line}
    assert set(rows) == set(modules), done.stderr[-2000:]
    bad = {m: r for m, r in rows.items() if r[0] != "0" or not re.search(r"(^|\\n)usage: python -m " + re.escape(m), r[1][1:])}
    assert not bad, bad
    assert rows["marin.diff"][2] == "True"  # its exit statuses are in its --help
    # the description under the usage is whole sentences (the docstring's first line ended
    # mid-sentence in marin.diff: "… differ between two runs, and")
    import ast
    helps = {m: ast.literal_eval(r[1]) for m, r in rows.items()}
    described = {m: text.split("\n\n")[1] for m, text in helps.items() if "\noptions:" in text}  # argparse's
    assert len(described) >= 10, sorted(described)
    cut = {m: d for m, d in described.items() if not d.rstrip().endswith((".", ")", ":"))}
    assert not cut, cut


def test_launch_py_help_starts_with_its_usage():
    done = subprocess.run([sys.executable, "launch.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("usage: python launch.py "), done.stdout[:300]
