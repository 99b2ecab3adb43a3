"""Peak memory of a training job estimated from its config, checked before anything runs.

A config whose batch cannot fit (``rollout.group_size=100000``) otherwise fails late: after the
SFT warm start, as an out-of-memory abort inside XLA. `check` compares the estimate of
`estimate_synth` / `estimate_agent` with the host's physical memory (or its cgroup limit, when
lower) or, on accelerators, with the summed memory jax reports for the devices (a necessary
condition however the mesh splits the arrays), and raises a `ConfigError` with the estimate and
the field to reduce.

The estimate adds up the large buffers of the job's phases (shapes: B rows, T tokens, L layers,
D model, N heads, K kv heads, H head dim, F ffw width, V vocabulary; b bytes per activation
element (model.dtype), 4 for float32 scores):

* ``state``: parameters (counted exactly with `nnx.eval_shape`, no memory allocated), their
  gradients and AdamW's two moments (4 x the parameter bytes), plus the reference copy when
  ``loss.kl_coef > 0`` and the sampler's published copy in async mode.
* ``sampler``: the KV cache, 2 x L x B x S x K x H x b (S the cached length; NSA without
  shared K/V keeps three sets), plus the prompt prefill's activations and scores and the
  decode step's logits. The synthesis sampler caches each prompt once per group
  (P x Lp) and each row's generated tokens (P x G x M); its evaluation batches
  (eval.prompts_per_batch x eval.num_samples rows) are counted the same way and the larger
  wins. The agent's session cache holds every row's whole context (agent.max_context_tokens +
  512 slots), twice (the cache and the rows gathered for an update).
* ``train``: the train step on one micro-batch keeps, per token and layer, the activations the
  backward pass reads, b x (6D + 4NH + 4KH + 6F) (the MoE counts its k routed copies), plus
  the attention scores 3 x 4 x N x T per token for dense attention (the XLA path forms
  [B, N, T, T] logits, probabilities and their gradient; squid's blockwise kernel keeps only
  the log-sum-exp, NSA the scores of its selected keys); plus one chunk of logits
  (1024 x V x 4, three buffers). The old and reference log-probs are a forward pass over the
  whole batch, one layer alive at a time (two buffers of scores); the larger of the two counts.
  The coefficients match XLA's own memory analysis of the compiled train step on CPU to within
  about 10% (dense and squid attention, 16 and 64 rows x 272 tokens, 8 rows x 1024 tokens).
* ``sft``: the warm start's train step (sft.batch_size / sft.microbatches rows).
* pretraining (`estimate_pretrain`): ``state``, the train step on data.rows_per_step /
  train.microbatches packed rows, and the held-out forward over data.eval_batch rows.

Peak = state + the largest phase (sync), or state + sampler + train (async sampling runs
while the trainer updates). The runtime's own memory, the host-side rollouts and fragmentation
are not counted, and the agent's batch is taken as one segment per episode: a config the check
accepts may still be tight, one it refuses needs more memory than the machine has.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from typing import Any

from rlcode.checks import ConfigError

F32 = 4
LOGPROB_CHUNK = 1024  # rows per chunk of `rlcode.models.logprobs.token_logprobs` (its default)
SESSION_SLACK = 512  # slots past the context the agent's session cache keeps (`SessionSampler`)
MODEL_FIELDS = ("reduce model.d_model", "model.num_layers", "model.ffw_dim")
SFT_FIELDS = ("reduce sft.batch_size", "raise sft.microbatches")


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Bytes per part ("state", "sampler", "train", "sft"), the peak, and for each part what
    shrinks it ("reduce <field>" first, then more fields) and the shapes it was computed for."""

    parts: dict[str, int]
    peak: int
    reduce: dict[str, tuple[str, ...]]
    shapes: dict[str, str]

    def largest(self) -> str:
        return max(self.parts, key=self.parts.get)

    def describe(self) -> str:
        return ", ".join(f"{name} {format_bytes(n)}" + (f" ({self.shapes[name]})" if name in self.shapes else "")
                         for name, n in self.parts.items())


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


# ------------------------------------------------------------------------------ model pieces


