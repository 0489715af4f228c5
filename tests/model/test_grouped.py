"""The ragged paths' guard (marin/model/grouped.py): on GPU a ragged path whose grouped matmuls
compile to more than 1.3× their useful FLOPs (XLA's dense rewrite over every expert) is refused
in one line naming cuDNN's version and the way out; the probe measures that ratio on whatever
backend runs it (on CPU ragged_dot is dense: ≈ E×, and allowed there as a test reference)."""
import jax
import pytest

from marin.model import grouped
from tests.helpers import make_config


def test_refusal_only_on_gpu_and_only_past_the_limit():
    useful = 1e12
    assert grouped.ragged_refusal(40 * useful, useful, "cpu", None) is None       # CPU: a reference path
    assert grouped.ragged_refusal(1.3 * useful, useful, "gpu", 91900) is None      # at the limit
    assert grouped.ragged_refusal(0.02 * useful, useful, "gpu", 92200) is None     # a kernel (custom call)
    line = grouped.ragged_refusal(64.2 * useful, useful, "gpu", 91900, "model.dispatch=ragged_dot")
    assert line is not None and "\n" not in line
    assert line.startswith("model.dispatch: model.dispatch=ragged_dot compiles its grouped matmuls to 64.2×")
    for words in ("cuDNN 9.19.0", "≤ 1.3×", "model.ep_transport=fixed", "cuDNN ≥ 9.22", "Pallas"):
        assert words in line, line
    assert "cuDNN unknown" in grouped.ragged_refusal(2 * useful, useful, "gpu", None)


def test_probe_on_cpu_sees_the_dense_rewrite():
    """XLA:CPU computes every group for every row: the ratio is about the group count, which on
    a GPU would be refused; here the guard lets it pass."""
    probe = grouped.ragged_probe(512, 16, 32, 48, "float32")
    assert probe["platform"] == "cpu" and probe["useful_flops"] == 18 * 512 * 32 * 48
    assert 0.5 * 16 < probe["ratio"] < 1.5 * 16, probe
    assert grouped.ragged_refusal(probe["compiled_flops"], probe["useful_flops"], probe["platform"], None) is None


@pytest.mark.parametrize("overrides,setting", [
    ((), None), (("model.ep_transport=pooled", "model.ep_waves=2"), None),
    (("model.dispatch=ragged_dot",), "model.dispatch=ragged_dot"),
    (("model.ep_transport=ragged", "dry_run=true"), "model.ep_transport=ragged")])
def test_ragged_setting_names_the_override_that_chose_it(overrides, setting):
    cfg = make_config("model=tiny", *overrides)
    assert grouped.ragged_setting(cfg) == setting
    assert grouped.check_ragged(cfg) is None          # CPU: nothing to check
    assert not grouped.use_grouped_kernel(cfg) and not jax.config.values[grouped.PALLAS_FLAG]


def test_under_expert_parallelism_only_the_transport_is_ragged():
    cfg = make_config("model=tiny", "model.dispatch=ragged_dot")
    assert grouped.ragged_setting(cfg, peers=4) is None           # EP runs model.ep_transport
    cfg = make_config("model=tiny", "model.dispatch=ragged_dot", "model.ep_transport=ragged", "dry_run=true")
    assert grouped.ragged_setting(cfg, peers=4) == "model.ep_transport=ragged"
    assert grouped.ragged_setting(cfg) == "model.dispatch=ragged_dot"


def test_shapes_of_one_device_and_of_the_expert_parallel_buffer():
    cfg = make_config("model=tiny", "model.num_experts=8")
    tokens = cfg.train.micro_batch * cfg.train.seq_len
    assert grouped.ragged_shapes(cfg) == (tokens * cfg.router.top_k, 8, int(cfg.model.latent_dim),
                                          int(cfg.model.expert_width))
    rows, groups, *_ = grouped.ragged_shapes(cfg, peers=4)
    assert groups == 2 and rows % 8 == 0
