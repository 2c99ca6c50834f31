"""Embedding optimizer configs (common.optim_config) and row-update kernels (core.optim)."""

from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from persia_nats.common.errors import ConfigError
from persia_nats.common.optim_config import (
    AdagradConfig,
    AdamConfig,
    EmbeddingHyperparams,
    SGDConfig,
    hyperparams_from_wire,
    hyperparams_to_wire,
    optimizer_from_wire,
    to_wire,
)
from persia_nats.core.optim import apply_update, init_state, state_width

W0 = np.array([[1.0, -2.0, 0.5], [0.25, 3.0, -1.0]], np.float32)
G = np.array([[0.5, 1.0, -2.0], [1.0, -0.5, 0.25]], np.float32)


def _tables(cfg, w0=W0, extra_rows=1):
    """emb/state with ``extra_rows`` untouched rows after the ones under test."""
    n, dim = w0.shape
    emb = np.vstack([w0, np.full((extra_rows, dim), 7.0, np.float32)])
    state = np.empty((n + extra_rows, state_width(cfg, dim)), np.float32)
    init_state(cfg, dim, state)
    return emb, state


def _step(cfg, emb, state, grads, bound=0.0, rows=None):
    rows = np.arange(grads.shape[0]) if rows is None else np.asarray(rows)
    apply_update(cfg, rows.astype(np.int64), grads, emb, state, bound)


# ---------------------------------------------------------------- configs


def test_state_width_per_optimizer():
    assert state_width(SGDConfig(lr=0.1), 8) == 0
    assert state_width(SGDConfig(lr=0.1, momentum=0.9), 8) == 8
    assert state_width(AdagradConfig(), 8) == 8
    assert state_width(AdagradConfig(vectorwise_shared=True), 8) == 1
    assert state_width(AdamConfig(), 8) == 17


def test_init_state_fills_adagrad_accumulator_and_zeroes_the_rest():
    out = np.full((2, 3), 5.0, np.float32)
    init_state(AdagradConfig(initial_accumulator_value=0.25), 3, out)
    np.testing.assert_array_equal(out, 0.25)
    out = np.full((2, 7), 5.0, np.float32)
    init_state(AdamConfig(), 3, out)
    np.testing.assert_array_equal(out, 0.0)
    with pytest.raises(ValueError):
        init_state(AdamConfig(), 3, np.zeros((2, 6), np.float32))


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: SGDConfig(lr=0.0), "lr"),
        (lambda: SGDConfig(lr=-1.0), "lr"),
        (lambda: SGDConfig(lr=math.nan), "lr"),
        (lambda: SGDConfig(lr=math.inf), "lr"),
        (lambda: SGDConfig(lr=True), "lr"),
        (lambda: SGDConfig(lr="0.1"), "lr"),
        (lambda: SGDConfig(lr=0.1, momentum=1.0), "momentum"),
        (lambda: SGDConfig(lr=0.1, momentum=-0.1), "momentum"),
        (lambda: SGDConfig(lr=0.1, weight_decay=-1e-3), "weight_decay"),
        (lambda: AdagradConfig(eps=0.0), "eps"),
        (lambda: AdagradConfig(initial_accumulator_value=-1.0), "initial_accumulator_value"),
        (lambda: AdagradConfig(g_square_momentum=1.5), "g_square_momentum"),
        (lambda: AdagradConfig(vectorwise_shared=1), "vectorwise_shared"),
        (lambda: AdagradConfig(persia_order="yes"), "persia_order"),
        (lambda: AdamConfig(betas=(1.0, 0.999)), "betas[0]"),
        (lambda: AdamConfig(betas=(0.9, -0.1)), "betas[1]"),
        (lambda: AdamConfig(betas=(0.9,)), "betas"),
        (lambda: AdamConfig(eps=-1e-8), "eps"),
        (lambda: EmbeddingHyperparams(init_lower=0.1, init_upper=0.1), "init_lower"),
        (lambda: EmbeddingHyperparams(admit_probability=1.5), "admit_probability"),
        (lambda: EmbeddingHyperparams(weight_bound=math.nan), "weight_bound"),
    ],
)
def test_config_validation_names_field_and_value(make, field):
    with pytest.raises(ConfigError) as err:
        make()
    assert field in str(err.value)