def param_bytes(model: Any) -> int:
    """Bytes of the model's parameters and state, from shapes only (nnx.eval_shape)."""
    import jax  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415

    from rlcode.models.transformer import init_model  # noqa: PLC0415

    abstract = nnx.state(nnx.eval_shape(lambda: init_model(model, 0)))
    return int(sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(abstract)))


def _dtype_bytes(model: Any) -> int:
    import numpy as np  # noqa: PLC0415

    from rlcode.models.transformer import DTYPES  # noqa: PLC0415

    return np.dtype(DTYPES[model.dtype]).itemsize


def _dims(model: Any) -> dict[str, int]:
    return {k: int(model[k]) for k in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads",
                                       "head_dim", "ffw_dim")}


def _attention(model: Any) -> dict[str, Any]:
    from rlcode.models.attention import ATTENTION_OPTIONS  # noqa: PLC0415

    kind = model.attention["kind"]
    return {"kind": kind, **ATTENTION_OPTIONS.get(kind, {}), **dict(model.attention)}


def _kv_sets(model: Any) -> int:
    """Key/value sets a layer caches: three for NSA with its own compression and window K/V."""
    a = _attention(model)
    return 3 if a["kind"] == "nsa" and not a["shared_kv"] else 1


def activation_bytes_per_token(model: Any) -> int:
    """Bytes a layer keeps per token for the backward pass (module docstring), without scores."""
    d = _dims(model)
    b = _dtype_bytes(model)
    D, N, K, H, F = d["d_model"], d["num_heads"], d["num_kv_heads"], d["head_dim"], d["ffw_dim"]
    mlp = dict(model.mlp)
    if mlp.get("kind") == "moe":
        from rlcode.models.moe import MOE_OPTIONS  # noqa: PLC0415

        o = {**MOE_OPTIONS, **mlp}
        k, Fe = int(o["top_k"]), int(o["expert_ffw_dim"])
        # k routed copies of the token and their expert activations, the shared experts, and
        # the float32 router logits and probabilities.
        shared = int(o["num_shared_experts"]) * Fe
        mlp_bytes = b * (2 * k * D + 6 * k * Fe + 6 * shared) + F32 * 2 * int(o["num_experts"])
    else:
        mlp_bytes = b * 6 * F
    return b * (6 * D + 4 * N * H + 4 * K * H) + mlp_bytes


