"""Optimizer parameter groups (spec §3) from explicit rules on WHOLE path components.

A rule is a path suffix: "a|b/c" matches a parameter whose second-to-last component is `a` or
`b` and whose last is `c`. Names are compared whole — never as substrings — because a substring
rule once routed the published run's `attn_gate` into `attn_gated_norm` silently. The first
matching rule wins; a parameter no rule claims is an error (a new parameter must be given a
group on purpose, not fall into a default).

Pure Python at import (JAX only inside `param_groups`): config validation uses the same matcher
on the parameter table of `marin.model.accounting` (weight-decay rules, `marin.optim.decay`).
"""
from __future__ import annotations

MUONH, ADAMH, ADAM, ADAMW = "muonh", "adamh", "adam", "adamw"

GATED_NORMS = "embed_gated_norm|attn_gated_norm|moe_gated_norm|final_gated_norm"
EXPERT_MATRICES = "w_gate|w_up|w_down|shared_gate|shared_up|shared_down|latent_down|latent_up"

RULES: tuple[tuple[str, str], ...] = (
    ("embed/embedding", ADAM),
    ("head/kernel", ADAMH),                   # output head: Adam direction, hyperball step
    ("moe/router", ADAM),
    ("attn/gate", ADAM),                      # per-head output gate (zero init: no norm to keep)
    ("scale", ADAM),                          # every norm gain
    ("attn/conv_k", ADAM),                    # causal convolutions
    ("attn_out_conv|moe_out_conv/kernel", ADAM),
    ("attn/wq|wk|wv|wo", MUONH),
    (f"moe/{EXPERT_MATRICES}", MUONH),
    (f"{GATED_NORMS}/down|up", MUONH),
)


def parse_rule(rule: str) -> tuple[frozenset[str], ...]:
    """"a|b/c" → ({a, b}, {c}): the allowed names of each trailing path component."""
    return tuple(frozenset(part.split("|")) for part in rule.split("/"))


def matches(names: tuple[str, ...], suffix: tuple[frozenset[str], ...]) -> bool:
    """Whether the path's last components are, one by one, among the rule's names (whole names)."""
    return len(names) >= len(suffix) and all(n in allowed for n, allowed in zip(names[-len(suffix):], suffix))


_PARSED = tuple((parse_rule(rule), group) for rule, group in RULES)


def path_names(path) -> tuple[str, ...]:
    """Key path (DictKey / GetAttrKey / SequenceKey entries) → plain component names."""
    names = []
    for entry in path:
        for attr in ("key", "name", "idx"):
            if hasattr(entry, attr):
                names.append(str(getattr(entry, attr)))
                break
        else:
            names.append(str(entry))
    return tuple(names)


def group_of(names: tuple[str, ...]) -> str | None:
    """The group of the first rule whose components equal the path's last components."""
    for suffix, group in _PARSED:
        if matches(names, suffix):
            return group
    return None


def param_groups(params, optimizer: str = "muonh"):
    """Pytree of group names with the structure of `params` (arrays or ShapeDtypeStructs).

    `optimizer="adamw"` puts every leaf in "adamw"; `"muonh"` applies RULES.
    """
    import jax

    if optimizer == "adamw":
        return jax.tree.map(lambda _: ADAMW, params)
    if optimizer != "muonh":
        raise ValueError(f"unknown optimizer {optimizer!r}")
    unmatched = []

    def label(path, _leaf):
        names = path_names(path)
        group = group_of(names)
        if group is None:
            unmatched.append("/".join(names))
        return group

    labels = jax.tree_util.tree_map_with_path(label, params)
    if unmatched:
        raise ValueError(f"no optimizer group rule matches parameter(s) {unmatched}; "
                         "add an explicit rule to marin.optim.groups.RULES")
    return labels