def test_configs_coerce_ints_and_lists():
    assert SGDConfig(lr=1).lr == 1.0 and isinstance(SGDConfig(lr=1).lr, float)
    assert AdamConfig(betas=[0.5, 0.75]).betas == (0.5, 0.75)


@pytest.mark.parametrize(
    "cfg",
    [
        SGDConfig(lr=0.1),
        SGDConfig(lr=0.5, momentum=0.9, weight_decay=1e-4),
        AdagradConfig(),
        AdagradConfig(lr=0.1, initial_accumulator_value=0.0, g_square_momentum=0.5, vectorwise_shared=True),
        AdagradConfig(persia_order=True),
        AdamConfig(),
        AdamConfig(lr=0.01, betas=(0.5, 0.75), weight_decay=0.1, eps=1e-6),
    ],
)
def test_optimizer_wire_round_trip_through_msgpack(cfg):
    wire = to_wire(cfg)
    assert wire["type"] in {"sgd", "adagrad", "adam"}
    assert optimizer_from_wire(msgpack.unpackb(msgpack.packb(wire))) == cfg


def test_adam_wire_betas_is_a_list():
    assert to_wire(AdamConfig())["betas"] == [0.9, 0.999]
    assert to_wire(SGDConfig(lr=0.25)) == {"type": "sgd", "lr": 0.25, "momentum": 0.0, "weight_decay": 0.0}


def test_hyperparams_wire_round_trip_and_defaults():
    hyper = EmbeddingHyperparams(init_lower=-0.5, init_upper=0.25, admit_probability=0.5, weight_bound=0.0)
    assert hyperparams_from_wire(msgpack.unpackb(msgpack.packb(hyperparams_to_wire(hyper)))) == hyper
    assert hyperparams_from_wire({}) == EmbeddingHyperparams()


@pytest.mark.parametrize(
    "wire",
    [
        None,
        [],
        "sgd",
        {},
        {"type": "rmsprop", "lr": 0.1},
        {"type": 3},
        {"type": "sgd"},  # lr is required
        {"type": "sgd", "lr": "0.1"},
        {"type": "sgd", "lr": None},
        {"type": "sgd", "lr": 10**400},
        {"type": "sgd", "lr": 0.1, "nesterov": True},
        {"type": "sgd", "lr": 0.1, b"momentum": 0.5},
        {"type": "adam", "betas": 0.9},
        {"type": "adam", "betas": [0.9, "x"]},
        {"type": "adam", "betas": {"a": 1}},
        {"type": "adagrad", "vectorwise_shared": "yes"},
        {"type": "adagrad", "eps": [1e-10]},
        {"type": "adagrad", "persia_order": 1},
    ],
)
def test_optimizer_from_wire_refuses_garbage_with_config_error(wire):
    with pytest.raises(ConfigError):
        optimizer_from_wire(wire)


@pytest.mark.parametrize("wire", [None, {"init_lower": "x"}, {"weight_bound": None}, {"bogus": 1}, {1: 2}])
def test_hyperparams_from_wire_refuses_garbage_with_config_error(wire):
    with pytest.raises(ConfigError):
        hyperparams_from_wire(wire)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text(max_size=8) | st.binary(max_size=4), inner, max_size=4),
    max_leaves=10,
)
_fields = st.sampled_from(["type", "lr", "momentum", "betas", "eps", "weight_decay", "vectorwise_shared",
                           "g_square_momentum", "initial_accumulator_value", "init_lower", "admit_probability"])


@settings(max_examples=300, deadline=None)
@given(st.one_of(_json, st.dictionaries(_fields, _json | st.sampled_from(["sgd", "adam", "adagrad"]), max_size=5)))
def test_wire_decoders_raise_only_config_error(value):
    for decode in (optimizer_from_wire, hyperparams_from_wire):
        try:
            decode(value)
        except ConfigError:
            pass


# ---------------------------------------------------------------- kernels: hand computations


