"""A persistent compilation cache entry is machine code run as is: one that is not the program its
key names (another config's train step, the eval step, copied or renamed into place) is not loaded
but compiled again and replaced (issue 42's probe: a swapped entry trained the wrong program
silently, or broke every later run with an AssertionError)."""
import numpy as np
import jax
import pytest
from jax._src import compilation_cache

from tests.helpers import make_config

PLUS_ONE = jax.jit(lambda x: x + 1.0)
TIMES_TWO = jax.jit(lambda x: x * 2.0)


@pytest.fixture
def cache_in(monkeypatch, tmp_path):
    """A function that points marin's cache at a folder and runs a program there from a cold start
    (no in-memory executable, the persistent cache opened afresh); JAX's state is restored after."""
    from marin.train.trainer import enable_compilation_cache

    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
    before = {name: getattr(jax.config, name) for name in names}
    monkeypatch.delenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", raising=False)
    monkeypatch.delenv("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", raising=False)
    cfg = make_config("model=micro", f"run.out_dir={tmp_path}")

    def run(folder, program):
        folder.mkdir(exist_ok=True, mode=0o755)
        monkeypatch.setenv("MARIN_JAX_CACHE", str(folder))
        enable_compilation_cache(cfg)
        compilation_cache.reset_cache()
        jax.clear_caches()
        return np.asarray(program(np.arange(4, dtype=np.float32)))

    yield run
    for name, value in before.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()
    jax.clear_caches()


def entries(folder):
    return sorted(p for p in folder.glob("*-cache") if "-marin-" not in p.name)


@pytest.mark.parametrize("with_its_record", [False, True])
def test_an_entry_of_another_program_under_this_key_is_not_run(cache_in, tmp_path, with_its_record):
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    expected = np.arange(4, dtype=np.float32) + 1.0
    assert (cache_in(mine, PLUS_ONE) == expected).all()
    cache_in(theirs, TIMES_TWO)
    [entry], [swapped] = entries(mine), entries(theirs)
    entry.write_bytes(swapped.read_bytes())          # another program's entry under this program's key
    if with_its_record:                               # and whatever was written beside it
        for side in theirs.iterdir():
            if side.name.startswith(swapped.name.removesuffix("-cache")) and side != swapped:
                (mine / side.name.replace(swapped.name.removesuffix("-cache"),
                                          entry.name.removesuffix("-cache"))).write_bytes(side.read_bytes())
    assert (cache_in(mine, PLUS_ONE) == expected).all()
    assert entry.read_bytes() != swapped.read_bytes()   # compiled again and replaced
    assert (cache_in(mine, PLUS_ONE) == expected).all()


def test_an_entry_is_still_loaded_when_it_is_the_program(cache_in, tmp_path, caplog):
    folder = tmp_path / "mine"
    cache_in(folder, PLUS_ONE)
    [entry] = entries(folder)
    written = entry.stat().st_mtime_ns
    with caplog.at_level("DEBUG", logger="jax._src.compiler"):
        assert (cache_in(folder, PLUS_ONE) == np.arange(4) + 1.0).all()
    assert entry.stat().st_mtime_ns == written
    assert any("Persistent compilation cache hit" in r.getMessage() for r in caplog.records), \
        [r.getMessage() for r in caplog.records]


def test_a_swapped_entry_is_named_in_one_warning(cache_in, tmp_path, caplog):
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    cache_in(mine, PLUS_ONE)
    cache_in(theirs, TIMES_TWO)
    [entry], [swapped] = entries(mine), entries(theirs)
    entry.write_bytes(swapped.read_bytes())
    with caplog.at_level("WARNING", logger="marin.train.cache_entries"):
        cache_in(mine, PLUS_ONE)
    [warning] = [r.getMessage() for r in caplog.records if r.name == "marin.train.cache_entries"]
    assert str(entry) in warning and "not used" in warning
