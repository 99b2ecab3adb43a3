"""rlcode.train.checkpoint: bit-exact resume in a fresh process, retention, interrupted saves,
corruption, typed PRNG keys, resharding across meshes, async saves overlapping donated steps.

Oracles: an uninterrupted training run (resume), values held on the host before a save
(interrupted / async saves), and hand-computed expectations of which steps survive pruning.
"""

import asyncio
import gc
import glob
import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import SingleDeviceSharding

import support
from rlcode.train.checkpoint import Checkpointer, CheckpointError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TMP_SUFFIX = ".orbax-checkpoint-tmp"


def run_python(code, timeout=120, xla_flags=None):
    """Run `code` in a fresh interpreter (CPU JAX); return its stdout, fail with its stderr."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    env["XLA_FLAGS"] = support.xla_flags()
    if xla_flags:
        env["XLA_FLAGS"] += " " + xla_flags
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def as_numpy(tree):
    """Leaves as numpy arrays keyed by path; typed PRNG keys as their key data."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if jax.dtypes.issubdtype(getattr(leaf, "dtype", np.float32), jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        out[jax.tree_util.keystr(path)] = np.asarray(leaf)
    return out


def assert_trees_equal(a, b):
    a, b = as_numpy(a), as_numpy(b)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k


# --------------------------------------------------------------------------------------------
# 1. Resume determinism in a fresh process
# --------------------------------------------------------------------------------------------

TRAIN_LIB = '''
"""A small MLP regression run: AdamW + warmup-cosine + global-norm clipping, dropout noise from a
PRNG key split every step, batches drawn from an (epoch, index) position over a shuffled set."""
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax

N, B, D, F = 40, 16, 8, 32  # dataset size (not a multiple of B: batches cross epochs), batch, dims


def make_optimizer():
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-2, warmup_steps=2, decay_steps=10,
                                                  end_value=3e-3)
    decay_mask = lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)
    return optax.chain(optax.clip_by_global_norm(0.5),
                       optax.adamw(schedule, weight_decay=0.1, mask=decay_mask))


def init_state(seed=0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    params = {"w1": jax.random.normal(k1, (D, F)) / 3, "b1": jnp.zeros(F),
              "w2": jax.random.normal(k2, (F, 1)) / 6, "b2": jnp.zeros(1)}
    return {"step": jnp.zeros((), jnp.int32), "params": params,
            "opt_state": make_optimizer().init(params), "key": k3}


def next_batch(position):
    rng = np.random.default_rng(1234)
    x = rng.normal(size=(N, D)).astype(np.float32)
    y = np.sin(x.sum(-1, keepdims=True)).astype(np.float32)
    epoch, index, rows = position["epoch"], position["index"], []
    while len(rows) < B:
        order = np.random.default_rng(epoch).permutation(N)
        take = min(B - len(rows), N - index)
        rows.extend(order[index:index + take])
        index += take
        if index == N:
            epoch, index = epoch + 1, 0
    return (x[rows], y[rows]), {"epoch": epoch, "index": index}


@partial(jax.jit, donate_argnums=0)
def train_step(state, xb, yb):
    key, k_drop = jax.random.split(state["key"])

    def loss_fn(params):
        h = jax.nn.relu(xb @ params["w1"] + params["b1"])
        h = jnp.where(jax.random.bernoulli(k_drop, 0.8, h.shape), h / 0.8, 0.0)
        return jnp.mean((h @ params["w2"] + params["b2"] - yb) ** 2)

    grads = jax.grad(loss_fn)(state["params"])
    updates, opt_state = make_optimizer().update(grads, state["opt_state"], state["params"])
    return {"step": state["step"] + 1, "params": jax.tree.map(jnp.add, state["params"], updates),
            "opt_state": opt_state, "key": key}


def run(state, position, steps):
    for _ in range(steps):
        (xb, yb), position = next_batch(position)
        state = train_step(state, xb, yb)
    return state, position


def as_numpy(state):
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        out[jax.tree_util.keystr(path)] = np.asarray(leaf)
    return out
'''


