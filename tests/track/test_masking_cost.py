"""Masking costs time in proportion to the text masked, whatever the config holds.

Issue 42's probe: one 120 KB override (`run.sweep_id=xxx…`) made a 30-step CPU run 3-7× slower.
record.json holds the value (argv, overrides) next to `sqlite:///…`, and `mask`'s URI-password
pattern began its match at every letter of the value, ran to its end and backed off: quadratic,
about 20 s for each write of record.json (three a run), in the tracking process while the
trainer waited for its MLflow run, then in the trainer's threads. `mask_assignments` (git.diff)
and the camel-case split of a name had the same shape, worse.

No timings here: each pattern is checked for the shape that makes it linear (where a match may
begin), and against the old patterns on random short texts for what it masks."""
import random
import re
import threading

import pytest

from marin.track import secrets

# The patterns before the fix: the reference for what is masked (they are right, only slow).
OLD_URI_PASSWORD = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://[^/\s:@'\"]*):([^/\s@'\"]+)@")
OLD_ASSIGNMENT = re.compile(r"""(?P<dash>--)?(?P<name>[A-Za-z_][A-Za-z0-9_.-]*)(?P<quote>['"]?)"""
                            r"""(?P<sep>\s*(?::|=|:=)\s*|(?(dash)\s+|(?!)))"""
                            r"""(?P<open>['"]?)(?:(?:Bearer|Basic|Token|Digest)\s+)?(?P<value>[^\s'"]+)""")


def old_components(name: str) -> list[str]:
    spaced = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", name)
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", spaced)
    return [c for c in re.split(r"[^a-z0-9]+", spaced.lower()) if c]


def old_mask_assignments(text: str) -> str:
    def redact_value(m):
        if not secrets.looks_secret(m.group("name")) or m.group("value") == secrets.REDACTED:
            return m.group(0)
        return m.group(0)[: m.start("value") - m.start()] + secrets.REDACTED
    return OLD_ASSIGNMENT.sub(redact_value, text)


LONG = "x" * 2_000   # a long value: what matters is where a match may begin inside it


def test_a_uri_password_match_begins_at_its_separator_not_in_the_text_before_it():
    """A match that may begin at any letter before `://` is retried from every letter of a long
    value: the pattern starts at the `://` itself (the scheme is looked at, not matched)."""
    text = LONG + "://alice:pw0rd@host"
    match = secrets.URI_PASSWORD.search(text)
    assert match is not None and match.start() == len(LONG)
    assert secrets.mask("sqlite:///db " + LONG + "://alice:pw0rd@host") == \
        "sqlite:///db " + LONG + "://alice:<redacted>@host"


def test_an_assignment_match_begins_only_where_its_names_characters_begin():
    """`abcHF_TOKEN=v` is one name, `abcHF_TOKEN`: a match that may also begin at b, c, H… is
    retried from every letter of a long word. Matches begin at the start of the run."""
    text = "abcHF_TOKEN=v"
    assert secrets.ASSIGNMENT.match(text, 3) is None
    assert secrets.ASSIGNMENT.match(text, 0) is not None
    assert secrets.mask_assignments("+" + LONG + " HF_TOKEN=hf_secret99") == "+" + LONG + " HF_TOKEN=<redacted>"


def test_the_camel_case_split_inserts_at_a_point_not_after_a_run():
    """`HFToken` → hf, token: the split is a zero-width point (an upper-case letter, then an
    upper-case one followed by a lower-case one), not a run of capitals matched and backed off."""
    assert secrets.CAMEL_RUN.pattern.startswith("(?<=")
    assert secrets.components("HFToken") == ["hf", "token"]
    assert secrets.components("A" * 2_000 + "Bc") == ["a" * 2_000, "bc"]


ALPHABET = "aA1_.-: =\"'/@-Tk" + "\t"
NAMES = ["HF_TOKEN", "password", "api-key", "apiKey", "x", "Bearer", "Basic", "--", "://", "u:p@h", "sqlite"]


def random_texts(count: int, seed: int = 0):
    rng = random.Random(seed)
    for _ in range(count):
        parts = [rng.choice(NAMES) if rng.random() < 0.3 else rng.choice(ALPHABET) for _ in range(rng.randint(1, 14))]
        yield "".join(parts)


def test_the_linear_patterns_mask_what_the_old_ones_masked():
    """On 4,000 random short texts: the same assignments redacted, the same name components, and
    every URI password the old pattern found still found (a scheme of digits alone now counts too)."""
    for text in random_texts(4_000):
        assert secrets.components(text) == old_components(text), text
        assert secrets.mask_assignments(text) == secrets.mask(old_mask_assignments(text)), text
        for old in OLD_URI_PASSWORD.finditer(text):
            assert any(new.start(2) == old.start(2) and new.group(2) == old.group(2)
                       for new in secrets.URI_PASSWORD.finditer(text)), text


def test_masking_a_line_does_not_sort_the_known_secrets_each_time(monkeypatch):
    """Every printed line is masked: the secrets are ordered (longest first) once per change of
    the set, not per line."""
    secrets.remember("qz-long-secret-7781")
    secrets.mask("warm")  # the order is made here at the latest
    calls, here, real_sorted = [], threading.get_ident(), sorted

    def counted(*args, **kwargs):  # this thread's calls only: a daemon thread of another test may sort
        if threading.get_ident() == here:
            calls.append(1)
        return real_sorted(*args, **kwargs)

    monkeypatch.setattr("builtins.sorted", counted)
    for _ in range(100):
        assert secrets.mask("step 5 qz-long-secret-7781") == "step 5 <redacted>"
    assert calls == []
    secrets.remember("qz-another-secret-7782")
    assert secrets.mask("qz-another-secret-7782") == "<redacted>"


@pytest.mark.parametrize("value", ["{" + "k" * 3_000, "[" + "a" * 3_000 + " : b"])
def test_a_dict_override_the_parser_refuses_is_scanned_by_runs(value):
    """`_parse_value`'s fallback reads `key: value` pairs; its keys begin where a run of key
    characters begins (`+x={abcHF_TOKEN: v}` is the key abcHF_TOKEN, not also bcHF_TOKEN…)."""
    assert secrets.DICT_PAIR.match("abcHF_TOKEN: v", 3) is None
    assert isinstance(secrets._parse_value("x", value), (dict, list))
