"""The project's scripts (scripts/) where a test can run them without root or side effects: the
commands they would change the machine with are stand-ins (on PATH, or the Python that setup.sh
is given) that record their arguments."""
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LAST_ARG = 'for a; do pkg=$a; done; '
# dpkg's record of each package: slurmd was removed but not purged ("rc": its config files kept)
STAND_INS = {
    "dpkg-query": LAST_ARG + 'case "$pkg" in slurmd) printf "rc ";; *) printf "ii ";; esac',
    # `dpkg -s`: as Debian's, status 0 for any package it has a record of
    "dpkg": LAST_ARG + 'case "$pkg" in slurmd) echo "Status: deinstall ok config-files";; '
                       '*) echo "Status: install ok installed";; esac',
    "apt-get": 'echo "$*" >> "$RECORD"',
    # the second `date` comes right after the install step: end the script there, before it
    # stops or starts anything
    "date": 'n=$(cat "$RECORD.date" 2>/dev/null || echo 0); echo $((n + 1)) > "$RECORD.date"; '
            '[ "$n" -ge 1 ] && exit 44; /bin/date "$@"',
}


def test_slurm_start_installs_a_package_that_was_removed_but_not_purged(tmp_path):
    """`dpkg -s` succeeds for a package whose config files are all that is left, so the script
    used to skip installing it and then failed to start a daemon that was not there."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in STAND_INS.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    record = tmp_path / "apt-get.log"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", RECORD=str(record), SLURM_INSTALL="1",
               SLURM_DBD="0", SLURM_AUTH="munge", SLURM_STATE=str(tmp_path / "state"))
    done = subprocess.run(["bash", str(ROOT / "scripts" / "slurm_start.sh")], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 44, done.stderr   # stopped by the stand-in `date`, right after installing
    asked = record.read_text().splitlines() if record.exists() else []
    assert any(line.startswith("install ") and line.split()[-1] == "slurmd" for line in asked), asked
    assert not any("slurmctld" in line for line in asked), asked   # what is installed is left alone
    assert not (tmp_path / "state").exists()


# scripts/setup.sh run in a copy of the project, with a stand-in Python: `-m venv` makes a .venv
# whose python and uv are stand-ins too; uv records the index it was given, the python's import
# check fails where FAIL_IMPORT names a module it is asked to import.
FAKE_VENV_PYTHON = ('case "$*" in *"import "*) for m in $FAIL_IMPORT; do case "$*" in *"$m"*) exit 1;; esac; done;; '
                    'esac; exit 0')
FAKE_PYTHON = f'''
case "$*" in
  "-m venv"*) mkdir -p .venv/bin; printf '#!/bin/sh\\n%s\\n' '{FAKE_VENV_PYTHON}' > .venv/bin/python;
              chmod +x .venv/bin/python;;
  *"config get global.index-url"*) [ -n "$CONFIG_INDEX" ] && echo "$CONFIG_INDEX" || exit 1;;
  *"install"*" uv"*) printf '#!/bin/sh\\necho "index=$UV_INDEX_URL $*" >> "$RECORD"\\n' > .venv/bin/uv;
                     chmod +x .venv/bin/uv;;
esac'''


def run_setup(tmp_path, **env_extra):
    project = tmp_path / "project"
    (project / "scripts").mkdir(parents=True)
    for name in ("pyproject.toml", "constraints.txt", "scripts/setup.sh"):
        (project / name).write_text((ROOT / name).read_text())
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\n{FAKE_PYTHON}\n")
    python.chmod(0o755)
    record = tmp_path / "uv.log"
    env = {k: v for k, v in os.environ.items() if k not in ("PIP_INDEX_URL", "UV_INDEX_URL")}
    env.update({"PYTHON": str(python), "RECORD": str(record), "FAIL_IMPORT": "", "CONFIG_INDEX": "", **env_extra})
    done = subprocess.run(["bash", str(project / "scripts" / "setup.sh")], env=env, capture_output=True, text=True,
                          timeout=60)
    return done, (record.read_text() if record.exists() else ""), project


def test_setup_passes_the_sites_pip_index_on_to_uv(tmp_path):
    done, asked, project = run_setup(tmp_path / "env", PIP_INDEX_URL="https://mirror.example/simple")
    assert done.returncode == 0, done.stderr
    assert asked.startswith("index=https://mirror.example/simple pip install") and "-c constraints.txt" in asked
    assert (project / ".venv" / ".marin-stamp").is_file()
    done, asked, _ = run_setup(tmp_path / "conf", CONFIG_INDEX="https://pip-conf.example/simple")
    assert done.returncode == 0 and asked.startswith("index=https://pip-conf.example/simple "), done.stderr + asked
    done, asked, _ = run_setup(tmp_path / "none")
    assert done.returncode == 0 and asked.startswith("index= pip install"), done.stderr + asked  # uv's own default


def test_setup_that_cannot_import_a_dependency_says_which_and_leaves_no_stamp(tmp_path):
    done, _, project = run_setup(tmp_path, FAIL_IMPORT="mlflow")
    assert done.returncode == 1
    assert "setup failed: mlflow, matplotlib.pyplot" in done.stderr and "did not import" in done.stderr, done.stderr
    assert not (project / ".venv" / ".marin-stamp").exists()    # the next call sets up again
