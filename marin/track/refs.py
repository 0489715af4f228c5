"""How a run or a sweep is named on a command line: the one resolver behind every tool
(`marin.status`, `.diff`, `.report`, `.generate`, `.lineage`) and `resume=` / `reproduce=` / `fork=`
(all go through `record.open` or `open_sweep`).

A run is named by
- its directory (a path), or its directory's name under ``<out_dir>/runs/``;
- its `run.name` (before the longer names that begin with it: its replays and forks), a unique
  prefix of its directory's name, or of its MLflow run id (the ids are read from the runs'
  ``record.json``, no store needed); a full 32-character id is looked up in the store;
- ``<sweep>/<job>``: a sweep (named as below) and one of its jobs by its override name as
  `marin.status` prints it (``lr_grid/lr=0.001``), or by enough of it to be unique
  (``router=qb`` alone in a sweep of lr × router names one job per lr: the error lists them).
  ``:`` and ``+`` stand for ``=`` and ``,`` (``resume=lr_grid/lr:0.001``); launch.py quotes a
  run reference holding ``=`` for Hydra (`marin.launch.entry.quote_run_references`), so
  ``fork=grid/lr=0.001@200`` works as well.

A sweep is named by its directory, its name (the newest sweep of that name), its directory's
name or a unique prefix of it, or a unique prefix of its parent's MLflow run id.

Only names are resolved here (files under `out_dir`); opening the run or sweep is
`record.open` / `sweep.open_parent`.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from marin.config.schema import Config, RunConfig
from marin.track import backend, sweep

FULL_ID = re.compile(r"[0-9a-f]{32}")
# A run directory's name: <run.name>-<config hash 8>-<date>-<time>-<unique 6> (record._new_run_dir)
RUN_DIR_NAME = re.compile(r"(?P<name>.+)-[0-9a-f]{8}-\d{8}-\d{6}-[0-9a-f]{6}")
MIN_ID_PREFIX = 4  # shorter hex strings match too many ids to be meant as one
SHOWN = 5          # candidates named in an "ambiguous" error


class RefError(LookupError):
    """A name that matches no run, or more than one; the message is one line."""


def out_root(out_dir: str | Path | None = None) -> Path:
    """`run.out_dir` as given, else the project's (where runs/ and sweeps/ are)."""
    return backend.out_dir(Config(run=RunConfig(out_dir=str(out_dir))) if out_dir else Config())


def _id_prefix(ref: str) -> bool:
    return len(ref) >= MIN_ID_PREFIX and re.fullmatch(r"[0-9a-f]+", ref) is not None


