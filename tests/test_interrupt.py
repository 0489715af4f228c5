"""A Ctrl-C while launch.py starts is never lost (marin.cli.interrupt_safely): JAX's
garbage-collection callback dropped a KeyboardInterrupt raised inside it ("Exception ignored in"),
and the run went on to its end; a library that swallows one is caught before the first write
(`raise_if_interrupted`). In a process of its own: the handler is process-wide."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROGRAM = """
import gc, os, signal, sys, time
sys.path.insert(0, sys.argv[1])
from marin.cli import interrupt_safely, raise_if_interrupted
if sys.argv[2] == "marin":
    interrupt_safely()

def in_a_gc_callback(phase, info):  # as JAX's _xla_gc_callback: Python code run at each collection
    if phase == "start":
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(100_000):  # the handler runs here, inside the callback
            pass

def gc_case():
    gc.callbacks.append(in_a_gc_callback)
    try:
        gc.collect()
        gc.callbacks.remove(in_a_gc_callback)
        time.sleep(1)  # the signal sent again, outside the callback
        print("lost")
    except KeyboardInterrupt:
        print("interrupted")


def swallowed_case():
    try:
        try:  # a library that swallows the KeyboardInterrupt
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        except BaseException:
            pass
        raise_if_interrupted()
        print("went on")
    except KeyboardInterrupt:
        print("stopped")


gc_case() if sys.argv[3] == "gc" else swallowed_case()
"""


def _run(handler: str, case: str) -> str:
    done = subprocess.run([sys.executable, "-c", PROGRAM, str(ROOT), handler, case], capture_output=True, text=True,
                          timeout=60)
    return done.stdout.strip()


def test_a_ctrl_c_inside_a_gc_callback_is_raised_after_it_and_a_swallowed_one_before_the_first_write():
    assert _run("marin", "gc") == "interrupted"
    assert _run("python's", "gc") == "lost"   # Python's own handler: what launch.py had
    assert _run("marin", "swallowed") == "stopped"
    assert _run("python's", "swallowed") == "went on"