def test_sgd_plain_hand_computed():
    cfg = SGDConfig(lr=0.1)
    emb, state = _tables(cfg)
    _step(cfg, emb, state, G)
    np.testing.assert_allclose(emb[:2], [[0.95, -2.1, 0.7], [0.15, 3.05, -1.025]], rtol=1e-6)
    np.testing.assert_array_equal(emb[2], 7.0)  # rows not listed are untouched


def test_sgd_weight_decay_hand_computed():
    cfg = SGDConfig(lr=0.1, weight_decay=0.5)
    emb, state = _tables(cfg)
    _step(cfg, emb, state, G[:1], rows=[0])
    # g' = g + 0.5 w = [1.0, 0.0, -1.75]
    np.testing.assert_allclose(emb[0], [0.9, -2.0, 0.675], rtol=1e-6)
    np.testing.assert_array_equal(emb[1], W0[1])


def test_adagrad_persia_order_hand_computed():
    cfg = AdagradConfig(lr=0.1, initial_accumulator_value=0.01, eps=1e-10, persia_order=True)
    emb, state = _tables(cfg, W0[:1, :2])
    g = np.array([[0.5, 1.0]], np.float32)
    _step(cfg, emb, state, g)
    # the first step divides by sqrt(old acc) = 0.1: w -= 0.1 * g / 0.1 = g
    np.testing.assert_allclose(emb[0], [0.5, -3.0], rtol=1e-6)
    np.testing.assert_allclose(state[0], [0.26, 1.01], rtol=1e-6)
    _step(cfg, emb, state, g)
    np.testing.assert_allclose(emb[0], [0.5 - 0.05 / math.sqrt(0.26), -3.0 - 0.1 / math.sqrt(1.01)], rtol=1e-6)
    np.testing.assert_allclose(state[0], [0.51, 2.01], rtol=1e-6)


def test_adagrad_g_square_momentum_and_weight_decay_hand_computed():
    cfg = AdagradConfig(lr=0.1, initial_accumulator_value=0.04, g_square_momentum=0.5, weight_decay=0.5, eps=1e-10,
                        persia_order=True)
    emb, state = _tables(cfg, np.array([[2.0, -1.0]], np.float32))
    _step(cfg, emb, state, np.array([[0.0, 1.0]], np.float32))
    # g' = g + 0.5 w = [1.0, 0.5]; w -= 0.1 g' / sqrt(0.04) = 0.5 g'; acc = 0.04 * 0.5 + g'^2
    np.testing.assert_allclose(emb[0], [1.5, -1.25], rtol=1e-6)
    np.testing.assert_allclose(state[0], [1.02, 0.27], rtol=1e-6)


def test_adagrad_vectorwise_shared_persia_order_hand_computed():
    cfg = AdagradConfig(lr=0.1, initial_accumulator_value=0.01, vectorwise_shared=True, eps=1e-10, persia_order=True)
    emb, state = _tables(cfg, W0[:1, :2])
    assert state.shape[1] == 1
    g = np.array([[0.5, 1.0]], np.float32)
    _step(cfg, emb, state, g)
    np.testing.assert_allclose(emb[0], [0.5, -3.0], rtol=1e-6)
    np.testing.assert_allclose(state[0], [0.01 + (0.25 + 1.0) / 2], rtol=1e-6)
    _step(cfg, emb, state, g)
    np.testing.assert_allclose(emb[0], [0.5 - 0.05 / math.sqrt(0.635), -3.0 - 0.1 / math.sqrt(0.635)], rtol=1e-6)
    np.testing.assert_allclose(state[0], [1.26], rtol=1e-6)


def test_adagrad_vectorwise_weight_decay_hand_computed():
    cfg = AdagradConfig(lr=0.2, initial_accumulator_value=0.25, vectorwise_shared=True, weight_decay=1.0,
                        persia_order=True)
    emb, state = _tables(cfg, np.array([[1.0, -1.0]], np.float32))
    _step(cfg, emb, state, np.array([[1.0, 0.0]], np.float32))
    # g' = [2, -1]; w -= 0.2 g' / 0.5; acc = 0.25 + mean(4, 1)
    np.testing.assert_allclose(emb[0], [0.2, -0.6], rtol=1e-6)
    np.testing.assert_allclose(state[0], [2.75], rtol=1e-6)


