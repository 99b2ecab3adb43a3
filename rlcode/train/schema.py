"""The config sections the training jobs share, field by field, and the checks both jobs run.

Each job (`rlcode.train.loop`, `rlcode.train.agent`) checks its whole config at start, before
any task, warm start or compilation: `common_schema` plus its own sections through
`rlcode.checks.check_fields` (types, ranges, finiteness, allowed values; an unknown field is an
error naming the closest known ones), then `check_common` (the sections' own validators and
the constraints between fields), then its own constraints and the memory estimate
(`rlcode.train.memory`). Every failure is a `ConfigError` naming the field.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from rlcode import losses
from rlcode.advantages import ADVANTAGE_SPECS, AdvantageConfig
from rlcode.checks import (ConfigError, check_fields, config_errors, flag, integer, real, schema_from_defaults,
                           sequence, text)
from rlcode.models.layers import ROPE_SCALINGS
from rlcode.recipes import RECIPES, SHAPING_SPECS, ShapingConfig
from rlcode.sharding import DEFAULT_RULES, MESH_AXES

SEED = integer(0, 2**31 - 1)
IMPLS = ("auto", "xla", "triton")
MAX_SANDBOX_WORKERS = 1024  # one process each; more is a typo, not a machine

# Ranges and allowed values of the fields of the shared sections. The fields themselves are those
# the sections' builders return (`sections`), so a field a builder gains is known (and checked by
# the type of its default) and one it drops is not.
ATTENTION_SPECS = {
    "impl": text(IMPLS), "block_len": integer(1), "stride": integer(1), "select_size": integer(1),
    "num_select": integer(3), "window": integer(1), "shared_kv": flag(), "cmp_hidden": integer(0),
}
MOE_SPECS = {
    "num_experts": integer(1), "top_k": integer(1), "expert_ffw_dim": integer(1), "num_shared_experts": integer(0),
    "router": text(("softmax", "sigmoid")), "renormalize": flag(), "aux_loss_coef": real(0), "z_loss_coef": real(0),
    "bias_update_rate": real(0), "dispatch": text(("dropless", "capacity")), "capacity_factor": real(0, low_open=True),
    "precision": text(("bf16", "mxfp8")), "impl": text(IMPLS),
}
MODEL_SPECS = {
    "vocab_size": integer(1), "d_model": integer(1), "num_layers": integer(1), "num_heads": integer(1),
    "num_kv_heads": integer(1), "head_dim": integer(2), "ffw_dim": integer(1), "rope_theta": real(0, low_open=True),
    "norm_eps": real(0, low_open=True), "qk_norm": flag(), "tie_embeddings": flag(), "value_head": flag(),
    "qkv_bias": flag(), "rope_scaling": text(ROPE_SCALINGS), "rope_factor": real(0, low_open=True),
    "rope_low_freq_factor": real(0, low_open=True), "rope_high_freq_factor": real(0, low_open=True),
    "rope_original_max_position": integer(1), "init_from": text(required=False),
}
# The advantage, loss and shaping sections are checked with the Specs of the typed sections the
# library reads them as (`AdvantageConfig`, `losses.ObjectiveConfig`, `ShapingConfig`).
LOSS_SPECS = {**losses.POLICY_SPECS, **losses.OBJECTIVE_SPECS}
SFT_SPECS = {"steps": integer(0), "batch_size": integer(1), "microbatches": integer(1), "lr": real(0, low_open=True),
             "warmup_steps": integer(0), "min_lr_ratio": real(0, 1), "weight_decay": real(0), "grad_clip": real(0),
             "cache_dir": text(), "log_every": integer(0), "seed": integer(-1, required=False)}
OPTIM_SPECS = {"lr": real(0, low_open=True), "warmup_steps": integer(0), "total_steps": integer(1),
               "min_lr_ratio": real(0, 1), "b1": real(0, 1, high_open=True), "b2": real(0, 1, high_open=True),
               "eps": real(0, low_open=True), "weight_decay": real(0), "grad_clip": real(0)}
MESH_SPECS = {**{axis: integer(-1) for axis in MESH_AXES}, "rules": sequence(sequence(min_len=2))}


def model_schema(model: Any) -> dict[str, Any]:
    """The `model` section's fields (`model_config`); the attention and MLP options are those of
    their kinds (`ATTENTION_OPTIONS`, `MOE_OPTIONS`), all optional (defaults fill them in)."""
    from rlcode.models.attention import ATTENTION_OPTIONS  # noqa: PLC0415
    from rlcode.models.moe import MOE_OPTIONS  # noqa: PLC0415
    from rlcode.models.transformer import DTYPES, model_config  # noqa: PLC0415

    def kind_of(section: str, kinds: tuple[str, ...]) -> str:
        value = model.get(section) if hasattr(model, "get") else None
        kind = value.get("kind") if hasattr(value, "get") else None
        if kind not in kinds:
            raise ConfigError(f"model.{section}.kind={kind!r}: must be one of {kinds}")
        return kind

    def optional(options: dict[str, Any], specs: dict[str, Any]) -> dict[str, Any]:
        return {k: dataclasses.replace(v, required=False) for k, v in schema_from_defaults(options, specs).items()}

    attention = kind_of("attention", tuple(ATTENTION_OPTIONS))
    mlp = kind_of("mlp", ("dense", "moe"))
    defaults = {k: v for k, v in model_config().items() if k not in ("attention", "mlp")}
    specs = dict(MODEL_SPECS, dtype=text(tuple(DTYPES)), param_dtype=text(tuple(DTYPES)))
    return {**schema_from_defaults(defaults, specs),
            "attention": {"kind": text(tuple(ATTENTION_OPTIONS)),
                          **optional(ATTENTION_OPTIONS[attention], ATTENTION_SPECS)},
            "mlp": {"kind": text(("dense", "moe")), **(optional(MOE_OPTIONS, MOE_SPECS) if mlp == "moe" else {})}}


def common_schema(cfg: Any) -> dict[str, Any]:
    """The fields every job has: top-level run settings and the shared sections, whose fields are
    those their builders (`optim_config`, `sft_config`, ...) return."""
    from rlcode.models.lora import LORA_SPECS, lora_config  # noqa: PLC0415
    from rlcode.recipes import advantage_config  # noqa: PLC0415
    from rlcode.sharding import mesh_config  # noqa: PLC0415
    from rlcode.train.sft import sft_config  # noqa: PLC0415
    from rlcode.train.step import optim_config  # noqa: PLC0415

    return {
        "seed": SEED, "workdir": text(), "resume": flag(), "resume_override": flag(required=False),
        "tokenizer": text(required=False),
        "objective": text(RECIPES),
        "model": model_schema(cfg.get("model", {})),
        "mesh": schema_from_defaults(mesh_config(), MESH_SPECS),
        "advantage": schema_from_defaults(advantage_config(), ADVANTAGE_SPECS),
        "loss": schema_from_defaults(losses.loss_config(), LOSS_SPECS),
        "shaping": dict(SHAPING_SPECS),
        "sft": schema_from_defaults(sft_config(), SFT_SPECS),
        "optim": schema_from_defaults(optim_config(), OPTIM_SPECS),
        "lora": schema_from_defaults(lora_config(), LORA_SPECS),
        "checkpoint": {"every": integer(0), "keep": integer(1)},
    }


def job_schema(cfg: Any, job_sections: dict[str, Any]) -> dict[str, Any]:
    """The whole schema of an RL job's config: the common sections and the job's own."""
    return {**common_schema(cfg), **job_sections}


def check_schema(cfg: Any, job_sections: dict[str, Any]) -> None:
    """Every field of `cfg` known, present and valid under the common and the job's sections."""
    if not hasattr(cfg, "keys"):
        raise ConfigError(f"the config must be a ConfigDict, got {type(cfg).__name__}")
    check_fields(cfg, job_schema(cfg, job_sections))


