"""Keeping secrets out of everything marin writes or prints: the one rule, used by every writer.

A secret is found two ways:

* by NAME: a key (at any depth of a config, an override, a dict override's own keys, an
  environment variable) whose name has a secret-looking component. Names are split into
  components on ``_ . -`` and camel case (``GH_PAT`` → gh, pat; ``apiKey`` → api, key). A
  component is secret when it IS one of `WORDS` (key, pat, auth, token…), ENDS with token
  (``ACCESSTOKEN``, ``hftoken``) or CONTAINS one of `PARTS` (secret, passw, passphrase,
  credential, cookie, apikey…). Whole components, not substrings of the name, so ordinary keys
  (``d_model``, ``patience``, ``path``, ``keep_last``, ``monkey``, ``tokens_per_active_param``,
  ``tokenizer``) stay visible.
* by VALUE: every value seen under a secret name is remembered (`remember`), and `mask` replaces
  it in any text: a run directory's name, record.json, MLflow params/tags/artifacts, log lines,
  error lines. Passwords in URIs (``http://user:pw@host``) are masked too.

`guard_output` wraps this process's stdout/stderr so that whatever is printed (our logs, Hydra's
crash line, a traceback) goes through `mask`. Pure Python (no JAX, no MLflow).
"""
from __future__ import annotations

import logging
import os
import re
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from marin.config.schema import Config

REDACTED = "<redacted>"
WORDS = {"key", "keys", "pat", "auth", "authorization", "oauth", "bearer", "pwd", "pw", "pass",
         "token", "sig", "signature", "otp", "pin"}
SUFFIXES = ("token",)
PARTS = ("secret", "passw", "passphrase", "credential", "cookie", "apikey", "accesskey", "privatekey",
         "secretkey", "sessionid")
# Whole names that match the rule but hold no secret (the shell's working directories, a socket path).
NOT_SECRET = {"PWD", "OLDPWD", "SSH_AUTH_SOCK"}
MIN_LENGTH = 4          # shorter values would mask ordinary text everywhere
ENV_MIN_LENGTH = 8      # the environment is not ours: a short value there (KEY=main) is no real secret
_PLAIN = {"true", "false", "none", "null", "yes", "no"}
# Every pattern here begins its match at a fixed point (a literal, the start of a run of name
# characters, a zero-width point), never anywhere inside a run it then scans to its end: that
# shape retries from every letter of a long value, quadratic (a 120 KB override took 20 s to mask).
# scheme://user:password@host → the password part (group 2). The match begins at `://`; the
# scheme is only looked at (one character of it), so `1://u:pw@h` is masked too.
URI_PASSWORD = re.compile(r"(?<=[A-Za-z0-9+.-])(://[^/\s:@'\"]*):([^/\s@'\"]+)@")
# HFToken → HF_Token: the point after a capital that is followed by a capital and a lower-case letter.
CAMEL_RUN = re.compile(r"(?<=[A-Z])(?=[A-Z][a-z])")

_known: set[str] = set()
# _known longest first (a longer secret may contain a shorter one), ordered once per new secret, not
# per line masked; keyed by the set and its size (secrets are only ever added)
_longest_first: tuple[tuple[int, int], list[str]] = ((0, 0), [])


def components(name: str) -> list[str]:
    spaced = CAMEL_RUN.sub("_", str(name))                            # HFToken → HF_Token
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", spaced)          # apiKey → api_Key
    return [c for c in re.split(r"[^a-z0-9]+", spaced.lower()) if c]


def looks_secret(name: str) -> bool:
    """True for a key/variable name that holds a secret (see the module docstring)."""
    if str(name).split(".")[-1] in NOT_SECRET:
        return False
    return any(c in WORDS or c.endswith(SUFFIXES) or any(p in c for p in PARTS) for c in components(name))


# ---------------------------------------------------------------------------- values

def remember(value, min_length: int = MIN_LENGTH) -> None:
    """Mask `value` wherever it appears from now on (in this process)."""
    if isinstance(value, dict):
        for v in value.values():
            remember(v)
        return
    if isinstance(value, (list, tuple)):
        for v in value:
            remember(v)
        return
    if value is None or isinstance(value, bool):
        return
    text = str(value).strip()
    if len(text) >= min_length and text.lower() not in _PLAIN and text != REDACTED:
        _known.add(text)


def _in_order() -> list[str]:
    global _longest_first
    key = (id(_known), len(_known))
    if _longest_first[0] != key:
        _longest_first = (key, sorted(_known, key=len, reverse=True))
    return _longest_first[1]


