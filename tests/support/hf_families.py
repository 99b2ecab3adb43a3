"""Tiny Hugging Face checkpoints of each supported family, and an independent float64 forward.

`write_checkpoint` writes config.json and random weights in the real file format (safetensors,
one file or sharded with an index), under the tensor names the families use. `numpy_forward`
computes the logits from those named tensors and the config.json dict alone, following each
family's published definition (Qwen2: biases on q/k/v; Qwen3: RMSNorm of each query/key head
before RoPE; Llama 3.1: RoPE frequencies rescaled by wavelength). It shares no code with
rlcode.models, so a wrong layout, transpose or formula in the loader shows up as a mismatch.
"""

from __future__ import annotations

import json
import math
import os

import ml_dtypes
import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

FAMILIES = ("qwen2", "qwen3", "llama")


def tiny_config(family: str, **overrides) -> dict:
    """A config.json dict of `family` at a test size (GQA 4/2, head_dim 8, 2 layers)."""
    base = {
        "vocab_size": 97, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
        "initializer_range": 0.02, "use_cache": True, "transformers_version": "4.51.0",
    }
    if family == "qwen2":
        base.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2", rope_theta=1000000.0, rope_scaling=None,
                    tie_word_embeddings=True, use_sliding_window=False, sliding_window=4096, max_window_layers=2,
                    attention_dropout=0.0)
    elif family == "qwen3":
        base.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=16, rope_theta=1000000.0,
                    rope_scaling=None, tie_word_embeddings=False, use_sliding_window=False, sliding_window=None,
                    max_window_layers=2, attention_bias=False, attention_dropout=0.0)
    elif family == "llama":
        base.update(architectures=["LlamaForCausalLM"], model_type="llama", head_dim=8, rope_theta=10000.0,
                    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                    tie_word_embeddings=False, attention_bias=False, mlp_bias=False, pretraining_tp=1,
                    attention_dropout=0.0)
    else:
        raise ValueError(family)
    base.update(overrides)
    return base


