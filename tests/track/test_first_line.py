"""`first_line`: the one line every error report shows, safe on an empty message."""
from marin.track.errors import first_line


def test_first_line():
    assert first_line("bad value\n  at line 3") == "bad value"
    assert first_line("\n  \n  second is first\nthird") == "second is first"
    assert first_line("") == "" and first_line(" \n\n") == ""   # no IndexError on an empty message
    assert first_line(ValueError()) == "ValueError"   # an exception without a message: its type
    assert first_line(KeyError("k")) == "'k'"
