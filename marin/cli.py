"""What the run tools (`marin.status`, `marin.diff`, `marin.forecast`, `marin.report`,
`marin.generate`) share on the command line: `--help` from argparse, and every error as one line
on stderr with exit status 2."""
from __future__ import annotations

import argparse
import sys


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (`error: ...`), not the usage block and a line."""

    def error(self, message: str):  # noqa: D102 (argparse's hook)
        print(f"error: {self.prog}: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def fail(message: str) -> int:
    """Print `error: <first line of message>` and return 2 (for `return fail(...)` in a main)."""
    text = str(message).strip()
    print(f"error: {text.splitlines()[0] if text else message}", file=sys.stderr)
    return 2
