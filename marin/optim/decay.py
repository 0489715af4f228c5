"""Scheduled, decoupled weight decay on chosen parameters (`optim.decay`).

The published run added Adam weight decay on the attention gate and the router mid-run
(marin#8833): a line from 0.02 at step 0 to 0 at the last step, read from the step count, switched
on by the fork at step 58,014 (spec §8), where the line gives 0.02·(1 − 58,014/390,251) = 0.01703.
A rule expresses that with `origin` (where the line is `value`, default: `start`) before `start`
(where it switches on): {value: 0.02, origin: 0, start: 58014, end: auto}.

A rule names a parameter group (muonh | adamh | adam under MuonH, adamw under AdamW: all of its
parameters) or a path suffix on whole components ("attn/gate", "a|b/c"; the syntax of
`marin.optim.groups`). A parameter takes at most one rule. Every group's transform ends with
`scheduled_decay`:

    update ← update − lr_group(step) · wd_rule(step) · w

AdamW's decoupled decay: on the adam group it is `optax.adamw` with a scheduled, masked
weight decay. It comes after the hyperball too, so on a MuonH/AdamH matrix it shrinks the norm
the hyperball would keep (the published run decayed only Adam parameters).

The transform is always there, with its own step counter, whether rules are set or not: the
optimizer state has one structure with and without rules, so a checkpoint taken without decay
resumes with a rule added (as the published run did). Leaves no rule matches are untouched.

`check` (pure Python, no JAX) matches the rules against the parameter table of
`marin.model.accounting`, which lists the paths the model builds, so a rule that matches nothing,
two rules on one parameter, or a bad value fail at validation, before anything is written.
"""
from __future__ import annotations

import math
from typing import NamedTuple

from marin.config.fields import is_auto
from marin.config.schema import Config, DecayRule
from marin.optim.groups import ADAM, ADAMH, ADAMW, MUONH, matches, parse_rule, path_names

GROUP_NAMES = (MUONH, ADAMH, ADAM, ADAMW)


def applies(rule: DecayRule, names: tuple[str, ...], group: str) -> bool:
    """Whether `rule` covers the parameter at path `names` in optimizer group `group`."""
    if rule.pattern in GROUP_NAMES:
        return rule.pattern == group
    return matches(names, parse_rule(rule.pattern))


def origin_of(rule: DecayRule) -> int:
    """Where the rule's line is `value`: `origin`, or `start` while it is still auto (unresolved)."""
    return rule.start if is_auto(rule.origin) else rule.origin


def coefficient(rule: DecayRule, step: float) -> float:
    """The rule's coefficient at `step` (plain Python, for logs and tests)."""
    if not rule.start <= step < rule.end:
        return 0.0
    origin = origin_of(rule)
    return rule.value * (rule.end - step) / (rule.end - origin)


def describe(cfg: Config) -> list[str]:
    """One line per rule of a resolved config: its line, and the coefficient where it switches on
    (the dry run's `decay` row)."""
    return [f"{r.pattern} {r.value:g} at step {origin_of(r):,} → 0 at {r.end:,}; on from step {r.start:,} "
            f"({coefficient(r, r.start):.5f} there)" for r in cfg.optim.decay]


def _syntax_problem(pattern) -> str | None:
    if pattern in GROUP_NAMES:
        return None
    if not isinstance(pattern, str) or any(not name for part in pattern.split("/") for name in part.split("|")):
        return (f"must be a group ({', '.join(GROUP_NAMES)}) or a path suffix of names joined by '/' "
                f"and '|' (e.g. attn/gate, a|b/c), none empty; got {pattern!r}")
    return None


