"""launch.py's command line, read before Hydra sees it.

Hydra answers some habits badly: an unknown key gets several lines of advice (`+key`) that
fail again, a comma list without -m five lines, `hydra.run.dir` a folder marin never writes to,
a value of the wrong type or against its override grammar several lines and a link (which
`report_in_one_line` makes one), and `--cfg job` prints the composed config before marin fills each group's `name` (`???`). `read`
refuses the first three in one line (exit 2, nothing written) and turns `--cfg job` into a
normal run that marin.launch.entry.show answers, so the config shown is the one a run gets;
`refuse_sweep_without_multirun` answers a named sweep without -m once Hydra has composed it.
No JAX.
"""
from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass
from typing import Optional

import yaml
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra._internal.utils import get_args_parser  # Hydra's own parser: the argv forms it accepts
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException, HydraException, MissingConfigException, OverrideParseException
from hydra.types import RunMode
from omegaconf.errors import OmegaConfBaseException

from marin.cli import fail
from marin.config.keys import is_mapping, root_groups, unknown_at, unknown_key_message
from marin.config.schema import GROUPS
from marin.config.store import options, override_key, shell_join

# Hydra would make these folders, but marin writes nothing there: a run's directory is
# <run.out_dir>/<run.name>, and Hydra's sweep folder only holds its private multirun.yaml.
HYDRA_OUTPUT_DIRS = ("hydra.run.dir", "hydra.sweep.dir")
# Hydra's errors about what it was given (an option, a key, a value, its grammar, a YAML file):
# `hydra_problem` words each in one line.
INPUT_ERRORS = (ConfigCompositionException, OverrideParseException, yaml.YAMLError)


@dataclass(frozen=True)
class Show:
    """`--cfg job [--resolve] [--package P]`: print the config instead of running it."""
    resolve: bool
    package: Optional[str]


def refuse(argv: list[str], sweep_hint: str = "add -m"):
    """Hydra's parse of `argv` (a Hydra app's sys.argv), after refusing in one line with exit
    status 2 what Hydra would answer badly: unknown keys, its output folders, a sweep without -m
    (`sweep_hint`: what to do instead). Also the command line of `python -m marin.data.prepare`."""
    args = get_args_parser().parse_args(argv[1:])
    if args.config_dir is not None and not os.path.isdir(args.config_dir):  # Hydra: two lines and a hint
        fail(f"--config-dir: {args.config_dir} is not a folder (one of your own config groups: <dir>/model/mine.yaml …)")
    if not (args.help or args.hydra_help or args.shell_completion or args.info):  # nothing composed
        _refuse_unknown_keys(args.overrides)
        _refuse_null_options(args.overrides)
        for override in args.overrides:
            if override_key(override) in HYDRA_OUTPUT_DIRS:
                fail(f"{override_key(override)}: marin writes nothing there; use run.out_dir=<folder> "
                     "(a run's directory is <run.out_dir>/<run.name>)")
        if not args.multirun:
            _refuse_sweeps(args.overrides, sweep_hint)
    return args


def read(argv: list[str]) -> tuple[list[str], Optional[Show]]:
    """The argv to give Hydra, and what to show instead of running (None: run). Refuses, in one
    line with exit status 2, what Hydra would answer badly."""
    args = refuse(argv)
    if args.cfg != "job" or _other_command(args):
        return argv, None  # Hydra's own --cfg hydra|all, and its refusal of two commands at once
    # The same command line without --cfg: Hydra composes it as for a run and calls the task.
    kept = [argv[0]]
    for flag, value in (("--config-path", args.config_path), ("--config-name", args.config_name),
                        ("--config-dir", args.config_dir)):
        if value is not None:
            kept += [flag, value]
    return kept + args.overrides, Show(resolve=args.resolve, package=args.package)


def _refuse_unknown_keys(overrides: list[str]) -> None:
    """`modle=tiny`, `train.step=50`: Hydra's answer is to add the key with `+`, which validation
    refuses next. A `+key` is left to validation (a group of one's own may add keys at the root:
    marin.config.validate.unknown_keys answers the same way), `hydra.*` and group paths to Hydra."""
    for text in overrides:
        key = override_key(text)
        if text.startswith("+") or key == "hydra" or key.startswith("hydra.") or "/" in key or "@" in key:
            continue
        if (at := unknown_at(key)) is not None:
            fail(f"{key}: no such key{' or group' if at == 0 else ''}; {unknown_key_message(key)}")


def _refuse_null_options(overrides: list[str]) -> None:
    """`model=null`: Hydra raises a ValueError (a traceback) for a group given no option."""
    for text in overrides:
        key, _, value = text.lstrip("+").partition("=")
        if value.strip() == "null" and key in root_groups():
            optional = key not in GROUPS  # experiment, sweep, local: none unless chosen
            fail(f"{key}=null: a group takes the name of one of its options ({key} has {', '.join(options(key))})"
                 + (f"; without {key}=… none is used" if optional else ""))