def test_adagrad_standard_order_hand_computed():
    cfg = AdagradConfig(lr=0.1, initial_accumulator_value=0.0, eps=1e-10)
    emb, state = _tables(cfg, W0[:1, :2])
    g = np.array([[0.5, 1.0]], np.float32)
    _step(cfg, emb, state, g)
    # acc = g^2 first, so the first step from a zero accumulator moves each weight by lr * sign(g)
    np.testing.assert_allclose(emb[0], [0.9, -2.1], rtol=1e-6)
    np.testing.assert_allclose(state[0], [0.25, 1.0], rtol=1e-6)


def test_adagrad_vectorwise_standard_order_hand_computed():
    cfg = AdagradConfig(lr=0.2, initial_accumulator_value=0.25, vectorwise_shared=True, weight_decay=1.0)
    emb, state = _tables(cfg, np.array([[1.0, -1.0]], np.float32))
    _step(cfg, emb, state, np.array([[1.0, 0.0]], np.float32))
    # g' = [2, -1]; acc = 0.25 + mean(4, 1) = 2.75; w -= 0.2 g' / sqrt(2.75)
    np.testing.assert_allclose(emb[0], [1.0 - 0.4 / math.sqrt(2.75), -1.0 + 0.2 / math.sqrt(2.75)], rtol=1e-6)
    np.testing.assert_allclose(state[0], [2.75], rtol=1e-6)


def test_adam_first_step_hand_computed():
    cfg = AdamConfig(lr=0.1, betas=(0.9, 0.999), eps=1e-8)
    emb, state = _tables(cfg, W0[:1, :2])
    _step(cfg, emb, state, np.array([[0.5, -2.0]], np.float32))
    # bias-corrected m_hat = g, v_hat = g^2, so the first step moves each weight by lr * sign(g)
    np.testing.assert_allclose(emb[0], [0.9, -1.9], rtol=1e-6)
    np.testing.assert_allclose(state[0], [0.05, -0.2, 0.00025, 0.004, 1.0], rtol=1e-5)


# ---------------------------------------------------------------- kernels against torch.optim


def _against_torch(cfg, torch_opt, steps=6, seed=0, bound=0.0):
    rng = np.random.default_rng(seed)
    w0 = rng.uniform(-1, 1, (3, 4)).astype(np.float32)
    emb, state = _tables(cfg, w0)
    param = torch.nn.Parameter(torch.tensor(w0, dtype=torch.float64))
    opt = torch_opt([param])
    for _ in range(steps):
        g = rng.uniform(-1, 1, w0.shape).astype(np.float32)
        _step(cfg, emb, state, g)
        param.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
        np.testing.assert_allclose(emb[:3], param.detach().numpy(), rtol=1e-5, atol=1e-5)
    return emb, state


@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sgd_matches_torch(momentum, wd):
    cfg = SGDConfig(lr=0.1, momentum=momentum, weight_decay=wd)
    _against_torch(cfg, lambda p: torch.optim.SGD(p, lr=0.1, momentum=momentum, weight_decay=wd))


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_adam_matches_torch(wd):
    cfg = AdamConfig(lr=0.01, betas=(0.8, 0.95), weight_decay=wd, eps=1e-8)
    _against_torch(cfg, lambda p: torch.optim.Adam(p, lr=0.01, betas=(0.8, 0.95), weight_decay=wd, eps=1e-8))


@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("iav", [0.0, 0.1])
def test_adagrad_matches_torch(iav, wd):
    cfg = AdagradConfig(lr=0.1, initial_accumulator_value=iav, weight_decay=wd, eps=1e-10)
    _against_torch(cfg, lambda p: torch.optim.Adagrad(p, lr=0.1, initial_accumulator_value=iav, weight_decay=wd,
                                                      eps=1e-10))


def test_adagrad_persia_order_differs_from_torch():
    """The option really selects the other update: it must not follow torch's."""
    with pytest.raises(AssertionError):
        _against_torch(AdagradConfig(lr=0.1, persia_order=True),
                       lambda p: torch.optim.Adagrad(p, lr=0.1, initial_accumulator_value=1e-2))


