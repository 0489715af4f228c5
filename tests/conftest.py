"""Shared test set-up: CPU JAX with one persistent compilation cache for the whole suite, MLflow
pointed away from any user store, and what a parallel run (`-n 2`, pytest-xdist) needs:

- `run_dir(config)`: one folder per test run, shared by the xdist controller and its workers;
  `once(config, name, make)`: a JSON result computed by the first process that asks, read by the others.
- `hero_compiled`: the hero's `dry_run=compile_json`, compiled once per run.
- The services (tests/services.py) start lazily for the tests that need them: `slurm` marks the
  local cluster, `browser` a headless Chromium, the `tracking_uri` fixture an MLflow server.
- Under xdist (`-n 2`), tests sharing a module-scoped fixture (a trained run) go to one worker, the
  Slurm tests to one worker, the hero's two to one worker, and the slow tests are scheduled first."""
import json
import os
from pathlib import Path

import pytest

from tests.helpers import SUITE_SITE, TEST_XLA_FLAGS, locked

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("MARIN_JAX_CACHE", str(ROOT / "outputs" / "cache" / "jax-tests"))
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.environ["MARIN_JAX_CACHE"])
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# Programs under 16 KiB (the model tests' eager ops: thousands of 2-5 KiB entries) are not cached:
# each write under the size limit below lists and stats every entry (JAX's LRU eviction), so with
# them the suite spent minutes of CPU in that scan; recompiling one costs tens of ms. Train, eval and
# init steps (80 KiB and up) are cached.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", str(16 << 10))
os.environ.pop("MLFLOW_TRACKING_URI", None)
os.environ["MARIN_SITE"] = str(SUITE_SITE)  # the suite's own site settings (tests/site/local/site.yaml)
if TEST_XLA_FLAGS.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):   # unless the user chose a level itself
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()


def _lock_the_compilation_cache() -> None:
    """Parallel workers (and the launch.py processes they start) share the persistent cache. JAX
    writes an entry in place (not atomically) unless the cache has a size limit: then every read
    and write holds the cache's file lock (the `filelock` package), so no process reads a half
    written entry and two processes compiling the same step cannot interleave their writes (a
    corrupt entry would never be replaced). 8 GiB is far above what the suite writes. Entries
    written before without the limit get the access-time file that the limit's eviction reads."""
    try:
        import filelock  # noqa: F401  (JAX needs it for a size-limited cache)
    except ImportError:
        return
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(8 << 30))
    cache = Path(os.environ["JAX_COMPILATION_CACHE_DIR"])
    if os.environ.get("PYTEST_XDIST_WORKER") or not cache.is_dir():
        return  # the controller (or the only process) has done this before the workers start
    for entry in cache.glob("*-cache"):
        atime = entry.with_name(entry.name.removesuffix("-cache") + "-atime")
        if not atime.exists():
            atime.write_bytes(int(entry.stat().st_mtime_ns).to_bytes(8, "little"))


_lock_the_compilation_cache()


# --- one folder and one computation per test run, across xdist workers ---------------------------

def run_dir(config) -> Path:
    """A folder unique to this test run and shared by the xdist controller and its workers (a
    worker's basetemp is <controller's basetemp>/popen-gwN)."""
    base = config._tmp_path_factory.getbasetemp()
    return base.parent if hasattr(config, "workerinput") else base


def once(config, name: str, make):
    """make() -> a JSON value, computed by the first process of this run that asks; the others
    wait for it and read it."""
    result = run_dir(config) / f"{name}.json"
    with locked(result.with_suffix(".lock")):
        if not result.exists():
            tmp = result.with_suffix(".tmp")
            tmp.write_text(json.dumps(make()))
            tmp.replace(result)
        return json.loads(result.read_text())


# --- the hero, compiled once -----------------------------------------------------------------------

HERO_COMPILE = ("experiment=mochi_535b_a23b", "dry_run=compile_json")


@pytest.fixture(scope="session")
def hero_compiled(request) -> dict:
    """`launch.py experiment=mochi_535b_a23b dry_run=compile_json` run once per test run (about 45 s on
    2 cores with a cold JAX cache, 5 s with a warm one): {"returncode", "stdout", "stderr"}. Under xdist the tests using it form one group (below),
    so they run one after the other on one worker and no worker waits for another."""
    import subprocess
    import sys

    def compile_hero():
        done = subprocess.run([sys.executable, "launch.py", *HERO_COMPILE], cwd=ROOT, capture_output=True,
                              text=True, timeout=900)
        return {"returncode": done.returncode, "stdout": done.stdout, "stderr": done.stderr}
    return once(request.config, "hero-compile", compile_hero)


