"""Tests for rlcode.advantages against plain-Python/numpy float64 oracles.

The oracles below are written from docs/reference.md §1 (and DAPO eq. 13 for the overlong penalty),
one element at a time with Python loops, and never call the code under test.
"""

from __future__ import annotations

import functools
import importlib
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numpy.testing import assert_allclose, assert_array_equal

from rlcode import advantages as adv_lib
from rlcode.advantages import AdvantageConfig
from rlcode.recipes import advantage_config

EPS = 1e-6
RTOL = 1e-5
ATOL = 1e-6
MODES = ("std", "none", "rloo", "batch")
EQUAL_VALUES = (0.1, 0.3, 1.0 / 3.0, -2.7, 0.0, 1.0, 1e6 + 0.1)  # float means are not exact
GROUP_SHAPES = list(itertools.product((2, 3, 8), (1, 2, 6)))  # (group size G, number of groups)

# Jitted entry points, built once and reused across tests.
group_jit = jax.jit(adv_lib.group_advantages, static_argnames=("group_size", "normalize"))
gae_jit = jax.jit(adv_lib.gae)


# ----------------------------------------------------------------------------------------------
# Oracles (float64, Python loops).
# ----------------------------------------------------------------------------------------------


def oracle_group(rewards, group_size, normalize, eps=EPS, valid=None):
    """docs/reference.md §1: GRPO (ddof=1), Dr. GRPO, RLOO and batch normalisation, element by element."""
    r = [float(x) for x in np.asarray(rewards, dtype=np.float64)]
    n = len(r)
    ok = [True] * n if valid is None else [bool(x) for x in np.asarray(valid)]
    out = [0.0] * n
    if normalize == "batch":
        groups = [list(range(n))]
    else:
        groups = [list(range(g * group_size, (g + 1) * group_size)) for g in range(n // group_size)]
    for members in groups:
        members = [i for i in members if ok[i]]
        vals = [r[i] for i in members]
        if len(vals) < 2 or max(vals) == min(vals):
            continue  # fewer than two valid samples, or all equal: advantage 0
        k = len(vals)
        mean = sum(vals) / k
        if normalize == "rloo":
            for i in members:
                out[i] = r[i] - (sum(vals) - r[i]) / (k - 1)
        elif normalize == "none":
            for i in members:
                out[i] = r[i] - mean
        else:  # "std" / "batch": sample std, ddof = 1
            std = math.sqrt(sum((x - mean) ** 2 for x in vals) / (k - 1))
            for i in members:
                out[i] = (r[i] - mean) / (std + eps)
    return np.array(out, dtype=np.float64)


def oracle_gae(rewards, values, mask, gamma, lam, bootstrap=None):
    """GAE walking only the masked tokens of each row, from the last one backwards."""
    rewards, values, mask = (np.asarray(x, dtype=np.float64) for x in (rewards, values, mask))
    b_size, t_size = rewards.shape
    adv = np.zeros((b_size, t_size))
    ret = np.zeros((b_size, t_size))
    for b in range(b_size):
        steps = [t for t in range(t_size) if mask[b, t] != 0]
        v_next = 0.0 if bootstrap is None else float(bootstrap[b])
        a_next = 0.0
        for t in reversed(steps):
            delta = rewards[b, t] + gamma * v_next - values[b, t]
            a_next = delta + gamma * lam * a_next
            v_next = values[b, t]
            adv[b, t] = a_next
            ret[b, t] = a_next + values[b, t]
    return adv, ret


def oracle_gae_closed_form(rewards, values, mask, gamma, lam, bootstrap=None):
    """A_k = sum_l (gamma * lam)^l delta_{k+l} over the compressed sequence of masked tokens."""
    rewards, values, mask = (np.asarray(x, dtype=np.float64) for x in (rewards, values, mask))
    adv = np.zeros(rewards.shape)
    for b in range(rewards.shape[0]):
        steps = [t for t in range(rewards.shape[1]) if mask[b, t] != 0]
        tail = 0.0 if bootstrap is None else float(bootstrap[b])
        v_next = [values[b, steps[k + 1]] for k in range(len(steps) - 1)] + [tail]
        deltas = [rewards[b, t] + gamma * v_next[k] - values[b, t] for k, t in enumerate(steps)]
        for k, t in enumerate(steps):
            adv[b, t] = sum((gamma * lam) ** l * deltas[k + l] for l in range(len(steps) - k))
    return adv


def oracle_broadcast(seq_values, mask):
    seq_values = np.asarray(seq_values, dtype=np.float64)
    mask = np.asarray(mask)
    out = np.zeros(mask.shape)
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if mask[b, t]:
                out[b, t] = seq_values[b]
    return out


def oracle_reward_at_last_token(rewards, mask):
    rewards = np.asarray(rewards, dtype=np.float64)
    mask = np.asarray(mask)
    out = np.zeros(mask.shape)
    for b in range(mask.shape[0]):
        last = None
        for t in range(mask.shape[1]):
            if mask[b, t]:
                last = t
        if last is not None:
            out[b, last] = rewards[b]
    return out


def oracle_shaping(potentials, gamma, initial, turn_mask=None):
    phi = np.asarray(potentials, dtype=np.float64)
    b_size, k_size = phi.shape
    init = np.broadcast_to(np.asarray(initial, dtype=np.float64), (b_size,))
    out = np.zeros((b_size, k_size))
    for b in range(b_size):
        for k in range(k_size):
            if turn_mask is not None and not turn_mask[b, k]:
                continue
            prev = init[b] if k == 0 else phi[b, k - 1]
            out[b, k] = gamma * phi[b, k] - prev
    return out


def oracle_overlong(length, max_length, cache_length):
    """DAPO (arXiv 2503.14476) eq. 13."""
    start = max_length - cache_length
    if length <= start:
        return 0.0
    if length <= max_length:
        return (start - length) / cache_length
    return -1.0


# ----------------------------------------------------------------------------------------------
# Helpers.
# ----------------------------------------------------------------------------------------------


def ragged_mask(rng, b_size, t_size):
    """[B, T] masks with a prompt prefix, tool-output gaps and trailing padding.

    Row 1 (when B > 1) is all masked out and row 2 (when B > 2) has a single generated token.
    """
    mask = np.zeros((b_size, t_size), dtype=bool)
    for b in range(b_size):
        if b == 1:
            continue
        if b == 2:
            mask[b, rng.integers(t_size)] = True
            continue
        prompt = int(rng.integers(0, max(1, t_size // 3)))
        end = int(rng.integers(prompt + 1, t_size + 1))
        mask[b, prompt:end] = True
        gaps = rng.random(t_size) < 0.25
        gaps[prompt] = False
        mask[b] &= ~gaps
    return mask


def x64_context():
    """A context manager that enables float64, or None when this jax offers none."""
    enable = getattr(jax, "enable_x64", None)
    if enable is not None:
        try:
            return enable(True)
        except TypeError:
            pass
    experimental = importlib.import_module("jax.experimental")
    enable = getattr(experimental, "enable_x64", None)
    if enable is not None:
        return enable()
    return None


# ----------------------------------------------------------------------------------------------
# group_advantages
# ----------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def all_modes_jit(group_size):
    """One jitted function returning the advantages of every normalize mode (one compile per shape)."""
    return jax.jit(lambda r, v: {m: adv_lib.group_advantages(r, group_size, m, valid=v) for m in MODES})


@pytest.mark.parametrize("group_size,num_groups", GROUP_SHAPES)
def test_group_advantages_matches_oracle(group_size, num_groups):
    rng = np.random.default_rng(1000 * group_size + num_groups)
    n = group_size * num_groups
    continuous = rng.normal(size=n).astype(np.float32)
    binary = (rng.random(n) < 0.4).astype(np.float32)
    binary[:2] = (1.0, 0.0)  # at least one group with mixed outcomes
    valid = rng.random(n) < 0.7
    if num_groups >= 2:
        valid[: 2 * group_size] = False  # group 0: no valid member
        valid[group_size] = True  # group 1: exactly one valid member
    masked = continuous.copy()
    masked[~valid] = np.nan  # invalid samples may carry NaN / Inf
    if (~valid).any():
        masked[np.flatnonzero(~valid)[-1]] = np.inf
    everyone = np.ones(n, dtype=bool)

    fn = all_modes_jit(group_size)
    for rewards, ok in ((continuous, everyone), (binary, everyone), (masked, valid)):
        got = fn(jnp.asarray(rewards), jnp.asarray(ok))
        for mode in MODES:
            out = np.asarray(got[mode])
            assert got[mode].dtype == jnp.float32 and out.shape == (n,)
            assert np.all(np.isfinite(out)), mode
            assert np.all(out[~ok] == 0), mode
            assert_allclose(out, oracle_group(rewards, group_size, mode, valid=ok), rtol=RTOL, atol=ATOL,
                            err_msg=f"normalize={mode}")
            if ok is valid and num_groups >= 2 and mode != "batch":
                assert np.all(out[: 2 * group_size] == 0), mode  # fewer than two valid members


@pytest.mark.parametrize("group_size", (2, 3, 8))
def test_group_advantages_eager_matches_oracle(group_size):
    rng = np.random.default_rng(2000 + group_size)
    num_groups = len(EQUAL_VALUES) + 1  # the shapes of the all-equal test: eager compiles are shared
    rewards = rng.normal(size=num_groups * group_size).astype(np.float32)
    binary = (rng.random(num_groups * group_size) < 0.5).astype(np.float32)
    binary[:2] = (1.0, 0.0)
    for mode in MODES:
        for r in (rewards, binary):
            got = adv_lib.group_advantages(jnp.asarray(r), group_size, mode)
            assert got.dtype == jnp.float32
            assert_allclose(np.asarray(got), oracle_group(r, group_size, mode), rtol=RTOL, atol=ATOL,
                            err_msg=f"normalize={mode}")


def test_group_advantages_hand_computed():
    # G=4, one success: mean 0.25, sample std 0.5 (ddof=1), A = (R - 0.25) / (0.5 + 1e-6).
    rewards = jnp.array([1.0, 0.0, 0.0, 0.0])
    got = np.asarray(adv_lib.group_advantages(rewards, 4, "std"))
    assert_allclose(got, np.array([0.75, -0.25, -0.25, -0.25]) / (0.5 + 1e-6), rtol=1e-6)
    assert_allclose(np.asarray(adv_lib.group_advantages(rewards, 4, "batch")), got, rtol=1e-6)
    # RLOO: 1 - 0 = 1; 0 - 1/3.
    got = np.asarray(adv_lib.group_advantages(rewards, 4, "rloo"))
    assert_allclose(got, [1.0, -1 / 3, -1 / 3, -1 / 3], rtol=1e-6)
    # Dr. GRPO: R - mean.
    got = np.asarray(adv_lib.group_advantages(rewards, 4, "none"))
    assert_allclose(got, [0.75, -0.25, -0.25, -0.25], rtol=1e-6)
    # Integer 0/1 rewards are accepted and computed in float32.
    got = adv_lib.group_advantages(jnp.array([1, 0, 0, 0], dtype=jnp.int32), 4, "std")
    assert got.dtype == jnp.float32
    assert_allclose(np.asarray(got), np.array([0.75, -0.25, -0.25, -0.25]) / (0.5 + 1e-6), rtol=1e-6)
    # Batch mode ignores the groups: [0, 1 | 2, 3] is one batch with mean 1.5 and std sqrt(5/3).
    got = np.asarray(adv_lib.group_advantages(jnp.array([0.0, 1.0, 2.0, 3.0]), 2, "batch"))
    assert_allclose(got, (np.arange(4) - 1.5) / (math.sqrt(5 / 3) + 1e-6), rtol=1e-6)


@pytest.mark.parametrize("normalize", ("std", "batch"))
def test_group_advantages_eps_is_added_to_std(normalize):
    # Tiny spread: std ~ 7e-6 is comparable to eps = 1e-6, so the eps term matters.
    rewards = np.array([0.0, 1e-5, 2.0e-5, 3.0e-5], dtype=np.float32)
    got = np.asarray(adv_lib.group_advantages(jnp.asarray(rewards), 2, normalize))
    assert_allclose(got, oracle_group(rewards, 2, normalize), rtol=RTOL, atol=ATOL)
    # A custom eps is used, added to the std (not under the square root).
    rewards = np.array([0.0, 1.0, 3.0, 7.0], dtype=np.float32)
    got = np.asarray(adv_lib.group_advantages(jnp.asarray(rewards), 2, normalize, eps=0.5))
    assert_allclose(got, oracle_group(rewards, 2, normalize, eps=0.5), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("group_size", (2, 3, 8))
def test_group_advantages_all_equal_group_is_exactly_zero(group_size):
    # Groups of equal values whose float mean is not exact (0.1, 1/3, ...), then one mixed group.
    mixed = (0.37 * np.arange(group_size) ** 2 + 0.1).astype(np.float32)
    rewards = np.concatenate([np.full(group_size, v, np.float32) for v in EQUAL_VALUES] + [mixed])
    n = rewards.size
    equal = slice(0, n - group_size)
    everyone = jnp.ones(n, bool)
    fn = all_modes_jit(group_size)
    for dtype in (jnp.float32, jnp.bfloat16):
        got = fn(jnp.asarray(rewards, dtype), everyone)
        rounded = np.asarray(jnp.asarray(rewards, dtype).astype(jnp.float32))
        for mode in ("std", "none", "rloo"):
            out = np.asarray(got[mode])
            assert np.all(out[equal] == 0), (mode, dtype)
            assert_allclose(out, oracle_group(rounded, group_size, mode), rtol=RTOL, atol=ATOL)
        # Batch mode: a batch whose rewards are all equal.
        for v in EQUAL_VALUES:
            out = fn(jnp.full((n,), v, dtype), everyone)
            for mode in MODES:
                assert np.all(np.asarray(out[mode]) == 0), (mode, v, dtype)
    # Eagerly, with the default valid=None.
    for mode in ("std", "none", "rloo"):
        out = np.asarray(adv_lib.group_advantages(jnp.asarray(rewards), group_size, mode))
        assert np.all(out[equal] == 0), mode
        assert_allclose(out, oracle_group(rewards, group_size, mode), rtol=RTOL, atol=ATOL)
    out = adv_lib.group_advantages(jnp.full((n,), 0.1, jnp.float32), group_size, "batch")
    assert np.all(np.asarray(out) == 0)


def test_group_advantages_valid_statistics_exclude_invalid():
    # Invalid members are not in the mean/std: a group [1, 0, 100(invalid), 0] is the group [1, 0, 0].
    rewards = jnp.array([1.0, 0.0, 100.0, 0.0])
    valid = jnp.array([True, True, False, True])
    for mode in MODES:
        got = np.asarray(adv_lib.group_advantages(rewards, 4, mode, valid=valid))
        assert_allclose(got[[0, 1, 3]], oracle_group([1.0, 0.0, 0.0], 3, mode), rtol=1e-6)
        assert got[2] == 0
    # Valid members all equal (the odd one out is invalid and NaN): exactly 0.
    for mode in MODES:
        got = adv_lib.group_advantages(jnp.array([0.1, 0.1, jnp.nan, 0.1]), 4, mode, valid=valid)
        assert np.all(np.asarray(got) == 0), mode
    # A single valid member: 0 (no std / leave-one-out exists).
    one = jnp.array([False, False, True, False])
    for mode in MODES:
        got = adv_lib.group_advantages(jnp.array([jnp.nan, 1.0, 5.0, -jnp.inf]), 4, mode, valid=one)
        assert np.all(np.asarray(got) == 0), mode
    # An integer 0/1 valid mask works like a bool one.
    got_int = adv_lib.group_advantages(rewards, 4, "std", valid=valid.astype(jnp.int32))
    assert_allclose(np.asarray(got_int), oracle_group([1.0, 0.0, 100.0, 0.0], 4, "std", valid=[1, 1, 0, 1]),
                    rtol=RTOL)


@pytest.mark.parametrize("bad", (np.nan, np.inf, -np.inf))
@pytest.mark.parametrize("normalize", MODES)
def test_group_advantages_nonfinite_reward_raises_eagerly(bad, normalize):
    rewards = jnp.array([1.0, 0.0, bad, 0.5])
    with pytest.raises(ValueError, match=r"rewards contains 1 non-finite value"):
        adv_lib.group_advantages(rewards, 2, normalize)
    # Also when a valid mask is given but the bad reward sits at a valid position.
    with pytest.raises(ValueError, match=r"non-finite"):
        adv_lib.group_advantages(rewards, 2, normalize, valid=jnp.array([False, True, True, True]))


def test_group_advantages_nonfinite_reward_raises_under_jit():
    rewards = jnp.array([1.0, jnp.nan, 0.0, 1.0])
    with pytest.raises(Exception) as info:
        jax.block_until_ready(group_jit(rewards, group_size=2, normalize="std"))
    assert "non-finite" in str(info.value)
    # The same NaN at an invalid position is fine under jit.
    got = group_jit(rewards, group_size=2, normalize="std", valid=jnp.array([True, False, True, True]))
    assert_allclose(np.asarray(got), oracle_group([1.0, 0.0, 0.0, 1.0], 2, "std", valid=[1, 0, 1, 1]),
                    rtol=RTOL, atol=ATOL)


def test_group_advantages_bad_arguments_raise():
    rewards = jnp.arange(6.0)
    with pytest.raises(ValueError, match="normalize"):
        adv_lib.group_advantages(rewards, 3, "zscore")
    for mode in MODES:
        with pytest.raises(ValueError, match="group_size"):
            adv_lib.group_advantages(rewards, 4, mode)
        with pytest.raises(ValueError, match="group_size"):
            adv_lib.group_advantages(rewards, 0, mode)
    with pytest.raises(ValueError, match=r"\[N\]"):
        adv_lib.group_advantages(rewards.reshape(2, 3), 3)
    with pytest.raises(ValueError, match=r"\[N\]"):
        adv_lib.group_advantages(jnp.float32(1.0), 1)
    with pytest.raises(ValueError, match="valid"):
        adv_lib.group_advantages(rewards, 3, valid=jnp.ones((5,), bool))


def test_group_advantages_vmap_and_jit():
    group_size, num_groups, batch = 3, 2, 4
    rng = np.random.default_rng(4)
    rewards = rng.normal(size=(batch, group_size * num_groups)).astype(np.float32)
    rewards[1, :group_size] = 0.1  # a degenerate group inside the batch
    valid = rng.random(rewards.shape) < 0.8
    valid[1, :group_size] = True
    rewards[~valid] = np.nan

    every_mode = jax.jit(jax.vmap(
        lambda r, v: {m: adv_lib.group_advantages(r, group_size, m, valid=v) for m in MODES}))
    got = every_mode(jnp.asarray(rewards), jnp.asarray(valid))
    # vmap of an already jitted function as well.
    got_outer = jax.vmap(all_modes_jit(group_size))(jnp.asarray(rewards), jnp.asarray(valid))
    results = [(m, np.asarray(got[m])) for m in MODES] + [(m, np.asarray(got_outer[m])) for m in MODES]
    for mode, out in results:
        assert out.shape == rewards.shape
        for b in range(batch):
            want = oracle_group(rewards[b], group_size, mode, valid=valid[b])
            assert_allclose(out[b], want, rtol=RTOL, atol=ATOL, err_msg=f"normalize={mode}, row {b}")
        if mode != "batch":
            assert np.all(out[1, :group_size] == 0), mode
        assert np.all(out[~valid] == 0), mode


def test_group_advantages_bfloat16():
    group_size = 8
    n = group_size * (len(EQUAL_VALUES) + 1)  # a shape the eager tests have compiled already
    rng = np.random.default_rng(5)
    rewards = rng.random(n).astype(np.float32)
    binary = (rng.random(n) < 0.5).astype(np.float32)
    binary[:2] = (0.0, 1.0)
    rounded = np.asarray(jnp.asarray(rewards, jnp.bfloat16).astype(jnp.float32), dtype=np.float64)
    everyone = jnp.ones(n, bool)
    fn = all_modes_jit(group_size)
    got = fn(jnp.asarray(rewards, jnp.bfloat16), everyone)
    got_binary = fn(jnp.asarray(binary, jnp.bfloat16), everyone)
    for mode in MODES:
        assert got[mode].dtype == jnp.float32
        # Tight against the oracle on the bf16-rounded rewards (statistics are computed in float32)...
        assert_allclose(np.asarray(got[mode]), oracle_group(rounded, group_size, mode), rtol=RTOL, atol=ATOL)
        # ...and close to the float32 oracle on the unrounded rewards.
        assert_allclose(np.asarray(got[mode]), oracle_group(rewards, group_size, mode), atol=0.05)
        # Binary rewards are exact in bfloat16: same result as in float32.
        assert_allclose(np.asarray(got_binary[mode]), oracle_group(binary, group_size, mode),
                        rtol=RTOL, atol=ATOL)
    # The eager path as well.
    eager = adv_lib.group_advantages(jnp.asarray(rewards, jnp.bfloat16), group_size, "std")
    assert eager.dtype == jnp.float32
    assert_allclose(np.asarray(eager), oracle_group(rounded, group_size, "std"), rtol=RTOL, atol=ATOL)


def test_group_advantages_float64_under_x64():
    ctx = x64_context()
    if ctx is None:
        pytest.skip("this jax has no x64 context manager")
    rng = np.random.default_rng(6)
    rewards = rng.normal(size=12)
    rewards[:4] = 0.1  # an all-equal group
    valid = rng.random(12) < 0.8
    with ctx:
        fn = jax.jit(lambda r, v: {m: adv_lib.group_advantages(r, 4, m, valid=v) for m in MODES})
        got = fn(jnp.asarray(rewards, dtype=jnp.float64), jnp.asarray(valid))
        got32 = fn(jnp.asarray(rewards, dtype=jnp.float32), jnp.asarray(valid))
        for mode in MODES:
            assert got[mode].dtype == jnp.float64
            assert_allclose(np.asarray(got[mode]), oracle_group(rewards, 4, mode, valid=valid),
                            rtol=1e-12, atol=1e-13, err_msg=f"normalize={mode}")
            if mode != "batch":
                assert np.all(np.asarray(got[mode])[:4] == 0)
            # float32 input stays float32 even with x64 enabled.
            assert got32[mode].dtype == jnp.float32


# ----------------------------------------------------------------------------------------------
# gae
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_bootstrap", (False, True))
@pytest.mark.parametrize("b_size,t_size", list(itertools.product((1, 3, 5), (1, 7, 16))))
def test_gae_matches_oracle(b_size, t_size, with_bootstrap):
    rng = np.random.default_rng(100 * b_size + t_size + 7 * with_bootstrap)
    mask = ragged_mask(rng, b_size, t_size)
    rewards = rng.normal(size=(b_size, t_size)).astype(np.float32)
    values = rng.normal(size=(b_size, t_size)).astype(np.float32)
    # Garbage at unmasked positions must be ignored.
    rewards[~mask] = 1e3
    values[~mask] = -1e3
    gamma, lam = (float(x) for x in rng.uniform(0.5, 1.0, size=2))
    bootstrap = rng.normal(size=b_size).astype(np.float32) if with_bootstrap else None

    want_adv, want_ret = oracle_gae(rewards, values, mask, gamma, lam, bootstrap)
    assert_allclose(oracle_gae_closed_form(rewards, values, mask, gamma, lam, bootstrap), want_adv,
                    rtol=1e-12, atol=1e-12)
    boot = None if bootstrap is None else jnp.asarray(bootstrap)
    args = (jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask))
    # Under jit, with gamma and lam as traced scalars (the eager path is covered by the tests below).
    adv, ret = gae_jit(*args, jnp.float32(gamma), jnp.float32(lam), bootstrap_value=boot)
    assert adv.shape == ret.shape == (b_size, t_size)
    assert adv.dtype == ret.dtype == jnp.float32
    adv, ret = np.asarray(adv), np.asarray(ret)
    assert_allclose(adv, want_adv, rtol=RTOL, atol=1e-5)
    assert_allclose(ret, want_ret, rtol=RTOL, atol=1e-5)
    assert np.all(adv[~mask] == 0)
    assert np.all(ret[~mask] == 0)
    # returns = advantages + values on the mask.
    assert_allclose(ret[mask], (adv + values)[mask], rtol=1e-6, atol=1e-6)


def test_gae_hand_computed_skips_gaps():
    # Positions 1 and 3 are generated; 0 is prompt, 2 is tool output, 4 is padding.
    mask = jnp.array([[0, 1, 0, 1, 0]])
    rewards = jnp.array([[9.0, 1.0, 9.0, 2.0, 9.0]])
    values = jnp.array([[9.0, 0.5, 9.0, 0.25, 9.0]])
    adv, ret = adv_lib.gae(rewards, values, mask, 0.9, 0.8)
    # t=3: delta = 2 - 0.25 = 1.75.  t=1: delta = 1 + 0.9 * 0.25 - 0.5 = 0.725, A = 0.725 + 0.72 * 1.75.
    assert_allclose(np.asarray(adv), [[0.0, 1.985, 0.0, 1.75, 0.0]], rtol=1e-6)
    assert_allclose(np.asarray(ret), [[0.0, 2.485, 0.0, 2.0, 0.0]], rtol=1e-6)
    # With a bootstrap value V = 2 after the last generated token: delta_3 = 2 + 0.9 * 2 - 0.25.
    adv, _ = adv_lib.gae(rewards, values, mask, 0.9, 0.8, bootstrap_value=jnp.array([2.0]))
    a3 = 2 + 0.9 * 2 - 0.25
    assert_allclose(np.asarray(adv), [[0.0, 0.725 + 0.72 * a3, 0.0, a3, 0.0]], rtol=1e-6)


def test_gae_nan_rewards_at_unmasked_positions_are_ignored():
    rng = np.random.default_rng(8)
    mask = np.array([[0, 1, 1, 0, 1, 0], [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=bool)
    rewards = rng.normal(size=mask.shape).astype(np.float32)
    values = rng.normal(size=mask.shape).astype(np.float32)
    rewards[~mask] = np.nan
    adv, ret = adv_lib.gae(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask), 0.95, 0.9)
    want_adv, want_ret = oracle_gae(np.where(mask, rewards, 0), values, mask, 0.95, 0.9)
    assert_allclose(np.asarray(adv), want_adv, rtol=RTOL, atol=1e-5)
    assert_allclose(np.asarray(ret), want_ret, rtol=RTOL, atol=1e-5)


@pytest.mark.parametrize("b_size,t_size", ((1, 1), (3, 7), (5, 16)))
def test_gae_reward_to_go(b_size, t_size):
    rng = np.random.default_rng(9 + t_size)
    mask = ragged_mask(rng, b_size, t_size)
    rewards = rng.normal(size=(b_size, t_size)).astype(np.float32)
    zeros = jnp.zeros((b_size, t_size))
    adv, ret = adv_lib.gae(jnp.asarray(rewards), zeros, jnp.asarray(mask), 1.0, 1.0)
    want = np.zeros((b_size, t_size))
    for b in range(b_size):
        for t in range(t_size):
            if mask[b, t]:
                want[b, t] = sum(float(rewards[b, s]) for s in range(t, t_size) if mask[b, s])
    assert_allclose(np.asarray(adv), want, rtol=RTOL, atol=1e-5)
    assert_allclose(np.asarray(ret), want, rtol=RTOL, atol=1e-5)


def test_gae_special_rows():
    # An all-masked-out row, a single-token row and a full row, with a bootstrap value.
    mask = np.array([[0, 0, 0, 0], [0, 0, 1, 0], [1, 1, 1, 1]], dtype=bool)
    rewards = np.array([[1, 2, 3, 4], [5, 6, 7, 8], [1, 0, 0, 2]], dtype=np.float32)
    values = np.array([[1, 1, 1, 1], [2, 2, 0.5, 2], [0.1, 0.2, 0.3, 0.4]], dtype=np.float32)
    boot = np.array([10.0, 3.0, 1.0], dtype=np.float32)
    adv, ret = adv_lib.gae(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask), 0.9, 0.7,
                           bootstrap_value=jnp.asarray(boot))
    adv, ret = np.asarray(adv), np.asarray(ret)
    assert np.all(adv[0] == 0) and np.all(ret[0] == 0)
    # Single token: delta = r + gamma * bootstrap - V.
    assert_allclose(adv[1], [0, 0, 7 + 0.9 * 3.0 - 0.5, 0], rtol=1e-6)
    assert_allclose(ret[1], [0, 0, 7 + 0.9 * 3.0, 0], rtol=1e-6)
    want_adv, want_ret = oracle_gae(rewards, values, mask, 0.9, 0.7, boot)
    assert_allclose(adv, want_adv, rtol=RTOL, atol=1e-6)
    assert_allclose(ret, want_ret, rtol=RTOL, atol=1e-6)


def test_gae_vmap_over_leading_axis():
    rng = np.random.default_rng(10)
    mask = np.stack([ragged_mask(rng, 3, 7) for _ in range(2)])
    rewards = rng.normal(size=mask.shape).astype(np.float32)
    values = rng.normal(size=mask.shape).astype(np.float32)
    fn = jax.vmap(lambda r, v, m: adv_lib.gae(r, v, m, 0.97, 0.9))
    adv, ret = fn(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask))
    for i in range(2):
        want_adv, want_ret = oracle_gae(rewards[i], values[i], mask[i], 0.97, 0.9)
        assert_allclose(np.asarray(adv[i]), want_adv, rtol=RTOL, atol=1e-5)
        assert_allclose(np.asarray(ret[i]), want_ret, rtol=RTOL, atol=1e-5)


def test_gae_bad_shapes_raise():
    x = jnp.zeros((2, 3))
    with pytest.raises(ValueError):
        adv_lib.gae(x, jnp.zeros((2, 4)), x, 1.0, 1.0)
    with pytest.raises(ValueError):
        adv_lib.gae(x, x, jnp.zeros((3, 3)), 1.0, 1.0)
    with pytest.raises(ValueError):
        adv_lib.gae(jnp.zeros(3), jnp.zeros(3), jnp.zeros(3), 1.0, 1.0)
    with pytest.raises(ValueError, match="bootstrap_value"):
        adv_lib.gae(x, x, x, 1.0, 1.0, bootstrap_value=jnp.zeros(3))


def test_gae_float64_under_x64():
    ctx = x64_context()
    if ctx is None:
        pytest.skip("this jax has no x64 context manager")
    rng = np.random.default_rng(11)
    mask = ragged_mask(rng, 4, 9)
    rewards, values = rng.normal(size=(2, 4, 9))
    boot = rng.normal(size=4)
    with ctx:
        adv, ret = adv_lib.gae(jnp.asarray(rewards, jnp.float64), jnp.asarray(values, jnp.float64),
                               jnp.asarray(mask), 0.93, 0.81, bootstrap_value=jnp.asarray(boot, jnp.float64))
        assert adv.dtype == ret.dtype == jnp.float64
        want_adv, want_ret = oracle_gae(rewards, values, mask, 0.93, 0.81, boot)
        assert_allclose(np.asarray(adv), want_adv, rtol=1e-12, atol=1e-12)
        assert_allclose(np.asarray(ret), want_ret, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------------------------
# broadcast_to_tokens, reward_at_last_token
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("b_size,t_size", ((1, 1), (3, 7), (5, 16)))
def test_broadcast_to_tokens(b_size, t_size):
    rng = np.random.default_rng(12 + t_size)
    mask = ragged_mask(rng, b_size, t_size)
    seq = rng.normal(size=b_size).astype(np.float32)
    got = adv_lib.broadcast_to_tokens(jnp.asarray(seq), jnp.asarray(mask))
    assert got.shape == (b_size, t_size) and got.dtype == jnp.float32
    assert_array_equal(np.asarray(got), oracle_broadcast(seq, mask).astype(np.float32))
    # An integer mask and bfloat16 values (returned as float32).
    got = adv_lib.broadcast_to_tokens(jnp.asarray(seq, jnp.bfloat16), jnp.asarray(mask.astype(np.int32)))
    assert got.dtype == jnp.float32
    rounded = np.asarray(jnp.asarray(seq, jnp.bfloat16).astype(jnp.float32))
    assert_array_equal(np.asarray(got), oracle_broadcast(rounded, mask).astype(np.float32))


def test_broadcast_to_tokens_bad_shapes_raise():
    with pytest.raises(ValueError):
        adv_lib.broadcast_to_tokens(jnp.zeros(3), jnp.ones((2, 4)))
    with pytest.raises(ValueError):
        adv_lib.broadcast_to_tokens(jnp.zeros((3, 1)), jnp.ones((3, 4)))
    with pytest.raises(ValueError):
        adv_lib.broadcast_to_tokens(jnp.zeros(3), jnp.ones(3))


def test_reward_at_last_token_hand_made():
    mask = np.array(
        [
            [0, 0, 1, 1, 1, 0, 0],  # prompt, generation, trailing padding
            [0, 1, 1, 0, 0, 1, 0],  # tool-output gap: last generated token is position 5
            [0, 0, 0, 0, 0, 0, 0],  # empty
            [1, 1, 1, 1, 1, 1, 1],  # full row
            [0, 0, 0, 0, 0, 0, 1],  # single token at the end
        ],
        dtype=bool,
    )
    rewards = np.array([1.5, -2.0, 7.0, 0.25, 3.0], dtype=np.float32)
    got = np.asarray(adv_lib.reward_at_last_token(jnp.asarray(rewards), jnp.asarray(mask)))
    want = np.zeros(mask.shape, dtype=np.float32)
    want[0, 4], want[1, 5], want[3, 6], want[4, 6] = 1.5, -2.0, 0.25, 3.0
    assert_array_equal(got, want)
    assert np.all(got[2] == 0)


@pytest.mark.parametrize("b_size,t_size", ((1, 1), (3, 7), (5, 16)))
def test_reward_at_last_token_random(b_size, t_size):
    rng = np.random.default_rng(13 + t_size)
    mask = ragged_mask(rng, b_size, t_size)
    rewards = rng.normal(size=b_size).astype(np.float32)
    got = adv_lib.reward_at_last_token(jnp.asarray(rewards), jnp.asarray(mask.astype(np.int32)))
    assert got.shape == (b_size, t_size) and got.dtype == jnp.float32
    assert_array_equal(np.asarray(got), oracle_reward_at_last_token(rewards, mask).astype(np.float32))
    got_jit = jax.jit(adv_lib.reward_at_last_token)(jnp.asarray(rewards), jnp.asarray(mask))
    assert_array_equal(np.asarray(got_jit), oracle_reward_at_last_token(rewards, mask).astype(np.float32))


def test_reward_at_last_token_bad_shapes_raise():
    with pytest.raises(ValueError):
        adv_lib.reward_at_last_token(jnp.zeros(3), jnp.ones((2, 4)))
    with pytest.raises(ValueError):
        adv_lib.reward_at_last_token(jnp.zeros((3, 4)), jnp.ones((3, 4)))


# ----------------------------------------------------------------------------------------------
# potential_shaping
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("per_row_initial", (False, True))
@pytest.mark.parametrize("gamma", (1.0, 0.9))
@pytest.mark.parametrize("b_size,k_size", ((1, 1), (3, 4), (4, 6)))
def test_potential_shaping_matches_oracle(b_size, k_size, gamma, per_row_initial):
    rng = np.random.default_rng(14 + 10 * b_size + k_size)
    phi = rng.random((b_size, k_size)).astype(np.float32)
    initial = rng.random(b_size).astype(np.float32) if per_row_initial else 0.25
    init_arg = jnp.asarray(initial) if per_row_initial else initial
    got = adv_lib.potential_shaping(jnp.asarray(phi), gamma=gamma, initial=init_arg)
    assert got.shape == (b_size, k_size) and got.dtype == jnp.float32
    assert_allclose(np.asarray(got), oracle_shaping(phi, gamma, initial), rtol=RTOL, atol=ATOL)
    # turn_mask zeroes the turns past the end of each episode.
    lengths = rng.integers(0, k_size + 1, size=b_size)
    turn_mask = np.arange(k_size)[None, :] < lengths[:, None]
    got = np.asarray(adv_lib.potential_shaping(jnp.asarray(phi), gamma=gamma, initial=init_arg,
                                               turn_mask=jnp.asarray(turn_mask)))
    assert np.all(got[~turn_mask] == 0)
    assert_allclose(got, oracle_shaping(phi, gamma, initial, turn_mask), rtol=RTOL, atol=ATOL)


def test_potential_shaping_default_initial_is_zero():
    phi = jnp.array([[0.5, 0.5, 1.0]])
    got = np.asarray(adv_lib.potential_shaping(phi))
    assert_allclose(got, [[0.5, 0.0, 0.5]], rtol=1e-7)


def test_potential_shaping_telescopes():
    # With gamma = 1 the shaped rewards of an episode of K turns sum to Phi_K - Phi_0; with any gamma,
    # sum_k gamma^(k-1) r_k = gamma^K Phi_K - Phi_0.
    rng = np.random.default_rng(15)
    b_size, k_size = 6, 8
    phi = rng.random((b_size, k_size))
    phi0 = rng.random(b_size)
    lengths = np.array([0, 1, 3, 5, 8, 8])
    turn_mask = np.arange(k_size)[None, :] < lengths[:, None]
    for gamma in (1.0, 0.8):
        shaped = np.asarray(adv_lib.potential_shaping(jnp.asarray(phi, jnp.float32), gamma=gamma,
                                                      initial=jnp.asarray(phi0, jnp.float32),
                                                      turn_mask=jnp.asarray(turn_mask)), np.float64)
        for b in range(b_size):
            k = lengths[b]
            discounted = sum(gamma**j * shaped[b, j] for j in range(k_size))
            final = phi[b, k - 1] if k else phi0[b]
            assert discounted == pytest.approx(gamma**k * final - phi0[b], abs=1e-5)
            if gamma == 1.0:
                assert shaped[b].sum() == pytest.approx(final - phi0[b], abs=1e-5)


def test_potential_shaping_jit_and_bad_rank():
    phi = jnp.array([[0.2, 0.6], [0.0, 1.0]])
    got = jax.jit(adv_lib.potential_shaping)(phi, 0.5, jnp.array([0.1, 0.3]))
    assert_allclose(np.asarray(got), oracle_shaping(np.asarray(phi), 0.5, [0.1, 0.3]), rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError):
        adv_lib.potential_shaping(jnp.zeros(3))


# ----------------------------------------------------------------------------------------------
# overlong_penalty
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_length,cache_length", ((20480, 4096), (100, 20), (10, 10), (7, 1)))
def test_overlong_penalty_matches_dapo_eq13(max_length, cache_length):
    start = max_length - cache_length
    candidates = {0, 1, start - 1, start, start + 1, (start + max_length) // 2, max_length - 1,
                  max_length, max_length + 1, 2 * max_length}
    lengths = np.array(sorted(x for x in candidates if x >= 0), dtype=np.int32)
    got = adv_lib.overlong_penalty(jnp.asarray(lengths), max_length, cache_length)
    assert got.dtype == jnp.float32 and got.shape == lengths.shape
    got = np.asarray(got)
    want = np.array([oracle_overlong(int(x), max_length, cache_length) for x in lengths])
    assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    # The boundaries exactly: no penalty at L_max - L_cache, exactly -1 at L_max and beyond.
    at = {int(x): float(y) for x, y in zip(lengths, got)}
    assert at[start] == 0.0
    assert at[max_length] == -1.0
    assert at[max_length + 1] == -1.0
    if start + 1 <= max_length:
        assert at[start + 1] == pytest.approx(-1.0 / cache_length, rel=1e-6)
    # Under jit as well.
    fn = jax.jit(functools.partial(adv_lib.overlong_penalty, max_length=max_length,
                                   cache_length=cache_length))
    assert_allclose(np.asarray(fn(jnp.asarray(lengths))), want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("cache_length", (0, -1, 11))
def test_overlong_penalty_bad_cache_length_raises(cache_length):
    with pytest.raises(ValueError, match="cache_length"):
        adv_lib.overlong_penalty(jnp.array([1, 2]), 10, cache_length)


# ----------------------------------------------------------------------------------------------
# compute_advantages
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_valid", (False, True))
@pytest.mark.parametrize("normalize", MODES)
def test_compute_advantages_group(normalize, with_valid):
    rng = np.random.default_rng(16)
    group_size, num_groups, t_size = 2, len(EQUAL_VALUES) + 1, 9  # shapes the eager tests compiled
    b_size = group_size * num_groups
    mask = ragged_mask(rng, b_size, t_size)
    rewards = (rng.random(b_size) < 0.5).astype(np.float32)
    rewards[:2] = (0.0, 1.0)
    valid = None
    if with_valid:
        valid = np.ones(b_size, bool)
        valid[[2, 7]] = False
        rewards[[2, 7]] = np.nan
    cfg = AdvantageConfig.from_config(advantage_config(normalize=normalize, eps=1e-6))
    valid_arg = None if valid is None else jnp.asarray(valid)
    adv, ret = adv_lib.compute_advantages(cfg, jnp.asarray(rewards), jnp.asarray(mask), group_size,
                                          valid=valid_arg)
    assert ret is None
    assert adv.shape == (b_size, t_size)
    want = oracle_broadcast(oracle_group(rewards, group_size, normalize, valid=valid), mask)
    assert_allclose(np.asarray(adv), want, rtol=RTOL, atol=ATOL)
    # Equals the composition of the public building blocks.
    seq = adv_lib.group_advantages(jnp.asarray(rewards), group_size, normalize, valid=valid_arg)
    assert_array_equal(np.asarray(adv), np.asarray(adv_lib.broadcast_to_tokens(seq, jnp.asarray(mask))))


def test_compute_advantages_group_uses_config_eps():
    rewards = np.array([0.0, 1.0, 3.0, 7.0], dtype=np.float32)
    mask = np.ones((4, 2), bool)
    adv, _ = adv_lib.compute_advantages(AdvantageConfig(eps=0.5), jnp.asarray(rewards), jnp.asarray(mask), 4)
    want = oracle_broadcast(oracle_group(rewards, 4, "std", eps=0.5), mask)
    assert_allclose(np.asarray(adv), want, rtol=RTOL)


@pytest.mark.parametrize("with_valid", (False, True))
def test_compute_advantages_gae(with_valid):
    rng = np.random.default_rng(17)
    b_size, t_size = 6, 11
    mask = ragged_mask(rng, b_size, t_size)
    rewards = rng.normal(size=b_size).astype(np.float32)
    values = rng.normal(size=(b_size, t_size)).astype(np.float32)
    gamma, lam = 0.97, 0.85
    cfg = AdvantageConfig.from_config(advantage_config(estimator="gae", gamma=gamma, lam=lam))
    valid = None
    token_mask = mask.copy()
    if with_valid:
        valid = np.ones(b_size, bool)
        valid[[0, 4]] = False
        rewards[[0, 4]] = np.nan
        token_mask[~valid] = False
    adv, ret = adv_lib.compute_advantages(cfg, jnp.asarray(rewards), jnp.asarray(mask), 3,
                                          values=jnp.asarray(values),
                                          valid=None if valid is None else jnp.asarray(valid))
    token_rewards = oracle_reward_at_last_token(np.where(np.isnan(rewards), 0, rewards), token_mask)
    want_adv, want_ret = oracle_gae(token_rewards, values, token_mask, gamma, lam)
    assert_allclose(np.asarray(adv), want_adv, rtol=RTOL, atol=1e-5)
    assert_allclose(np.asarray(ret), want_ret, rtol=RTOL, atol=1e-5)
    if with_valid:
        assert np.all(np.asarray(adv)[~valid] == 0) and np.all(np.asarray(ret)[~valid] == 0)


def test_compute_advantages_errors():
    rewards = jnp.array([1.0, 0.0, 1.0, 1.0])
    mask = jnp.ones((4, 3), bool)
    gae_cfg = AdvantageConfig(estimator="gae")
    with pytest.raises(ValueError, match="values"):
        adv_lib.compute_advantages(gae_cfg, rewards, mask, 2)
    with pytest.raises(ValueError, match="non-finite"):
        adv_lib.compute_advantages(gae_cfg, rewards.at[1].set(jnp.nan), mask, 2, values=jnp.zeros((4, 3)))
    with pytest.raises(ValueError, match="non-finite"):
        adv_lib.compute_advantages(AdvantageConfig(), rewards.at[1].set(jnp.inf), mask, 2)
    cfg = advantage_config()
    cfg.estimator = "monte-carlo"
    with pytest.raises(ValueError, match="estimator"):
        adv_lib.compute_advantages(AdvantageConfig.from_config(cfg), rewards, mask, 2)
    # The library reads the typed section only: the ConfigDict itself is refused.
    with pytest.raises(TypeError, match="AdvantageConfig.from_config"):
        adv_lib.compute_advantages(advantage_config(), rewards, mask, 2)