def check(cfg: Config) -> list[tuple[str, str]]:
    """Problems with `optim.decay` of a resolved config, as (field, message)."""
    from marin.model.accounting import Shapes, leaves_of  # pure Python

    leaves = leaves_of(Shapes.of(cfg))
    optimizer = cfg.optim.name
    claimed: dict[str, int] = {}
    problems = []
    for i, rule in enumerate(cfg.optim.decay):
        field = f"optim.decay[{i}]"
        value, start, end, origin = rule.value, rule.start, rule.end, rule.origin
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            problems.append((f"{field}.value", f"must be a finite number ≥ 0; got {value!r}"))
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            problems.append((f"{field}.start", f"must be an integer ≥ 0; got {start!r}"))
        elif isinstance(end, bool) or not isinstance(end, int) or end <= start:
            problems.append((f"{field}.end", f"must be 'auto' (train.steps) or an integer step > start ({start}); got {end!r}"))
        elif isinstance(origin, bool) or not isinstance(origin, int) or not 0 <= origin <= start:
            problems.append((f"{field}.origin", f"must be 'auto' (= start) or an integer step in [0, start ({start})]; "
                             f"got {origin!r}"))
        if (msg := _syntax_problem(rule.pattern)) is not None:
            problems.append((f"{field}.pattern", msg))
            continue
        hits = [leaf.path for leaf in leaves
                if applies(rule, tuple(leaf.path.split("/")), ADAMW if optimizer == ADAMW else leaf.group)]
        if not hits:
            groups = ", ".join((ADAMW,) if optimizer == ADAMW else (MUONH, ADAMH, ADAM))
            problems.append((f"{field}.pattern", f"matches no parameter under optim.name={optimizer} (give a "
                             f"group: {groups}, or a path suffix of whole names such as attn/gate; "
                             f"see docs/CONTRACTS.md); got {rule.pattern!r}"))
        for path in hits:
            if path in claimed:
                problems.append((f"{field}.pattern", f"overlaps optim.decay[{claimed[path]}] on {path}: "
                                 f"one rule per parameter; got {rule.pattern!r}"))
                break
            claimed[path] = i
    return problems


# --- The optax transform (JAX imported inside: validation imports this module) ---

class DecayState(NamedTuple):
    count: object  # int32 scalar: updates applied so far, the schedules' step


def rule_schedule(rule: DecayRule, numbers=None):
    """An optax schedule, step → coefficient: on the line from `value` at `origin` to 0 at `end`
    from `start` on, 0 before. `numbers` = (value, start, end, origin), possibly traced
    (`marin.optim.hparams`); default: the rule's."""
    import jax.numpy as jnp

    value, start, end, origin = numbers if numbers is not None else (rule.value, rule.start, rule.end, origin_of(rule))
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    start, end, value, origin = f32(start), f32(end), f32(value), f32(origin)

    def schedule(count):
        step = jnp.asarray(count, jnp.float32)
        line = jnp.interp(step, jnp.stack([origin, end]), jnp.stack([value, f32(0.0)]))
        return jnp.where(step >= start, line, 0.0)

    return schedule


def scheduled_decay(learning_rate, rules: list[DecayRule], group: str, numbers=None):
    """The last transform of `group`: update ← update − lr(step) · wd_rule(step) · w on the
    leaves a rule covers. `learning_rate` is the group's optax schedule (or a float); `numbers`
    one (value, start, end, origin) per rule, in place of the rules' own (see `rule_schedule`)."""
    import jax
    import jax.numpy as jnp
    import optax

    from marin.model.memory import on_host  # JAX: decay rules are checked on the config path (launch.checks)
    from marin.optim.muonh import per_layer  # JAX

    numbers = numbers if numbers is not None else [None] * len(rules)
    schedules = [(rule, rule_schedule(rule, n)) for rule, n in zip(rules, numbers, strict=True)]

    def init_fn(params):
        del params
        return DecayState(count=jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("scheduled_decay needs the parameters: call update(updates, state, params)")
        lr = learning_rate(state.count) if callable(learning_rate) else learning_rate

        def decay(path, u, w):
            names = path_names(path)
            for rule, schedule in schedules:  # resolved while tracing: no per-step Python
                if applies(rule, names, group):
                    wd = lr * schedule(state.count)
                    step = lambda u, w: u - (wd * w).astype(u.dtype)
                    # leaves in host memory (offloaded expert masters): one layer at a time
                    return per_layer(step, u, w) if on_host(u) or on_host(w) else step(u, w)
            return u

        new_updates = jax.tree_util.tree_map_with_path(decay, updates, params)
        return new_updates, DecayState(count=optax.safe_increment(state.count))

    return optax.GradientTransformation(init_fn, update_fn)
