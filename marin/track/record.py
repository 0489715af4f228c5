"""The run record: one directory and one MLflow run per run, made once, after validation.

A run directory ``<run.out_dir>/runs/<run.name>-<config hash 8>-<unique id>/`` (a sweep's job:
``<sweep>-<its overrides>-…``, `sweep.job_name`) holds

    composed.yaml   the config as composed (with its ``auto`` leaves): what reproduction starts from
    resolved.yaml   every derived value filled in: what was trained
    overrides.yaml  the command-line overrides, in order
    record.json     provenance: MLflow run id, git commit/dirty flag, packages, platform, seeds
    git.diff        uncommitted changes at creation (when the tree was dirty)
    run.log         the run's log lines from creation on, the eval lines among them (masked)

and the MLflow run gets the resolved config as flattened params, provenance as tags and the
three config files as artifacts. Creation is all or nothing: a failure removes the directory and
deletes the MLflow run.

Secrets never reach any of it: every text written goes through `marin.track.secrets` (values
under secret-looking names, and those values wherever else they appear, are <redacted>; so are
passwords in URIs). The directory is always inside run.out_dir.
"""
from __future__ import annotations

import dataclasses
import errno
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf

from marin.config.paths import PROJECT_ROOT
from marin.config.schema import Config, RunConfig
from marin.config.store import override_key
from marin.track import backend, refs, runfiles, secrets, sweep
from marin.track.errors import first_line

log = logging.getLogger("marin.track")

COMPOSED, RESOLVED, OVERRIDES, INFO, DIFF = "composed.yaml", "resolved.yaml", "overrides.yaml", "record.json", "git.diff"
LOG = "run.log"  # the run's log lines (attach_log)
LONG_PARAMS = "record/long_params.json"  # MLflow artifact: params past its limit, whole
# Leaves that do not change what is trained: left out of the config hash.
UNHASHED = ("tracking", "run", "data.root", "data.cache_dir", "reproduce", "resume", "fork", "dry_run", "wait",
            "verify", "verify_steps", "verify_rtol")
# Environment variables worth keeping for provenance (secret-looking ones are redacted).
ENV_PREFIXES = ("SLURM_", "JAX_", "XLA_", "PJRT_", "CUDA_", "NCCL_", "NVIDIA_", "MLFLOW_", "HYDRA_",
                "MARIN_", "OMP_", "TPU_")


# Folders tools write into the project that are no source: they never make a run "dirty" (`mlflow ui`
# started in the project keeps its artifacts in ./mlartifacts, a file store in ./mlruns).
NOT_SOURCE = ("mlartifacts", "mlruns", "outputs")


class RecordError(LookupError):
    """A run that does not exist or lacks a config; the message names what is missing."""


@dataclass(frozen=True)
class RunRecord:
    run_dir: Path
    run_id: str
    tracking_uri: str
    experiment_name: str

    def path(self, name: str) -> Path:
        return self.run_dir / name

    def info(self) -> dict:
        return json.loads(self.path(INFO).read_text())

    def overrides(self) -> list[str]:
        return list(yaml.safe_load(self.path(OVERRIDES).read_text()) or [])

    def composed(self) -> DictConfig:
        return OmegaConf.create(load_config_file(self.path(COMPOSED)))

    def resolved(self) -> DictConfig:
        return OmegaConf.create(load_config_file(self.path(RESOLVED)))


def load_config_file(path: Path) -> dict:
    """A run's saved config (composed.yaml, resolved.yaml, a resume's resolved.resume-N.yaml) as a
    dict, read as OmegaConf.load reads it; a file that is not a YAML mapping is a RecordError naming
    it, not a parser's traceback."""
    from omegaconf._utils import get_yaml_loader   # OmegaConf.load's own reader (`1e-3` a float)

    try:
        data = yaml.load(Path(path).read_text(), Loader=get_yaml_loader())
    except (OSError, UnicodeDecodeError, yaml.YAMLError, RecursionError) as err:
        raise RecordError(f"{path} is damaged ({type(err).__name__}: {' '.join(str(err).split())[:160]}); "
                          f"restore it from the MLflow run's record/ artifacts") from None
    if not isinstance(data, dict):
        raise RecordError(f"{path} is damaged (a {type(data).__name__}, not a config mapping); "
                          f"restore it from the MLflow run's record/ artifacts")
    return data


