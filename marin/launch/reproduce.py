"""`python launch.py reproduce=<run dir or MLflow run id> [overrides]`: the saved run, again, as a
new run named `<its run.name>-reproduce` (unless `run.name=` is given).

The saved composed config (with its ``auto`` leaves) is the base. Hydra composes conf/ twice,
with the saved overrides and with the saved plus the new ones; the leaves where those two differ
are what the new overrides change, and only they replace saved values. So derived values are
recomputed by `validate.load`, run-specific ones (train.seed…) stay as saved, edits made to conf/
since the run do not leak in (they are reported), and site-specific leaves (tracking.uri,
data.root, run.out_dir) come from the current environment. The saved config is data: nothing in
it is instantiated, a ``_target_`` outside marin/optax/flax is refused, and so is any ``${…}``
interpolation (``${oc.env:…}`` would read this machine's environment into the run). What the
saved config would run on this machine — `hardware.env`, `hardware.xla_flags`, `hardware.setup`
(shell lines of the batch script) — is applied only where it equals the shipped
conf/hardware/<name>.yaml, or with `reproduce_trust=true`. A config folder the run was composed
with (`--config-dir`) that is gone is one warning line: the saved config is the base as it is, and
the saved choices of options from that folder (`experiment=mine`) are not composed again.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from omegaconf import OmegaConf

from marin.config.paths import CONF_DIR, SWEEPS_DIR
from marin.config.schema import Config, RunConfig
from marin.config.store import compose, last_per_key, override, override_key, override_value
from marin.config.validate import RUN_NAME_MAX
from marin.launch.checks import load
from marin.launch.command_line import INPUT_ERRORS, hydra_problem
from marin.track import backend, record, secrets
from marin.track.errors import first_line
from marin.track.record import flatten

log = logging.getLogger("marin.launch")

SITE = ("tracking.uri", "data.root", "data.cache_dir", "run.out_dir")
# Never inherited (reproduce_trust: a saved config cannot trust itself).
CONTROL = ("reproduce", "resume", "fork", "dry_run", "wait", "reproduce_trust", "verify", "verify_steps", "verify_rtol")
# What a saved config runs on this machine: applied only as shipped, or with reproduce_trust=true.
UNTRUSTED = ("hardware.env", "hardware.xla_flags", "hardware.setup")
NOT_INHERITED = ("run.sweep", "run.sweep_id")  # a reproduction is a run of its own, not a sweep job
TARGET_PREFIXES = ("marin.", "optax.", "flax.")
WATCHED_PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "hydra-core",
                    "omegaconf", "mlflow", "marin-moe")


class ReproduceError(ValueError):
    """A saved run that cannot be reproduced as asked; the message is one line."""



def _check_targets(tree, where: str) -> None:
    for key, value in flatten(tree).items():
        if key.split(".")[-1] == "_target_" and not str(value).startswith(TARGET_PREFIXES):
            raise ReproduceError(f"{where}: {key}={value} is not allowed (only {', '.join(TARGET_PREFIXES)} targets)")


def _check_interpolations(tree, where: str) -> None:
    """A saved config is data: no `${…}` (resolvers read the environment or files when resolved)."""
    for key, value in flatten(tree).items():
        texts = value if isinstance(value, list) else [value]
        if any(isinstance(t, str) and "${" in t for t in texts):
            raise ReproduceError(f"{where}: {key}={value}: interpolations (${{…}}) are not allowed in a saved "
                                 "config; give the value on the command line instead")


def _is_under(key: str, prefixes) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def _check_trust(merged: dict, own: set[str], trust: bool) -> None:
    """Refuse saved hardware.env/xla_flags/setup that differ from the shipped hardware option,
    unless this command line says reproduce_trust=true or sets those fields itself (`own`)."""
    if trust:
        return
    applied = {k: v for k, v in merged.items() if _is_under(k, UNTRUSTED) and not _is_under(k, own)
               and v not in ({}, [], "", None) and v != secrets.REDACTED}
    if not applied:
        return
    name = merged.get("hardware.name")
    try:
        shipped = flatten(_compose([f"hardware={name}"]))
    except Exception:  # not a shipped option (or not one any more): nothing of it is trusted
        shipped = {}
    differ = [k for k, v in applied.items() if shipped.get(k) != v]
    if differ:
        raise ReproduceError(f"the saved config's {', '.join(sorted(differ))} differ from conf/hardware/{name}.yaml "
                             "(they would run on this machine as saved); check them and pass reproduce_trust=true "
                             "to apply them, or override them")


# Fields added since schema_version 1 and what a config saved before them meant: filled in, so an
# older run resumes, forks and reproduces as it ran (a field added without an entry is refused).
ADDED_SINCE = {
    "train.init_from_mode": "continue",   # init_from then kept its source's whole state and step counter
    "train.watchdog_minutes": None,
    "hardware.max_restarts": 0,
    "hardware.segment_nodes": None,
    "hardware.exclusive": False,
    "debug": {"hang_at_step": None, "hang_process": 0},
    "fork": None,
}


def _fill_added(saved: dict) -> None:
    for key, value in ADDED_SINCE.items():
        *parents, leaf = key.split(".")
        node = saved
        for part in parents:
            node = node.setdefault(part, {})
        node.setdefault(leaf, value)


def _check_schema(saved: dict) -> None:
    """Same schema version and the same fields, or a message naming the fields that differ."""
    current = OmegaConf.to_container(OmegaConf.structured(Config))
    have, want = set(flatten(saved)), set(flatten(current))

    def known(key, keys):  # free-form dicts (hardware.env) flatten to their own keys, or to {} when empty
        parts = key.split(".")
        # An empty dict flattens to one leaf, a filled one to its entries: either side may hold
        # the other's form (the schema's empty hardware.env vs a saved h200_node env).
        return (any(".".join(parts[:i]) in keys for i in range(1, len(parts) + 1))
                or any(k.startswith(key + ".") for k in keys))

    removed = sorted(k for k in have if not known(k, want))
    # a new control key is no change, nor a new tracking setting (what is logged, not what is
    # trained: the saved run gets its default, as tracking.system_metrics did)
    added = sorted(k for k in want if not known(k, have) and k not in CONTROL and not k.startswith("tracking."))
    version, expected = saved.get("schema_version"), current["schema_version"]
    if version == expected and not removed and not added:
        return
    fields = "; ".join(filter(None, [f"unknown now: {', '.join(removed)}" if removed else "",
                                     f"missing from the saved config: {', '.join(added)}" if added else ""]))
    raise ReproduceError(f"the saved config has schema_version {version} and this code reads {expected}"
                         + (f"; fields that differ: {fields}" if fields else ""))


def search_path_override(saved: list[str]) -> tuple[list[str], list[str]]:
    """(`hydra.searchpath=[...]` for the folders the saved run was composed with (`--config-dir`,
    `hydra.searchpath`, kept in record.json) that are still here and this job's own, or [] when
    there are none; the saved folders that are gone)."""
    gone = [url[len("file://"):] for url in saved if url.startswith("file://") and not Path(url[len("file://"):]).is_dir()]
    urls = [url for url in saved if url[len("file://"):] not in gone]
    for url in record.config_search_path():  # this command line's --config-dir / hydra.searchpath
        if url not in urls:
            urls.append(url)
    return ([f"hydra.searchpath=[{','.join(urls)}]"] if urls else []), gone


def _folders(search: list[str]) -> list[Path]:
    """The config folders options are found in now: conf/, sweeps/ and the search path's."""
    urls = search[0][len("hydra.searchpath=["):-1].split(",") if search else []
    return [CONF_DIR, *(Path(u[len("file://"):]) for u in urls if u.startswith("file://"))]


