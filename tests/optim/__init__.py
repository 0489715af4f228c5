"""Tests of marin/optim. `config` builds a resolved Config directly (no Hydra) for unit tests."""
from marin.config.schema import Config


def config(optimizer: str = "adamw", steps: int = 100, lr: float = 1e-2, **schedule) -> Config:
    cfg = Config()
    cfg.schedule.name = "warmup_linear"
    cfg.optim.name, cfg.optim.lr, cfg.optim.b2, cfg.optim.eps = optimizer, lr, 0.95, 1e-8
    cfg.train.steps = steps
    for name, value in schedule.items():
        setattr(cfg.schedule, name, value)
    return cfg