def check_info(info, path: Path) -> None:
    """Refuse a record.json that is not an object, or whose fields have the wrong type (one line)."""
    problem = runfiles.info_problem(info)
    if problem:
        raise RecordError(f"{path} is damaged: {problem}; restore it from the MLflow run's record/ artifacts")


# ---------------------------------------------------------------------------- config as data

def config_dict(cfg: Config | DictConfig) -> dict:
    """A plain dict of a config dataclass or DictConfig (no interpolation left)."""
    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True)
    return dataclasses.asdict(cfg)  # the same tree, without OmegaConf's (slow) node building


def flatten(tree, prefix: str = "") -> dict:
    """Dotted keys for nested dicts; lists stay whole (one leaf)."""
    if isinstance(tree, dict) and tree:
        out = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def _drop(tree: dict, dotted: str) -> None:
    *parents, last = dotted.split(".")
    for part in parents:
        tree = tree.get(part, {})
    if isinstance(tree, dict):
        tree.pop(last, None)


def config_hash(resolved: Config | DictConfig) -> str:
    """sha256 of the resolved config without bookkeeping and site-specific leaves."""
    tree = config_dict(resolved)
    for name in UNHASHED:
        _drop(tree, name)
    return hashlib.sha256(json.dumps(tree, sort_keys=True, default=str).encode()).hexdigest()


def to_yaml(tree: dict) -> str:
    return OmegaConf.to_yaml(OmegaConf.create(tree))


# ---------------------------------------------------------------------------- provenance

def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(PROJECT_ROOT), *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def git_state() -> tuple[dict, str]:
    """(commit, dirty flag, untracked files) and the diff against HEAD (secret assignments in it
    redacted: `secrets.mask_assignments`).

    Dirty means a tracked file changed, or a new file appeared in a folder the project tracks
    (``marin/new_module.py`` can change what runs). Untracked files elsewhere (notes at the top,
    a scratch folder) are listed but leave the run clean: they cannot change what was trained."""
    commit = (_git("rev-parse", "HEAD") or "").strip() or None
    status = _git("status", "--porcelain", "--", ".", *(f":(exclude){d}" for d in NOT_SOURCE)) or ""
    lines = status.splitlines()
    untracked = [line[3:] for line in lines if line.startswith("??")]
    folders = set((_git("ls-tree", "--name-only", "-d", "HEAD") or "").split()) if commit else set()
    changed = [line for line in lines if not line.startswith("??")]
    new_source = [path for path in untracked if "/" in path and path.split("/", 1)[0] in folders]
    diff = (_git("diff", "HEAD", "--binary") or "") if commit else ""
    branch = (_git("rev-parse", "--abbrev-ref", "HEAD") or "").strip()
    remote = secrets.safe_uri((_git("remote", "get-url", "origin") or "").strip())
    return {"commit": commit, "branch": branch if branch not in ("", "HEAD") else None, "remote": remote or None,
            "dirty": bool(changed or new_source), "untracked": untracked}, secrets.mask_assignments(diff)


@functools.lru_cache(maxsize=1)  # reading every package's metadata takes a good fraction of a second
def package_versions() -> dict[str, str]:
    versions = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            versions[name.lower()] = dist.version
    return dict(sorted(versions.items()))


def environment() -> dict[str, str]:
    chosen = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)}
    return secrets.redact(dict(sorted(chosen.items())))


