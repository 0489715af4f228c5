"""Routers: QB exactly as the spec (threshold, weights, histogram quantile, bias state), the
softmax aux-loss router and DeepSeek-style bias_update, each balancing skewed routing."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marin.model import routers
from tests.helpers import make_config

E, K, T, D = 8, 2, 2048, 32


def _cfg(router, *overrides):
    return make_config("model=tiny", f"model.num_experts={E}", f"router={router}", *overrides)


def _skewed_logits(seed=0):
    """Random tokens (plus a constant feature) through a router whose columns have different
    scales and offsets 0..3: the last experts start with most of the load (max/mean ≈ 2.7)."""
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jnp.concatenate([jax.random.normal(kx, (T, D)), jnp.ones((T, 1))], axis=1)
    w = jnp.concatenate([jax.random.normal(kw, (D, E)) / D ** 0.5 * jnp.linspace(0.5, 1.5, E),
                         jnp.linspace(0.0, 3.0, E)[None]], axis=0)
    return x, w, x @ w


def _imbalance(load):
    return float(jnp.max(load) / jnp.mean(load))


def test_qb_selection_threshold_and_weights():
    cfg = _cfg("qb")
    _, _, logits = _skewed_logits()
    bias = jax.random.normal(jax.random.key(3), (E,))
    idx, weights, stats = routers.route(logits, bias, cfg)
    biased = np.asarray(logits + bias)
    order = np.argsort(-biased, axis=1)
    np.testing.assert_array_equal(np.sort(idx, 1), np.sort(order[:, :K], 1))    # top-k of biased
    chosen = np.take_along_axis(np.asarray(logits), np.asarray(idx), 1)
    expected = 1 / (1 + np.exp(-chosen))
    expected *= cfg.router.combine_sum / expected.sum(1, keepdims=True)              # unbiased sigmoid
    np.testing.assert_allclose(weights, expected, rtol=1e-5)
    np.testing.assert_allclose(weights.sum(1), cfg.router.combine_sum, rtol=1e-5)
    # β is the (1 − k/E) quantile of the margins s − α, α the (k+1)-th biased value.
    alpha = np.take_along_axis(biased, order[:, K:K + 1], 1)
    margins = np.asarray(logits) - alpha
    bin_width = (margins.max() - margins.min()) / cfg.router.qb_bins
    np.testing.assert_allclose(stats["beta"], np.quantile(margins, 1 - K / E, axis=0, method="inverted_cdf"),
                               atol=bin_width)
    np.testing.assert_allclose(stats["load"], np.bincount(np.asarray(idx).ravel(), minlength=E) / (T * K))


def test_histogram_quantile_within_a_bin_width():
    """As bins → ∞ the estimate tends to the smallest value with ≥ q·N values at or below it
    (numpy's inverted_cdf), so that exactly (1 − q)·N tokens lie above β."""
    values = jax.random.gumbel(jax.random.key(1), (4001, 5)) * jnp.arange(1, 6)
    for bins in (100, 10000):
        estimate = routers.histogram_quantile(values, 0.75, bins)
        exact = np.quantile(np.asarray(values), 0.75, axis=0, method="inverted_cdf")
        bin_width = float(values.max() - values.min()) / bins
        assert np.max(np.abs(estimate - exact)) <= bin_width, (estimate, exact, bin_width)


def _scatter_histogram_quantile(values, q, bins):
    """The estimator as it was written first (an [E, bins] histogram by scatter-add), one device:
    the reference the scatter-free one must equal exactly."""
    values = values.astype(jnp.float32)
    tokens, experts = values.shape
    lo, hi = jnp.min(values), jnp.max(values)
    width = jnp.maximum(hi - lo, 1e-12) / bins
    bin_idx = jnp.clip(jnp.floor((values - lo) / width), 0, bins - 1).astype(jnp.int32)
    flat = (bin_idx + jnp.arange(experts, dtype=jnp.int32) * bins).reshape(-1)
    counts = jnp.zeros((experts * bins,), jnp.int32).at[flat].add(1).reshape(experts, bins)
    target = q * jnp.float32(tokens)
    cdf = jnp.cumsum(counts, axis=1)
    crossing = jnp.argmax(cdf.astype(jnp.float32) >= target, axis=1)
    in_bin = jnp.take_along_axis(counts, crossing[:, None], axis=1)[:, 0].astype(jnp.float32)
    below = jnp.take_along_axis(cdf, crossing[:, None], axis=1)[:, 0].astype(jnp.float32) - in_bin
    frac = jnp.clip((target - below) / jnp.maximum(in_bin, 1.0), 0.0, 1.0)
    return lo + width * (crossing.astype(jnp.float32) + frac)


@pytest.mark.parametrize("tokens,experts,q,bins", [(4001, 5, 0.75, 10000), (2048, 8, 0.75, 7), (300, 6, 0.5, 2),
                                                   (1000, 16, 1 - 2 / 16, 1000), (64, 4, 0.0, 50)])
def test_histogram_quantile_equals_the_scatter_histogram_exactly(tokens, experts, q, bins):
    """The bisection over cumulative counts finds the histogram's crossing bin and counts: the
    same β bit for bit, ties (values on bin edges, repeated values) included."""
    k1, k2 = jax.random.split(jax.random.key(tokens))
    smooth = jax.random.gumbel(k1, (tokens, experts)) * jnp.arange(1, experts + 1)
    tied = jnp.round(jax.random.normal(k2, (tokens, experts)) * 4) / 4        # many equal values
    new, old = (jax.jit(f, static_argnums=(1, 2)) for f in (routers.histogram_quantile, _scatter_histogram_quantile))
    for values in (smooth, tied):   # both jitted: the same final arithmetic, so the same rounding
        np.testing.assert_array_equal(new(values, q, bins), old(values, q, bins))


def test_expert_load_counts_like_bincount():
    idx = jax.random.randint(jax.random.key(0), (513, 3), 0, 7)
    np.testing.assert_array_equal(routers.count_values(idx, 9), np.bincount(np.asarray(idx).ravel(), minlength=9))
    np.testing.assert_allclose(routers.expert_load(idx, 9), np.bincount(np.asarray(idx).ravel(), minlength=9) / idx.size)


def test_router_bias_is_zero_mean_and_takes_no_gradient():
    cfg = _cfg("qb")
    state = jax.random.normal(jax.random.key(0), (3, E)) + 5.0
    bias = routers.router_bias(state, cfg)
    np.testing.assert_allclose(bias.mean(-1), 0.0, atol=1e-6)
    np.testing.assert_allclose(bias, -(state - state.mean(-1, keepdims=True)), atol=1e-6)
    _, _, logits = _skewed_logits()
    grad = jax.grad(lambda b: jnp.sum(routers.route(logits, b, cfg)[1] ** 2))(bias[0])
    assert float(jnp.abs(grad).max()) == 0.0


def test_qb_balances_load_within_a_few_steps():
    """Fixed skewed tokens, route → state update 5 times: max load / mean load ≤ 1.25."""
    cfg = _cfg("qb", "model.num_layers=1")
    _, _, logits = _skewed_logits()
    state = routers.init_router_state(cfg)
    _, _, stats = routers.route(logits, routers.router_bias(state, cfg)[0], cfg)
    history = [_imbalance(stats["load"])]
    assert history[0] > 2.0                       # the skew is real
    for _ in range(5):
        state = routers.next_router_state(state, jax.tree.map(lambda s: s[None], stats), cfg)
        _, _, stats = routers.route(logits, routers.router_bias(state, cfg)[0], cfg)
        history.append(_imbalance(stats["load"]))
    assert history[-1] <= 1.25, history
    # The state is the latest β itself: replaced, not accumulated.
    np.testing.assert_array_equal(routers.next_router_state(state, {"beta": stats["beta"][None]}, cfg)[0],
                                  stats["beta"])


def test_softmax_aux_loss_reduces_imbalance_under_gradient():
    cfg = _cfg("softmax_aux", "router.aux_loss_weight=1.0")
    x, w, _ = _skewed_logits()

    def aux(w):
        return routers.route(x @ w, jnp.zeros(E), cfg)[2]["aux_loss"]
    idx, weights, stats = routers.route(x @ w, jnp.zeros(E), cfg)
    np.testing.assert_allclose(weights.sum(1), 1.0, rtol=1e-5)     # renormalised softmax
    before = _imbalance(stats["load"])
    assert float(stats["aux_loss"]) > 0
    step = jax.jit(lambda w: w - 0.5 * jax.grad(aux)(w))
    for _ in range(50):
        w = step(w)
    after = _imbalance(routers.route(x @ w, jnp.zeros(E), cfg)[2]["load"])
    assert after < 0.8 * before, (before, after)


def test_bias_update_moves_toward_balance():
    cfg = _cfg("bias_update", "model.num_layers=1", "router.bias_update_rate=0.1")
    _, _, logits = _skewed_logits()
    state = routers.init_router_state(cfg)
    loads = []
    for _ in range(30):
        _, _, stats = routers.route(logits, routers.router_bias(state, cfg)[0], cfg)
        loads.append(_imbalance(stats["load"]))
        state = routers.next_router_state(state, {"load": stats["load"][None]}, cfg)
    np.testing.assert_allclose(state.mean(-1), 0.0, atol=1e-6)
    assert loads[-1] < 0.6 * loads[0], loads


@pytest.mark.parametrize("router", ["softmax_aux", "bias_update"])
def test_other_routers_report_zero_beta(router):
    _, _, logits = _skewed_logits()
    _, _, stats = routers.route(logits, jnp.zeros(E), _cfg(router))
    assert float(jnp.abs(stats["beta"]).max()) == 0.0


def test_a_new_router_is_its_yaml_and_its_registered_class(tmp_path):
    """Adding a router: an option file (here in a search-path folder, as a site's conf/ would be)
    and a class registered under its kind. Validation knows the kind without importing this code
    path's JAX (the registry is pure Python), and the MoE routes with it."""
    from marin.config.registry import ROUTERS
    from marin.config.validate import ConfigError
    from marin.launch.checks import load
    from tests.helpers import compose_dict

    (tmp_path / "router").mkdir()
    (tmp_path / "router" / "lowest.yaml").write_text("name: lowest\nkind: lowest\ntop_k: 2\ncombine: softmax\n")
    overrides = ("model=tiny", f"model.num_experts={E}", f"hydra.searchpath=[file://{tmp_path}]", "router=lowest")
    with pytest.raises(ConfigError) as err:   # a YAML outside conf/ and no code: the kind is unknown
        load(compose_dict(*overrides))
    (name, message), = err.value.problems
    assert name == "router.kind" and message == "must be one of bias_update, qb, softmax_aux; got 'lowest'"

    @routers.router("lowest")
    class Lowest(routers.Router):  # the k experts with the smallest logits: nothing a real router does
        def select(self, logits, biased, k, cfg, axis_names, valid=None):
            return super().select(logits, -logits, k, cfg, axis_names)

    try:
        _, cfg = load(compose_dict(*overrides))
        assert cfg.router.kind == "lowest" and cfg.router.combine == "softmax"
        _, _, logits = _skewed_logits()
        idx, weights, stats = routers.route(logits, jnp.zeros(E), cfg)
        np.testing.assert_array_equal(np.sort(idx, 1), np.sort(np.argsort(np.asarray(logits), 1)[:, :K], 1))
        np.testing.assert_allclose(weights.sum(1), 1.0, rtol=1e-5)
        state = routers.init_router_state(cfg)
        assert float(jnp.abs(routers.router_bias(state, cfg)).sum()) == 0.0
        assert routers.next_router_state(state, stats, cfg) is state
    finally:
        ROUTERS._impls.pop("lowest")  # noqa: SLF001 (other tests see the shipped routers only)