def _found_here(override: str, folders: list[Path]) -> bool:
    """False for a group choice (`experiment=mine`) whose option file none of `folders` holds."""
    key, _, value = override.partition("=")
    key = key.lstrip("+~")
    leaves = [k for k, v in OmegaConf.to_container(OmegaConf.structured(Config)).items() if not isinstance(v, dict)]
    if "." in key or "/" in key or not value or key in leaves:
        return True  # a leaf (train.seed=7), a Hydra group or a removal: not an option of a config folder
    if key == "sweep" and (SWEEPS_DIR / f"{value}.yaml").is_file():
        return True
    return any((folder / key / f"{value}.yaml").is_file() for folder in folders)


def _problem(err: Exception) -> str:
    """A compose error as one line: Hydra's as launch.py words them (`model=tinyy: no such option…`)."""
    if isinstance(err, INPUT_ERRORS):
        return hydra_problem(err)
    return first_line(err)


def _compose(overrides: list[str]) -> dict:
    return OmegaConf.to_container(compose(overrides), resolve=True)


def _arm_leaves(new: list[str], folders: list[Path]) -> dict:
    """The leaves of an A/B arm (`+ab=<arm>`: its option file, which marin.ab writes on the job's
    hydra.searchpath), which win over the parent's saved overrides. Hydra applies a value override
    after every group option, so a sweep job's own `optim.lr=0.001` would beat the candidate arm's
    `optim.lr` and the candidate would run as the control."""
    arm = next((o.split("=", 1)[1] for o in new if override_key(o) == "ab"), None)
    for folder in folders if arm else []:
        if (folder / "ab" / f"{arm}.yaml").is_file():
            leaves = OmegaConf.to_container(OmegaConf.load(folder / "ab" / f"{arm}.yaml")) or {}
            return flatten(leaves) if leaves else {}  # the control's is empty
    return {}


