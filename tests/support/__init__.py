"""Helpers shared by the test modules (see tests/conftest.py)."""

import os


def xla_flags(devices: int | None = None) -> str:
    """XLA_FLAGS for a subprocess: the suite's own flags (tests/conftest.py sets them in this
    process's environment) plus, when `devices` is given, that many fake CPU devices."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    flags = [f for f in flags if not f.startswith("--xla_force_host_platform_device_count=")]
    if devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    return " ".join(flags)


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def config_module(name: str):
    """The module of configs/`name`.py, loaded from its path as experiments.ablate loads a config."""
    from experiments.ablate import load_config_module  # noqa: PLC0415

    return load_config_module(os.path.join(ROOT, "configs", f"{name}.py"))


def job_config(name: str, arg: str | None = None):
    """configs/`name`.py's get_config(arg)."""
    return config_module(name).get_config(arg)


def derived_config(path, base: str, *changes: str, arg: str | None = "base=bytes") -> str:
    """Write a config file at `path` whose get_config() is configs/`base`.py's for the argument
    `arg` (default: the fresh byte-level policy, whose shape the changes may shrink) with `changes`
    (statements on ``cfg``) applied; returns its path. For scripts that take a config file."""
    source = os.path.join(ROOT, "configs", f"{base}.py")
    lines = ["import importlib.util", "",
             f"spec = importlib.util.spec_from_file_location('base_{base}', {source!r})",
             "base = importlib.util.module_from_spec(spec)", "spec.loader.exec_module(base)", "", "",
             "def get_config():", f"    cfg = base.get_config({arg!r})", *(f"    {c}" for c in changes), "    return cfg", ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return str(path)


def training_logprobs(graphdef, params, batch, cfg):
    """Log-probs of a `rlcode.sampling.TrainingBatch`'s targets under the sampler's distribution
    (`cfg`: its SamplingConfig), from the full training forward: the oracle for behaviour log-probs."""
    import jax
    from flax import nnx

    from rlcode.models.attention import AttentionMask
    from rlcode.models.logprobs import token_logprobs

    @jax.jit
    def fn(params, batch):
        model = nnx.merge(graphdef, params)
        hidden = model(batch.inputs, batch.positions, AttentionMask(kv_lengths=batch.kv_lengths)).hidden
        w, layout = model.unembedding()
        return token_logprobs(hidden, w, batch.targets, temperature=cfg.temperature, top_k=cfg.top_k,
                              top_p=cfg.top_p, unembed_layout=layout)

    return fn(params, batch)
