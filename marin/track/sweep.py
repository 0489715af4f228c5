"""A sweep in MLflow: one parent run per launch, one child run per job.

Every job of a sweep (``run.sweep`` set by ``sweeps/<name>.yaml``, or any ``-m`` multirun)
finds its parent by a *sweep id* and creates it if absent, so the same code serves a local
sequential multirun (all jobs in one process) and a Slurm array (jobs in separate processes, or
all records made by the launcher at submit time). The sweep id is, in order:

1. ``run.sweep_id`` if set (to add jobs to an existing sweep later);
2. ``$MARIN_SWEEP_ID`` (a launcher may export one for its tasks);
3. ``$SLURM_ARRAY_JOB_ID`` (shared by the tasks of one job array);
4. the id the launcher pinned for this launch (`begin`: it makes the parent before any job);
5. one id per launch in this process: drawn anew when Hydra starts job 0 of a multirun.

Child runs are named by their swept overrides with short keys (``lr=0.001,router=qb``).

The parent also gets a sweep directory ``<run.out_dir>/sweeps/<name>-<sweep id>/`` with
``sweep.json`` (parent run id, tracking URI) and ``jobs.jsonl`` (one line per child), which
`python -m marin.status` and `python -m marin.forecast` accept in place of the parent's id.
"""
from __future__ import annotations

import json
import math
import os
import re
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from marin.config.schema import Config, RunConfig
from marin.config.store import override_key
from marin.config.validate import NOT_IN_RUN_NAME, RUN_NAME_MAX
from marin.track import backend, secrets
from marin.track.errors import first_line

PARENT, CHILD = "parent", "child"
TERMINAL = ("FINISHED", "FAILED", "KILLED")
_launch = {"id": uuid.uuid4().hex[:8]}


class SweepError(backend.TrackingUnavailable):
    """A sweep that cannot be tracked as asked: parallel jobs on a sqlite store. A kind of
    TrackingUnavailable, so launchers that report that one before submitting report this too."""


class SweepNotFound(LookupError):
    """Not a sweep directory, or not the parent run of a sweep."""


def _hydra():
    try:
        from hydra.core.hydra_config import HydraConfig

        return HydraConfig.get()
    except (ValueError, ImportError):
        return None


def _is_multirun(hc) -> bool:
    return hc is not None and str(hc.mode).endswith("MULTIRUN")


def sweep_name(cfg: Config) -> str | None:
    """The sweep this job belongs to, or None for a plain run."""
    if cfg.run.sweep:
        return cfg.run.sweep
    return "multirun" if _is_multirun(_hydra()) else None


def sweep_id(cfg: Config) -> str:
    explicit = cfg.run.sweep_id or os.environ.get("MARIN_SWEEP_ID") or os.environ.get("SLURM_ARRAY_JOB_ID")
    if explicit:
        return re.sub(r"[^\w.-]", "_", str(explicit))  # it goes into file names and MLflow filters
    if _launch.get("pinned"):
        return _launch["id"]
    hc = _hydra()
    if _job_num(hc) == 0 and _launch.get("job0") is not hc:  # job 0 of a new launch in this process
        _launch.update(id=uuid.uuid4().hex[:8], job0=hc)
    return _launch["id"]


def _job_num(hc) -> int | None:
    """Hydra's number of this job in its multirun; None outside one (or in a launcher's process)."""
    from omegaconf import OmegaConf

    if not _is_multirun(hc) or OmegaConf.is_missing(hc.job, "num"):
        return None
    return hc.job.num


def check_tracking(cfg: Config, uri: str) -> None:
    """A sqlite file takes one writer at a time; the jobs of a Slurm multirun write at once."""
    if _is_multirun(_hydra()) and cfg.hardware.launcher == "slurm" and backend.is_sqlite(uri):
        raise SweepError(
            f"tracking store {uri} is a sqlite file, which takes one writer at a time, but a Slurm sweep "
            "runs its jobs in parallel: start an MLflow server (mlflow server --backend-store-uri "
            f"{uri} ...) and pass tracking.uri=http://<host>:<port> (or set MLFLOW_TRACKING_URI)")