def _unflatten(flat: dict) -> dict:
    tree: dict = {}
    for key, value in flat.items():
        node = tree
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        if not (value == {} and isinstance(node.get(last), dict)):  # an empty dict leaf adds nothing
            node[last] = value
    return tree


def lookup_uri(new_overrides: list[str]) -> str | None:
    for o in reversed(new_overrides):
        if override_key(o) == "tracking.uri":
            return override_value(o)
    return os.environ.get("MLFLOW_TRACKING_URI")


def out_dir(new_overrides: list[str]) -> Path | None:
    for o in reversed(new_overrides):
        if override_key(o) == "run.out_dir":
            return backend.out_dir(Config(run=RunConfig(out_dir=override_value(o))))
    return None


def _warn_provenance(info: dict, verb: str) -> None:
    git, _ = record.git_state()
    was = (info.get("git") or {}).get("commit")
    if was and git["commit"] != was:
        log.warning("%s a run made at git commit %s from commit %s", verb, was[:12], (git["commit"] or "?")[:12])
    if verb == "reproducing" and (info.get("git") or {}).get("dirty"):  # a resume goes on with the code it has
        log.warning("the original run had uncommitted changes (see git.diff in its run directory)")
    now = record.package_versions()
    saved = info.get("packages") or {}
    changed = [f"{p} {saved[p]} → {now.get(p, 'absent')}" for p in WATCHED_PACKAGES
               if p in saved and now.get(p) != saved[p]]
    others = sum(1 for p, v in saved.items() if p not in WATCHED_PACKAGES and now.get(p) != v)
    if changed or others:
        log.warning("package versions differ from the record: %s%s", ", ".join(changed),
                    f" (+{others} other packages)" if others else "")


def replay_name(name: str, what: str) -> str:
    """`<name>-<what>` (`probe-reproduce`, `probe-verify`) within run.name's length: a replay gets
    a name of its own, so the original's name keeps naming the original alone (marin.track.refs).
    A replay of a replay keeps its name (`probe-reproduce` reproduced is `probe-reproduce`)."""
    suffix = f"-{what}"
    return name if name.endswith(suffix) else name[:RUN_NAME_MAX - len(suffix)] + suffix