def test_adam_counts_steps_per_row():
    """A row updated at some steps only follows its own torch.optim.Adam, stepped on those steps only."""
    cfg = AdamConfig(lr=0.05, betas=(0.9, 0.99), weight_decay=0.01)
    rng = np.random.default_rng(1)
    w0 = rng.uniform(-1, 1, (2, 3)).astype(np.float32)
    emb, state = _tables(cfg, w0)
    params = [torch.nn.Parameter(torch.tensor(w, dtype=torch.float64)) for w in w0]
    opts = [torch.optim.Adam([p], lr=0.05, betas=(0.9, 0.99), weight_decay=0.01) for p in params]
    schedule = [[0, 1], [0], [0], [1, 0], [1], [0, 1]]
    for rows in schedule:
        g = rng.uniform(-1, 1, (len(rows), 3)).astype(np.float32)
        _step(cfg, emb, state, g, rows=rows)
        for k, r in enumerate(rows):
            params[r].grad = torch.tensor(g[k], dtype=torch.float64)
            opts[r].step()
    for r in range(2):
        np.testing.assert_allclose(emb[r], params[r].detach().numpy(), rtol=1e-5, atol=1e-5)
    assert state[0, -1] == 5 and state[1, -1] == 4  # each row's own step count t


# ---------------------------------------------------------------- weight bound


@pytest.mark.parametrize("cfg", [SGDConfig(lr=10.0), AdagradConfig(lr=10.0), AdamConfig(lr=10.0)])
def test_weight_bound_clips_touched_rows_only(cfg):
    emb, state = _tables(cfg, np.zeros((1, 3), np.float32))
    emb[1] = 100.0  # an untouched row out of bounds stays as it is
    _step(cfg, emb, state, np.array([[-5.0, 5.0, 0.0]], np.float32), bound=2.0)
    assert emb[0, 0] == 2.0 and emb[0, 1] == -2.0 and abs(emb[0, 2]) <= 2.0
    np.testing.assert_array_equal(emb[1], 100.0)


def test_weight_bound_zero_or_negative_means_no_bound():
    cfg = SGDConfig(lr=10.0)
    for bound in (0.0, -1.0):
        emb, state = _tables(cfg, np.zeros((1, 2), np.float32))
        _step(cfg, emb, state, np.array([[-5.0, 5.0]], np.float32), bound=bound)
        np.testing.assert_array_equal(emb[0], [50.0, -50.0])


def test_apply_update_checks_shapes():
    cfg = AdagradConfig()
    emb, state = _tables(cfg)
    with pytest.raises(ValueError):
        apply_update(cfg, np.array([0]), G, emb, state, 0.0)
    with pytest.raises(ValueError):
        apply_update(cfg, np.array([0, 1]), G, emb, state[:, :1], 0.0)
    with pytest.raises(ValueError):
        apply_update(cfg, np.array([0, 5]), G, emb, state, 0.0)


# --- issue 38 (7): an update whose effect is not finite is refused; a non-finite row is repaired ---


@pytest.mark.parametrize("cfg", [AdagradConfig(lr=0.01), AdagradConfig(lr=0.01, vectorwise_shared=True),
                                 AdagradConfig(lr=0.01, persia_order=True), AdamConfig(lr=0.01)],
                         ids=["adagrad", "adagrad-rowwise", "adagrad-persia", "adam"])
@pytest.mark.parametrize("grad", [65504 * 2.0**100, 1e20], ids=["scaled-65504-by-2^-100", "1e20"])
def test_a_finite_gradient_that_would_overflow_the_state_is_refused_and_changes_nothing(cfg, grad):
    from persia_nats.core.optim import NonFiniteUpdate

    if isinstance(cfg, AdamConfig) and grad == 1e20:
        pytest.skip("(1 - beta2) * g * g is 1e37 in float32: Adam's state stays finite, the step is taken")
    dim = 4
    emb = np.arange(3 * dim, dtype=np.float32).reshape(3, dim) / 10
    state = np.empty((3, state_width(cfg, dim)), np.float32)
    init_state(cfg, dim, state)
    before = emb.copy(), state.copy()
    grads = np.full((2, dim), grad, np.float32)
    assert np.isfinite(grads).all()
    with pytest.raises(NonFiniteUpdate, match="row 2 .*non-finite.*no update applied") as info:
        apply_update(cfg, np.array([0, 2]), np.stack([np.ones(dim, np.float32), grads[1]]), emb, state, 0.0)
    assert info.value.code == 400
    assert (emb == before[0]).all() and (state == before[1]).all()  # row 0's valid step was not applied either
    # the row still learns from the next sane gradient
    apply_update(cfg, np.array([2]), np.ones((1, dim), np.float32), emb, state, 0.0)
    assert np.isfinite(state).all() and (emb[2] < before[0][2]).all()


