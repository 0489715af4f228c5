"""A config validated as a launch needs it: its own rules (marin.config.validate) and the checks
that read more than the config, each living with the code that knows what it reads. They are
passed down to `validate.load` from here, so marin.config stays the bottom layer.

    load(cfg) -> (composed, resolved)     or ConfigError, one (field, message) per problem

Everything that launches, plans, reproduces or prepares a run validates through this `load`.
Pure Python: no JAX.
"""
from __future__ import annotations

from omegaconf import DictConfig

from marin.config import validate
from marin.config.schema import Config
from marin.data.mixture import check as check_data
from marin.model.accounting import offload_estimate
from marin.optim.decay import check as check_decay
from marin.optim.newton_schulz import check as check_newton_schulz
from marin.track.backend import check_uri as check_tracking_uri
from marin.track.forecast_check import check_config as check_forecast
from marin.track.secrets import check_experiment_names
from marin.train.init_from import problems as check_init_from

CHECKS = (
    check_decay,       # optim.decay rules against the parameter table
    check_newton_schulz,  # optim.ns_coefficients: a known schedule, or ns_steps triples
    check_init_from,   # train.init_from: its form, and its checkpoint
    check_data,        # sources, cells, phases, epochs, files, tokenizer
    check_forecast,    # forecast.registered matches this run
    check_experiment_names,  # run.experiment, tracking.experiment: no password in an MLflow name
    check_tracking_uri,      # tracking.uri: a store MLflow takes new runs in
)


def load(cfg: DictConfig | Config, resuming: bool = False) -> tuple[Config, Config]:
    """`resuming`: a resume restores the run's own checkpoints; its `train.init_from` served its
    start and is not read again (its source may be gone or damaged since)."""
    checks = tuple(c for c in CHECKS if not (resuming and c is check_init_from))
    return validate.load(cfg, checks, memory=offload_estimate)  # the plan resolves offload `auto`
