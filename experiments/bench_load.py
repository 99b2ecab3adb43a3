"""Time loading a Hugging Face checkpoint and measure the host memory it takes.

    python -m experiments.bench_load --shape=qwen2.5-0.5b            # writes a random checkpoint first
    python -m experiments.bench_load --path=/models/Qwen2.5-Coder-0.5B-Instruct --mesh=fsdp=8

Without --path, a checkpoint of the named shape with random bfloat16 weights is written to
--workdir (once; reused when present), in shards of --shard_mb. Each load runs in a fresh
process, which reports the seconds from the call to parameters ready on the devices and the peak
of its memory above what it held before the call, sampled every few milliseconds and split into
anonymous memory (allocations: on CPU this includes the parameters themselves, since the
"device" is the host) and resident pages of the memory-mapped files (page cache, which the
kernel can evict). Reading slice by slice from the mapped files keeps the anonymous peak near
the parameters a process holds plus one tensor, not the checkpoint plus a copy. Writes JSON to --out (default
runs/bench_load/<shape>.json).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

from absl import app, flags

SHAPES = {
    # Real sizes of the families (random weights): config.json fields.
    "qwen2.5-0.5b": ("qwen2", dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                   num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                                   rope_theta=1000000.0)),
    "qwen3-0.6b": ("qwen3", dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                 tie_word_embeddings=True, rope_theta=1000000.0)),
    "llama3.2-1b": ("llama", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                  num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
                                  rope_theta=500000.0,
                                  rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
    "tiny": ("qwen2", dict(vocab_size=1024, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
}
FAMILY_CONFIG = {
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=False),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", attention_bias=False),
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=False, mlp_bias=False),
}

_SHAPE = flags.DEFINE_enum("shape", "qwen2.5-0.5b", list(SHAPES), "Random checkpoint to write and load.")
_PATH = flags.DEFINE_string("path", None, "Load this checkpoint directory instead of a random one.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/bench_load", "Where random checkpoints are written.")
_SHARD_MB = flags.DEFINE_integer("shard_mb", 256, "Shard size of the random checkpoint.")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Parameter dtype to load into.")
_MESH = flags.DEFINE_string("mesh", "", "Mesh sizes, e.g. 'fsdp=4,tensor=2' (default: no mesh).")
_REPEATS = flags.DEFINE_integer("repeats", 2, "Loads (each in a fresh process).")
_OUT = flags.DEFINE_string("out", None, "JSON output (default runs/bench_load/<name>.json).")
_WORKER = flags.DEFINE_bool("worker", False, "Internal: load once and print one JSON line.")


def _vm(field: str) -> int:
    """A /proc/self/status memory field in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def write_random(path: str, shape: str, shard_mb: int) -> None:
    import ml_dtypes  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    from rlcode.models import hf  # noqa: PLC0415
    from rlcode.models.safetensors_file import write_file  # noqa: PLC0415
    from rlcode.models.transformer import ModelConfig  # noqa: PLC0415

    family, fields = SHAPES[shape]
    config = {**FAMILY_CONFIG[family], **fields, "hidden_act": "silu", "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16"}
    cfg = ModelConfig.from_config(hf.model_config_from_hf(config, dtype="bfloat16"))
    rng = np.random.default_rng(0)
    # One tensor at a time, written per shard, so writing never holds the model either.
    maps = sorted(hf.tensor_maps(cfg), key=lambda m: m.name)
    os.makedirs(path, exist_ok=True)
    shard, size, weight_map, files = {}, 0, {}, []

    def flush():
        nonlocal shard, size
        if shard:
            file = f"part-{len(files):05d}.safetensors"
            write_file(os.path.join(path, file), shard)
            weight_map.update({n: file for n in shard})
            files.append(file)
            shard, size = {}, 0

    for i, m in enumerate(maps):
        value = (rng.standard_normal(m.stored_shape, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)
        if size and size + value.nbytes > shard_mb * 2**20:
            flush()
        shard[m.name] = value
        size += value.nbytes
        print(f"\rwriting {i + 1}/{len(maps)} tensors", end="", file=sys.stderr, flush=True)
    flush()
    print(file=sys.stderr)
    with open(os.path.join(path, hf.INDEX), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(path, hf.CONFIG), "w") as f:
        json.dump(config, f)


def worker(path: str, dtype: str, mesh_spec: str) -> dict:
    import jax  # noqa: PLC0415

    from rlcode.models import hf  # noqa: PLC0415
    from rlcode.sharding import make_mesh, mesh_config  # noqa: PLC0415

    mesh = None
    if mesh_spec:
        sizes = {k: int(v) for k, v in (item.split("=") for item in mesh_spec.split(","))}
        mesh = make_mesh(mesh_config(**{"data": 1, **sizes}))
    from flax import nnx  # noqa: PLC0415

    jax.block_until_ready(jax.numpy.zeros(1))  # backend up before the baseline
    anon0, file0 = _vm("RssAnon"), _vm("RssFile")
    peaks = {"anon": anon0, "file": file0}
    done = threading.Event()

    def sample():  # the kernel keeps no high-water mark per kind of page
        while not done.is_set():
            peaks["anon"], peaks["file"] = max(peaks["anon"], _vm("RssAnon")), max(peaks["file"], _vm("RssFile"))
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    model = hf.load_checkpoint(path, dtype=dtype, mesh=mesh)
    jax.block_until_ready(nnx.state(model))
    seconds = time.perf_counter() - t0
    done.set()
    sampler.join()
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
    return {"seconds": seconds, "peak_anon_above_start": peaks["anon"] - anon0,
            "peak_file_pages_above_start": peaks["file"] - file0, "peak_rss_above_start": _vm("VmHWM") - anon0 - file0,
            "param_bytes": param_bytes, "devices": len(jax.devices()), "platform": jax.devices()[0].platform}


def main(argv):
    del argv
    if _WORKER.value:
        print(json.dumps(worker(_PATH.value, _DTYPE.value, _MESH.value)))
        return
    name = os.path.basename(os.path.normpath(_PATH.value)) if _PATH.value else _SHAPE.value
    path = _PATH.value or os.path.join(_WORKDIR.value, _SHAPE.value)
    if not _PATH.value and not os.path.exists(os.path.join(path, "config.json")):
        write_random(path, _SHAPE.value, _SHARD_MB.value)
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    file_bytes = sum(os.path.getsize(os.path.join(path, f)) for f in files)
    runs = []
    for i in range(_REPEATS.value):
        cmd = [sys.executable, "-m", "experiments.bench_load", "--worker", f"--path={path}", f"--dtype={_DTYPE.value}",
               f"--mesh={_MESH.value}"]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(f"load failed:\n{out.stderr[-3000:]}")
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"load {i + 1}/{_REPEATS.value}: {runs[-1]['seconds']:.2f} s", file=sys.stderr)
    best = min(runs, key=lambda r: r["seconds"])
    largest = max((_largest_tensor(os.path.join(path, f)) for f in files), default=0)
    result = {"checkpoint": name, "path": path, "files": len(files), "file_bytes": file_bytes, "dtype": _DTYPE.value,
              "mesh": _MESH.value or None, "largest_tensor_bytes": largest, "runs": runs,
              "seconds": best["seconds"], "gb_per_s": file_bytes / best["seconds"] / 1e9,
              "param_bytes": best["param_bytes"], "platform": best["platform"]}
    for key in ("peak_anon_above_start", "peak_file_pages_above_start"):
        result[key] = max(r[key] for r in runs)
    gib = 2**30
    print(f"{'checkpoint':<16} {'files':>5} {'GiB':>7} {'load s':>8} {'GB/s':>6} {'anon GiB':>9} {'mapped GiB':>11} "
          f"{'params GiB':>11} {'largest tensor GiB':>19}")
    print(f"{name:<16} {len(files):>5} {file_bytes / gib:>7.3f} {result['seconds']:>8.2f} {result['gb_per_s']:>6.2f} "
          f"{result['peak_anon_above_start'] / gib:>9.3f} {result['peak_file_pages_above_start'] / gib:>11.3f} "
          f"{result['param_bytes'] / gib:>11.3f} {largest / gib:>19.3f}")
    print(f"anon: peak anonymous memory above the start (on CPU it includes the loaded parameters themselves); "
          f"mapped: peak resident pages of the mapped files (page cache, evictable) on {result['platform']}")
    out = _OUT.value or os.path.join("runs", "bench_load", f"{name}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {out}")


def _largest_tensor(file: str) -> int:
    from rlcode.models.safetensors_file import SafetensorsFile  # noqa: PLC0415

    st = SafetensorsFile(file)
    return max((st.array(n).nbytes for n in st.names), default=0)


if __name__ == "__main__":
    app.run(main)
