"""benchmarks/moe_layer.py: its matmul reference computes in the layers' compute dtype (a float32
reference made a bfloat16 layer's "% of matmul rate" meaningless on a GPU), and the whole
benchmark, census and ragged probe included, runs at a tiny size."""
import importlib.util
from pathlib import Path

import jax.numpy as jnp
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _benchmark():
    spec = importlib.util.spec_from_file_location("moe_layer_benchmark", ROOT / "benchmarks" / "moe_layer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TINY = ["--tokens", "128", "--d", "32", "--latent", "32", "--width", "48", "--experts", "4", "--top-k", "2",
        "--matmul", "64", "--rounds", "1"]


def test_matmul_reference_in_the_compute_dtype():
    bench = _benchmark()
    for dtype in ("bfloat16", "float32"):
        steps = bench.build(bench.parse_args(TINY + ["--dtype", dtype]))
        (mats,) = steps["matmul"][1]
        assert mats.dtype == jnp.dtype(dtype)


@pytest.mark.slow
def test_benchmark_runs_at_a_tiny_size(capsys):
    _benchmark().main(TINY + ["--dtype", "bfloat16", "--dispatch", "sort,ragged_dot", "--ragged-probe"])
    out = capsys.readouterr().out
    assert "moe[sort]" in out and "data movement: " in out
    assert "ragged_dot probe, Pallas lowering off: XLA/useful" in out and "guard: allowed" in out