def config_search_path() -> list[str]:
    """The config folders this job was composed with besides the project's conf/ (`--config-dir`,
    `hydra.searchpath`), as Hydra URLs with absolute paths: reproduce=/resume= compose with them
    again (marin.launch.reproduce). Empty outside @hydra.main."""
    from hydra.core.hydra_config import HydraConfig

    try:
        sources = HydraConfig.get().runtime.config_sources
    except ValueError:  # not under Hydra (tests calling create directly)
        return []
    found = []
    for source in sources:
        if source.provider != "command-line" and not str(source.provider).startswith("hydra.searchpath"):
            continue  # main (conf/), hydra's own, the schema store, the site folder (marin.config.site)
        url = f"file://{os.path.abspath(source.path)}" if source.schema == "file" else f"{source.schema}://{source.path}"
        if url not in found:
            found.append(url)
    return found


def provenance(search_path: list[str], argv: list[str]) -> tuple[dict, str]:
    """record.json's provenance; `search_path` and `argv` are the launching process's."""
    git, diff = git_state()
    return {
        "config_search_path": search_path,
        "git": git,
        "packages": package_versions(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "argv": argv,
        "env": environment(),
    }, diff


def update_info(record: RunRecord, **fields) -> None:
    """Merge fields into record.json (e.g. devices, added by the loop once JAX is up)."""
    info = record.info()
    info.update(fields)
    _write_json(record.path(INFO), info)


def _write_json(path: Path, data: dict) -> None:
    secrets.write_private(path, json.dumps(data, indent=2, default=str) + "\n")


def _write_text(path: Path, text: str) -> None:
    secrets.write_private(path, text)


# ---------------------------------------------------------------------------- create

def _new_run_dir(root: Path, name: str, digest: str) -> Path:
    """A fresh directory directly inside `root`; never an existing one (the unique id is drawn
    again on a clash). validate.check_run_name refuses names with separators; this is the net."""
    root.mkdir(parents=True, exist_ok=True)
    name = secrets.mask(name)
    while True:
        unique = time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]
        path = root / f"{name}-{digest[:8]}-{unique}"
        if path.resolve().parent != root.resolve():
            raise ValueError(f"run.name {name!r} would put the run directory outside {root}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue


def mlflow_params(resolved_tree: dict) -> tuple[dict[str, str], dict[str, str]]:
    """(params, too_long): flattened, stringified; a value past MLflow's limit is logged cut short,
    with a note saying so (`shortened`), and whole in `too_long` (record/long_params.json; the
    resolved config artifact has it too)."""
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    params, too_long = {}, {}
    for key, value in flatten(resolved_tree).items():
        text = secrets.mask(json.dumps(value) if isinstance(value, (list, dict)) else str(value))
        if len(text) > MAX_PARAM_VAL_LENGTH:
            too_long[key] = text
        params[key] = shortened(text, MAX_PARAM_VAL_LENGTH, f"record/{RESOLVED}")
    return params, too_long


def shortened(text: str, limit: int, whole_in: str) -> str:
    """`text` if it has at most `limit` characters, else its start and a note of its length and
    of where it is whole, `limit` characters in all (MLflow refuses a longer param or tag)."""
    if len(text) <= limit:
        return text
    note = f" …(truncated: {len(text):,} characters, whole in {whole_in})"
    return text[: max(limit - len(note), 0)] + note[: limit]


def tag_value(text: str, whole_in: str = f"record/{INFO}") -> str:
    """A tag's value within MLflow's limit (`shortened`)."""
    from mlflow.utils.validation import MAX_TAG_VAL_LENGTH

    return shortened(text, MAX_TAG_VAL_LENGTH, whole_in)


_tag_value = tag_value  # marin.launch.resume's name for it


def list_tag(items: list[str], whole_in: str) -> str:
    """A list of strings (overrides) as a JSON tag that stays JSON within MLflow's limit: each
    item past an equal share is shortened (`shortened`), never the JSON text itself, which
    readers parse (marin.report, marin.status)."""
    from mlflow.utils.validation import MAX_TAG_VAL_LENGTH

    share = MAX_TAG_VAL_LENGTH
    while True:
        text = json.dumps([shortened(i, share, whole_in) for i in items])
        if len(text) <= MAX_TAG_VAL_LENGTH or share <= 1:
            return text
        share //= 2


@dataclass(frozen=True)
class Draft:
    """A run directory with its config written, before its MLflow run exists (`prepare`): what
    `register` needs to make that run (in the tracking process: marin.track.worker)."""
    run_dir: Path
    uri: str
    experiment_name: str
    digest: str
    resolved: Config
    overrides: list[str]          # as typed (register finds the secrets in them again)
    sweep: object                 # marin.track.sweep.Membership, or None
    search_path: list[str]
    argv: list[str]

    @property
    def tracking_uri(self) -> str:
        return self.uri


def create(composed: Config, resolved: Config, overrides: list[str]) -> RunRecord:
    """Make the run directory and its MLflow run here (after validation). All or nothing."""
    draft = prepare(composed, resolved, overrides)
    try:
        return made(register(draft), draft)
    except BaseException:
        abandon(draft)
        raise


def prepare(composed: Config, resolved: Config, overrides: list[str]) -> Draft:
    """Check the store, then make the run directory with its config files; its log lines go to
    run.log from now on. No MLflow: `register` makes the run."""

    uri = backend.tracking_uri(resolved)
    backend.check_reachable(uri)  # before anything is written
    sweep.check_tracking(resolved, uri)
    _scan_secrets(resolved, overrides)
    safe_overrides = [secrets.redact_override(o) for o in overrides]
    digest = config_hash(resolved)
    member = sweep.membership(resolved, overrides)
    # A sweep's job is named after the sweep and its own overrides (`lr_grid-lr=0.001`), in both
    # configs, so its directory, saved config, MLflow tags and trainer agree (run.name is not hashed).
    composed.run.name = resolved.run.name = sweep.job_name(resolved.run.name, member)
    run_dir = _new_run_dir(backend.out_dir(resolved) / "runs", resolved.run.name, digest)
    draft = Draft(run_dir, uri, backend.experiment_name(resolved), digest, resolved, list(overrides),
                  member, config_search_path(), [secrets.redact_override(a) for a in sys.argv])
    try:
        _write_text(run_dir / COMPOSED, to_yaml(secrets.redact(config_dict(composed))))
        _write_text(run_dir / RESOLVED, to_yaml(secrets.redact(config_dict(resolved))))
        _write_text(run_dir / OVERRIDES, yaml.safe_dump(safe_overrides, default_flow_style=False))
        attach_log(draft)
    except BaseException:
        abandon(draft)
        raise
    return draft


def register(draft: Draft) -> RunRecord:
    """Make the MLflow run of a prepared directory: provenance, the run with its params and tags,
    record.json, the record's artifacts. A failure deletes what it made and raises (the caller
    removes the directory: `abandon`)."""

    resolved, uri, run_dir = draft.resolved, draft.uri, draft.run_dir
    _scan_secrets(resolved, draft.overrides)  # again: this may be the tracking process
    safe_overrides = [secrets.redact_override(o) for o in draft.overrides]
    client, run_id, made_parent, sweep_tags = None, None, None, {}
    try:
        info, diff = provenance(draft.search_path, draft.argv)
        if diff:
            _write_text(run_dir / DIFF, diff)
        client = backend.client(uri)
        exp_id = backend.experiment_id(client, draft.experiment_name, uri)
        sweep_tags, made_parent = sweep.attach(client, exp_id, draft.sweep, uri)
        tags = {
            "git_commit": info["git"]["commit"] or "unknown",
            "git_dirty": str(info["git"]["dirty"]).lower(),
            "config_hash": draft.digest,
            "run_dir": str(run_dir),
            "overrides": list_tag(safe_overrides, f"record/{OVERRIDES}"),
            "run_name": resolved.run.name,
            "model": resolved.model.name,
            "router": resolved.router.kind,
            "hardware": resolved.hardware.name,
            **({"experiment": resolved.run.experiment} if resolved.run.experiment else {}),
            **_mlflow_system_tags(info, draft.argv),
            **sweep_tags,
        }
        if resolved.reproduce:
            tags["reproduced_from"] = str(resolved.reproduce)
            if resolved.verify:
                tags["verification_of"] = str(resolved.reproduce)  # marin/launch/verify.py adds verify_result
        if resolved.fork:  # <parent run id>@<step> (marin/launch/fork.py); the lineage follows these
            tags["forked_from"] = str(resolved.fork)
        if "sweep_overrides" in tags:  # JSON its readers parse: shortened item by item
            tags["sweep_overrides"] = list_tag(json.loads(tags["sweep_overrides"]), f"record/{OVERRIDES}")
        tags = {k: tag_value(secrets.mask(str(v))) for k, v in tags.items()}
        run_name = secrets.mask(sweep.run_name(sweep_tags)
                                or display_name(resolved.run.name, safe_overrides, unique_suffix(run_dir)))
        run_id = client.create_run(exp_id, tags=tags, run_name=run_name).info.run_id
        _log_params(client, run_id, secrets.redact(config_dict(resolved)))
        info = {"run_id": run_id, "tracking_uri": secrets.safe_uri(uri), "experiment": draft.experiment_name,
                "experiment_id": exp_id, "name": resolved.run.name, "config_hash": draft.digest,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "schema_version": resolved.schema_version,
                "seeds": {"train.seed": resolved.train.seed}, "overrides": safe_overrides,
                "sweep": sweep_tags or None, **info}
        _write_json(run_dir / INFO, info)
        for name in (COMPOSED, RESOLVED, OVERRIDES, INFO, DIFF):
            if (run_dir / name).exists():
                client.log_artifact(run_id, str(run_dir / name), artifact_path="record")
        rec = RunRecord(run_dir, run_id, uri, draft.experiment_name)
        if sweep_tags:
            sweep.note_child(rec, sweep_tags)
    except BaseException:
        for made_run in (run_id, made_parent):
            if made_run and client is not None:
                _discard(client, made_run)
        if made_parent:
            shutil.rmtree(sweep_tags["sweep_dir"], ignore_errors=True)
        raise
    log.info("run %s: %s (MLflow %s, experiment %s)", run_id, run_dir, secrets.safe_uri(uri), draft.experiment_name)
    return rec


def unique_suffix(run_dir: Path) -> str:
    """The random end of a run directory's name (`probe-<hash>-<date>-<time>-47d4e7` → 47d4e7)."""
    return Path(run_dir).name.rsplit("-", 1)[-1]


def display_name(name: str, overrides: list[str], suffix: str = "") -> str:
    """A single run's name in MLflow's table: `run.name`, its directory's unique suffix (two runs
    of one command line are two rows, told apart and matched to their directories) and what its
    command line changed, as a sweep's children are named (`sweep.child_name`):
    ``probe-47d4e7 model=tiny,lr=0.002``. Overrides of bookkeeping (where it is stored, its name:
    `UNHASHED`) are left out; the run directory is the `run_dir` tag."""
    name = f"{name}-{suffix}" if suffix else name
    def bookkeeping(override: str) -> bool:
        key = override_key(override)
        return key.startswith("hydra.") or any(key == u or key.startswith(u + ".") for u in UNHASHED)

    changed = sweep.child_name([o for o in overrides if "=" in o and not bookkeeping(o)])
    return f"{name} {changed}"[:250] if changed else name


def _mlflow_system_tags(info: dict, argv: list[str]) -> dict[str, str]:
    """The tags MLflow's own `mlflow.start_run` sets, which its UI shows (User, Source, the git
    commit): marin makes runs with the client, which sets none of them."""
    import getpass

    git = info["git"]
    tags = {"mlflow.source.type": "LOCAL", "mlflow.source.name": os.path.abspath(argv[0]) if argv else "launch.py"}
    try:
        tags["mlflow.user"] = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry for this uid (some containers)
        pass
    for tag, value in (("commit", git.get("commit")), ("branch", git.get("branch")), ("repoURL", git.get("remote"))):
        if value:
            tags[f"mlflow.source.git.{tag}"] = value
    return tags


def made(rec: RunRecord, draft: Draft) -> RunRecord:
    """In the process that trains, once `register` returned: a sweep's launch learns of its child."""

    if draft.sweep is not None:
        sweep.made_child(rec.run_id)  # a sweep's launch learns of its child
    return rec


def abandon(draft: Draft) -> None:
    """Remove a run directory whose MLflow run was not made (it holds only its config)."""
    for handler in [h for h in logging.getLogger().handlers if getattr(h, "marin_run_log", False)]:
        if Path(handler.baseFilename).parent == draft.run_dir:
            detach_log(handler)
    shutil.rmtree(draft.run_dir, ignore_errors=True)


def _scan_secrets(resolved: Config, overrides: list[str]) -> None:
    secrets.scan_environment()
    secrets.scan_overrides(overrides)
    secrets.scan(config_dict(resolved))  # before anything is masked: every value under a secret key


class _RunLog(logging.FileHandler):
    """run.log's handler: on a full disk it stops, with one line on stderr, instead of printing
    logging's "--- Logging error ---" and a traceback for every line logged after."""
    full = False

    def emit(self, record):
        if not self.full:
            super().emit(record)

    def handleError(self, record):  # noqa: N802 (logging's hook)
        err = sys.exc_info()[1]
        if isinstance(err, OSError) and err.errno == errno.ENOSPC:
            self.full = True
            print(f"warning: {self.baseFilename}: no space left on device; run.log is not written from here on",
                  file=sys.stderr)
            return
        super().handleError(record)


def attach_log(rec) -> logging.Handler:
    """From now on this process's log lines also go to <run dir>/run.log (masked like stderr), so
    the run directory keeps its own log. Called where the record is made (process 0), as soon as
    its directory exists (`rec`: anything with a `run_dir`)."""
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "marin_run_log", False)]:  # one run per process
        root.removeHandler(old)
        old.close()
    path = Path(rec.run_dir) / LOG
    # 0600 whatever the umask, as the run's other files: a log line can quote what masking missed
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600))
    os.chmod(path, 0o600)
    handler = _RunLog(path, encoding="utf-8")
    handler.marin_run_log = True
    handler.setFormatter(logging.Formatter("[%(asctime)s %(name)s] %(message)s", "%Y-%m-%d %H:%M:%S"))
    handler.addFilter(secrets.MaskingFilter())
    root.addHandler(handler)
    if root.level > logging.INFO or root.level == logging.NOTSET:
        root.setLevel(logging.INFO)
    return handler


