"""The nearest valid keys to a typo (marin.config.keys), read from the schema dataclasses."""
import pytest

from marin.config.keys import nearest, unknown_at


@pytest.mark.parametrize("key", ["model", "train.steps", "data.sources.0.kind", "optim.decay.1.pattern",
                                 "hardware.env.ANY_NAME", "experiment", "sweep", "dry_run"])
def test_known_keys(key):
    assert unknown_at(key) is None


@pytest.mark.parametrize("key,first_guess", [
    ("modle", "model"),
    ("train.step", "train.steps"),
    ("trian.steps", "train.steps"),          # the rest of the key kept where it fits
    ("steps", "train.steps"),                # a field typed without its group
    ("lr", "optim.lr"),
    ("seqlen", "train.seq_len"),
    ("data.sources.0.knd", "data.sources.0.kind"),  # through a list's index
    ("expriment", "experiment"),             # a group that is no field of Config
])
def test_nearest_names_the_likely_key(key, first_guess):
    assert unknown_at(key) is not None
    assert nearest(key)[0][0] == first_guess


def test_nothing_close_gives_what_is_allowed_there():
    guesses, allowed = nearest("model.zzz")
    assert guesses == [] and "d_model" in allowed and "steps" not in allowed
