"""The project's scripts (scripts/) where a test can run them without root or side effects: the
commands they would change the machine with are stand-ins on PATH that record their arguments."""
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