def to_run_log(line: str, name: str = "marin.train") -> None:
    """`line` into run.log only (masked), not stderr: for what is printed there otherwise, like
    the progress bar's eval lines and its last state (marin.train.components.MetricLogger)."""
    entry = logging.LogRecord(name, logging.INFO, __file__, 0, line, None, None)
    for handler in logging.getLogger().handlers:
        if getattr(handler, "marin_run_log", False):
            handler.handle(entry)  # its MaskingFilter masks secrets


def detach_log(handler: logging.Handler) -> None:
    logging.getLogger().removeHandler(handler)
    handler.close()


def _log_params(client, run_id: str, resolved_tree: dict) -> None:
    from mlflow.entities import Param
    from mlflow.utils.validation import MAX_PARAMS_TAGS_PER_BATCH

    params, too_long = mlflow_params(resolved_tree)
    items = [Param(k, v) for k, v in params.items()]
    for start in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
        client.log_batch(run_id, params=items[start:start + MAX_PARAMS_TAGS_PER_BATCH])
    if too_long:
        client.log_dict(run_id, too_long, LONG_PARAMS)
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

        log.warning("%s: past MLflow's %s characters for a param: logged truncated; whole in the run's "
                    "%s and MLflow's record/%s and %s", ", ".join(f"{k} ({len(v):,} characters)" for k, v in too_long.items()),
                    f"{MAX_PARAM_VAL_LENGTH:,}", RESOLVED, RESOLVED, LONG_PARAMS)