# --- a real tokenizer, trained once ----------------------------------------------------------------

@pytest.fixture(scope="session")
def bpe_tokenizer() -> Path:
    """A byte-level BPE tokenizer.json (512 ids, fits model=tiny / micro) trained on the built-in
    text (`marin.data.bpe`, a few seconds), kept beside the JAX cache between runs: its folder name
    hashes the text and the library version, so a change retrains it."""
    from marin.data import bpe

    folder = Path(os.environ["MARIN_JAX_CACHE"]).parent / "tokenizers"
    folder.mkdir(parents=True, exist_ok=True)
    with locked(folder / "train.lock"):  # xdist workers: one trains, the others read its file
        return bpe.cached(folder)


# --- services, started by the first test that needs them ------------------------------------------

def pytest_runtest_setup(item):
    for name in ("slurm", "browser"):
        if item.get_closest_marker(name) is not None:
            from tests import services

            services.require(item.config, name)


def pytest_sessionfinish(session):
    """Stop what this run started, once every worker is done: in the xdist controller, or in the
    only process when not parallel (where nothing can have started unless tests/services.py ran)."""
    import sys

    config = session.config
    if hasattr(config, "workerinput"):
        return
    if not getattr(config.option, "tx", None) and "tests.services" not in sys.modules:
        return
    from tests import services

    services.stop_started(config)


# --- scheduling under xdist --------------------------------------------------------------------------
# Tests that share expensive state run on one worker: those using a module-scoped fixture (a trained
# run) per module, the Slurm tests (one 1-node cluster), the two tests reading the hero's compile.
# The Slurm group is dealt first, then the slow tests; the short ones fill in. xdist's own
# `xdist_group` cannot do this with pytest 9 (it renames node ids through an attribute pytest 9 no
# longer reads), so the workers write {node id: group} to this run's folder and the controller's
# scheduler reads it.

# The test that opens the report in a browser, until its module marks it `browser` itself.
BROWSER_TESTS = {"test_the_report_renders_offline_in_a_real_browser"}
GROUP = pytest.StashKey[str]()


def _shares_module_state(item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(d.scope in ("module", "class", "package") for defs in info.name2fixturedefs.values() for d in defs)


def _group(item) -> str | None:
    if "hero_compiled" in getattr(item, "fixturenames", ()):
        return "hero"
    if item.get_closest_marker("slurm") is not None:
        return "slurm"
    if _shares_module_state(item):
        return item.nodeid.split("::")[0]
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if getattr(item, "originalname", None) in BROWSER_TESTS:
            item.add_marker(pytest.mark.browser)
    if not hasattr(config, "workerinput"):
        return  # not under xdist: the order as written
    for item in items:
        group = _group(item)
        if group:
            item.stash[GROUP] = group
    # Stable: the Slurm group first (its worker mostly waits on jobs, for minutes: from the start it
    # overlaps everything else), then the slow tests, the short ones fill in.
    items.sort(key=lambda item: (item.get_closest_marker("slurm") is None, item.get_closest_marker("slow") is None))


def _groups_file(config) -> Path:
    return run_dir(config) / "xdist-groups.json"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_finish(session):
    """In each worker, before it reports its collection: the groups, by final node id."""
    if not hasattr(session.config, "workerinput"):
        return
    groups = {item.nodeid: item.stash[GROUP] for item in session.items if GROUP in item.stash}
    path = _groups_file(session.config)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(groups))
    tmp.replace(path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """-n N (xdist's default --dist load) or --dist loadgroup: whole groups to one worker, in this
    collection order (slow first); other --dist modes are xdist's own."""
    if config.getvalue("dist") not in ("load", "loadgroup"):
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False   # keep our order, not "largest group first"

    groups_file = _groups_file(config)

    class GroupScheduling(LoadScopeScheduling):
        groups: dict | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:
                self.groups = json.loads(groups_file.read_text()) if groups_file.exists() else {}
            return self.groups.get(nodeid, nodeid)

    return GroupScheduling(config, log)