def swept_values() -> dict[str, list[str]]:
    """Each swept key and its values: `hydra.sweeper.params` merged with sweeps on the command
    line (the command line wins, as in Hydra's basic sweeper). Empty outside a multirun."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    hc = _hydra()
    if not _is_multirun(hc):
        return {}
    params = dict(hc.sweeper.get("params") or {}) if "sweeper" in hc else {}
    specs = [f"{k}={v}" for k, v in params.items()]
    specs += [a for a in sys.argv[1:] if "=" in a and not a.startswith("-")]
    values = {}
    try:
        for override in OverridesParser.create().parse_overrides(specs):
            if override.is_sweep_override():
                values[override.key_or_group] = list(override.sweep_string_iterator())
    except Exception:  # a launcher's own argv: keep what parsed
        pass
    return values


def _sweep_dir(cfg: Config, name: str, sid: str) -> Path:
    return backend.out_dir(cfg) / "sweeps" / f"{name}-{sid}"


def find_parent(client, exp_id: str, sid: str):
    runs = client.search_runs([exp_id], f"tags.sweep_id = '{sid}' and tags.sweep_role = '{PARENT}'",
                              order_by=["attributes.start_time ASC"])
    return sorted(runs, key=lambda r: (r.info.start_time, r.info.run_id))


@dataclass(frozen=True)
class Membership:
    """What ties a job to its sweep, read from Hydra in the job's process (`membership`); the
    parent run is found or made from it wherever the MLflow run is made (`attach`)."""
    name: str
    sweep_id: str
    folder: Path
    swept: dict            # each swept key and its values
    own: list[str]         # this job's swept overrides (redacted)
    expected: int | None   # jobs the multirun will run, when the command line says
    experiment: str
    number: int | None = None  # Hydra's number of this job in its multirun


def membership(cfg: Config, overrides: list[str]) -> Membership | None:
    """This job's sweep, or None for a plain run."""
    name = sweep_name(cfg)
    if not name:
        return None
    sid = sweep_id(cfg)
    swept = swept_values()
    expected = math.prod(len(v) for v in swept.values()) if swept and any(
        a in ("-m", "--multirun") for a in sys.argv) else None
    own = [secrets.redact_override(o) for o in overrides if override_key(o) in swept]
    return Membership(name, sid, _sweep_dir(cfg, name, sid), swept, own, expected, backend.experiment_name(cfg),
                      _job_num(_hydra()))


def job_name(name: str, member: Membership | None) -> str:
    """A sweep job's run.name, which names its run directory: the sweep's name (or `name`, where
    run.name was set) and the job's own swept overrides, `lr_grid-lr=0.001`,
    `router_ablation-lr=0.001+router=qb` (else its number, `lr_grid-job3`), so a sweep's
    directories say which job each is rather than `default-<hash>-…`. Kept to run.name's safe
    characters and length (marin.config.validate.RUN_NAME). `name` itself outside a sweep."""
    if member is None:
        return name
    base = member.name if name == RunConfig().name else name
    own = child_name(member.own) or (f"job{member.number}" if member.number is not None else "")
    if not own:
        return name
    # `,` between overrides would read as a sweep on a command line: `+`, as refs.find_job takes it
    own = NOT_IN_RUN_NAME.sub("_", own.replace(",", "+"))
    if name.endswith(f"-{own}"):  # named once
        return name
    return NOT_IN_RUN_NAME.sub("_", f"{base}-{own}").lstrip("._+=-")[:RUN_NAME_MAX]


def attach(client, exp_id: str, member: Membership | None, uri: str) -> tuple[dict, str | None]:
    """Tags that make this job a child of its sweep's parent (created if absent), and the id of
    the parent if this call created it (so a failed creation can remove it again)."""
    if member is None:
        return {}, None
    made = None
    parents = find_parent(client, exp_id, member.sweep_id)
    if not parents:
        made = _create_parent(client, exp_id, member, uri)
        parents = find_parent(client, exp_id, member.sweep_id)
        if parents and parents[0].info.run_id != made:  # another job was first: use its parent
            client.delete_run(made)
            made = None
    parent_id = parents[0].info.run_id if parents else made
    tags = {"mlflow.parentRunId": parent_id, "sweep": member.name, "sweep_id": member.sweep_id, "sweep_role": CHILD,
            "sweep_dir": str(member.folder), "sweep_overrides": json.dumps(member.own)}
    return tags, made


def _short_value(value: str) -> str:
    """A swept value for a run name: a dict's `name` if it has one (the ladder's rungs)."""
    if value.startswith("{"):
        match = re.search(r"\bname\s*:\s*([^,}]+)", value)
        if match:
            return match.group(1).strip()
    return value


def child_name(overrides: list[str]) -> str | None:
    """`["optim.lr=0.001", "router=qb"]` → `lr=0.001,router=qb` (the last part of each key);
    None when nothing was swept. Keys that would clash keep their full path."""
    keys = [override_key(o) for o in overrides]
    short = [k.rsplit(".", 1)[-1] for k in keys]
    parts = []
    for o, k, s in zip(overrides, keys, short):
        value = _short_value(o.split("=", 1)[1]) if "=" in o else ""
        parts.append(f"{s if short.count(s) == 1 else k}={value}")
    return ",".join(parts)[:250] or None