def _head_dim(cfg: dict) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def random_tensors(cfg: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Every tensor of the family, float64, named as the family stores them."""
    rng = np.random.default_rng(seed)
    D, F, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    N, K, H = cfg["num_attention_heads"], cfg["num_key_value_heads"], _head_dim(cfg)
    family = cfg["model_type"]
    w = lambda *shape: rng.normal(0.0, 1.0 / math.sqrt(shape[-1]), size=shape)
    norm = lambda n: 1.0 + 0.1 * rng.normal(size=n)
    out = {"model.embed_tokens.weight": rng.normal(0.0, 1.0, size=(V, D)), "model.norm.weight": norm(D)}
    if not cfg["tie_word_embeddings"]:
        out["lm_head.weight"] = w(V, D)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({
            p + "input_layernorm.weight": norm(D), p + "post_attention_layernorm.weight": norm(D),
            p + "self_attn.q_proj.weight": w(N * H, D), p + "self_attn.k_proj.weight": w(K * H, D),
            p + "self_attn.v_proj.weight": w(K * H, D), p + "self_attn.o_proj.weight": w(D, N * H),
            p + "mlp.gate_proj.weight": w(F, D), p + "mlp.up_proj.weight": w(F, D), p + "mlp.down_proj.weight": w(D, F),
        })
        if family == "qwen2":
            out.update({p + f"self_attn.{x}_proj.bias": 0.5 * rng.normal(size=n * H) for x, n in (("q", N), ("k", K), ("v", K))})
        if family == "qwen3":
            out.update({p + f"self_attn.{x}_norm.weight": norm(H) for x in "qk"})
    return out


def _write_safetensors(path: str, tensors: dict[str, np.ndarray]) -> None:
    """The file format written out by hand (header length, JSON header, raw little-endian data)."""
    names = sorted(tensors)
    dtype_names = {np.dtype("<f4"): "F32", np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype("<f8"): "F64"}
    header, offset = {}, 0
    for name in names:
        a = tensors[name]
        header[name] = {"dtype": dtype_names[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for name in names:
            f.write(np.ascontiguousarray(tensors[name]).tobytes())


def write_checkpoint(path, family: str, *, seed: int = 0, dtype: str = "float32", shards: int = 1,
                     extra_tensors: dict | None = None, **config_overrides) -> tuple[dict, dict[str, np.ndarray]]:
    """Write a tiny checkpoint of `family` to directory `path`; returns (config, tensors) where
    tensors are the stored values as float64 (after rounding to `dtype`)."""
    os.makedirs(path, exist_ok=True)
    cfg = tiny_config(family, **config_overrides)
    cfg["torch_dtype"] = dtype
    np_dtype = {"float32": np.dtype("<f4"), "bfloat16": np.dtype(ml_dtypes.bfloat16)}[dtype]
    stored = {k: v.astype(np_dtype) for k, v in random_tensors(cfg, seed).items()}
    stored.update(extra_tensors or {})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    names = sorted(stored)
    if shards == 1:
        _write_safetensors(os.path.join(path, "model.safetensors"), stored)
    else:
        weight_map = {}
        for s in range(shards):
            part = names[s::shards]
            file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            _write_safetensors(os.path.join(path, file), {n: stored[n] for n in part})
            weight_map.update({n: file for n in part})
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return cfg, {k: np.asarray(v, np.float64) for k, v in stored.items()}


def _rms_norm(x, weight, eps):
    return weight * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def _inv_freq(cfg: dict) -> np.ndarray:
    H = _head_dim(cfg)
    inv = np.array([cfg["rope_theta"] ** (-(2.0 * i) / H) for i in range(H // 2)])
    scaling = cfg.get("rope_scaling")
    if not scaling:
        return inv
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(f)
        elif wavelen > old / low:
            out.append(f / factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return np.array(out)


def _rope(x_tnh, positions, inv_freq):
    angles = positions[:, None] * inv_freq[None, :]  # [T, H/2]
    emb = np.concatenate([angles, angles], axis=-1)  # [T, H]
    cos, sin = np.cos(emb)[:, None, :], np.sin(emb)[:, None, :]
    half = x_tnh.shape[-1] // 2
    rotated = np.concatenate([-x_tnh[..., half:], x_tnh[..., :half]], axis=-1)
    return x_tnh * cos + rotated * sin


def numpy_forward(cfg: dict, t: dict[str, np.ndarray], tokens) -> np.ndarray:
    """float64 logits [T, V] of one sequence of token ids (positions 0..T-1, causal)."""
    tokens = np.asarray(tokens)
    T = len(tokens)
    N, K, H, eps = cfg["num_attention_heads"], cfg["num_key_value_heads"], _head_dim(cfg), cfg["rms_norm_eps"]
    family = cfg["model_type"]
    positions = np.arange(T, dtype=np.float64)
    inv_freq = _inv_freq(cfg)
    h = t["model.embed_tokens.weight"][tokens]
    causal = np.tril(np.ones((T, T), bool))
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = _rms_norm(h, t[p + "input_layernorm.weight"], eps)
        q, k, v = (x @ t[p + f"self_attn.{n}_proj.weight"].T for n in "qkv")
        if family == "qwen2":
            q, k, v = (a + t[p + f"self_attn.{n}_proj.bias"] for a, n in zip((q, k, v), "qkv"))
        q, k, v = q.reshape(T, N, H), k.reshape(T, K, H), v.reshape(T, K, H)
        if family == "qwen3":
            q = _rms_norm(q, t[p + "self_attn.q_norm.weight"], eps)
            k = _rms_norm(k, t[p + "self_attn.k_norm.weight"], eps)
        q, k = _rope(q, positions, inv_freq), _rope(k, positions, inv_freq)
        heads = []
        for n in range(N):
            kv = n // (N // K)
            scores = q[:, n] @ k[:, kv].T / math.sqrt(H)
            scores = np.where(causal, scores, -np.inf)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            heads.append(probs @ v[:, kv])
        h = h + np.concatenate(heads, axis=-1) @ t[p + "self_attn.o_proj.weight"].T
        x = _rms_norm(h, t[p + "post_attention_layernorm.weight"], eps)
        gate, up = x @ t[p + "mlp.gate_proj.weight"].T, x @ t[p + "mlp.up_proj.weight"].T
        h = h + (gate / (1 + np.exp(-gate)) * up) @ t[p + "mlp.down_proj.weight"].T
    h = _rms_norm(h, t["model.norm.weight"], eps)
    head = t["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else t["lm_head.weight"]
    return h @ head.T


# ---- tokenizers: a small trained BPE with each family's special tokens and a chat template in
# the family's format (written for these tests, not the released files).

CORPUS = ["def add(a, b):\n    return a + b\n", "Hello, how are you? Fine.", "read the file src/app.py please",
          '{"name": "read", "arguments": {"path": "a.py"}}', "système: café ✓", "print(1)\n"] * 30

# Templates in the two formats, written for these tests (not the released files).
QWEN_STYLE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

Call functions with <tool_call>{"name": ..., "arguments": ...}</tool_call>. Available:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}{% continue %}{% endif %}
{%- if message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{% generation %}{{ message.content }}
{%- if message.tool_calls %}{% for call in message.tool_calls %}{% set fn = call.function %}
<tool_call>
{"name": "{{ fn.name }}", "arguments": {{ fn.arguments | tojson }}}
</tool_call>{% endfor %}{% endif %}<|im_end|>{% endgeneration %}

{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA_STYLE = """{{- bos_token }}
{%- if messages and messages[0].role == 'system' %}{%- set system = messages[0].content %}{%- set rest = messages[1:] %}
{%- else %}{%- set system = '' %}{%- set rest = messages %}{%- endif %}
<|start_header_id|>system<|end_header_id|>

{% if tools %}Environment: ipython
Answer a call as one JSON object {"name": function name, "parameters": arguments}.

{% for t in tools %}{{ t | tojson(indent=4) }}

{% endfor %}{% endif %}{{ system }}<|eot_id|>
{%- for message in rest %}
{%- if message.role == 'assistant' and message.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

{% set fn = message.tool_calls[0].function %}{"name": "{{ fn.name }}", "parameters": {{ fn.arguments | tojson }}}<|eot_id|>
{%- elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content | trim }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

TOKENIZERS = {
    "qwen": dict(specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"],
                 config={"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                         "chat_template": QWEN_STYLE},
                 generation_eos=None),
    "llama": dict(specials=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                            "<|eot_id|>", "<|python_tag|>"],
                  config={"bos_token": "<|begin_of_text|>", "eos_token": {"content": "<|end_of_text|>", "special": True},
                          "chat_template": LLAMA_STYLE},
                  generation_eos=["<|end_of_text|>", "<|eot_id|>"]),
}



def write_tokenizer(path, name: str) -> tokenizers.Tokenizer:
    """Train the tiny BPE of tokenizer family `name` ("qwen" or "llama") and write
    tokenizer.json, tokenizer_config.json (and generation_config.json) into directory `path`."""
    spec = TOKENIZERS[name]
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=spec["specials"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(spec["config"], f)
    if spec["generation_eos"]:
        with open(os.path.join(path, "generation_config.json"), "w") as f:
            json.dump({"eos_token_id": [tok.token_to_id(s) for s in spec["generation_eos"]]}, f)
    return tok
