"""marin: declarative mixture-of-experts experiments in JAX (Hydra + MLflow + Slurm)."""
