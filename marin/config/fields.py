"""Rules carried on the schema's fields: `setting(default, "help", range=..., choices=...)`.

Every field of `marin.config.schema` is declared with `setting`, which keeps its one-line help,
its numeric range or its allowed values in the dataclass field's metadata. `leaves()` walks the
dataclasses (nested ones included) and `problems(cfg)` checks every leaf against its own rule:
a choice must be one of its values; a number must be finite, inside its range and, for an
integer, fit int32 (the model's index maths is int32 on the device). Pure Python: no JAX.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Union

AUTO = "auto"
INT32_MAX = 2**31 - 1


def is_auto(value) -> bool:
    return isinstance(value, str) and value == AUTO


@dataclass(frozen=True)
class Range:
    """``lo ≤ value ≤ hi`` (``<`` where open); `integer` leaves must be whole numbers within int32."""
    integer: bool
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a finite number"
        hi = INT32_MAX if self.integer and self.hi is None else self.hi
        if self.lo is not None and hi is not None:
            return f"{kind} in {'(' if self.lo_open else '['}{_fmt(self.lo)}, {_fmt(hi)}{')' if self.hi_open else ']'}"
        if self.lo is not None:
            return f"{kind} {'>' if self.lo_open else '≥'} {_fmt(self.lo)}"
        return kind

    def allows(self, value) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.integer and (not isinstance(value, int) or abs(value) > INT32_MAX):
            return False
        if not math.isfinite(value):
            return False
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        return self.hi is None or not (value >= self.hi if self.hi_open else value > self.hi)


def _fmt(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def count(lo: int = 0, hi: int | None = None) -> Range:
    return Range(True, lo, hi)


def real(lo: float | None = None, hi: float | None = None, lo_open: bool = False, hi_open: bool = False) -> Range:
    return Range(False, lo, hi, lo_open, hi_open)


POSITIVE = real(0.0, lo_open=True)
NON_NEGATIVE = real(0.0)
FRACTION = real(0.0, 1.0)
BETA = real(0.0, 1.0, hi_open=True)       # Adam's b1/b2, momentum: 1 would never forget

Choices = Union[tuple, Callable[[], Iterable[str]]]  # a callable: a registry's names, read when checked


def setting(default: Any = dataclasses.MISSING, help: str = "", *, range: Range | None = None,  # noqa: A002
            choices: Choices | None = None, factory: Callable[[], Any] | None = None) -> Any:
    """A dataclass field with its rules: `help` (one line), `range` (numbers) or `choices`."""
    meta = {"help": help, "range": range, "choices": choices}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclass(frozen=True)
class Leaf:
    """One leaf of the schema: its dotted name and the rules its field carries."""
    name: str
    help: str
    range: Range | None     # numbers: integer or not, bounds
    choices: Choices | None
    nullable: bool          # Optional[...]: null allowed
    auto: bool              # "auto" allowed (typed Any with default auto)

    def allowed(self) -> tuple:
        choices = self.choices() if callable(self.choices) else self.choices
        return tuple(choices or ())


def _default(f: dataclasses.Field):
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]


def _unwrap(hint) -> tuple[Any, bool]:
    args = typing.get_args(hint)
    if typing.get_origin(hint) is Union and type(None) in args:
        return next(a for a in args if a is not type(None)), True
    return hint, False


def leaves(cls, prefix: str = "") -> Iterator[Leaf]:
    """Every leaf of the dataclass `cls`, e.g. marin.config.schema.Config (nested dataclasses
    walked; list items are not)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint, nullable = _unwrap(hints[f.name])
        if dataclasses.is_dataclass(hint):
            yield from leaves(hint, f"{prefix}{f.name}.")
            continue
        rule = f.metadata.get("range")
        if rule is None and hint in (int, float):
            rule = Range(hint is int)   # a number without a stated range: at least finite (and int32)
        elif rule is not None and hint is int and not rule.integer:
            rule = dataclasses.replace(rule, integer=True)
        auto = hint is Any and (is_auto(_default(f)) or f.metadata.get("range") is not None)
        yield Leaf(f"{prefix}{f.name}", f.metadata.get("help", ""), rule, f.metadata.get("choices"), nullable, auto)


def numeric_leaves(cls) -> list[Leaf]:
    return [leaf for leaf in leaves(cls) if leaf.range is not None]


def get(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _same(value, choice) -> bool:
    """`value` is `choice`; a bool only matches a bool (True == 1 would let 1 pass as a choice,
    and 1 == True a bool pass as the choice 1)."""
    if isinstance(value, bool) or isinstance(choice, bool):
        return value is choice
    return value == choice


def _show(choice) -> str:
    return str(choice).lower() if isinstance(choice, bool) else str(choice)


def problems(cfg) -> list[tuple[str, str]]:
    """``(field, what is allowed)`` for every leaf outside its choices or range."""
    found = []
    for leaf in leaves(type(cfg)):
        value = get(cfg, leaf.name)
        if value is None and leaf.nullable or leaf.auto and is_auto(value):
            continue
        extra = ("'auto' or " if leaf.auto else "") + ("null or " if leaf.nullable else "")
        if leaf.choices is not None:
            allowed = leaf.allowed()
            if not any(_same(value, choice) for choice in allowed):
                found.append((leaf.name, f"must be {extra}one of {', '.join(map(_show, allowed))}; got {value!r}"))
        elif leaf.range is not None and not leaf.range.allows(value):
            found.append((leaf.name, f"must be {extra}{leaf.range.describe()}; got {value!r}"))
    return found