def _refuse_sweeps(overrides: list[str], hint: str) -> None:
    """A comma list (`optim.lr=1e-3,3e-3`, `sweep=a,b`), range() or choice() runs only with -m;
    Hydra's answer without it is five lines of options."""
    parser = OverridesParser.create()
    for text in overrides:
        try:
            override = parser.parse_override(text)
        except HydraException:
            continue  # not well formed: Hydra says why
        if override.is_sweep_override():
            try:
                values = f" of {len(list(override.sweep_string_iterator()))} values"
            except HydraException:  # glob() and interval(): counted only by a sweeper
                values = ""
            fail(f"{text} is a sweep{values}: {hint}")


def refuse_sweep_without_multirun() -> None:
    """`sweep=<name>` without -m: Hydra composes the sweep's file and ignores its
    hydra.sweeper.params, so one job of defaults would run as if it were the sweep. Called in
    the task function, before anything is written; the jobs counted as Hydra's sweeper would."""
    hydra = HydraConfig.get()
    if hydra.mode != RunMode.RUN or not hydra.sweeper.get("params"):
        return
    params = [f"{key}={value}" for key, value in hydra.sweeper.params.items()]
    parsed = OverridesParser.create().parse_overrides(params + list(hydra.overrides.task))
    jobs = sum(len(batch) for batch in BasicSweeper.split_arguments(parsed, None))
    name = hydra.runtime.choices.get("sweep")
    fail(f"{f'sweep={name}' if name else 'hydra.sweeper.params'} has {jobs} job{'s' * (jobs != 1)}: add -m")


def report_in_one_line() -> None:
    """Have Hydra report a command line it cannot compose (a value of the wrong type, its override
    grammar) as one `error:` line, exit 2, where it prints several and a link; HYDRA_FULL_ERROR=1
    keeps its own report. Hydra's other errors, and the run's, are reported as before."""
    from hydra._internal import utils  # where Hydra's entry point looks its reporter up

    hydras = utils.run_and_report

    def in_one_line(func):
        def run():
            try:
                return func()
            except INPUT_ERRORS as err:
                if os.environ.get("HYDRA_FULL_ERROR") == "1":
                    raise
                fail(hydra_problem(err))
        return run

    if not getattr(hydras, "marin_one_line", False):
        utils.run_and_report = lambda func: hydras(in_one_line(func))
        utils.run_and_report.marin_one_line = True


_TYPES = {"bool": "true or false", "Integer": "an integer", "Float": "a number"}


def hydra_problem(err: BaseException) -> str:
    """A composition error of Hydra's as one line naming the field (or override) and what it allows."""
    if isinstance(err, yaml.YAMLError):  # a config file of one's own that is not YAML: a traceback before
        mark = getattr(err, "problem_mark", None)
        where = f"{mark.name}, line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        return f"{where}not valid YAML ({getattr(err, 'problem', None) or str(err).splitlines()[0]})"
    if isinstance(err, OverrideParseException):
        return (f"{err.override}: {str(err.message).splitlines()[0]} (Hydra's override grammar: quote a value "
                "that holds '=' or a space, key='a=b')")
    if isinstance(err, MissingConfigException) and err.options and err.missing_cfg_file:
        where = re.match(r"In '([^']+)'", str(err))  # 'config': the command line; else the file that asked
        return _unknown_option(err.missing_cfg_file, list(err.options),
                               where.group(1) if where and where.group(1) != "config" else None)
    cause = err.__cause__
    if isinstance(cause, OmegaConfBaseException) and getattr(cause, "full_key", None):
        key, value, reason = cause.full_key, getattr(cause, "value", None), str(cause.msg).splitlines()[0]
        wanted = re.search(r"not a valid (bool)|converted to (Integer|Float)", reason)
        line = f"{key}: must be {_TYPES[wanted.group(1) or wanted.group(2)]}; got {value!r}" if wanted else f"{key}: {reason}"
        if "is not in struct" in reason:  # a key below a dict field (hardware.env) or below a value
            parent, _, leaf = key.rpartition(".")
            line = (f"{key}: {parent} has no key {leaf}; add one with +{key}=<value>" if is_mapping(parent) else
                    f"{key}: no such key; {parent} is one value, with no keys below it ({parent}=<value>)")
        if key == "verify":  # `verify=<run>`: the flag goes with reproduce=
            line += f" (a replay of run {value}: {shell_join(['python', 'launch.py', f'reproduce={value}', 'verify=true'])})"
        return line
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]  # an option file's error: its reason below
    reason = [line for line in lines[1:] if " not in '" in line or "could not be converted" in line or "not a valid" in line]
    if not reason and cause is not None:
        reason = str(cause).splitlines()[:1]
    return " ".join(lines[:1] + reason[:1]) or type(err).__name__


def _unknown_option(missing: str, options: list[str], asked_in: str | None) -> str:
    """`model=tinyy`: Hydra's "Could not find 'model/tinyy'" and its options, one per line, as one
    line with the nearest names first. `asked_in`: the config file whose defaults named it."""
    group, _, option = missing.rpartition("/")
    options = sorted(options)
    near = difflib.get_close_matches(option, options, n=3, cutoff=0.6)
    listed = f"{group} has {', '.join(options)}"
    where = f" (in {asked_in})" if asked_in else ""
    return f"{group}={option}{where}: no such option of {group}; " + (f"did you mean {' / '.join(near)}? ({listed})" if near else listed)


def _other_command(args) -> bool:
    return bool(args.help or args.hydra_help or args.run or args.multirun or args.shell_completion
                or args.info or args.experimental_rerun)
