"""Hugging Face checkpoints in and out: Qwen2 / Qwen2.5, Qwen3 and Llama 3.x.

A checkpoint directory holds ``config.json`` and the weights as ``model.safetensors`` or as
shards listed by ``model.safetensors.index.json`` (tokenizer files beside them are read by
`rlcode.tokenizer.load_tokenizer`).

* `load_checkpoint(path)` builds the model config from config.json (`model_config_from_hf`) and
  reads every parameter from the memory-mapped files. With a mesh, each device's slice of a
  parameter is read and placed on that device directly (`jax.make_array_from_callback`), so no
  host ever holds a whole model it cannot fit.
* `save_checkpoint(model, path)` writes the same layout back (safetensors, config.json and the
  tokenizer's files); loading the export gives bit-identical parameters.

The three families differ only in what the model config already expresses: Qwen2 has biases on
the query/key/value projections (`qkv_bias`), Qwen3 normalises queries and keys per head
(`qk_norm`), Llama 3.1+ rescales its RoPE frequencies (`rope_scaling="llama3"`). A config field
that changes the computation and is not implemented here (a sliding window, another RoPE
scaling, biases on the output or MLP projections, dropout) is an error naming it, as is any
field this module does not know; pass `ignore_fields` to accept fields known to be harmless.

Tensor layouts: Hugging Face stores a linear layer's weight as [out, in]; the model here stores
projections as [in, ..., out] with heads split out (wq [D, N, H], wo [N, H, D]). Each tensor's
conversion is a reshape and a transpose of the stored array, both views of the mapped file, so
a device's slice is read without materialising the rest.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from rlcode.models.safetensors_file import SafetensorsError, SafetensorsFile, write_file
from rlcode.models.transformer import DTYPES, ModelConfig, Transformer, logical_axes, model_config
from rlcode.sharding import DEFAULT_RULES, Rules, logical_to_spec, place

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


class CheckpointFormatError(ValueError):
    """A checkpoint this module cannot load or write faithfully; the message names the field,
    tensor or file."""


@dataclasses.dataclass(frozen=True)
class Family:
    """What distinguishes one architecture of config.json's ``architectures``."""

    architecture: str
    model_type: str
    qkv_bias: bool
    qk_norm: bool


FAMILIES = {
    f.architecture: f
    for f in (
        Family("Qwen2ForCausalLM", "qwen2", qkv_bias=True, qk_norm=False),
        Family("Qwen3ForCausalLM", "qwen3", qkv_bias=False, qk_norm=True),
        Family("LlamaForCausalLM", "llama", qkv_bias=False, qk_norm=False),
    )
}

# Fields read into the model config (and written back by `hf_config`).
_READ = {
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "rope_theta",
    "rope_scaling", "rope_parameters", "tie_word_embeddings",
}
# Fields that must have the value that means "the feature is off": value -> what it would switch on.
_MUST_BE_OFF = {
    "use_sliding_window": (False, "a sliding attention window"),
    "attention_bias": (False, "biases on every attention projection including the output"),
    "mlp_bias": (False, "biases on the MLP projections"),
    "attention_dropout": (0.0, "attention dropout"),
}
# Fields that do not change the forward of a causal LM (generation defaults, initialisation,
# bookkeeping, limits the model does not enforce).
_HARMLESS = {
    "bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype", "dtype", "transformers_version", "use_cache",
    "initializer_range", "max_position_embeddings", "_name_or_path", "sliding_window", "max_window_layers",
    "pretraining_tp", "return_dict", "output_attentions", "output_hidden_states", "id2label", "label2id",
    "tokenizer_class", "keys_to_ignore_at_inference", "_attn_implementation_autoset", "layer_types",
    "is_encoder_decoder", "tie_encoder_decoder", "num_nextn_predict_layers", "use_mrope", "torchscript",
}