def score_bytes_per_token(model: Any, T: int, buffers: int = 3) -> int:
    """Attention scores per token and layer for a sequence of T tokens: `buffers` float32 copies
    of a query's row of scores (logits, probabilities, and in the backward pass their gradient)."""
    a = _attention(model)
    N = int(model.num_heads)
    if a["kind"] == "dense":
        return buffers * F32 * N * T
    if a["kind"] == "nsa":
        seen = min(T, int(a["num_select"]) * int(a["select_size"]) + int(a["window"]) + T // int(a["stride"]))
        return buffers * F32 * N * seen
    return 2 * F32 * N  # squid: blockwise (log-sum-exp and running maximum)


def train_step_bytes(model: Any, rows: int, T: int) -> int:
    """One micro-batch of `rows` x T tokens through the train step (module docstring)."""
    d = _dims(model)
    b = _dtype_bytes(model)
    layer = activation_bytes_per_token(model) + score_bytes_per_token(model, T)
    per_token = d["num_layers"] * layer + 2 * b * d["d_model"]
    logits = 3 * F32 * min(LOGPROB_CHUNK, rows * T) * d["vocab_size"]
    return rows * T * per_token + logits


def forward_bytes(model: Any, rows: int, T: int) -> int:
    """A forward pass (old / reference log-probs) over `rows` x T tokens: one layer alive."""
    d = _dims(model)
    b = _dtype_bytes(model)
    per_token = activation_bytes_per_token(model) + score_bytes_per_token(model, T, 2) + 2 * b * d["d_model"]
    return rows * T * per_token + 3 * F32 * min(LOGPROB_CHUNK, rows * T) * d["vocab_size"]


def kv_cache_bytes(model: Any, rows: int, length: int) -> int:
    """Keys and values of `rows` sequences of `length` tokens in every layer."""
    d = _dims(model)
    b = _dtype_bytes(model)
    return 2 * d["num_layers"] * rows * length * d["num_kv_heads"] * d["head_dim"] * b * _kv_sets(model)


def sampler_bytes(model: Any, prompts: int, group: int, prompt_len: int, new_tokens: int) -> int:
    """`rlcode.sampling.sample` of `group` completions of `new_tokens` for `prompts` prompts of
    `prompt_len` tokens: shared prompt cache, per-row cache, the prefill forward, decode logits."""
    d = _dims(model)
    rows = prompts * group
    return (kv_cache_bytes(model, prompts, prompt_len) + kv_cache_bytes(model, rows, new_tokens)
            + forward_bytes(model, prompts, prompt_len) + 3 * F32 * rows * d["vocab_size"])


# ------------------------------------------------------------------------------ the jobs


def _peak(parts: dict[str, int], concurrent: bool) -> int:
    phases = [parts[p] for p in parts if p != "state"]
    return parts["state"] + (sum(phases) if concurrent else max(phases, default=0))


def _state(cfg: Any, copies: int) -> int:
    return param_bytes(cfg.model) * copies


def estimate_synth(cfg: Any) -> Estimate:
    """The synthesis job (`rlcode.train.loop`) of `cfg`."""
    m = cfg.model
    P, G = int(cfg.rollout.prompts_per_step), int(cfg.rollout.group_size)
    Lp, M = int(cfg.task.max_prompt_len), int(cfg.sampling.max_new_tokens)
    T = Lp + M
    Ep, En = int(cfg.eval.prompts_per_batch), int(cfg.eval.num_samples)
    train_rows = P * G // max(int(cfg.train.minibatches) * int(cfg.train.microbatches), 1)
    copies = 4 + (cfg.loss.kl_coef > 0) + bool(cfg.rollout.async_mode)
    train_sampler = sampler_bytes(m, P, G, Lp, M)
    eval_sampler = sampler_bytes(m, Ep, En, Lp, M)
    parts = {"state": _state(cfg, copies), "sampler": max(train_sampler, eval_sampler),
             "train": max(train_step_bytes(m, max(train_rows, 1), T), forward_bytes(m, P * G, T))}
    sft_rows = max(int(cfg.sft.batch_size) // max(int(cfg.sft.microbatches), 1), 1)
    if cfg.sft.steps > 0:
        parts["sft"] = train_step_bytes(m, sft_rows, T)
    sampler_fields = (("reduce rollout.group_size", "rollout.prompts_per_step", "sampling.max_new_tokens")
                      if train_sampler >= eval_sampler else
                      ("reduce eval.num_samples", "eval.prompts_per_batch", "sampling.max_new_tokens"))
    train_fields = ("reduce rollout.group_size", "raise train.microbatches", "reduce rollout.prompts_per_step",
                    "sampling.max_new_tokens")
    reduce = {"state": MODEL_FIELDS, "sampler": sampler_fields, "train": train_fields, "sft": SFT_FIELDS}
    shapes = {"sampler": f"{max(P * G, Ep * En)} rows x {T} tokens", "train": f"{P * G} rows x {T} tokens, "
              f"{max(train_rows, 1)} per micro-batch", "sft": f"{sft_rows} rows x {T} tokens"}
    return Estimate(parts, _peak(parts, bool(cfg.rollout.async_mode)), reduce, shapes)


def estimate_pretrain(cfg: Any) -> Estimate:
    """The pretraining job (`rlcode.train.pretrain`) of `cfg`: the train step on one micro-batch
    of packed rows, or the held-out forward over ``data.eval_batch`` rows."""
    m, T = cfg.model, int(cfg.data.seq_len)
    rows = max(int(cfg.data.rows_per_step) // max(int(cfg.train.microbatches), 1), 1)
    E = int(cfg.data.eval_batch)
    parts = {"state": _state(cfg, 4), "train": train_step_bytes(m, rows, T), "eval": forward_bytes(m, E, T)}
    reduce = {"state": MODEL_FIELDS, "train": ("reduce data.rows_per_step", "raise train.microbatches", "data.seq_len"),
              "eval": ("reduce data.eval_batch", "data.seq_len")}
    shapes = {"train": f"{rows} rows x {T} tokens per micro-batch", "eval": f"{E} rows x {T} tokens"}
    return Estimate(parts, _peak(parts, False), reduce, shapes)


def estimate_agent(cfg: Any, row_multiple: int = 8) -> Estimate:
    """The agent job (`rlcode.train.agent`) of `cfg`; the train batch is taken as one segment per
    episode (a summarised episode adds one row per segment)."""
    m = cfg.model
    P, G = int(cfg.rollout.prompts_per_step), int(cfg.rollout.group_size)
    C = int(cfg.agent.max_context_tokens)
    rows = max(P * G, int(cfg.eval.batch_rows)) + 1
    T = -(-C // 512) * 512
    batch = -(-P * G // row_multiple) * row_multiple
    micro = max(batch // max(int(cfg.train.microbatches), 1), 1)
    copies = 4 + (cfg.loss.kl_coef > 0)
    d = _dims(m)
    decode = 3 * F32 * rows * d["vocab_size"]
    parts = {"state": _state(cfg, copies), "sampler": 2 * kv_cache_bytes(m, rows, C + SESSION_SLACK) + decode,
             "train": max(train_step_bytes(m, micro, T), forward_bytes(m, batch, T))}
    sft_rows = max(int(cfg.sft.batch_size) // max(int(cfg.sft.microbatches), 1), 1)
    if cfg.sft.steps > 0:
        parts["sft"] = train_step_bytes(m, sft_rows, -(-C // 64) * 64)
    reduce = {"state": MODEL_FIELDS,
              "sampler": ("reduce rollout.group_size", "agent.max_context_tokens", "eval.batch_rows"),
              "train": ("reduce rollout.group_size", "raise train.microbatches", "reduce agent.max_context_tokens"),
              "sft": SFT_FIELDS}
    shapes = {"sampler": f"{rows} rows x {C + SESSION_SLACK} slots", "train": f"{batch} rows x {T} tokens, "
              f"{micro} per micro-batch", "sft": f"{sft_rows} rows x {-(-C // 64) * 64} tokens"}
    return Estimate(parts, _peak(parts, False), reduce, shapes)


# ------------------------------------------------------------------------------ limits


def host_memory() -> int | None:
    """Physical memory of the host in bytes, or the cgroup's memory limit when that is lower."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = None
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                limit = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit > 0 and (total is None or limit < total):
            total = limit
    return total


def device_memory(devices: Sequence[Any]) -> int | None:
    """The summed memory limit of `devices` where jax reports one for every device (accelerators),
    else None (CPU devices share the host's memory)."""
    limits = []
    for device in devices:
        try:
            stats = device.memory_stats()
        except Exception:  # noqa: BLE001 (a backend without memory statistics)
            stats = None
        if not stats or not stats.get("bytes_limit"):
            return None
        limits.append(int(stats["bytes_limit"]))
    return sum(limits) if limits else None


def limits(devices: Sequence[Any] | None = None) -> list[tuple[str, int]]:
    """[(what, bytes)] the estimate must fit: the devices' memory where jax reports it (the
    arrays live there), else the host's (CPU devices are host memory)."""
    dev = device_memory(devices) if devices else None
    if dev:
        return [(f"the memory of the {len(devices)} {devices[0].platform} device(s)", dev)]
    host = host_memory()
    return [("the host's physical memory", host)] if host else []


def check(estimate: Estimate, budget: Sequence[tuple[str, int]]) -> None:
    """Raise ConfigError when the estimated peak exceeds one of the budgets, naming the part that
    dominates and the fields that shrink it."""
    for what, available in budget:
        if estimate.peak > available:
            part = estimate.largest()
            fields = estimate.reduce.get(part, ("reduce the batch",))
            hint = fields[0] + (f" (or {', '.join(fields[1:])})" if len(fields) > 1 else "")
            raise ConfigError(f"estimated peak memory {format_bytes(estimate.peak)} exceeds {what} "
                              f"({format_bytes(available)}): {hint}; estimate: {estimate.describe()}")