def read_json(path: Path) -> dict:
    """A record.json or sweep.json; {} for one that is missing or cut short."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):   # RecursionError: nested past the parser's depth
        return {}


def _one(ref: str, matches: list, what: str, names) -> object | None:
    """The single match, None for none; several are an error naming a few of them."""
    if len(matches) > 1:
        shown = ", ".join(names(m) for m in matches[:SHOWN]) + (f" (+{len(matches) - SHOWN} more)" if len(matches) > SHOWN else "")
        raise RefError(f"{ref}: names {len(matches)} {what}: {shown}; give more of it")
    return matches[0] if matches else None


# ---------------------------------------------------------------------------- runs

def run_dirs(out_dir: str | Path | None = None) -> list[Path]:
    """The run directories under `<out_dir>/runs/` (those with a record.json), newest first."""
    runs = out_root(out_dir) / "runs"
    found = [p for p in runs.glob("*") if (p / "record.json").is_file()] if runs.is_dir() else []
    return sorted(found, key=lambda p: (p / "record.json").stat().st_mtime, reverse=True)


def find_run(ref: str, out_dir: str | Path | None = None) -> Path | str:
    """The run directory `ref` names, or the full MLflow run id to look up in the store."""
    ref = str(ref)
    if not ref.strip():  # Path("") is the working directory
        raise RefError("the run is empty: give its directory, its name or its MLflow run id")
    runs = out_root(out_dir) / "runs"
    for candidate in (Path(ref).expanduser(), runs / ref):
        if candidate.is_dir():
            return candidate.resolve()
    if "/" in ref:
        folder, _, job = ref.rpartition("/")
        if job and names_sweep(folder, out_dir):
            return find_job(folder, job, out_dir)
        raise RefError(f"{ref}: no such run directory")
    if FULL_ID.fullmatch(ref):
        return ref
    dirs = run_dirs(out_dir) if ref else []
    by_id = {p: read_json(p / "record.json").get("run_id", "") for p in dirs} if _id_prefix(ref) else {}
    matches = [p for p in dirs if p.name.startswith(ref) or str(by_id.get(p, "")).startswith(ref)]
    # A run's whole name names it before the longer names it begins (its replays `<name>-verify`,
    # `<name>-reproduce`, its forks `<name>-step<N>`), so making those leaves it addressable.
    named = [p for p in matches if (m := RUN_DIR_NAME.fullmatch(p.name)) and m["name"] == ref]
    matches = named or matches
    ids = {str(by_id.get(p, "")) for p in matches}
    if len(matches) > 1 and len(ids) == 1 and FULL_ID.fullmatch(run_id := ids.pop()):
        return run_id  # copies of one run's directory: the store knows which one is the run's
    if len(matches) > 1 and (folder := sweep_folder(ref, out_dir)):  # `lr_grid`: a job, as marin.status names them
        every = jobs(folder)
        shown = ", ".join(f"{ref}/{j['name']}" for j in every[:SHOWN]) + (f" (+{len(every) - SHOWN} more)"
                                                                         if len(every) > SHOWN else "")
        raise RefError(f"{ref}: a sweep of {len(every)} jobs, not one run: name a job, {shown or '<sweep>/<job>'}")
    found = _one(ref, matches, "runs", lambda p: p.name)
    if found is None:
        raise RefError(f"{ref}: no run directory, directory name, run id or unique prefix of one under {runs} "
                       "(a sweep's job: <sweep>/<job name>)")
    return found


# ---------------------------------------------------------------------------- sweeps

def sweep_dirs(out_dir: str | Path | None = None) -> list[Path]:
    """The sweep directories under `<out_dir>/sweeps/` (those with a sweep.json), newest first."""
    root = out_root(out_dir) / "sweeps"
    found = [p for p in root.glob("*") if (p / "sweep.json").is_file()] if root.is_dir() else []
    return sorted(found, key=lambda p: (p / "sweep.json").stat().st_mtime, reverse=True)


def find_sweep(ref: str, out_dir: str | Path | None = None) -> Path | str:
    """The sweep directory `ref` names, or `ref` itself for `sweep.open_parent` to judge (a full
    parent run id, or something it will say is no sweep)."""
    ref = str(ref)
    folder = Path(ref).expanduser()
    if (folder / "sweep.json").is_file():
        return folder
    if "/" in ref or folder.exists() or not ref:
        return ref
    named = sweep.find_sweep_dir(ref, str(out_dir) if out_dir else None)
    if named is not None:
        return named
    if FULL_ID.fullmatch(ref):
        return ref
    dirs = sweep_dirs(out_dir)
    by_id = {p: str(read_json(p / "sweep.json").get("parent_run_id", "")) for p in dirs} if _id_prefix(ref) else {}
    matches = [p for p in dirs if p.name.startswith(ref) or by_id.get(p, "").startswith(ref)]
    found = _one(ref, matches, "sweeps", lambda p: p.name)
    return found if found is not None else ref


def sweep_folder(ref: str, out_dir: str | Path | None = None) -> Path | None:
    """The directory of the sweep `ref` names under `out_dir`, or None; a full id that is no local
    sweep's parent is left to the store."""
    try:
        found = find_sweep(ref, out_dir)
    except RefError:
        return None
    return found if isinstance(found, Path) else None


def names_sweep(ref: str, out_dir: str | Path | None = None) -> bool:
    """Whether `ref` names a sweep found under `out_dir` (tools that take a run or a sweep try the
    sweep first)."""
    return sweep_folder(ref, out_dir) is not None


def open_sweep(ref: str, tracking_uri: str | None = None, out_dir: str | Path | None = None):
    """(client, parent run) of the sweep `ref` names (`sweep.open_parent`); SweepNotFound or
    TrackingUnavailable otherwise."""
    try:
        found = find_sweep(ref, out_dir)
    except RefError as err:
        raise sweep.SweepNotFound(str(err)) from None
    return sweep.open_parent(str(found), tracking_uri, str(out_dir) if out_dir else None)


def jobs(folder: Path) -> list[dict]:
    """A sweep directory's jobs (jobs.jsonl: run_id, run_dir, overrides) with their `name`."""
    out = []
    try:
        lines = (folder / "jobs.jsonl").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            job = json.loads(line)
        except ValueError:
            continue  # a line cut short by a crash
        job["name"] = sweep.child_name(job.get("overrides") or []) or job.get("run_id", "")
        out.append(job)
    return out


def find_job(sweep_ref: str, name: str, out_dir: str | Path | None = None) -> Path | str:
    """The run directory (or, if it is not here, the run id) of the job `name` of a sweep: its
    override name, or parts of it (``router=qb``), or its full overrides (``optim.lr=0.001``)."""
    folder = Path(find_sweep(sweep_ref, out_dir))
    parts = [p if "=" in p or ":" not in p else p.replace(":", "=", 1) for p in re.split(r"[,+]", name)]
    name, wanted = ",".join(parts), set(parts)
    every = jobs(folder)
    exact = [j for j in every if j["name"] == name]
    matches = exact or [j for j in every if wanted <= set(j["name"].split(",")) | set(j.get("overrides") or [])]
    found = _one(f"{sweep_ref}/{name}", matches, "jobs", lambda j: j["name"])
    if found is None:
        names = ", ".join(j["name"] for j in every[:SHOWN]) or "none yet"
        raise RefError(f"{sweep_ref}/{name}: no job of sweep {folder.name} is named {name} (its jobs: {names})")
    run_dir = Path(found.get("run_dir") or "")
    return run_dir if found.get("run_dir") and run_dir.is_dir() else found["run_id"]