def _rope_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    """RoPE theta and scaling from ``rope_theta`` + ``rope_scaling`` or ``rope_parameters``."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    theta = hf.get("rope_theta", params.get("rope_theta", 10000.0))
    kind = scaling.get("rope_type", scaling.get("type")) or params.get("rope_type", "default")
    source = scaling if scaling else params
    if kind == "default":
        return {"rope_theta": float(theta), "rope_scaling": "none"}
    if kind == "llama3":
        try:
            return {"rope_theta": float(theta), "rope_scaling": "llama3", "rope_factor": float(source["factor"]),
                    "rope_low_freq_factor": float(source["low_freq_factor"]),
                    "rope_high_freq_factor": float(source["high_freq_factor"]),
                    "rope_original_max_position": int(source["original_max_position_embeddings"])}
        except KeyError as e:
            raise CheckpointFormatError(f"config.json: llama3 rope_scaling lacks {e.args[0]!r}") from None
    raise CheckpointFormatError(f"config.json: rope_scaling of type {kind!r} is not implemented (only 'llama3')")


def model_config_from_hf(hf: Mapping[str, Any], *, dtype: str = "bfloat16", param_dtype: str | None = None,
                         ignore_fields: Sequence[str] = ()) -> ml_collections.ConfigDict:
    """The `model` config section of a Hugging Face config.json (a dict).

    dtype: compute dtype; param_dtype: parameter dtype (default: `dtype`). Raises
    CheckpointFormatError for an architecture other than `FAMILIES`, a field that switches on
    something not implemented, or a field not known here (unless listed in `ignore_fields`).
    """
    architectures = hf.get("architectures") or []
    if len(architectures) != 1 or architectures[0] not in FAMILIES:
        raise CheckpointFormatError(f"config.json: architectures={architectures!r}; supported: {sorted(FAMILIES)}")
    family = FAMILIES[architectures[0]]
    if hf.get("model_type", family.model_type) != family.model_type:
        raise CheckpointFormatError(f"config.json: model_type={hf['model_type']!r} does not match "
                                    f"{family.architecture} ({family.model_type!r})")
    unknown = sorted(set(hf) - _READ - set(_MUST_BE_OFF) - _HARMLESS - {"use_qk_norm"} - set(ignore_fields))
    if unknown:
        raise CheckpointFormatError(f"config.json: field(s) {unknown} are not known to {family.architecture} "
                                    "loading here; if they do not change the forward, pass ignore_fields")
    if "use_qk_norm" in hf and bool(hf["use_qk_norm"]) != family.qk_norm:
        raise CheckpointFormatError(f"config.json: use_qk_norm={hf['use_qk_norm']!r} differs from {family.architecture}")
    for name, (off, what) in _MUST_BE_OFF.items():
        if hf.get(name) is not None and hf[name] != off:
            raise CheckpointFormatError(f"config.json: {name}={hf[name]!r} switches on {what}, which is not implemented")
    layer_types = hf.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise CheckpointFormatError(f"config.json: layer_types {sorted(set(layer_types))} include layers other than "
                                    "'full_attention' (a sliding window), which is not implemented")
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointFormatError(f"config.json: hidden_act={hf['hidden_act']!r}; only 'silu' (SwiGLU) is implemented")
    try:
        D, N = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        section = {
            "vocab_size": int(hf["vocab_size"]), "d_model": D, "num_layers": int(hf["num_hidden_layers"]),
            "num_heads": N, "num_kv_heads": int(hf.get("num_key_value_heads") or N),
            "head_dim": int(hf.get("head_dim") or D // N), "ffw_dim": int(hf["intermediate_size"]),
            "norm_eps": float(hf.get("rms_norm_eps", 1e-6)), "qk_norm": family.qk_norm, "qkv_bias": family.qkv_bias,
            "tie_embeddings": bool(hf.get("tie_word_embeddings", family.model_type != "llama")),
        }
    except KeyError as e:
        raise CheckpointFormatError(f"config.json: required field {e.args[0]!r} is missing") from None
    section.update(_rope_fields(hf))
    for name in ("dtype", "param_dtype"):
        value = dtype if name == "dtype" or param_dtype is None else param_dtype
        if value not in DTYPES:
            raise ValueError(f"{name}={value!r} is not one of {sorted(DTYPES)}")
        section[name] = value
    return model_config(**section)


def family_of(cfg: ModelConfig) -> Family:
    """The Hugging Face architecture that represents `cfg` (raises if none does)."""
    if cfg.attention["kind"] not in ("dense", "squid") or cfg.mlp["kind"] != "dense":
        raise CheckpointFormatError(f"attention.kind={cfg.attention['kind']!r}, mlp.kind={cfg.mlp['kind']!r}: only "
                                    "dense (or squid, which has the same parameters) attention and a dense MLP "
                                    "have a Hugging Face layout here")
    if cfg.qkv_bias and cfg.qk_norm:
        raise CheckpointFormatError("qkv_bias together with qk_norm matches none of " + ", ".join(FAMILIES))
    if cfg.qkv_bias:
        family = FAMILIES["Qwen2ForCausalLM"]
    elif cfg.qk_norm:
        family = FAMILIES["Qwen3ForCausalLM"]
    else:
        family = FAMILIES["LlamaForCausalLM"]
    if cfg.rope_scaling != "none" and family.model_type != "llama":
        raise CheckpointFormatError(f"rope_scaling={cfg.rope_scaling!r} is written only for Llama here")
    return family


def hf_config(cfg: ModelConfig, *, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """config.json for `cfg` in its family's format (`family_of`); `extra` adds fields such as
    token ids or max_position_embeddings (it may not change the architecture's fields)."""
    family = family_of(cfg)
    dtype = {v: k for k, v in DTYPES.items()}[cfg.param_dtype]
    out = {
        "architectures": [family.architecture], "model_type": family.model_type, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model, "intermediate_size": cfg.ffw_dim, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": None,
        "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": dtype, "max_position_embeddings": 32768,
    }
    if family.model_type != "qwen2":
        out["attention_bias"] = False
    if cfg.rope_scaling == "llama3":
        out["rope_scaling"] = {"rope_type": "llama3", "factor": cfg.rope_factor,
                               "low_freq_factor": cfg.rope_low_freq_factor,
                               "high_freq_factor": cfg.rope_high_freq_factor,
                               "original_max_position_embeddings": cfg.rope_original_max_position}
    for name, value in (extra or {}).items():
        if name in _READ and out.get(name) != value:
            raise CheckpointFormatError(f"extra config field {name!r}={value!r} contradicts the model ({out.get(name)!r})")
        out[name] = value
    return out


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """One stored tensor and the parameter it becomes: ours = stored.reshape(split).transpose(perm)."""

    name: str  # the Hugging Face tensor name
    path: tuple[str, ...]  # the parameter's path in nnx.to_pure_dict(state)
    stored_shape: tuple[int, ...]
    split: tuple[int, ...]
    perm: tuple[int, ...]

    def to_ours(self, stored: np.ndarray) -> np.ndarray:
        return stored.reshape(self.split).transpose(self.perm)

    def to_stored(self, ours: np.ndarray) -> np.ndarray:
        return ours.transpose(np.argsort(self.perm)).reshape(self.stored_shape)


def tensor_maps(cfg: ModelConfig) -> list[TensorMap]:
    """Every stored tensor of `cfg`'s family, with the parameter it maps to."""
    D, N, K, H, F, V = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffw_dim, cfg.vocab_size
    same = lambda name, path, shape: TensorMap(name, path, shape, shape, tuple(range(len(shape))))
    linear = lambda name, path, out, inp: TensorMap(name, path, (out, inp), (out, inp), (1, 0))
    maps = [same("model.embed_tokens.weight", ("embed",), (V, D)), same("model.norm.weight", ("final_norm", "scale"), (D,))]
    if not cfg.tie_embeddings:
        maps.append(linear("lm_head.weight", ("unembed",), V, D))
    for i in range(cfg.num_layers):
        p, b = f"model.layers.{i}.", f"block_{i}"
        attn = (b, "attn", "proj")
        maps += [
            same(p + "input_layernorm.weight", (b, "attn_norm", "scale"), (D,)),
            same(p + "post_attention_layernorm.weight", (b, "mlp_norm", "scale"), (D,)),
            # [N*H, D] -> [N, H, D] -> [D, N, H]
            TensorMap(p + "self_attn.q_proj.weight", attn + ("wq",), (N * H, D), (N, H, D), (2, 0, 1)),
            TensorMap(p + "self_attn.k_proj.weight", attn + ("wk",), (K * H, D), (K, H, D), (2, 0, 1)),
            TensorMap(p + "self_attn.v_proj.weight", attn + ("wv",), (K * H, D), (K, H, D), (2, 0, 1)),
            # [D, N*H] -> [D, N, H] -> [N, H, D]
            TensorMap(p + "self_attn.o_proj.weight", attn + ("wo",), (D, N * H), (D, N, H), (1, 2, 0)),
            linear(p + "mlp.gate_proj.weight", (b, "mlp", "w_gate"), F, D),
            linear(p + "mlp.up_proj.weight", (b, "mlp", "w_up"), F, D),
            linear(p + "mlp.down_proj.weight", (b, "mlp", "w_down"), D, F),
        ]
        if cfg.qkv_bias:
            maps += [TensorMap(p + f"self_attn.{x}_proj.bias", attn + (f"b{x}",), (n * H,), (n, H), (0, 1))
                     for x, n in (("q", N), ("k", K), ("v", K))]
        if cfg.qk_norm:
            maps += [same(p + f"self_attn.{x}_norm.weight", attn + (f"{x}_norm", "scale"), (H,)) for x in "qk"]
    return maps


# Tensors some exporters add that carry nothing the forward needs (RoPE's table is recomputed).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def _open_weights(path: str) -> dict[str, SafetensorsFile]:
    """Tensor name -> the open file holding it, from an index or a single file."""
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointFormatError(f"{index}: no 'weight_map' object")
        files: dict[str, SafetensorsFile] = {}
        where: dict[str, SafetensorsFile] = {}
        for name, file in weight_map.items():
            full = os.path.join(path, file)
            if os.path.dirname(os.path.normpath(file)) or not os.path.isfile(full):
                raise CheckpointFormatError(f"{index}: tensor {name!r} is in {file!r}, which is not a file of {path}")
            if file not in files:
                files[file] = SafetensorsFile(full)
            if name not in files[file]:
                raise CheckpointFormatError(f"{index}: tensor {name!r} is listed in {file!r}, which does not hold it")
            where[name] = files[file]
        return where
    single = os.path.join(path, SINGLE)
    if os.path.isfile(single):
        st = SafetensorsFile(single)
        return {name: st for name in st.names}
    raise CheckpointFormatError(f"{path} holds neither {SINGLE} nor {INDEX}")


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    file = os.path.join(os.fspath(path), CONFIG)
    if not os.path.isfile(file):
        raise CheckpointFormatError(f"{os.fspath(path)} has no {CONFIG}")
    with open(file, encoding="utf-8") as f:
        return json.load(f)


def _get(tree: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


def _paths(tree: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = []
    for key, value in tree.items():
        out += _paths(value, prefix + (key,)) if isinstance(value, Mapping) else [prefix + (key,)]
    return out


def load_checkpoint(path: str | os.PathLike, *, dtype: str = "bfloat16", param_dtype: str | None = None,
                    mesh: Mesh | None = None, rules: Rules = DEFAULT_RULES,
                    overrides: Mapping[str, Any] | None = None, ignore_fields: Sequence[str] = ()) -> Transformer:
    """The model of a Hugging Face checkpoint directory.

    dtype / param_dtype: compute and parameter dtypes (bfloat16 by default; float32 parameters
      hold a bfloat16 checkpoint exactly). mesh / rules: place every parameter on its sharding as
      it is read (each device's slice only) and give the model its placement; None: the default
      device. overrides: model-config fields that do not change the stored parameters, e.g.
      ``{"attention": {"kind": "squid"}}`` or ``{"value_head": True}`` (a new value head starts at
      zero). ignore_fields: config.json fields to accept unread (see the module docstring).

    Every stored tensor must be used and every parameter found, with the stored shape the config
    implies; otherwise CheckpointFormatError names the tensors.
    """
    path = os.fspath(path)
    section = model_config_from_hf(read_config(path), dtype=dtype, param_dtype=param_dtype, ignore_fields=ignore_fields)
    for name, value in (overrides or {}).items():
        if name not in section:
            raise CheckpointFormatError(f"overrides: the model config has no field {name!r}")
        section[name] = value
    cfg = ModelConfig.from_config(section)
    family_of(cfg)  # an attention or MLP kind without this layout is refused before any reading
    where = _open_weights(path)
    maps = tensor_maps(cfg)
    expected = {m.name for m in maps}
    # A tied checkpoint may store the shared matrix a second time as the head (checked equal).
    expected_extra = {"lm_head.weight"} if cfg.tie_embeddings else set()
    missing = sorted(expected - set(where))
    if missing:
        raise CheckpointFormatError(f"{path}: missing tensor(s) {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    unexpected = sorted(n for n in set(where) - expected - expected_extra if not n.endswith(_IGNORED_SUFFIXES))
    if unexpected:
        raise CheckpointFormatError(f"{path}: tensor(s) {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''} "
                                    f"are not part of {family_of(cfg).architecture} as configured")
    for m in maps:
        shape = where[m.name].shape(m.name)
        if shape != m.stored_shape:
            raise CheckpointFormatError(f"{path}: tensor {m.name!r} has shape {list(shape)}, config.json implies "
                                        f"{list(m.stored_shape)}")
    if cfg.tie_embeddings and "lm_head.weight" in where:
        _check_tied(where, path)

    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    shapes = nnx.to_pure_dict(state)
    axes = logical_axes(abstract)
    params = jax.tree.map(lambda x: None, shapes)
    for m in maps:
        target = _get(shapes, m.path)
        view = m.to_ours(where[m.name].array(m.name))
        if view.shape != target.shape:  # a mapping bug, not a file problem
            raise AssertionError(f"{m.name} maps to {view.shape}, parameter {m.path} is {target.shape}")
        _set(params, m.path, _materialise(view, target, _get(axes, m.path), mesh, rules))
    leftover = [p for p in _paths(params) if _get(params, p) is None]
    for p in leftover:
        if p[0] not in ("value_w", "value_b"):
            raise CheckpointFormatError(f"{path}: the model has parameter {'.'.join(p)}, which "
                                        f"{family_of(cfg).architecture} checkpoints do not store")
        target = _get(shapes, p)
        _set(params, p, _materialise(np.zeros(target.shape, target.dtype), target, _get(axes, p), mesh, rules))
    nnx.replace_by_pure_dict(state, params)
    model = nnx.merge(graphdef, state)
    return place(model, mesh, rules) if mesh is not None else model


# The fields of a `model` section that a checkpoint's config.json decides.
ARCHITECTURE_FIELDS = ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "ffw_dim",
                       "norm_eps", "qk_norm", "qkv_bias", "tie_embeddings", "rope_theta", "rope_scaling", "rope_factor",
                       "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_position")


def resolve_model_section(section: Any) -> ml_collections.ConfigDict:
    """A copy of a `model` config section; with ``init_from`` set, its architecture fields
    (`ARCHITECTURE_FIELDS`) are those of the checkpoint's config.json, so every check, memory
    estimate and saved run config sees the model that will be loaded. The section keeps what
    it decides itself: dtypes, attention and MLP kinds, the value head."""
    out = ml_collections.ConfigDict(section.to_dict() if hasattr(section, "to_dict") else dict(section))
    init_from = out.get("init_from", "")
    if not init_from:
        return out
    loaded = model_config_from_hf(read_config(init_from), dtype=out.dtype, param_dtype=out.param_dtype)
    for name in ARCHITECTURE_FIELDS:
        out[name] = loaded[name]
    return out


def checkpoint_fingerprint(path: str | os.PathLike) -> str:
    """A short identity of a checkpoint directory: config.json's content and the name, size and
    modification time of each weight file (cheap; a changed file changes it)."""
    import hashlib  # noqa: PLC0415

    path = os.fspath(path)
    h = hashlib.sha256(json.dumps(read_config(path), sort_keys=True).encode())
    for name in sorted(os.listdir(path)):
        if name.endswith((".safetensors", ".json")):
            st = os.stat(os.path.join(path, name))
            h.update(f"{name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def initial_model(section: Any, seed: int, *, mesh: Mesh | None = None, rules: Rules = DEFAULT_RULES) -> Transformer:
    """The model a job starts from: `init_model` of the section, or with ``init_from`` set the
    checkpoint (placed on `mesh` as it is read), with the section's attention kind, MLP kind
    and value head (a new value head starts at zero)."""
    from rlcode.models.transformer import init_model  # noqa: PLC0415

    init_from = section.get("init_from", "") if hasattr(section, "get") else ""
    if not init_from:
        return init_model(section, seed)
    overrides = {"attention": dict(section["attention"]), "mlp": dict(section["mlp"]),
                 "value_head": bool(section["value_head"])}
    return load_checkpoint(init_from, dtype=section["dtype"], param_dtype=section["param_dtype"], mesh=mesh,
                           rules=rules, overrides=overrides)


def _check_tied(where: Mapping[str, SafetensorsFile], path: str) -> None:
    embed = where["model.embed_tokens.weight"].array("model.embed_tokens.weight")
    head = where["lm_head.weight"].array("lm_head.weight")
    if head.shape != embed.shape or not np.array_equal(head, embed):
        raise CheckpointFormatError(f"{path}: tie_word_embeddings is true but lm_head.weight differs from "
                                    "model.embed_tokens.weight")


def _materialise(view: np.ndarray, target: Any, axes: tuple, mesh: Mesh | None, rules: Rules) -> jax.Array:
    """The parameter as a jax Array of the target dtype: on the mesh slice by slice, else whole."""
    dtype = np.dtype(target.dtype)
    if mesh is None:
        return jax.device_put(np.asarray(view, dtype=dtype))
    sharding = NamedSharding(mesh, logical_to_spec(axes, rules, target.shape, mesh))
    return jax.make_array_from_callback(target.shape, sharding, lambda index: np.asarray(view[index], dtype=dtype))


def save_checkpoint(model: Transformer, path: str | os.PathLike, *, tokenizer: Any = None,
                    dtype: str | None = None, max_shard_bytes: int = 4 * 2**30,
                    extra_config: Mapping[str, Any] | None = None) -> None:
    """Write `model` as a Hugging Face checkpoint directory (created if needed).

    dtype: the stored dtype (default: the parameters' own, which round-trips exactly).
    max_shard_bytes: above this the weights are split into ``model-0000i-of-0000n.safetensors``
      with an index; otherwise one ``model.safetensors``. tokenizer: anything with a
      ``save(path)`` method (`rlcode.tokenizer.HFTokenizer`, `ByteTokenizer`) writes its files
      beside the weights.
    extra_config: additional config.json fields (`hf_config`). A value head, which the layout has
    no place for, is not written.
    """
    cfg = model.cfg
    config = hf_config(cfg, extra=extra_config)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    out_dtype = None
    if dtype is not None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is not one of {sorted(DTYPES)}")
        out_dtype = np.dtype(DTYPES[dtype])
        config["torch_dtype"] = dtype
    tensors = {}
    for m in tensor_maps(cfg):
        value = np.asarray(jax.device_get(_get(params, m.path)), dtype=out_dtype)
        tensors[m.name] = np.ascontiguousarray(m.to_stored(value))
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    for stale in (SINGLE, INDEX):
        if os.path.exists(os.path.join(path, stale)):
            os.remove(os.path.join(path, stale))
    shards = _shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        write_file(os.path.join(path, SINGLE), tensors, {"format": "pt"})
    else:
        weight_map = {}
        for i, names in enumerate(shards, 1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            write_file(os.path.join(path, file), {n: tensors[n] for n in names}, {"format": "pt"})
            weight_map.update({n: file for n in names})
        total = sum(t.nbytes for t in tensors.values())
        _write_json(os.path.join(path, INDEX), {"metadata": {"total_size": total}, "weight_map": weight_map})
    _write_json(os.path.join(path, CONFIG), config)
    if tokenizer is not None:
        if not hasattr(tokenizer, "save"):
            raise ValueError(f"{type(tokenizer).__name__} has no Hugging Face files to save")
        tokenizer.save(path)


def _shards(tensors: Mapping[str, np.ndarray], max_bytes: int) -> list[list[str]]:
    if max_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be > 0, got {max_bytes}")
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _write_json(file: str, obj: Any) -> None:
    tmp = f"{file}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, file)


__all__ = ["ARCHITECTURE_FIELDS", "CheckpointFormatError", "FAMILIES", "SafetensorsError", "checkpoint_fingerprint",
           "family_of", "hf_config", "initial_model", "load_checkpoint", "model_config_from_hf", "read_config",
           "resolve_model_section", "save_checkpoint", "tensor_maps"]