def known() -> frozenset[str]:
    return frozenset(_known)


def mask(text: str) -> str:
    """`text` with every remembered secret and every URI password replaced by <redacted>."""
    if not isinstance(text, str) or not text:
        return text
    for secret in _in_order():
        if secret in text:
            text = text.replace(secret, REDACTED)
    if "://" in text:
        text = URI_PASSWORD.sub(lambda m: f"{m.group(1)}:{REDACTED}@", text)
    return text


def _uri_passwords(text: str) -> None:
    if "://" in text:
        for m in URI_PASSWORD.finditer(text):
            if m.group(2) != REDACTED:
                remember(m.group(2))


def scan(tree, secret: bool = False) -> None:
    """Remember the values under secret keys of a nested dict/list (and passwords in URIs)."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            scan(v, secret or looks_secret(str(k)))
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            scan(v, secret)
    elif secret:
        remember(tree)
    elif isinstance(tree, str):
        _uri_passwords(tree)


def scan_environment(environ=None) -> None:
    """Remember the values of secret-named environment variables (so `${oc.env:…}` or a log
    line quoting them cannot show them)."""
    for name, value in (os.environ if environ is None else environ).items():
        if looks_secret(name):
            remember(value, ENV_MIN_LENGTH)


# `${oc.env:NAME}` / `${oc.env:NAME,default}` in an override: the environment variable it reads.
_OC_ENV = re.compile(r"\$\{oc\.env:\s*([A-Za-z_][A-Za-z0-9_]*)")


def _env_references(value: str, environ=None) -> None:
    """Remember the values of the secret-named variables `value` pulls in with ``${oc.env:…}``,
    however short: whoever wrote it chose that variable as a secret, so ENV_MIN_LENGTH's excuse
    (an unrelated variable that merely looks secret) does not hold."""
    environ = os.environ if environ is None else environ
    for name in _OC_ENV.findall(value):
        if looks_secret(name) and environ.get(name):
            remember(environ[name])


def _split(override: str) -> tuple[str, str, str]:
    key, sep, value = override.partition("=")
    return key.lstrip("+~"), sep, value


def scan_overrides(overrides) -> None:
    """Remember the secrets of command-line overrides: `x.HF_TOKEN=v`, `+hardware.env={HF_TOKEN: v}`."""
    for o in overrides:
        key, sep, value = _split(str(o))
        if not sep:
            continue
        _env_references(value)
        if looks_secret(key.rsplit(".", 1)[-1]):
            remember(value.strip("'\""))
            continue
        _uri_passwords(value)
        if value.lstrip()[:1] in "{[" and value.strip():
            scan(_parse_value(key, value))


def _parse_value(key: str, value: str):
    """A dict/list override value as data (Hydra's own parser; a lenient fallback)."""
    try:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        parsed = OverridesParser.create().parse_override(f"{key}={value}").value()
        if isinstance(parsed, (dict, list)):
            return parsed
    except Exception:
        pass
    return {k: v.strip().strip("'\"") for k, v in DICT_PAIR.findall(value)}


# `key: value` in a dict override Hydra's parser refused; a key begins where its run of key characters does.
DICT_PAIR = re.compile(r"(?<![\w.-])([\w.-]+)\s*:\s*([^,}\]]+)")


# ---------------------------------------------------------------------------- writers' helpers

def redact(tree, secret: bool = False):
    """A copy of a nested dict/list: values under secret keys (any depth) are <redacted> (and
    remembered), remembered values and URI passwords in other strings are masked."""
    if isinstance(tree, dict):
        return {k: redact(v, secret or looks_secret(str(k))) for k, v in tree.items()}
    if isinstance(tree, list):
        return [redact(v, secret) for v in tree]
    if secret:
        remember(tree)
        return REDACTED if tree is not None else None
    if isinstance(tree, str):
        _uri_passwords(tree)
        return mask(tree)
    return tree


def redact_override(override: str) -> str:
    """`hardware.env.HF_TOKEN=abc` → `hardware.env.HF_TOKEN=<redacted>`; the secrets inside a
    dict override (`+hardware.env={HF_TOKEN: abc}`) and URI passwords are masked in place."""
    scan_overrides([override])
    key, sep, value = _split(override)
    if sep and looks_secret(key.rsplit(".", 1)[-1]):
        return f"{override.partition('=')[0]}={REDACTED}"
    return mask(override)


# `NAME=value`, `NAME: value`, `"NAME": "value"` (shell, .env, YAML, JSON, Python) anywhere in a line;
# a command-line option `--NAME value` too (a space separates only after `--`, else any two words
# would be an assignment). An HTTP auth scheme (`Authorization: Bearer TOKEN`) is kept, its token is
# the value. The match begins where a run of name characters begins (`run`: digits, dots or dashes,
# then the name, possessively: nothing is given back); `assigned_name` finds the name in the run.
ASSIGNMENT = re.compile(r"""(?<![A-Za-z0-9_.-])(?P<run>[0-9.-]*+[A-Za-z_][A-Za-z0-9_.-]*+)(?P<quote>['"]?)"""
                        r"""(?P<sep>\s*(?::|=|:=)\s*|\s+)"""
                        r"""(?P<open>['"]?)(?:(?:Bearer|Basic|Token|Digest)\s+)?(?P<value>[^\s'"]+)""")
_DASHED_NAME = re.compile(r"--(?=[A-Za-z_])")


def assigned_name(match: re.Match) -> str | None:
    """The name an `ASSIGNMENT` match assigns to: the run from its first letter or underscore
    (`1x.HF_TOKEN=` → x.HF_TOKEN); with a space for separator, the run after its first `--` that
    a letter follows (`--api-key v` → api-key), else None (two words are no assignment)."""
    run = match.group("run")
    if ":" in match.group("sep") or "=" in match.group("sep"):
        return run[re.search(r"[A-Za-z_]", run).start():]
    dashes = _DASHED_NAME.search(run)
    return run[dashes.end():] if dashes else None


def mask_assignments(text: str) -> str:
    """`text` (a diff, a file) with the value of every assignment to a secret-looking name
    <redacted>: an uncommitted ``HF_TOKEN=hf_abc`` in a tracked file, whose value no config or
    environment told us. The values are not remembered (in code ``api_key: str`` assigns no
    secret); then `mask` as everywhere."""
    if not isinstance(text, str) or not text:
        return text
    out, done, pos = [], 0, 0
    while (m := ASSIGNMENT.search(text, pos)) is not None:
        name = assigned_name(m)
        if name is None:  # two words: the next assignment may begin at the second
            pos = m.end("run")
            continue
        if looks_secret(name) and m.group("value") != REDACTED:
            out += [text[done:m.start("value")], REDACTED]
            done = m.end()
        pos = m.end()
    return mask("".join(out) + text[done:])


def write_private(path, text: str) -> None:
    """Write `text`, masked, to `path` (replaced whole: a reader never sees half of it) with mode
    0600 whatever the umask: a file that can hold a secret masking missed (a record, a saved
    config, git.diff) is its owner's alone."""
    path = os.fspath(path)
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
    os.fchmod(fd, 0o600)  # a leftover .tmp keeps its old mode through O_CREAT
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(mask(text))
    os.replace(tmp, path)


def safe_uri(uri: str) -> str:
    """A URI without its password (user names are kept)."""
    return mask(uri) if isinstance(uri, str) else uri


# ---------------------------------------------------------------------------- printed output

class MaskingStream:
    """A text stream that masks secrets before they reach the real one (everything else, e.g.
    encoding, fileno, isatty, is the real stream's)."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text):
        return self._stream.write(mask(text) if isinstance(text, str) else text)

    def flush(self):
        return self._stream.flush()

    def __getattr__(self, name):  # fileno, isatty, encoding, buffer…
        return getattr(self._stream, name)


class MaskingFilter(logging.Filter):
    """Masks a log record's message (for handlers whose stream is not guarded, e.g. pytest's)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:
            return True
        masked = mask(message)
        if masked != message:
            record.msg, record.args = masked, None
        return True


def guard_output(argv=None) -> None:
    """Remember the secrets of `argv` and of the environment, and mask stdout/stderr from now
    on (idempotent)."""
    scan_environment()
    scan_overrides([a for a in (argv or []) if "=" in a])
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, MaskingStream):
            setattr(sys, name, MaskingStream(stream))
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, MaskingFilter) for f in handler.filters):
            handler.addFilter(MaskingFilter())


def check_experiment_names(cfg: Config) -> list[tuple[str, str]]:
    """An MLflow experiment's name is stored and shown as given, so one holding a secret (a URI
    pasted with its password) is refused, not masked: a masked name would file the run under an
    experiment nobody asked for. The value is not quoted (it is the secret)."""
    return [(key, "holds a password (or another secret): name the experiment plainly; the store's "
             "address goes in tracking.uri")
            for key, value in (("run.experiment", cfg.run.experiment), ("tracking.experiment", cfg.tracking.experiment))
            if value and mask(str(value)) != str(value)]
