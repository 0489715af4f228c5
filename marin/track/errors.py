"""The first line of an error message: what every one-line report (stderr, logs, MLflow tags) shows."""
from __future__ import annotations


def first_line(message) -> str:
    """The first non-blank line of `str(message)`, stripped. An exception with no message gives
    its type's name; an empty or blank string gives ''."""
    for line in str(message).splitlines():
        if line.strip():
            return line.strip()
    return type(message).__name__ if isinstance(message, BaseException) else ""


class DiskFull(RuntimeError):
    """A write lost for want of space (a checkpoint); the message says what was lost, where, and
    what a resume starts from: the one line the command prints."""


def disk_full(err: BaseException) -> str | None:
    """The line to print when `err`, or an error it was raised from or while handling, is a full
    disk (None: it is not): a DiskFull's own message first (the writes after it, in the run's
    ending, fail for the same reason), else "no space left on device: <first line>"."""
    seen, stack, found = set(), [err], None
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, DiskFull):
            return first_line(e)
        text = str(e)
        if found is None and ((isinstance(e, OSError) and e.errno == 28) or "No space left on device" in text):
            found = f"no space left on device: {first_line(e)[:300]}"
        stack += [e.__cause__, e.__context__]
    return found


def quiet_disk_full(record) -> bool:
    """A logging filter: False for a record about a full disk (orbax's threads log the same error
    with its traceback several times; the run reports it once, as a DiskFull)."""
    err = record.exc_info[1] if record.exc_info else None
    return not ((err is not None and disk_full(err)) or "No space left on device" in str(record.msg))


# What an allocation that failed says: Python's MemoryError, XLA's RESOURCE_EXHAUSTED ("Out of
# memory allocating N bytes"), the dynamic loader mapping JAX's library under `ulimit -v`
# ("failed to map segment from shared object"), a thread whose stack could not be mapped ("can't
# start new thread"), an OSError with ENOMEM.
_OUT_OF_MEMORY = ("RESOURCE_EXHAUSTED", "Out of memory", "failed to map segment", "Cannot allocate memory",
                  "can't start new thread")


def out_of_memory(err: BaseException) -> str | None:
    """The first line of the allocation failure that `err` is, was raised from or while handling
    (None: it is none): what the command reports as out of memory, in one line."""
    seen, stack = set(), [err]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, MemoryError) or (isinstance(e, OSError) and e.errno == 12) \
                or any(mark in str(e) for mark in _OUT_OF_MEMORY):
            return first_line(e)[:300] if str(e).strip() else type(e).__name__
        stack += [e.__cause__, e.__context__]
    return None


def address_limits() -> list[tuple[str, float]]:
    """The address-space limits this process runs under, (name, GiB): `ulimit -v` (RLIMIT_AS) and
    `ulimit -d` (RLIMIT_DATA), where set. A child (the tracking process) inherits them."""
    import resource

    limits = []
    for which, name in ((resource.RLIMIT_AS, "RLIMIT_AS, `ulimit -v`"), (resource.RLIMIT_DATA, "RLIMIT_DATA, `ulimit -d`")):
        soft, _ = resource.getrlimit(which)
        if soft != resource.RLIM_INFINITY:
            limits.append((name, soft / 2 ** 30))
    return limits