def run_name(tags: dict) -> str | None:
    """The MLflow run name of a sweep's child (from `attach`'s tags); None outside a sweep."""
    if not tags.get("sweep_overrides"):
        return None
    return child_name(json.loads(tags["sweep_overrides"]))


def _create_parent(client, exp_id, member: Membership, uri: str) -> str:
    tags = {"sweep": member.name, "sweep_id": member.sweep_id, "sweep_role": PARENT, "sweep_dir": str(member.folder),
            "sweep_params": json.dumps(member.swept)}
    if member.expected:
        tags["expected_jobs"] = str(member.expected)
    run_id = client.create_run(exp_id, tags=tags, run_name=f"{member.name}-{member.sweep_id}").info.run_id
    member.folder.mkdir(parents=True, exist_ok=True)
    info = {"parent_run_id": run_id, "tracking_uri": secrets.safe_uri(uri), "experiment_id": exp_id,
            "experiment": member.experiment, "sweep": member.name, "sweep_id": member.sweep_id,
            "params": member.swept, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if member.expected:  # also here: `marin.status` lists sweeps from their directories
        info["expected_jobs"] = member.expected
    secrets.write_private(member.folder / "sweep.json", json.dumps(secrets.redact(info), indent=2) + "\n")
    return run_id


def note_child(record, tags: dict) -> None:
    """One line per child in the sweep directory's jobs.jsonl (O_APPEND: safe for parallel jobs)."""
    folder = Path(tags["sweep_dir"])
    folder.mkdir(parents=True, exist_ok=True)
    line = secrets.mask(json.dumps({"run_id": record.run_id, "run_dir": str(record.run_dir),
                                    "overrides": json.loads(tags["sweep_overrides"])})) + "\n"
    # 0600 whatever the umask, as every file that can hold what masking missed (the overrides)
    fd = os.open(folder / "jobs.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        os.fchmod(fd, 0o600)  # one made before this rule keeps its mode through O_CREAT
        os.write(fd, line.encode())
    finally:
        os.close(fd)


@dataclass
class Launch:
    """A sweep's parent as made by the launcher before its first job."""
    name: str
    sweep_id: str
    parent_id: str
    folder: Path
    uri: str
    experiment: str


def begin(cfg: Config, expected: int) -> Launch | None:
    """Before the first job of a multirun that trains: pin the sweep id for this launch's jobs
    and make (or reopen) the parent run, so its id and directory can be shown before any job runs.
    None for a job outside a sweep. Raises TrackingUnavailable before anything is written."""
    name = sweep_name(cfg)
    if not name:
        return None
    sid = sweep_id(cfg)
    _launch.update(id=sid, pinned=True, job0=None, children=[])
    uri = backend.tracking_uri(cfg)
    backend.check_reachable(uri)
    check_tracking(cfg, uri)
    client = backend.client(uri)
    exp_name = backend.experiment_name(cfg)
    exp_id = backend.experiment_id(client, exp_name, uri)
    folder = _sweep_dir(cfg, name, sid)
    parents = find_parent(client, exp_id, sid)
    if parents:  # jobs added to an existing sweep (run.sweep_id): it runs again until they end
        parent_id = parents[0].info.run_id
        total = len(children(client, parents[0])) + expected
        client.set_tag(parent_id, "expected_jobs", str(total))
        _note_expected(folder, total)
        client.update_run(parent_id, status="RUNNING")
    else:
        member = Membership(name, sid, folder, swept_values(), [], expected, exp_name)
        parent_id = _create_parent(client, exp_id, member, uri)
    return Launch(name, sid, parent_id, folder, uri, exp_name)


def _note_expected(folder: Path, total: int) -> None:
    """The sweep's expected job count in its sweep.json too (read by `marin.status` without MLflow)."""
    path = folder / "sweep.json"
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    info["expected_jobs"] = total
    secrets.write_private(path, json.dumps(info, indent=2) + "\n")


def made_child(run_id: str) -> None:
    """A job of this process's launch made its run (`end` closes the ones left running)."""
    if "children" in _launch:
        _launch["children"].append(run_id)


def release() -> None:
    """Forget the pinned sweep id (jobs submitted elsewhere close their parent themselves)."""
    _launch.pop("pinned", None)
    _launch.pop("children", None)


def end(launch: Launch, interrupted: bool = False) -> str | None:
    """After this process has run its jobs: children it made that are still RUNNING are gone
    (KILLED if the launch was interrupted, else FAILED), and the parent ends FINISHED when every
    expected job finished, KILLED if interrupted, else FAILED. A parent whose other children
    (another launch's) still run stays open. Returns the parent's status."""
    _launch.pop("pinned", None)
    client = backend.client(launch.uri)
    mine = set(_launch.pop("children", []))
    parent = client.get_run(launch.parent_id)
    kids = children(client, parent)
    for kid in kids:
        if kid.info.run_id in mine and kid.info.status not in TERMINAL:
            client.set_terminated(kid.info.run_id, "KILLED" if interrupted else "FAILED")
    kids = children(client, parent)
    if any(k.info.status not in TERMINAL for k in kids):
        return parent.info.status
    expected = int(parent.data.tags.get("expected_jobs") or 0)
    if interrupted:
        status = "KILLED"
    elif len(kids) >= expected and kids and all(k.info.status == "FINISHED" for k in kids):
        status = "FINISHED"
    else:
        status = "FAILED"
    client.set_terminated(launch.parent_id, status)
    return status


def children(client, parent) -> list:
    exp_id = parent.info.experiment_id
    return list(client.search_runs([exp_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'",
                                   order_by=["attributes.start_time ASC"], max_results=10000))


def close_if_done(client, parent_id: str) -> str | None:
    """End the parent once every child has ended (and, when the sweep's size is known, all of
    them exist): FINISHED if they all finished, FAILED if one failed, else KILLED. Returns the
    status set, if any."""
    parent = client.get_run(parent_id)
    if parent.info.status in TERMINAL:
        return None
    kids = children(client, parent)
    expected = parent.data.tags.get("expected_jobs")
    if not kids or any(k.info.status not in TERMINAL for k in kids):
        return None
    if expected and len(kids) < int(expected):
        return None
    states = {k.info.status for k in kids}
    status = "FINISHED" if states == {"FINISHED"} else "FAILED" if "FAILED" in states else "KILLED"
    client.set_terminated(parent_id, status)
    return status


def sweeps_root(out_dir: str | None = None) -> Path:
    return backend.out_dir(Config(run=RunConfig(out_dir=out_dir)) if out_dir else Config()) / "sweeps"


def find_sweep_dir(name: str, out_dir: str | None = None) -> Path | None:
    """The newest sweep directory of sweep `name` (`lr_grid` → sweeps/lr_grid-<newest id>), or
    the directory `name` itself (`lr_grid-1a2b3c4d`); None if there is none."""
    root = sweeps_root(out_dir)
    if (root / name / "sweep.json").is_file():
        return root / name
    found = [p for p in root.glob(f"{name}-*") if p.name.rsplit("-", 1)[0] == name and (p / "sweep.json").is_file()]
    return max(found, key=lambda p: (p / "sweep.json").stat().st_mtime) if found else None


def open_parent(ref: str, tracking_uri: str | None = None, out_dir: str | None = None):
    """(client, parent run) of a sweep: its directory (sweep.json), its name (the newest sweep
    directory of that name under `<out_dir>/sweeps`) or its parent run id. The store is
    `tracking_uri`, else the sweep directory's, $MLFLOW_TRACKING_URI or the project's."""
    folder = Path(ref).expanduser()
    if not (folder / "sweep.json").is_file() and "/" not in ref and not folder.exists():
        folder = find_sweep_dir(ref, out_dir) or folder
    if (folder / "sweep.json").is_file():
        info = json.loads((folder / "sweep.json").read_text())
        ref, tracking_uri = info["parent_run_id"], tracking_uri or info["tracking_uri"]
    elif "/" in ref or folder.exists():
        raise SweepNotFound(f"{ref}: not a sweep directory (no sweep.json)")
    elif not re.fullmatch(r"[0-9a-f]{32}", ref):
        raise SweepNotFound(f"{ref}: no sweep of that name under {sweeps_root(out_dir)}, and not an MLflow run id")
    uri = tracking_uri or backend.default_uri()
    if backend.is_sqlite(uri) and not backend.sqlite_path(uri).exists():
        raise SweepNotFound(f"{ref}: no MLflow store at {uri}")
    backend.check_reachable(uri)
    client = backend.client(uri)
    try:
        parent = client.get_run(ref)
    except Exception as err:
        raise SweepNotFound(f"{ref}: no such run in {secrets.safe_uri(uri)} ({first_line(err)})") from None
    if parent.data.tags.get("sweep_role") != PARENT:
        raise SweepNotFound(f"{ref}: not the parent run of a sweep")
    return client, parent