@pytest.mark.parametrize("cfg", [AdagradConfig(lr=0.1), AdamConfig(lr=0.1), SGDConfig(lr=0.1, momentum=0.9)],
                         ids=["adagrad", "adam", "sgd-momentum"])
def test_a_row_whose_state_became_non_finite_is_repaired_and_reported(cfg, caplog):
    dim = 4
    emb = np.zeros((2, dim), np.float32)
    state = np.empty((2, state_width(cfg, dim)), np.float32)
    init_state(cfg, dim, state)
    state[1, 0] = np.inf
    emb[1, 1] = np.nan
    with caplog.at_level("WARNING", logger="persia_nats.core.optim"):
        assert apply_update(cfg, np.array([0, 1]), np.ones((2, dim), np.float32), emb, state, 0.0) == 1
    assert "repaired 1 embedding rows" in caplog.text
    assert np.isfinite(state).all() and np.isfinite(emb).all()
    assert (emb[1] == emb[0]).all()  # moved as a fresh row does


@pytest.mark.parametrize("cfg", [AdagradConfig(lr=0.5), AdagradConfig(lr=0.5, vectorwise_shared=True),
                                 AdagradConfig(lr=0.5, persia_order=True, eps=1e-10), AdamConfig(lr=0.5),
                                 SGDConfig(lr=0.5, momentum=0.99)], ids=["adagrad", "rowwise", "persia", "adam", "sgd"])
def test_the_largest_gradient_the_fast_path_takes_never_leaves_a_row_non_finite(cfg):
    """Without judging each row: the kernels keep weights within WEIGHT_LIMIT and accumulators within
    ACC_LIMIT, so 10,000 steps of the largest gradient that skips the row-by-row guard stay finite."""
    from persia_nats.core.optim import ACC_LIMIT, SAFE_GRAD, WEIGHT_LIMIT, _provably_finite

    dim = 4
    emb = np.zeros((1, dim), np.float32)
    state = np.empty((1, state_width(cfg, dim)), np.float32)
    init_state(cfg, dim, state)
    grads = np.full((1, dim), SAFE_GRAD, np.float32)
    grads[0, 1] = -SAFE_GRAD
    assert _provably_finite(cfg, grads)
    for _ in range(10_000):
        assert apply_update(cfg, np.array([0]), grads, emb, state, 0.0) == 0
    assert np.isfinite(emb).all() and np.isfinite(state).all()
    assert np.abs(emb).max() <= np.float32(WEIGHT_LIMIT)
    if isinstance(cfg, AdagradConfig):
        assert state.max() <= np.float32(ACC_LIMIT)


def test_a_nan_or_oversized_gradient_is_judged_row_by_row():
    from persia_nats.core.optim import NonFiniteUpdate, _provably_finite

    cfg = AdagradConfig(lr=0.01)
    assert not _provably_finite(cfg, np.array([[np.nan, 0.0]], np.float32))
    assert not _provably_finite(cfg, np.array([[1e16, 0.0]], np.float32))
    assert not _provably_finite(AdagradConfig(lr=0.01, weight_decay=2.0), np.ones((1, 2), np.float32))
    emb = np.zeros((1, 2), np.float32)
    state = np.full((1, 2), 0.01, np.float32)
    with pytest.raises(NonFiniteUpdate):
        apply_update(cfg, np.array([0]), np.array([[np.nan, 0.0]], np.float32), emb, state, 0.0)
    assert (emb == 0).all() and (state == np.float32(0.01)).all()