def _discard(client, run_id: str) -> None:
    """Delete a half-made run; if even that fails, at least mark it failed."""
    try:
        client.delete_run(run_id)
    except Exception:
        try:
            client.set_terminated(run_id, "FAILED")
        except Exception:
            log.warning("could not delete the half-made MLflow run %s", run_id)


def mlflow_link(rec: RunRecord) -> str:
    """Where to look at a run: its page in the MLflow UI, in the model-training view
    (`backend.ui_url`), when the store is a tracking server; else the store's URI (no password)."""
    try:
        experiment = rec.info().get("experiment_id")
    except (OSError, ValueError):
        experiment = None
    return (experiment and backend.ui_url(rec.tracking_uri, experiment, rec.run_id)) or secrets.safe_uri(rec.tracking_uri)


# ---------------------------------------------------------------------------- open

def open(ref: str | os.PathLike, tracking_uri: str | None = None, out_dir: Path | None = None) -> RunRecord:  # noqa: A001
    """The record of the run `ref` names (`marin.track.refs`: a run directory, its name under
    <out_dir>/runs/ or a unique prefix of it or of its run id, `<sweep>/<job>`, an MLflow run id).

    A full run id is looked up in `tracking_uri` (default: $MLFLOW_TRACKING_URI, else the sqlite
    store under `out_dir`, by default the project's); its `run_dir` tag names the directory.
    """
    try:
        found = refs.find_run(str(ref), out_dir)
    except refs.RefError as err:
        raise RecordError(str(err)) from None
    if isinstance(found, Path):
        return _from_dir(found, tracking_uri)
    ref = found
    site = Config(run=RunConfig(out_dir=str(out_dir))) if out_dir else Config()
    uri = tracking_uri or backend.tracking_uri(site)
    if backend.is_sqlite(uri) and not backend.sqlite_path(uri).exists():
        raise RecordError(f"{ref}: no such run directory, and no MLflow store at {uri} to look it up in")
    try:
        run = backend.client(uri).get_run(ref)
    except Exception as err:  # MlflowException: RESOURCE_DOES_NOT_EXIST, or a bad id
        raise RecordError(f"{ref}: neither a run directory nor an MLflow run id in {secrets.safe_uri(uri)} "
                          f"({first_line(err)})") from None
    run_dir = run.data.tags.get("run_dir")
    if not run_dir:
        raise RecordError(f"MLflow run {ref} has no run_dir tag: it was not made by marin")
    if not Path(run_dir).is_dir():
        raise RecordError(f"MLflow run {ref}: its run directory {run_dir} does not exist here")
    return _from_dir(Path(run_dir), uri)


def _from_dir(run_dir: Path, tracking_uri: str | None) -> RunRecord:
    if not (run_dir / INFO).is_file():
        raise RecordError(f"{run_dir}: not a run directory (no {INFO})")
    if not (run_dir / COMPOSED).is_file():
        raise RecordError(f"{run_dir}: the run lacks its config ({COMPOSED})")
    try:  # a write cut short (disk full, killed) must not become a traceback on resume=/reproduce=
        info = json.loads((run_dir / INFO).read_text())
        check_info(info, run_dir / INFO)
        found = RunRecord(run_dir, info["run_id"], tracking_uri or info["tracking_uri"], info["experiment"])
    except (ValueError, KeyError, TypeError, RecursionError) as err:  # JSONDecodeError is a ValueError
        raise RecordError(f"{run_dir / INFO} is damaged or truncated ({type(err).__name__}: "
                          f"{first_line(err)}); restore it from the MLflow "
                          f"run's record/ artifacts") from None
    for name in (COMPOSED, RESOLVED):   # every tool reads them: refused here, in one line
        if name == COMPOSED or (run_dir / name).is_file():
            load_config_file(run_dir / name)
    return found