def load_train_lib(tmp_path):
    path = tmp_path / "resume_lib.py"
    path.write_text(TRAIN_LIB)
    spec = importlib.util.spec_from_file_location("resume_lib", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_resume_in_fresh_process_is_bit_identical(tmp_path):
    lib = load_train_lib(tmp_path)
    start = {"epoch": 0, "index": 0}
    straight, straight_position = lib.run(lib.init_state(), start, 4)

    config = ml_collections.ConfigDict({"optim": {"lr": 3e-2, "betas": (0.9, 0.999)}, "seed": 0})
    half, position = lib.run(lib.init_state(), start, 2)
    ckpt_dir = tmp_path / "ckpt"
    with Checkpointer(ckpt_dir) as ckpt:
        ckpt.save(2, half, extra={"config": config.to_dict(), "data": position})
        half, _ = lib.run(half, position, 1)  # keep training (donating) while the save runs

    out = tmp_path / "resumed.npz"
    stdout = run_python(f"""
        import json, sys
        import jax, numpy as np
        sys.path.insert(0, {str(tmp_path)!r})
        import resume_lib as lib
        from rlcode.train.checkpoint import Checkpointer

        with Checkpointer({str(ckpt_dir)!r}) as ckpt:
            assert ckpt.latest_step() == 2, ckpt.all_steps()
            state, extra = ckpt.restore_or_none(target=jax.eval_shape(lib.init_state))
        assert extra["config"]["optim"]["betas"] == [0.9, 0.999], extra
        state, position = lib.run(state, extra["data"], 2)
        np.savez({str(out)!r}, **lib.as_numpy(state))
        print(json.dumps(position))
    """)
    resumed = dict(np.load(out))
    expected = lib.as_numpy(straight)
    assert resumed.keys() == expected.keys()
    assert any("opt_state" in k and "count" in k for k in expected)  # the adam / schedule counts
    for k in expected:
        assert resumed[k].dtype == expected[k].dtype and np.array_equal(resumed[k], expected[k]), k
    assert int(resumed["['step']"]) == 4
    assert json.loads(stdout.strip().splitlines()[-1]) == straight_position == {"epoch": 1, "index": 24}

    # The oracle is sensitive: resuming without the data position (or the optimizer state) differs.
    with Checkpointer(ckpt_dir) as ckpt:
        state, extra = ckpt.restore(target=jax.eval_shape(lib.init_state))
        assert extra["data"] == position != start
        wrong_data, _ = lib.run(state, start, 2)  # donates `state`
        state, _ = ckpt.restore(target=jax.eval_shape(lib.init_state))
        fresh_opt = dict(state, opt_state=lib.make_optimizer().init(state["params"]))
        wrong_opt, _ = lib.run(fresh_opt, extra["data"], 2)
    for wrong in (wrong_data, wrong_opt):
        assert not np.array_equal(lib.as_numpy(wrong)["['params']['w1']"], expected["['params']['w1']"])


# --------------------------------------------------------------------------------------------
# 2. Retention
# --------------------------------------------------------------------------------------------


def small_state(v):
    return {"w": jnp.full((4, 3), float(v)), "step": jnp.int32(v)}


def step_dirs(directory):
    return sorted(int(n) for n in os.listdir(directory) if n.isdigit())


def test_keep_last_n_without_metric(tmp_path):
    with Checkpointer(tmp_path, keep=3) as ckpt:
        for s in range(1, 6):
            ckpt.save(s, small_state(s))
        ckpt.wait()
        assert ckpt.all_steps() == [3, 4, 5] and ckpt.latest_step() == 5
        assert ckpt.best_step() is None
    assert step_dirs(tmp_path) == [3, 4, 5]


def test_best_checkpoint_survives_pruning_and_nan_is_never_best(tmp_path):
    nan, inf = float("nan"), float("inf")
    expected_after = {1: [1], 2: [1, 2], 3: [2, 3], 4: [2, 3, 4], 5: [2, 4, 5], 6: [2, 5, 6]}
    # NaN first: a plain max() over the values would return it.
    values = {1: nan, 2: 0.9, 3: 0.4, 4: nan, 5: 0.2, 6: None}
    with Checkpointer(tmp_path, keep=2, best_metric="eval/pass", best_mode="max") as ckpt:
        for s, v in values.items():
            metrics = {"loss": 1.0} if v is None else {"eval/pass": v, "loss": 1.0}
            ckpt.save(s, small_state(s), metrics=metrics)
            ckpt.wait()
            assert ckpt.all_steps() == expected_after[s], s
            assert ckpt.best_step() == (None if s == 1 else 2), s
        assert ckpt.metrics(5) == {"eval/pass": 0.2, "loss": 1.0} and ckpt.metrics(6) == {"loss": 1.0}
    assert step_dirs(tmp_path) == [2, 5, 6]

    # A fresh process reads the metrics back from disk and keeps pruning consistently.
    with Checkpointer(tmp_path, keep=2, best_metric="eval/pass", best_mode="max") as ckpt:
        assert ckpt.best_step() == 2 and ckpt.latest_step() == 6
        state, _ = ckpt.restore(2)
        assert float(state["w"][0, 0]) == 2.0
        ckpt.save(7, small_state(7), metrics={"eval/pass": 0.95})
        ckpt.wait()
        assert ckpt.all_steps() == [6, 7] and ckpt.best_step() == 7
    assert step_dirs(tmp_path) == [6, 7]

    # min mode, keep=1: NaN and -inf never win, ties go to the newer step.
    d = tmp_path / "min"
    losses = {1: nan, 2: 2.0, 3: 1.0, 4: 3.0, 5: 1.0, 6: -inf, 7: nan}
    with Checkpointer(d, keep=1, best_metric="loss", best_mode="min") as ckpt:
        for s, v in losses.items():
            ckpt.save(s, small_state(s), metrics={"loss": v})
        ckpt.wait()
        assert ckpt.best_step() == 5
        assert ckpt.all_steps() == [5, 7]
    assert step_dirs(d) == [5, 7]

    # No finite metric at all: no best, plain keep-last-N.
    d = tmp_path / "allnan"
    with Checkpointer(d, keep=2, best_metric="loss", best_mode="min") as ckpt:
        for s in range(1, 5):
            ckpt.save(s, small_state(s), metrics={"loss": nan})
        ckpt.wait()
        assert ckpt.best_step() is None and ckpt.all_steps() == [3, 4]


def test_existing_step_needs_force(tmp_path):
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, small_state(1), extra={"v": 1})
        with pytest.raises(CheckpointError, match="step 1 .*already exists"):
            ckpt.save(1, small_state(5))
        ckpt.wait()
        with pytest.raises(CheckpointError, match="already exists"):
            ckpt.save(1, small_state(5))
        assert ckpt.save(1, small_state(5), extra={"v": 5}, force=True)
        state, extra = ckpt.restore(1)
        assert float(state["w"][0, 0]) == 5.0 and extra == {"v": 5}
        assert ckpt.all_steps() == [1]
    with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(CheckpointError, match="already exists"):
            ckpt.save(1, small_state(6))
        assert ckpt.restore(1)[1] == {"v": 5}


