"""A run in this process (hardware.launcher=local): make the run record, then train here.

    run_local(composed, resolved, overrides)
"""
from __future__ import annotations

import os
from pathlib import Path

from marin.cli import fail, raise_if_interrupted
from marin.data.prepare import UnreadableSource
from marin.track import backend, record, secrets, worker
from marin.track.errors import first_line


def run_local(composed, resolved, overrides) -> record.RunRecord:
    """Make the run directory, then train in this process; returns the run's record. The
    tracking process (marin.track.worker) makes the MLflow run while JAX starts; a run that cannot
    be made stops before its first step with one line (exit 2), its directory removed. Before
    anything is written: the output folder, the tracking store, a `train.init_from` checkpoint
    the model cannot take, the data, host memory. The run's last line on stdout sums it up
    (marin.train.ending)."""
    tracking = worker.Worker.get()  # first: MLflow's import runs in its own process while this one imports JAX
    from marin.data.loader import Loader  # JAX (these four): imported after the worker started
    from marin.train.components import NonFiniteLoss
    from marin.train.trainer import RunNotMade, Trainer, say

    out = backend.out_dir(resolved)
    if (problem := _unwritable(out)) is not None:  # before the data cache or the run is written there
        fail(f"run.out_dir: cannot write to {out}: {problem}")
    uri = backend.tracking_uri(resolved)
    if not backend.is_sqlite(uri):  # a sqlite store is made under run.out_dir when the run is
        try:
            backend.check_reachable(uri)
        except backend.TrackingUnavailable as err:
            fail(f"tracking.uri: {err}")
    if resolved.train.init_from:  # a checkpoint this model cannot take: refused before the run exists
        from marin.train.init_from import structure_problem  # JAX

        if (problem := structure_problem(resolved)) is not None:
            fail(problem)
    try:  # read (and cache) the data before the run exists: a bad source leaves nothing behind
        loader = Loader(resolved)
    except (UnreadableSource, ValueError, OSError) as err:
        fail(str(err))
    if resolved.optim.offload:  # pinned host memory must exist before anything is written
        from marin.train.state import check_host_memory  # JAX

        if (why := check_host_memory()) is not None:
            fail(why)
    not_made = f"could not create the run record ({secrets.safe_uri(uri)}, {out})"
    raise_if_interrupted()  # the last moment a Ctrl-C leaves nothing behind
    try:
        draft = record.prepare(composed, resolved, overrides)
    except Exception as err:  # noqa: BLE001 — nothing was made: one line, not a traceback
        fail(f"{not_made}: {first_line(err)}")
    say(f"run directory: {draft.run_dir}")
    registering = tracking.submit(worker.register_watched, draft)
    try:
        Trainer(resolved, draft, loader, registering=registering).fit()
    except RunNotMade as err:
        record.abandon(draft)
        fail(f"{not_made}: {err}")
    except NonFiniteLoss as err:
        fail(str(err), code=3)
    return registering.result()


def _unwritable(path) -> str | None:
    """Why `path` (existing or to be made) cannot be written, or None. Nothing is created."""
    path = Path(path)
    while not path.exists():
        if path.is_symlink() or path.parent == path:
            return f"{path} cannot be created"
        path = path.parent
    if not path.is_dir():
        return f"{path} is not a directory"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"{path} is not writable"
    return None
