"""A rung that stopped early: extrapolated from its 60–80% window (the published d2048 rung crashed
at 81%, spec §8) and flagged; one that stopped before 60% is refused with one line."""
import numpy as np
import pytest

from marin import forecast

STEPS = 100
PER_STEP = [1e9, 4e9, 1.6e10, 6.4e10]  # training FLOPs per step of four rungs


def rung(name, per_step, stop=STEPS, law=lambda C: 1.5 + 40 * C ** -0.12):
    """A synthetic rung evaluated every 5 steps (and at `stop`) up to where it stopped."""
    steps = sorted({*range(5, stop + 1, 5), stop})
    return forecast.Rung(name, f"id-{name}", STEPS, per_step, [(s, float(law(per_step * s))) for s in steps])


def test_a_rung_stopped_at_81_percent_is_extended_from_its_60_to_80_percent_window():
    line = lambda s: 4.0 - 0.01 * s  # noqa: E731: the crashed rung's loss, linear in the step
    crashed = forecast.Rung("d2048", "id-d2048", STEPS, PER_STEP[3],
                            [(s, line(s)) for s in (*range(5, 81, 5), 81)])
    completed = forecast.extrapolated(crashed)
    assert completed.stopped_at == 81 and forecast.extrapolated(rung("d768", PER_STEP[0])).stopped_at is None
    assert completed.loss_at(100) == pytest.approx(line(100)) and completed.loss_at(90) == pytest.approx(line(90))
    assert completed.loss_at(50) == pytest.approx(line(50))          # before it stopped: its own record
    assert completed.loss_at(101) is None                            # never past the horizon
    assert not completed.extrapolated_at(81) and completed.extrapolated_at(85)

    # the window is 60–80% only: a different slope outside it does not move the line
    bent = forecast.Rung("d2048", "x", STEPS, PER_STEP[3],
                         [(s, line(s) + (0.5 if s < 60 else 0.0) + (0.3 if s > 80 else 0.0)) for s in (*range(5, 81, 5), 81)])
    assert forecast.extrapolated(bent).loss_at(100) == pytest.approx(line(100))

    rungs = [forecast.extrapolated(rung(f"d{i}", c)) for i, c in enumerate(PER_STEP[:3])] + [completed]
    fits = [forecast.fit_at(rungs, f, 1.5) for f in (0.8, 0.85, 1.0)]
    assert [f.extrapolated for f in fits] == [(), ("d2048",), ("d2048",)]
    assert all(len(f.points) == 4 for f in fits)                     # kept, not dropped
    assert (PER_STEP[3] * 100, pytest.approx(line(100))) in fits[-1].points
    for f in fits:
        f.target_C = 1e20
    text = forecast.table(fits, "hero").splitlines()
    assert "extrapolated" not in text[1] and text[2].endswith("* extrapolated: d2048")
    assert text[-1].startswith("* a rung that stopped early") and "60%–80%" in text[-1]


def test_a_rung_stopped_before_60_percent_is_refused_with_one_line():
    with pytest.raises(forecast.NotALadder) as err:
        forecast.extrapolated(rung("d1536", PER_STEP[2], stop=55))
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("rung d1536 (id-d1536) stopped at 55% of its run (step 55 of 100)")
    assert "only from 60% on" in message


def test_a_rung_stopped_at_62_percent_uses_what_it_has_of_the_window():
    r = forecast.extrapolated(rung("d1024", PER_STEP[1], stop=62))  # evaluations at 60 and 62
    slope, _ = r.line
    assert slope < 0 and r.loss_at(100) < r.loss_at(62)
    with pytest.raises(forecast.NotALadder, match="window has 1 evaluation"):
        forecast.extrapolated(forecast.Rung("x", "y", STEPS, 1e9, [(10, 3.0), (61, 2.0)]))


def test_whole_rungs_are_unchanged():
    whole = rung("d768", PER_STEP[0])
    assert forecast.extrapolated(whole) is whole and not np.isnan(whole.loss_at(100))
