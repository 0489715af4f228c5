"""The training progress bar as a log file keeps it (stderr not a terminal: Slurm's log, a pipe)."""
import io
import sys
import time

from marin.train.components import _Progress


def _drawn(last: int, total: int = 6) -> str:
    err, sys.stderr = sys.stderr, io.StringIO()
    try:
        bar = _Progress(0, total, True, last=last)
        for n in range(1, last + 1):
            bar.update(n, 1.0, 100.0)
            time.sleep(0.2)  # past tqdm's mininterval: the steps before the last are drawn
        bar.write(f"step {last}: the eval line")
        bar.close()
        return sys.stderr.getvalue()
    finally:
        sys.stderr = err


def test_the_final_bar_is_drawn_once_above_the_last_eval_line():
    """It was drawn by the last step's update, again under the eval line (tqdm's redraw) and again
    at close: three copies of `6/6` in the log."""
    text = _drawn(6)
    assert text.count("6/6") == 1, repr(text)
    assert text.index("6/6") < text.index("step 6: the eval line")     # the bar, then the line under it
    stopped = _drawn(4)                                               # train.stop_after=4 of 6
    assert stopped.count("4/6") == 1 and stopped.index("4/6") < stopped.index("step 4: the eval line"), repr(stopped)