def mesh_sizes(mesh: Any, num_devices: int | None) -> dict[str, int]:
    """Each mesh axis's size on `num_devices` devices (-1 = the rest; left as -1 when the number of
    devices is not given); ConfigError if they do not fit."""
    sizes = {a: int(mesh[a]) for a in MESH_AXES}
    if any(s == 0 for s in sizes.values()) or sum(s == -1 for s in sizes.values()) > 1:
        raise ConfigError(f"mesh={sizes}: each axis is a size >= 1, or -1 (all remaining devices) for one axis")
    if num_devices is None:
        return sizes
    known = math.prod(s for s in sizes.values() if s != -1)
    if num_devices % known:
        raise ConfigError(f"mesh={sizes} does not fit {num_devices} devices")
    return {a: (num_devices // known if s == -1 else s) for a, s in sizes.items()}


def check_common(cfg: Any, num_devices: int | None = None) -> None:
    """The constraints within and between the shared sections (after `check_schema`)."""
    from rlcode.models.lora import MLP_TARGETS, LoraConfig  # noqa: PLC0415
    from rlcode.models.moe import MoEOptions  # noqa: PLC0415
    from rlcode.models.transformer import ModelConfig  # noqa: PLC0415
    from rlcode.tokenizer import job_tokenizer  # noqa: PLC0415

    if not cfg.workdir:
        raise ConfigError("workdir='': must name a directory")
    with config_errors("model"):
        ModelConfig.from_config(cfg.model)
        if cfg.model.mlp["kind"] == "moe":
            MoEOptions.from_config(cfg.model.mlp)
    if cfg.model.attention["kind"] == "nsa":
        from kernels.nsa import check_sizes  # noqa: PLC0415
        from rlcode.models.attention import ATTENTION_OPTIONS  # noqa: PLC0415

        a = {**ATTENTION_OPTIONS["nsa"], **dict(cfg.model.attention)}
        with config_errors("model.attention"):
            check_sizes(a["block_len"], a["stride"], a["select_size"], a["num_select"], a["window"])
    with config_errors("tokenizer"):
        vocab = job_tokenizer(cfg.get("tokenizer", "byte"), cfg.model.get("init_from", "")).vocab_size
    if cfg.model.vocab_size < vocab:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size}: must be >= the tokenizer's {vocab}")
    known_rules = dict(DEFAULT_RULES)
    for rule in cfg.mesh.rules:
        name, axes = rule[0], rule[1]
        axes = tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)
        if name not in known_rules or len(rule) != 2 or any(a not in MESH_AXES for a in axes):
            raise ConfigError(f"mesh.rules: {tuple(rule)!r} must be (logical axis, mesh axes) with a logical axis of "
                              f"{tuple(known_rules)} and mesh axes of {MESH_AXES}")
    mesh_sizes(cfg.mesh, num_devices)
    with config_errors("loss"):
        losses.ObjectiveConfig.from_config(cfg.loss)
    with config_errors("advantage"):
        AdvantageConfig.from_config(cfg.advantage)
    with config_errors("shaping"):
        ShapingConfig.from_config(cfg.shaping)
    with config_errors("lora"):
        lora = LoraConfig.from_config(cfg.lora)
    mlp_targets = [t for t in lora.targets if t in MLP_TARGETS]
    if lora.rank > 0 and cfg.model.mlp["kind"] != "dense" and mlp_targets:
        raise ConfigError(f"lora.targets={lora.targets!r}: {mlp_targets} adapt the dense MLP, the model's is "
                          f"model.mlp.kind={cfg.model.mlp['kind']!r} (target only q, k, v, o)")
    if cfg.sft.steps > 0 and cfg.sft.batch_size % cfg.sft.microbatches:
        raise ConfigError(f"sft.batch_size={cfg.sft.batch_size} is not divisible by sft.microbatches="
                          f"{cfg.sft.microbatches}")
    if (cfg.advantage.estimator == "gae" or cfg.loss.value_coef > 0) and not cfg.model.value_head:
        raise ConfigError("advantage.estimator='gae' / loss.value_coef > 0 need model.value_head=True")