def recompose(ref: str, new_overrides: list[str], verb: str = "reproducing",
              added: list[str] = ()) -> tuple[Config, Config, list[str]]:
    """(composed, resolved, overrides for the new record) of the run at `ref` with `new_overrides`.

    `new_overrides` are this command line's overrides (a ``reproduce=`` entry among them is
    ignored). `verb` says what the caller does with it in its warnings ("resuming": resume= says
    itself which run it continues). `added`: overrides the caller adds (verify's replay name),
    applied but not reported as this command line's. A reproduction is named `<name>-reproduce` unless
    `new_overrides` name it. Raises ReproduceError (one line) or validate.ConfigError.
    """
    new = [o for o in new_overrides if override_key(o) != "reproduce"]
    given = list(new)  # what this command line changes (not the run.name added below, nor `added`)
    new += list(added)
    try:
        source = record.open(ref, tracking_uri=lookup_uri(new), out_dir=out_dir(new))
    except record.RecordError as err:
        raise ReproduceError(str(err)) from None
    saved = OmegaConf.to_container(source.composed(), resolve=False)
    if verb == "reproducing" and not any(override_key(o) == "run.name" for o in new):
        new.append(override("run.name", replay_name(str((saved.get('run') or {}).get('name') or 'default'), 'reproduce')))
    _check_interpolations(saved, f"{source.run_dir / record.COMPOSED}")
    _check_targets(saved, f"{source.run_dir / record.COMPOSED}")
    _check_targets({override_key(o): o.split("=", 1)[-1] for o in new}, "overrides")
    _fill_added(saved)
    _check_schema(saved)
    kept = []
    for o in source.overrides():
        if override_key(o) in SITE + CONTROL:
            continue
        if secrets.REDACTED in o:
            log.warning("saved override %s was redacted: the current environment's value is used", o)
            continue
        kept.append(o)
    _check_interpolations({override_key(o): o.split("=", 1)[-1] for o in kept}, f"{source.run_dir / record.OVERRIDES}")
    _check_targets({override_key(o): o.split("=", 1)[-1] for o in kept}, "saved overrides")

    search, gone = search_path_override(source.info().get("config_search_path") or [])
    if gone:  # the saved config holds what those folders gave: it is the base as it is
        unfound = [o for o in kept if not _found_here(o, _folders(search))]
        kept = [o for o in kept if o not in unfound]
        log.warning("config folder %s (the run's --config-dir or hydra.searchpath) is gone: using the run's saved "
                    "config (%s)%s", ", ".join(gone), record.COMPOSED,
                    f" for {', '.join(unfound)}" if unfound else "")
    try:
        base = flatten(_compose(search + kept))
    except Exception as err:
        raise ReproduceError(f"the saved overrides no longer compose with conf/: {_problem(err)}") from None
    try:
        wanted = flatten(_compose(search + kept + new)) if new else base  # a compose is ~0.1 s of Hydra
    except Exception as err:
        raise ReproduceError(f"overrides do not apply to the saved config: {_problem(err)}") from None

    merged = flatten(saved)
    # run.name is not conf/'s to drift: a sweep job's is made when its record is (sweep.job_name)
    drift = [] if gone else sorted(k for k in base if k in merged and base[k] != merged[k]  # gone: said above
                                   and k not in SITE + CONTROL + NOT_INHERITED + ("run.name",)
                                   and merged[k] != secrets.REDACTED)
    if drift:
        log.warning("conf/ (or the site config, local/site.yaml) changed since the run; keeping the saved values of %s", ", ".join(drift[:10])
                    + (f" (+{len(drift) - 10} more)" if len(drift) > 10 else ""))
    for key, value in wanted.items():  # what the new overrides change
        if key not in base or base[key] != value:
            merged[key] = value
    for key in set(base) - set(wanted):  # removed by a ~key override
        merged.pop(key, None)
    merged.update(_arm_leaves(new, _folders(search)))
    own = {override_key(o) for o in new if _is_under(override_key(o), UNTRUSTED)}
    for key, value in wanted.items():  # the user's own, even where equal to conf/ (an untrusted value reset)
        if _is_under(key, own):
            merged[key] = value
    for key in SITE + CONTROL:
        merged[key] = wanted.get(key)
    for key in NOT_INHERITED:
        if not any(override_key(o) == key for o in new):
            merged[key] = None
    _check_trust(merged, own, bool(wanted.get("reproduce_trust")))
    for key, value in list(merged.items()):  # secrets were never saved: this environment's, if any
        if value == secrets.REDACTED:
            if key in wanted:
                merged[key] = wanted[key]
            else:
                del merged[key]
    merged["reproduce"] = source.run_id  # tagged reproduced_from by record.create
    _warn_provenance(source.info(), verb)

    try:
        typed = OmegaConf.merge(OmegaConf.structured(Config), _unflatten(merged))
    except Exception as err:
        raise ReproduceError(f"the recomposed config does not fit the schema: {first_line(err)}") from None
    composed, resolved = load(typed, resuming=verb == "resuming")
    if verb == "reproducing":
        log.info("reproducing run %s (%s)%s", source.run_id, source.run_dir,
                 f" with {len(given)} new override(s): {' '.join(given)}" if given else ", as it was")
    return composed, resolved, last_per_key(kept + new) + [override("reproduce", source.run_id)]
