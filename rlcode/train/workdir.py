"""A job's run directory: created once, refused when it already holds a run, and its config kept.

`prepare_workdir(cfg)` is called by the engine before anything is built. It writes the run's
config.json and, on resume, compares the given config with it: a resumed run is the same
experiment, so a change outside `RESUME_MUTABLE` is refused (naming every changed field) unless
``resume_override`` is set; every replaced config.json is archived in ``config_history/``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

from rlcode.checks import ConfigError, flatten

# Fields a resumed run may change without resume_override: where the run and its warm-start
# cache live, how long it runs (extending train.steps also stretches the learning-rate schedule
# when optim.total_steps follows train.steps, as in the shipped configs), its time budget, the
# sandbox's parallelism, how often and how many checkpoints are kept, the train batch's layout
# (train.shared_prompts: the same log-probs either way), the sampler's batching (sampling.slots:
# the same tokens either way) and the resume switches themselves. Any other change (seeds, learning rate, rewards, model, batch shape, evaluation,
# ...) would make the resumed run a different experiment.
RESUME_MUTABLE = ("resume", "resume_override", "workdir", "train.steps", "train.max_minutes", "sandbox.workers",
                  "sft.cache_dir", "checkpoint.every", "checkpoint.keep", "train.shared_prompts",
                  "sampling.slots")
CONFIG_HISTORY = "config_history"
# The final parameters alone (`rlcode.train.checkpoint.save_params`), written when a run ends.
PARAMS_DIR = "params"
_ABSENT = "(absent)"
# Fields added to the configs after runs were written without them, each with the value that
# computes what those runs computed: a run's saved config that lacks one is not "changed" by the
# new config holding that value (any other value is a change like any other).
ADDED_FIELDS = {
    "tokenizer": "byte", "model.init_from": "", "model.qkv_bias": False, "model.rope_scaling": "none",
    "model.rope_factor": 1.0, "model.rope_low_freq_factor": 1.0, "model.rope_high_freq_factor": 4.0,
    "model.rope_original_max_position": 8192, "lora.rank": 0, "lora.alpha": 16.0,
    "lora.targets": ["q", "k", "v", "o", "gate", "up", "down"], "lora.dtype": "float32",
    # Either job's own default task source (a set: any of them is the neutral value).
    "task.source": frozenset({"synth", "repo"}), "task.mined_dir": ".cache/mined",
    "sft.seed": -1, "task.demo_bugs": "standard",
    "data.repeat_fraction": 0.0, "data.repeat_span": 256, "data.repeat_tokens": "span",
}


def config_changes(old: dict, new: dict) -> dict[str, tuple[Any, Any]]:
    """path -> (old value, new value) for every leaf that differs between two configs as JSON;
    a field only one of them has shows "(absent)" on the other side, except a field of
    `ADDED_FIELDS` missing from the old config and holding its listed value in the new."""
    a, b = flatten(old), flatten(new)
    a.update({k: b[k] for k, v in ADDED_FIELDS.items() if k not in a and k in b and _same(b[k], v)})
    return {k: (a.get(k, _ABSENT), b.get(k, _ABSENT)) for k in sorted(set(a) | set(b))
            if a.get(k, _ABSENT) != b.get(k, _ABSENT)}


def _same(value: Any, default: Any) -> bool:
    if isinstance(default, frozenset):
        return value in default
    return list(value) == default if isinstance(value, (list, tuple)) else value == default


def _mutable_on_resume(path: str, old: dict, new: dict) -> bool:
    if path in RESUME_MUTABLE:
        return True
    # optim.total_steps may follow train.steps (a reference in the configs) and nothing else.
    if path == "optim.total_steps":
        a, b = flatten(old), flatten(new)
        return a.get(path) == a.get("train.steps") and b.get(path) == b.get("train.steps")
    return False


def _archive_config(workdir: str, old: Any, changes: dict, *, resume: bool, override: bool) -> str:
    """Keep a replaced config.json as config_history/<n>.json with what changed; returns the path."""
    folder = os.path.join(workdir, CONFIG_HISTORY)
    os.makedirs(folder, exist_ok=True)
    n = 1 + sum(1 for name in os.listdir(folder) if name.endswith(".json"))
    path = os.path.join(folder, f"{n:03d}.json")
    record = {"replaced_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "resume": resume, "override": override,
              "changes": {k: list(v) for k, v in changes.items()}, "config": old}
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, indent=2, sort_keys=True)
    os.replace(path + ".tmp", path)
    return path


def _format_value(value: Any) -> str:
    return value if value == _ABSENT else json.dumps(value)


def prepare_workdir(cfg: Any, log: Callable[[str], None] | None = None) -> tuple[str, str]:
    """(workdir, checkpoint dir) of a job: created, refused when it holds checkpoints and
    cfg.resume is off, with the config written to config.json.

    Resuming compares the config with the run's saved config.json and raises a ConfigError
    naming every changed field (old -> new) unless only `RESUME_MUTABLE` fields changed or
    ``resume_override`` is set. config.json is replaced only after that check passes, and a
    replaced config is kept in ``config_history/<n>.json`` with its changes, so the run's
    history of configs stays complete."""
    workdir = os.path.abspath(cfg.workdir)
    os.makedirs(workdir, exist_ok=True)
    ckpt_dir = os.path.join(workdir, "checkpoints")
    has_ckpt = os.path.isdir(ckpt_dir) and any(n.isdigit() for n in os.listdir(ckpt_dir))
    if has_ckpt and not cfg.resume:
        raise ConfigError(f"workdir {workdir} already has checkpoints: pass --config.resume=True to continue "
                          "that run, or choose another --config.workdir")
    path = os.path.join(workdir, "config.json")
    text_new = cfg.to_json_best_effort(indent=2, sort_keys=True)
    new = json.loads(text_new)
    override = bool(cfg.get("resume_override", False))
    if os.path.exists(path):
        with open(path) as f:
            raw = f.read()
        try:
            old = json.loads(raw)
        except ValueError:
            old = None
        if old is None or not isinstance(old, dict):
            if cfg.resume and not override:
                raise ConfigError(f"resume: {path} is not a readable config, so the resumed config cannot be "
                                  "compared with it; restore it, or pass --config.resume_override=True to resume "
                                  f"with the given config (the unreadable file is kept in {CONFIG_HISTORY}/)")
            _archive_config(workdir, raw, {}, resume=bool(cfg.resume), override=override)
        else:
            changes = config_changes(old, new)
            refused = {k: v for k, v in changes.items() if not _mutable_on_resume(k, old, new)}
            if cfg.resume and refused and not override:
                listed = ", ".join(f"{k} {_format_value(a)} -> {_format_value(b)}" for k, (a, b) in refused.items())
                raise ConfigError(
                    f"resume: the config differs from the run's {path} in {len(refused)} field(s): {listed}; "
                    "resume with the saved values, or pass --config.resume_override=True to continue with the new "
                    f"ones (the saved config is then kept in {CONFIG_HISTORY}/). Fields that may change on resume: "
                    f"{', '.join(RESUME_MUTABLE)}")
            if changes:
                kept = _archive_config(workdir, old, changes, resume=bool(cfg.resume), override=bool(refused))
                if cfg.resume and refused and log is not None:
                    log(f"resume_override: continuing with {len(refused)} changed field(s) "
                        f"({', '.join(refused)}); the previous config is in {kept}")
    with open(path + ".tmp", "w") as f:
        f.write(text_new)
    os.replace(path + ".tmp", path)
    return workdir, ckpt_dir




def load_run_model(path: str, step: int | None = None) -> tuple[Any, Any, int]:
    """(config, model with the parameters of checkpoint `step`, step) of the run in directory
    `path` (its config.json, and params/ or checkpoints/; `step` None: the latest). The final
    parameters in params/ are read when they are of the wanted step (no optimizer state to read),
    else the checkpoint. ValueError naming the directory when it is not a run or holds neither."""
    from flax import nnx  # noqa: PLC0415

    from rlcode.train.checkpoint import Checkpointer, restore_params  # noqa: PLC0415

    cfg, model = _run_config_and_model(path)
    graphdef, state = nnx.split(model)
    params_dir, ckpt_dir = os.path.join(path, PARAMS_DIR), os.path.join(path, "checkpoints")
    exported = _exported_step(params_dir)
    ckpt = Checkpointer(ckpt_dir, read_only=True) if os.path.isdir(ckpt_dir) else None
    try:
        latest = ckpt.latest_step() if ckpt is not None else None
        step = (latest if latest is not None else exported) if step is None else step
        if step is None:
            raise ValueError(f"{path}: no checkpoint in {ckpt_dir} and no {PARAMS_DIR}/")
        if step == exported:
            saved, _ = restore_params(params_dir)
        elif ckpt is None:
            raise ValueError(f"{path}: no checkpoint in {ckpt_dir} (and {PARAMS_DIR}/ holds step {exported})")
        else:
            restored, _ = ckpt.restore(step)
            saved = restored["params"] if isinstance(restored, dict) else restored[1]
    finally:
        if ckpt is not None:
            ckpt.close()
    nnx.replace_by_pure_dict(state, saved)
    return cfg, nnx.merge(graphdef, state), int(step)


def load_run_warm_start(path: str) -> tuple[Any, Any, str]:
    """(config, model with the SFT warm start the run in directory `path` began RL from, the
    cache directory it came from): the ``sft.path`` of its summary.json. ValueError naming what
    is missing."""
    from flax import nnx  # noqa: PLC0415

    from rlcode.train import sft as sft_lib  # noqa: PLC0415

    summary_path = os.path.join(path, "summary.json")
    if not os.path.exists(os.path.join(path, "config.json")):
        raise ValueError(f"{path}: no config.json (not a run directory)")
    if not os.path.exists(summary_path):
        raise ValueError(f"{path}: no summary.json (it is written when the run ends or is stopped), so no warm start")
    with open(summary_path) as f:
        sft_path = (json.load(f).get("sft") or {}).get("path")
    if not sft_path:
        raise ValueError(f"{path}: its summary.json names no SFT warm start (sft.steps = 0?)")
    cfg, model = _run_config_and_model(path)
    cached = sft_lib.restore_cached(sft_path, cfg.model) if os.path.isdir(sft_path) else None
    if cached is None:
        raise ValueError(f"{path}: its warm start {sft_path} is not there (the SFT cache was moved or cleared)")
    graphdef, state = nnx.split(model)
    nnx.replace_by_pure_dict(state, sft_lib.merge_params(nnx.to_pure_dict(state), cached[0]))
    return cfg, nnx.merge(graphdef, state), sft_path


def _run_config_and_model(path: str) -> tuple[Any, Any]:
    """(config with its model section resolved, a fresh model of it) of the run in `path`."""
    import ml_collections  # noqa: PLC0415

    from rlcode.models.hf import initial_model, resolve_model_section  # noqa: PLC0415

    config_path = os.path.join(path, "config.json")
    if not os.path.exists(config_path):
        raise ValueError(f"{path}: no config.json (not a run directory)")
    with open(config_path) as f:
        cfg = ml_collections.ConfigDict(json.load(f))
    cfg.model = resolve_model_section(cfg.model)
    return cfg, initial_model(cfg.model, cfg.seed)


def _exported_step(params_dir: str) -> int | None:
    """The step of the final parameters in `params_dir` (None when there are none)."""
    from rlcode.train.checkpoint import params_extra  # noqa: PLC0415

    if not os.path.isdir(params_dir):
        return None
    step = (params_extra(params_dir) or {}).get("step")
    return step if isinstance(step, int) else None
