"""Shared test set-up: CPU JAX with one persistent compilation cache for the whole suite, and
MLflow pointed away from any user store."""
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("MARIN_JAX_CACHE", str(ROOT / "outputs" / "cache" / "jax-tests"))
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.environ["MARIN_JAX_CACHE"])
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
os.environ.pop("MLFLOW_TRACKING_URI", None)