# --------------------------------------------------------------------------------------------
# 3. Interrupted save
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_save_killed_mid_write_keeps_previous_checkpoint(tmp_path):
    d = tmp_path / "ckpt"
    # The child saves step 1, then starts a ~200 MB save of step 2 whose commit (orbax's rename
    # of the temporary directory) is held back, so the SIGKILL always lands before the commit.
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import asyncio, sys, time
            import jax, jax.numpy as jnp, numpy as np
            from orbax.checkpoint._src.path import atomicity
            from rlcode.train.checkpoint import Checkpointer

            ckpt = Checkpointer({str(d)!r}, keep=5)
            ckpt.save(1, {{"w": jnp.arange(1000.0), "big": jnp.zeros(10)}})
            ckpt.wait()

            async def never_commit(self, *args, **kwargs):
                await asyncio.sleep(3600)

            atomicity.AtomicRenameTemporaryPath.finalize = never_commit
            # 200 MB that do not compress, drawn by numpy: the suite's XLA flags (no backend
            # optimisation) make jax.random take seconds at this size.
            big = jnp.asarray(np.random.default_rng(0).standard_normal(50_000_000, dtype=np.float32))
            ckpt.save(2, {{"w": jnp.arange(1000.0) + 1, "big": big}})
            print("SAVING", flush=True)
            time.sleep(600)
        """)],
        cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    tmp_dir = d / f"2{TMP_SUFFIX}"
    try:
        assert child.stdout.readline().strip() == "SAVING", child.stderr.read()[-3000:]
        deadline = time.time() + 60
        written = 0
        while time.time() < deadline:  # kill once array data is being written
            files = glob.glob(str(tmp_dir / "**" / "*"), recursive=True)
            written = sum(os.path.getsize(f) for f in files if os.path.isfile(f))
            if written > 1 << 20:
                break
            time.sleep(0.005)
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert written > 1 << 20
    assert tmp_dir.is_dir() and not (d / "2").exists()

    # A reader (read_only: leaves temporaries alone) sees only the committed step.
    with Checkpointer(d, read_only=True) as reader:
        assert reader.latest_step() == 1 and reader.all_steps() == [1]
        state, _ = reader.restore()
        assert np.array_equal(state["w"], np.arange(1000.0)) and state["big"].shape == (10,)
        with pytest.raises(CheckpointError, match="step 2 .*interrupted"):
            reader.restore(2)
        with pytest.raises(CheckpointError, match="read_only"):
            reader.save(3, small_state(3))
    assert tmp_dir.is_dir()

    # A writer cleans the temporary up and saves step 2 again.
    with Checkpointer(d, keep=5) as ckpt:
        assert ckpt.latest_step() == 1
        new = {"w": jnp.arange(1000.0) * 3, "big": jnp.ones(10)}
        ckpt.save(2, new)
        ckpt.wait()
        assert ckpt.all_steps() == [1, 2]
        state, _ = ckpt.restore()
        assert_trees_equal(state, new)
        ckpt.save(3, new)
    assert not tmp_dir.exists() and step_dirs(d) == [1, 2, 3]


# --------------------------------------------------------------------------------------------
# 4. Corruption, missing steps, empty directories
# --------------------------------------------------------------------------------------------


def largest_file(directory):
    files = [f for f in glob.glob(str(directory / "**" / "*"), recursive=True) if os.path.isfile(f)]
    return max(files, key=os.path.getsize)


# A failed read makes orbax abandon the reads still in flight, which Python reports as unraisable.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.slow
def test_corrupted_missing_and_empty_raise_checkpoint_error(tmp_path):
    d = tmp_path / "ckpt"
    state = {"w": jax.random.normal(jax.random.key(1), (64, 256)), "b": jnp.arange(8),
             "key": jax.random.key(2)}
    target = jax.eval_shape(lambda: state)
    with Checkpointer(d, keep=None) as ckpt:
        for s in range(1, 7):
            ckpt.save(s, state, extra={"step": s})

    def truncate(step):
        f = largest_file(d / str(step) / "state")
        with open(f, "r+b") as fh:
            fh.truncate(os.path.getsize(f) // 2)

    def delete(step):
        os.remove(largest_file(d / str(step) / "state"))

    def flip_bit(step):
        f = largest_file(d / str(step) / "state")
        data = bytearray(open(f, "rb").read())
        data[len(data) // 2] ^= 0x10
        open(f, "wb").write(bytes(data))

    def garble_meta(step):
        (meta,) = [f for f in glob.glob(str(d / str(step) / "meta" / "*"))
                   if not f.endswith("commit_success.txt")]
        open(meta, "w").write('{"format": "rlcode.checkpoint/1", "leaves": [')

    def garble_tree_metadata(step):
        open(d / str(step) / "state" / "_METADATA", "w").write("{not json")

    damage = {1: truncate, 2: delete, 3: flip_bit, 4: garble_meta, 5: garble_tree_metadata}
    for step, fn in damage.items():
        fn(step)

    with Checkpointer(d, keep=None) as ckpt:  # opening a directory with damaged steps works
        assert ckpt.all_steps() == [1, 2, 3, 4, 5, 6]
        restored, extra = ckpt.restore(target=target)  # the latest (6) is intact
        assert_trees_equal(restored, state) and extra == {"step": 6}
        for step in damage:
            for tgt in (target, None):
                with pytest.raises(CheckpointError) as err:
                    ckpt.restore(step, target=tgt)
                message = str(err.value)
                assert f"step {step} " in message and str(d) in message, message
                if step != 3:  # 3: orbax reads the altered bytes without error; the checksum fails
                    assert err.value.__cause__ is not None
        with pytest.raises(CheckpointError, match="checksum"):
            ckpt.restore(3, target=target)
        with pytest.raises(CheckpointError, match="metadata"):
            ckpt.restore(4)
        with pytest.raises(CheckpointError, match=r"step 99 .*available steps: \[1, 2, 3, 4, 5, 6\]"):
            ckpt.restore(99)
        # A target that does not fit the checkpoint is a clear error too.
        with pytest.raises(CheckpointError, match="shapes"):
            ckpt.restore(6, target=dict(target, w=jax.ShapeDtypeStruct((64, 255), jnp.float32)))
        with pytest.raises(CheckpointError, match="not the checkpoint"):
            ckpt.restore(6, target=dict(target, extra_leaf=jax.ShapeDtypeStruct((2,), jnp.float32)))

    empty = tmp_path / "empty"
    with Checkpointer(empty) as ckpt:
        assert ckpt.latest_step() is None and ckpt.all_steps() == []
        assert ckpt.restore_or_none(target=target) is None
        with pytest.raises(CheckpointError, match="no checkpoint in"):
            ckpt.restore()
        with pytest.raises(CheckpointError, match="step 0 "):
            ckpt.restore(0)
    for _ in range(5):  # finalise orbax's abandoned reads here, under this test's warning filter
        gc.collect()
        time.sleep(0.1)


# --------------------------------------------------------------------------------------------
# 5. PRNG keys and sharded restore
# --------------------------------------------------------------------------------------------


def test_typed_and_raw_keys_round_trip_onto_single_device_target(tmp_path):
    state = {
        "typed": jax.random.key(7),
        "typed_batch": jax.random.split(jax.random.key(8), 3),
        "rbg": jax.random.key(9, impl="rbg"),
        "raw": jax.random.PRNGKey(10),
        "w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4),
        "count": jnp.int32(5),
    }
    device = jax.devices()[0]
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=SingleDeviceSharding(device)), state)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(jnp.int32(1), state)  # integer scalar arrays are valid steps
        restored, _ = ckpt.restore(target=target)
        untargeted, _ = ckpt.restore()
        concrete, _ = ckpt.restore(1, target=jax.tree.map(jnp.zeros_like, state))
        cast, _ = ckpt.restore(target=dict(target, w=jax.ShapeDtypeStruct((3, 4), jnp.bfloat16)))

    for tree in (restored, untargeted, concrete):
        assert_trees_equal(tree, state)
        for name in ("typed", "typed_batch", "rbg"):
            assert tree[name].dtype == state[name].dtype, name  # typed keys stay typed
        assert tree["raw"].dtype == jnp.uint32 and not jax.dtypes.issubdtype(
            tree["raw"].dtype, jax.dtypes.prng_key)
        # The restored keys generate the same numbers.
        for name in ("typed", "rbg", "raw"):
            assert np.array_equal(jax.random.normal(tree[name], (5,)),
                                  jax.random.normal(state[name], (5,))), name
    for leaf, t in zip(jax.tree.leaves(restored), jax.tree.leaves(target)):
        assert leaf.sharding == t.sharding
    assert cast["w"].dtype == jnp.bfloat16
    assert np.array_equal(cast["w"], state["w"].astype(jnp.bfloat16))


def test_restore_onto_a_different_sharding(tmp_path):
    d = tmp_path / "ckpt"
    out = tmp_path / "saved.npz"
    # Four fake CPU devices: save sharded over the mesh, restore replicated and resharded.
    run_python(f"""
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import NamedSharding, PartitionSpec as P
        from rlcode.train.checkpoint import Checkpointer

        assert jax.device_count() == 4
        mesh = jax.make_mesh((4,), ("x",))
        shard = lambda spec: NamedSharding(mesh, spec)
        state = {{
            "w": jax.device_put(jnp.arange(64.0).reshape(8, 8), shard(P("x"))),
            "v": jax.device_put(jnp.arange(4, dtype=jnp.int32), shard(P("x"))),
            "keys": jax.device_put(jax.random.split(jax.random.key(3), 8), shard(P("x"))),
            "step": jax.device_put(jnp.int32(11), shard(P())),
        }}
        assert len(state["w"].addressable_shards) == 4
        with Checkpointer({str(d)!r}) as ckpt:
            ckpt.save(11, state)
            for spec_w in (P(), P(None, "x")):
                target = {{k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shard(P()))
                           for k, x in state.items()}}
                target["w"] = jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=shard(spec_w))
                restored, _ = ckpt.restore(target=target)
                assert restored["w"].sharding == target["w"].sharding
                for k in state:
                    # Typed keys report P() as the equivalent P(None,).
                    assert restored[k].sharding.is_equivalent_to(target[k].sharding,
                                                                 len(state[k].shape)), k
                    a, b = restored[k], state[k]
                    if k == "keys":
                        assert a.dtype == b.dtype
                        a, b = jax.random.key_data(a), jax.random.key_data(b)
                    assert np.array_equal(a, b), k
        np.savez({str(out)!r}, w=state["w"], v=state["v"], keys=jax.random.key_data(state["keys"]))
        print("OK")
    """, xla_flags="--xla_force_host_platform_device_count=4")
    saved = np.load(out)

    # This process has one device: the 4-device checkpoint restores onto it with a target.
    device = jax.devices()[0]
    on_device = SingleDeviceSharding(device)
    target = {
        "w": jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=on_device),
        "v": jax.ShapeDtypeStruct((4,), jnp.int32, sharding=on_device),
        "keys": jax.ShapeDtypeStruct((8,), jax.random.key(0).dtype, sharding=on_device),
        "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=on_device),
    }
    with Checkpointer(d) as ckpt:
        restored, _ = ckpt.restore(target=target)
        with pytest.raises(CheckpointError, match="pass target="):
            ckpt.restore()  # the saved 4-device shardings do not exist here
    assert np.array_equal(restored["w"], saved["w"]) and np.array_equal(restored["v"], saved["v"])
    assert np.array_equal(jax.random.key_data(restored["keys"]), saved["keys"])
    assert int(restored["step"]) == 11 and restored["w"].sharding == on_device


# --------------------------------------------------------------------------------------------
# 6. Async saves overlapping donated training steps
# --------------------------------------------------------------------------------------------


def test_async_save_holds_values_at_save_time(tmp_path, monkeypatch):
    # Hold back orbax's background JSON write until `release` is set, so the save is certainly
    # still in flight while the state is donated and `extra` is mutated below.
    release = threading.Event()
    json_handler = ocp.handlers.JsonCheckpointHandler
    original_save_fn = json_handler._save_fn

    async def slow_save_fn(self, *args, **kwargs):
        for _ in range(1000):
            if release.is_set():
                break
            await asyncio.sleep(0.01)
        return await original_save_fn(self, *args, **kwargs)

    monkeypatch.setattr(json_handler, "_save_fn", slow_save_fn)

    @jax.jit
    def init():
        return {"w": jnp.ones((4_000_000,)), "step": jnp.int32(0), "key": jax.random.key(0)}

    def step_fn(state):
        key, sub = jax.random.split(state["key"])
        return {"w": state["w"] * 2 + jax.random.uniform(sub), "step": state["step"] + 1, "key": key}

    train_step = jax.jit(step_fn, donate_argnums=0)
    train_step(init())  # compile now, so the steps below run while the save is in flight
    # The oracle comes from a separate, identical array: reading `state` on the host would pin its
    # buffers (a CPU numpy view is an external reference, which blocks donation).
    expected = as_numpy(init())
    state = init()
    extra = {"data": {"epoch": 0, "index": 16}}
    with Checkpointer(tmp_path, async_save=True) as ckpt:
        assert ckpt.save(1, state, extra=extra) is True
        extra["data"]["index"] = 999
        for _ in range(3):  # donate and overwrite the saved buffers while the write runs
            state = train_step(state)
        live = as_numpy(state)
        assert not (tmp_path / "1").exists()  # not committed yet
        release.set()
        ckpt.wait()
        assert (tmp_path / "1").is_dir()
        restored, restored_extra = ckpt.restore(target=jax.eval_shape(init))
    restored = as_numpy(restored)
    assert restored.keys() == expected.keys()
    for k in expected:
        assert np.array_equal(restored[k], expected[k]), k
    assert restored_extra == {"data": {"epoch": 0, "index": 16}}
    assert int(live["['step']"]) == 3 and not np.array_equal(live["['w']"], expected["['w']"])


# --------------------------------------------------------------------------------------------
# 7. Parameters alone, the previous format, orbax's own metrics
# --------------------------------------------------------------------------------------------


def test_params_export_round_trips_and_refuses_damage(tmp_path):
    from rlcode.train.checkpoint import params_extra, restore_params, save_params

    params = {"embed": jax.random.normal(jax.random.key(0), (64, 256)),
              "layers": [{"w": jnp.arange(12.0).reshape(3, 4), "b": jnp.zeros(4, jnp.bfloat16)}]}
    path = tmp_path / "params"
    save_params(path, params, extra={"step": 7, "model": {"d": 8}})
    assert params_extra(path) == {"step": 7, "model": {"d": 8}}
    restored, extra = restore_params(path)
    assert_trees_equal(restored, params) and extra["step"] == 7
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32,
                                                         sharding=SingleDeviceSharding(jax.devices()[0])), params)
    cast, _ = restore_params(path, target=target)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(cast))
    np.testing.assert_array_equal(cast["layers"][0]["b"], np.zeros(4, np.float32))
    # The parameters and their record, no optimizer state.
    assert {"meta", "params"} <= set(os.listdir(path)) and not any("opt" in n for n in os.listdir(path))

    with pytest.raises(CheckpointError, match="already exist"):
        save_params(path, params)
    save_params(path, jax.tree.map(lambda x: x + 1, params), extra={"step": 8}, force=True)
    assert params_extra(path) == {"step": 8}
    with pytest.raises(CheckpointError, match="does not match the target"):
        restore_params(path, target={"embed": target["embed"]})
    with pytest.raises(CheckpointError, match=r"no parameters in .*missing"):
        restore_params(tmp_path / "missing")

    f = largest_file(path / "params")
    data = bytearray(open(f, "rb").read())
    data[len(data) // 2] ^= 0x10
    open(f, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match=r"parameters in .*params.*(checksum|cannot read)"):
        restore_params(path)


def test_previous_format_restores_with_its_keys_and_metrics(tmp_path):
    """A checkpoint of the previous format (metrics in the metadata, typed keys stored as key
    data with their implementation) written here by hand with orbax: it restores unchanged."""
    from rlcode.train import checkpoint as ck

    state = {"w": jnp.arange(6.0).reshape(2, 3), "key": jax.random.key(4), "keys": jax.random.split(
        jax.random.key(5, impl="rbg"), 2)}
    stored = {k: (jax.random.key_data(v) if k != "w" else v) for k, v in state.items()}
    records = ck._records(stored)
    for r in records:
        r["prng_impl"] = {"key": "threefry2x32", "keys": "rbg"}.get(r["path"])
    meta = {"format": "rlcode.checkpoint/1", "step": 3, "metrics": {"eval/pass": 0.5},
            "extra": {"iteration": 3}, "leaves": records}
    manager = ocp.CheckpointManager(tmp_path, options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False))
    manager.save(3, args=ocp.args.Composite(state=ocp.args.StandardSave(stored), meta=ocp.args.JsonSave(meta)))
    manager.close()

    with Checkpointer(tmp_path, best_metric="eval/pass") as ckpt:
        assert ckpt.metrics(3) == {"eval/pass": 0.5}
        for target in (None, jax.eval_shape(lambda: state)):
            restored, extra = ckpt.restore(target=target)
            assert extra == {"iteration": 3} and restored["key"].dtype == state["key"].dtype
            assert_trees_equal(restored, state)
            assert np.array_equal(jax.random.normal(restored["keys"][1], (3,)),
                                  jax.random.normal(state["keys"][1], (3,)))


def test_metrics_are_orbaxs_own_item(tmp_path, caplog):
    with Checkpointer(tmp_path, keep=2, best_metric="acc") as ckpt, caplog.at_level("WARNING"):
        ckpt.save(1, small_state(1), metrics={"acc": 0.5, "loss": 2.0})
        ckpt.save(2, small_state(2))
    assert not [r for r in caplog.records if "metrics" in r.getMessage()]  # a save without metrics is normal
    assert (tmp_path / "1" / "metrics" / "metrics").is_file() and not (tmp_path / "2" / "metrics").exists()
    meta = ocp.CheckpointManager(tmp_path, options=ocp.CheckpointManagerOptions(read_only=True))
    assert meta.metrics(1) == {"acc": 0.5, "loss": 2.0}
    meta.close()
    with Checkpointer(tmp_path, read_only=True) as ckpt:
        assert ckpt.metrics(1) == {"acc": 0.5, "loss": 2.0} and ckpt.metrics(2) is None
