"""Mixture-of-experts feed-forward layer (`model.mlp.kind = "moe"`), REFERENCE section 10.

Each token x_n (the B*T tokens flattened, N = B*T) is routed to k of E SwiGLU experts and gets

    y_n = sum_{j < k} gate_nj * Expert_{e_nj}(x_n)  +  Shared(x_n)

Expert_e(x) = W_down_e (silu(x W_gate_e) * (x W_up_e)) with W_gate_e, W_up_e [D, F], W_down_e
[F, D] (F = expert_ffw_dim); Shared is a dense SwiGLU of width num_shared_experts * F, always
applied (the sum of that many shared experts, DeepSeekMoE). Shapes: B batch, T time, N tokens,
D model, E experts, F expert ffw, C capacity, k = top_k.

Router (float32, REFERENCE section 9: routers stay in high precision), logits z = x W_r [N, E]:

* "softmax" (Switch Transformer, Fedus et al. 2021; GShard, Lepikhin et al. 2020): p =
  softmax(z), the k largest p are selected, gate = p (renormalised over the selected when
  `renormalize`).
* "sigmoid" with aux-loss-free balancing (DeepSeek-V3, 2024): s = sigmoid(z); selection on s + b,
  gate = s normalised over the selected (always). b [E] is not trained: it is a `RouterBias`
  variable that the train step moves after each step (`rebalance_routers`, each layer by its own
  load), b_i <- b_i - gamma * sign(load_i - mean load), gamma = bias_update_rate.

Auxiliary outputs (the `aux` dict, which the model sums over layers):

* "moe_aux_loss" = aux_loss_coef * E * sum_i f_i P_i (Switch load balancing), f_i = fraction of
  the N*k routed assignments (before capacity drops) that chose expert i, P_i = mean over tokens
  of the router probability of i (softmax p; for sigmoid the scores normalised over the experts,
  s / sum_j s_j). Equals aux_loss_coef when routing is uniform. Computed over the global batch
  (under expert parallelism the per-shard sums are all-reduced).
* "moe_z_loss" = z_loss_coef * mean_n (logsumexp z_n)^2 (ST-MoE router z-loss, Zoph et al. 2022).
* metrics: "moe_load" [E] = f, "moe_dropped_frac" = fraction of assignments dropped by capacity,
  and for the sigmoid router "moe_bias_abs_mean" = mean |b|. Summed over layers like the losses
  (divide by the number of MoE layers for a per-layer mean).

The losses are already multiplied by their coefficients; the train step adds every aux entry
whose name ends in "_loss" to the objective. The layer sees no padding mask, so padding tokens are
routed and counted like any other token.

Dispatch (`dispatch`):

* "dropless" (MegaBlocks, Gale et al. 2022): the N*k (token, choice) assignments are sorted by
  expert (stable argsort), their rows gathered, the three expert GEMMs run as grouped GEMMs
  (`kernels.moe_gemm.grouped_matmul`, `jax.lax.ragged_dot` on XLA), then unsorted, weighted by
  the gates and summed over the k choices.
* "capacity" (GShard / Switch): C = ceil(k * N / E * capacity_factor) slots per expert (capped at
  N, the most one expert can receive). Priority: the assignments of an expert are ranked in token
  order (token 0 first; one token sends at most one assignment to a given expert, so the choice
  index never ties); this is the position from a cumsum over the flattened (token, choice)
  assignment order, computed here as the rank after a stable sort by expert. Assignments at
  position >= C are dropped: gate 0, the token contributes nothing here and passes through the
  residual. Kept rows are scattered into [E, C, D] buffers, the experts run as batched matmuls
  and the outputs are gathered back (no one-hot dispatch einsum).

Precision (`precision`): "bf16" runs the expert GEMMs in model.dtype with float32 accumulation;
"mxfp8" runs each of the three expert GEMMs (and the shared experts') through the MXFP8 emulation
of `kernels.moe_gemm` (REFERENCE section 9). The router is float32 either way. `impl` chooses the
grouped-GEMM face ("auto" | "xla" | "triton").

Expert parallelism: on a model placed (`rlcode.sharding.place`) on a mesh whose "expert" axis has size
n_ep > 1, the routed part runs in `jax.shard_map`. Tokens are split over the batch mesh axes and
the expert axis (N padded to a multiple of the shard count; padding is masked out of routing,
capacity and statistics); expert weights are split over "expert" (E_loc = E / n_ep experts per
shard, contiguous). Each shard routes its N_loc tokens, fills capacity-padded send buffers
[E, C, D] = [n_ep, E_loc, C, D], `all_to_all`s them to the shards owning the experts, runs its
local experts on [E_loc, n_ep * C, D], `all_to_all`s the results back and combines. Capacity is
per (source shard, expert): C = ceil(k * N_loc / E * capacity_factor), i.e. capacity mode under
EP equals the unsharded layer applied to each shard's tokens separately. `ragged_all_to_all` is
not implemented on XLA:CPU, so dropless mode under EP uses the worst-case C = N_loc (a token
sends at most one assignment to an expert): exact, no drops, E / k times the memory of a perfectly
balanced exchange.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from kernels.moe_gemm import grouped_matmul
from rlcode.models.layers import fan_in_init, make_param

MOE_OPTIONS: dict[str, Any] = {
    "num_experts": 8,
    "top_k": 2,
    "expert_ffw_dim": 64,
    "num_shared_experts": 0,
    "router": "softmax",
    "renormalize": True,
    "aux_loss_coef": 1e-2,
    "z_loss_coef": 1e-3,
    "bias_update_rate": 1e-3,
    "dispatch": "dropless",
    "capacity_factor": 1.25,
    "precision": "bf16",
    "impl": "auto",
}


def moe_config(**overrides: Any) -> dict[str, Any]:
    """The `model.mlp` section of an MoE with every option present, e.g. moe_config(top_k=1)."""
    unknown = set(overrides) - set(MOE_OPTIONS)
    if unknown:
        raise ValueError(f"mlp kind 'moe' has no option(s) {sorted(unknown)}; it has {sorted(MOE_OPTIONS)}")
    return {"kind": "moe", **MOE_OPTIONS, **overrides}


@dataclasses.dataclass(frozen=True)
class MoEOptions:
    """Validated `model.mlp` options of an MoE layer (see the module docstring)."""

    num_experts: int
    top_k: int
    expert_ffw_dim: int
    num_shared_experts: int
    router: str
    renormalize: bool
    aux_loss_coef: float
    z_loss_coef: float
    bias_update_rate: float
    dispatch: str
    capacity_factor: float
    precision: str
    impl: str

    @classmethod
    def from_config(cls, mlp: Any) -> "MoEOptions":
        values = dict(mlp)
        values.pop("kind", None)
        unknown = set(values) - set(MOE_OPTIONS)
        if unknown:
            raise ValueError(f"mlp kind 'moe' has no option(s) {sorted(unknown)}; it has {sorted(MOE_OPTIONS)}")
        out = cls(**{**MOE_OPTIONS, **values})
        if out.num_experts < 1 or out.expert_ffw_dim < 1 or out.num_shared_experts < 0:
            raise ValueError(f"moe sizes must be positive: {out}")
        if not 1 <= out.top_k <= out.num_experts:
            raise ValueError(f"mlp.top_k={out.top_k} must be in [1, num_experts={out.num_experts}]")
        for name, allowed in (("router", ("softmax", "sigmoid")), ("dispatch", ("dropless", "capacity")),
                              ("precision", ("bf16", "mxfp8")), ("impl", ("auto", "xla", "triton"))):
            if getattr(out, name) not in allowed:
                raise ValueError(f"mlp.{name}={getattr(out, name)!r} is not one of {allowed}")
        if out.capacity_factor <= 0:
            raise ValueError(f"mlp.capacity_factor must be > 0, got {out.capacity_factor}")
        return out


def capacity(num_tokens: int, opts: MoEOptions) -> int:
    """C = ceil(k * N / E * capacity_factor) (REFERENCE section 10), capped at N."""
    c = math.ceil(opts.top_k * num_tokens / opts.num_experts * opts.capacity_factor)
    return max(1, min(c, num_tokens))


class RouterBias(nnx.Variable):
    """The selection bias b [E] of the sigmoid router (DeepSeek-V3): state, not a trained param.

    It receives no gradient (it only shifts the top-k selection); the train step moves it
    (`rebalance_routers`), and `update_router_bias` does the same outside a train step."""


# ---------------------------------------------------------------------------------------------
# Routing and dispatch as pure functions of arrays (shared by the local and expert-parallel paths)
# ---------------------------------------------------------------------------------------------


class Routing(NamedTuple):
    """idx [N, k] int32 chosen experts; gate [N, k] float32; probs [N, E] float32 (the P of the
    load-balancing loss); lse [N] float32 logsumexp of the logits (z-loss)."""

    idx: jax.Array
    gate: jax.Array
    probs: jax.Array
    lse: jax.Array


def route(x_nd: jax.Array, router_de: jax.Array, bias_e: jax.Array | None, opts: MoEOptions) -> Routing:
    """Top-k routing in float32 (softmax or sigmoid with selection bias; module docstring)."""
    z = jnp.einsum("nd,de->ne", x_nd.astype(jnp.float32), router_de.astype(jnp.float32))
    lse = jax.nn.logsumexp(z, axis=-1)
    k = opts.top_k
    if opts.router == "softmax":
        probs = jnp.exp(z - lse[:, None])
        gate, idx = jax.lax.top_k(probs, k)
        if opts.renormalize:
            gate = gate / jnp.sum(gate, axis=-1, keepdims=True)
        return Routing(idx.astype(jnp.int32), gate, probs, lse)
    s = jax.nn.sigmoid(z)
    # The bias only shifts which experts are selected; the weights come from s alone.
    _, idx = jax.lax.top_k(s + jax.lax.stop_gradient(bias_e.astype(jnp.float32)), k)
    chosen = jnp.take_along_axis(s, idx, axis=-1)
    gate = chosen / jnp.sum(chosen, axis=-1, keepdims=True)
    probs = s / jnp.sum(s, axis=-1, keepdims=True)
    return Routing(idx.astype(jnp.int32), gate, probs, lse)


def routing_sums(r: Routing, num_experts: int, valid_n: jax.Array | None = None) -> dict[str, jax.Array]:
    """Sums over (valid) tokens from which the global aux terms follow: assignment counts [E],
    router probability sums [E], sum of lse^2 and the token count (all float32)."""
    w = jnp.ones(r.lse.shape, jnp.float32) if valid_n is None else valid_n.astype(jnp.float32)
    counts = jnp.zeros((num_experts,), jnp.float32).at[r.idx].add(jnp.broadcast_to(w[:, None], r.idx.shape))
    return {
        "counts": counts,
        "prob_sum": jnp.einsum("ne,n->e", r.probs, w),
        "z2_sum": jnp.sum(w * r.lse * r.lse),
        "tokens": jnp.sum(w),
    }


def aux_outputs(sums: dict[str, jax.Array], dropped: jax.Array, opts: MoEOptions, bias_e: jax.Array | None):
    """The aux dict from (globally reduced) routing sums and the dropped-assignment count."""
    E, k = opts.num_experts, opts.top_k
    n = jnp.maximum(sums["tokens"], 1.0)
    f = sums["counts"] / (n * k)
    p = sums["prob_sum"] / n
    aux = {
        "moe_aux_loss": opts.aux_loss_coef * E * jnp.sum(f * p),
        "moe_z_loss": opts.z_loss_coef * sums["z2_sum"] / n,
        "moe_load": jax.lax.stop_gradient(f),
        "moe_dropped_frac": jax.lax.stop_gradient(dropped / (n * k)),
    }
    if bias_e is not None:
        aux["moe_bias_abs_mean"] = jnp.mean(jnp.abs(jax.lax.stop_gradient(bias_e)))
    return aux


def assignment_slots(idx_nk: jax.Array, num_experts: int, cap: int, valid_n: jax.Array | None = None):
    """Capacity slots of the N*k assignments (flattened token-major).

    Returns (dest [N*k] int32, kept [N*k] bool): assignment j goes to row dest[j] = e * C + pos of
    the [E * C + 1] dispatch buffer, where pos is its rank among the assignments of expert e in
    token order; dropped (pos >= C) and invalid (padding) assignments go to the spare row E * C.
    """
    N, k = idx_nk.shape
    E = num_experts
    flat_e = idx_nk.reshape(N * k)
    if valid_n is not None:
        # Padding rows sort after every expert (group E) so they take no expert's slots.
        flat_e = jnp.where(jnp.repeat(valid_n, k), flat_e, E)
    order = jnp.argsort(flat_e, stable=True)
    counts = jnp.zeros((E + 1,), jnp.int32).at[flat_e].add(1)
    starts = jnp.cumsum(counts) - counts
    sorted_e = flat_e[order]
    pos = jnp.zeros((N * k,), jnp.int32).at[order].set(jnp.arange(N * k, dtype=jnp.int32) - starts[sorted_e])
    kept = (pos < cap) & (flat_e < E)
    dest = jnp.where(kept, flat_e * cap + pos, E * cap)
    return dest.astype(jnp.int32), kept


def dispatch(x_nd: jax.Array, dest: jax.Array, k: int, num_experts: int, cap: int) -> jax.Array:
    """Scatter each kept assignment's token row into its slot: [E, C, D] (empty slots are 0)."""
    D = x_nd.shape[-1]
    buf = jnp.zeros((num_experts * cap + 1, D), x_nd.dtype).at[dest].add(jnp.repeat(x_nd, k, axis=0))
    return buf[:-1].reshape(num_experts, cap, D)


def combine(out_ecd: jax.Array, dest: jax.Array, gate_nk: jax.Array) -> jax.Array:
    """y [N, D] float32 = sum_k gate * (expert output of the assignment's slot; 0 if dropped)."""
    E, C, D = out_ecd.shape
    N, k = gate_nk.shape
    rows = jnp.concatenate([out_ecd.reshape(E * C, D), jnp.zeros((1, D), out_ecd.dtype)])
    y_nkd = rows[dest].reshape(N, k, D).astype(jnp.float32)
    return jnp.einsum("nk,nkd->nd", gate_nk, y_nkd)


class ExpertWeights(NamedTuple):
    """w_gate, w_up [E, D, F]; w_down [E, F, D] (already in the compute dtype)."""

    w_gate: jax.Array
    w_up: jax.Array
    w_down: jax.Array


def _matmul(x_md, w_edf, group_sizes, opts):
    return grouped_matmul(x_md, w_edf, group_sizes, precision=opts.precision, impl=opts.impl)


def experts_grouped(x_md: jax.Array, w: ExpertWeights, group_sizes: jax.Array, opts: MoEOptions) -> jax.Array:
    """SwiGLU of each row under its group's expert: rows sorted by expert, [M, D] -> [M, D]."""
    h = jax.nn.silu(_matmul(x_md, w.w_gate, group_sizes, opts)) * _matmul(x_md, w.w_up, group_sizes, opts)
    return _matmul(h, w.w_down, group_sizes, opts)


def experts_batched(x_ecd: jax.Array, w: ExpertWeights, opts: MoEOptions) -> jax.Array:
    """SwiGLU of every expert on its own [C, D] buffer: [E, C, D] -> [E, C, D]."""
    E, C, D = x_ecd.shape
    if opts.precision == "bf16":
        mm = lambda a, b: jnp.einsum("ecd,edf->ecf", a, b, preferred_element_type=jnp.float32).astype(a.dtype)
        return mm(jax.nn.silu(mm(x_ecd, w.w_gate)) * mm(x_ecd, w.w_up), w.w_down)
    # MX scales need the grouped GEMM's per-GEMM quantisation; equal groups of C rows.
    sizes = jnp.full((E,), C, jnp.int32)
    return experts_grouped(x_ecd.reshape(E * C, D), w, sizes, opts).reshape(E, C, D)


def routed_dropless(x_nd: jax.Array, r: Routing, w: ExpertWeights, opts: MoEOptions) -> jax.Array:
    """Sort the assignments by expert, grouped GEMMs, unsort, gate, sum over k: [N, D] float32."""
    N, k = r.idx.shape
    flat_e = r.idx.reshape(N * k)
    order = jnp.argsort(flat_e, stable=True)
    group_sizes = jnp.zeros((opts.num_experts,), jnp.int32).at[flat_e].add(1)
    y_sorted = experts_grouped(x_nd[order // k], w, group_sizes, opts)
    inverse = jnp.zeros((N * k,), jnp.int32).at[order].set(jnp.arange(N * k, dtype=jnp.int32))
    y_nkd = y_sorted[inverse].reshape(N, k, -1).astype(jnp.float32)
    return jnp.einsum("nk,nkd->nd", r.gate, y_nkd)


# ---------------------------------------------------------------------------------------------
# The layer
# ---------------------------------------------------------------------------------------------


class MoE(nnx.Module):
    """Routed SwiGLU experts plus optional shared experts; `moe(x_btd) -> (y_btd, aux)`.

    Parameters: router_w [D, E] float32 ("embed", None); w_gate, w_up [E, D, F] ("expert",
    "embed", "mlp"); w_down [E, F, D] ("expert", "mlp", "embed"); shared_w_gate, shared_w_up
    [D, S*F] and shared_w_down [S*F, D] when num_shared_experts S > 0; router_bias [E]
    (`RouterBias`, sigmoid router only). Options: `MoEOptions` / module docstring.
    """

    def __init__(self, cfg: Any, *, rngs: nnx.Rngs):
        self.placement = None  # where activations are pinned: set by rlcode.sharding.place
        self.opts = MoEOptions.from_config(cfg.mlp)
        o = self.opts
        D, E, F, pd = cfg.d_model, o.num_experts, o.expert_ffw_dim, cfg.param_dtype
        self.dtype = cfg.dtype
        self.router_w = make_param(rngs, fan_in_init((0,)), (D, E), ("embed", None), jnp.float32)
        self.w_gate = make_param(rngs, fan_in_init((1,)), (E, D, F), ("expert", "embed", "mlp"), pd)
        self.w_up = make_param(rngs, fan_in_init((1,)), (E, D, F), ("expert", "embed", "mlp"), pd)
        self.w_down = make_param(rngs, fan_in_init((1,)), (E, F, D), ("expert", "mlp", "embed"), pd)
        if o.num_shared_experts:
            S = o.num_shared_experts * F
            self.shared_w_gate = make_param(rngs, fan_in_init((0,)), (D, S), ("embed", "mlp"), pd)
            self.shared_w_up = make_param(rngs, fan_in_init((0,)), (D, S), ("embed", "mlp"), pd)
            self.shared_w_down = make_param(rngs, fan_in_init((0,)), (S, D), ("mlp", "embed"), pd)
        # One assignment: nnx fixes an attribute as data (Variable) or static (None) when first set.
        bias = RouterBias(jnp.zeros((E,), jnp.float32), logical_axes=(None,)) if o.router == "sigmoid" else None
        self.router_bias = bias

    def _bias(self) -> jax.Array | None:
        return None if self.router_bias is None else self.router_bias[...]

    def _expert_weights(self) -> ExpertWeights:
        dt = self.dtype
        return ExpertWeights(self.w_gate[...].astype(dt), self.w_up[...].astype(dt), self.w_down[...].astype(dt))

    def __call__(self, x_btd: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        if x_btd.ndim != 3:
            raise ValueError(f"MoE input must be [B, T, D], got shape {x_btd.shape}")
        B, T, D = x_btd.shape
        x_nd = x_btd.astype(self.dtype).reshape(B * T, D)
        p = self.placement
        if p is not None and p.mesh.shape.get("expert", 1) > 1:
            y_nd, aux = self._expert_parallel(x_nd, p.mesh, p.rules)
        else:
            y_nd, aux = self._local(x_nd)
        if self.opts.num_shared_experts:
            y_nd = y_nd + self._shared(x_nd).astype(jnp.float32)
        return y_nd.astype(self.dtype).reshape(B, T, D), aux

    def _local(self, x_nd):
        o, N = self.opts, x_nd.shape[0]
        bias = self._bias()
        r = route(x_nd, self.router_w[...], bias, o)
        w = self._expert_weights()
        if o.dispatch == "dropless":
            y = routed_dropless(x_nd, r, w, o)
            dropped = jnp.zeros((), jnp.float32)
        else:
            cap = capacity(N, o)
            dest, kept = assignment_slots(r.idx, o.num_experts, cap)
            out = experts_batched(dispatch(x_nd, dest, o.top_k, o.num_experts, cap), w, o)
            y = combine(out, dest, r.gate)
            dropped = jnp.sum(~kept).astype(jnp.float32)
        return y, aux_outputs(routing_sums(r, o.num_experts), dropped, o, bias)

    def _shared(self, x_nd):
        dt, o = self.dtype, self.opts
        wg, wu, wd = (getattr(self, f"shared_w_{n}")[...].astype(dt) for n in ("gate", "up", "down"))
        if o.precision == "bf16":
            mm = lambda a, b: jnp.einsum("nd,df->nf", a, b, preferred_element_type=jnp.float32).astype(dt)
        else:
            # One group holding every token: the dense GEMM through the same MX emulation.
            mm = lambda a, b: _matmul(a, b[None], jnp.full((1,), a.shape[0], jnp.int32), o)
        return mm(jax.nn.silu(mm(x_nd, wg)) * mm(x_nd, wu), wd)

    def _expert_parallel(self, x_nd, mesh, rules):
        o = self.opts
        E, k = o.num_experts, o.top_k
        n_ep = mesh.shape["expert"]
        if E % n_ep:
            raise ValueError(f"num_experts={E} is not divisible by the mesh's expert axis ({n_ep})")
        e_loc = E // n_ep
        batch_axes = [a for a in dict(rules).get("batch", ()) if a != "expert" and mesh.shape[a] > 1]
        token_axes = tuple(batch_axes) + ("expert",)
        shards = math.prod(mesh.shape[a] for a in token_axes)
        N, D = x_nd.shape
        n_pad = -N % shards
        valid = jnp.arange(N + n_pad) < N
        x_pad = jnp.pad(x_nd, ((0, n_pad), (0, 0)))
        n_loc = (N + n_pad) // shards
        cap = n_loc if o.dispatch == "dropless" else capacity(n_loc, o)
        bias = self._bias()
        bias_in = jnp.zeros((E,), jnp.float32) if bias is None else bias

        def body(x, valid_n, router, b, wg, wu, wd):
            r = route(x, router, None if bias is None else b, o)
            dest, kept = assignment_slots(r.idx, E, cap, valid_n)
            dropped = jnp.sum(jnp.repeat(valid_n, k) & ~kept).astype(jnp.float32)
            sums, dropped = jax.lax.psum((routing_sums(r, E, valid_n), dropped), token_axes)
            # [E, C, D] = [n_ep, E_loc, C, D]: block j goes to the shard owning experts j*E_loc...
            send = dispatch(x, dest, k, E, cap)
            recv = jax.lax.all_to_all(send, "expert", 0, 0, tiled=True)
            h = recv.reshape(n_ep, e_loc, cap, D).swapaxes(0, 1).reshape(e_loc, n_ep * cap, D)
            out = experts_batched(h, ExpertWeights(wg, wu, wd), o)
            back = out.reshape(e_loc, n_ep, cap, D).swapaxes(0, 1).reshape(E, cap, D)
            out_ecd = jax.lax.all_to_all(back, "expert", 0, 0, tiled=True)
            return combine(out_ecd, dest, r.gate), sums, dropped

        tok = P(token_axes)
        fn = jax.shard_map(
            body, mesh=mesh,
            in_specs=(tok, tok, P(), P(), P("expert"), P("expert"), P("expert")),
            out_specs=(tok, P(), P()),
        )
        y, sums, dropped = fn(x_pad, valid, self.router_w[...], bias_in, *self._expert_weights())
        return y[:N], aux_outputs(sums, dropped, o, bias)


# ---------------------------------------------------------------------------------------------
# Aux-loss-free balancing (DeepSeek-V3)
# ---------------------------------------------------------------------------------------------


def router_bias_update(bias_e: jax.Array, load_e: jax.Array, rate: float) -> jax.Array:
    """b_i <- b_i - rate * sign(load_i - mean load) (DeepSeek-V3 aux-loss-free balancing)."""
    load_e = jnp.asarray(load_e, jnp.float32)
    return bias_e - rate * jnp.sign(load_e - jnp.mean(load_e))


def _load_for(load: Any, path: tuple) -> jax.Array:
    if isinstance(load, Mapping):
        return load[path]
    return load


def update_router_bias(model_or_params: Any, load: Any, rate: float | None = None) -> Any:
    """Move every sigmoid router's selection bias against its load, outside a train step (the
    train step itself uses `rebalance_routers`).

    model_or_params: an nnx model (updated in place and returned) or a pure-dict parameter tree
    such as `TrainState.params` (a new tree is returned). load: expert load fractions [E] (the "moe_load" aux entry) applied to every router,
    or a mapping from a layer's path (tuple of keys to the MoE module) to its [E] load. The model's
    aux sums "moe_load" over layers, so a single [E] load balances the layer-summed load; pass
    per-layer loads for the exact per-layer rule. rate: gamma; defaults to each layer's
    bias_update_rate (required for parameter trees, which carry no config).
    """
    if isinstance(model_or_params, nnx.Module):
        for path, node in nnx.iter_graph(model_or_params):
            if isinstance(node, MoE) and node.router_bias is not None:
                gamma = node.opts.bias_update_rate if rate is None else rate
                node.router_bias[...] = router_bias_update(node.router_bias[...], _load_for(load, tuple(path)), gamma)
        return model_or_params
    if rate is None:
        raise ValueError("update_router_bias on a parameter tree needs the rate (gamma)")

    def walk(tree, path):
        if not isinstance(tree, Mapping):
            return tree
        out = {key: walk(value, path + (key,)) for key, value in tree.items()}
        if "router_bias" in tree and tree["router_bias"] is not None:
            out["router_bias"] = router_bias_update(tree["router_bias"], _load_for(load, path), rate)
        return out

    return walk(model_or_params, ())


def rebalance_routers(graphdef: nnx.GraphDef, old_params: Any, new_params: Any, metrics: Mapping[str, Any]) -> Any:
    """The train step's router-bias update (DeepSeek-V3 aux-loss-free balancing), per layer.

    For every sigmoid router of the model (`graphdef`), block i's bias becomes
    `router_bias_update(old bias, metrics["aux_moe_load_layer<i>"], bias_update_rate)`: its own
    layer's load from this step's forward, and whatever the optimizer did to the bias (it has no
    gradient, but decoupled weight decay would shrink it) is discarded. Returns new_params
    (pure dict) with the biases replaced; unchanged when the model has no sigmoid router.
    """
    out = None
    for path, node in nnx.iter_graph(nnx.merge(graphdef, old_params)):
        if not isinstance(node, MoE) or node.router_bias is None:
            continue
        layer = next((p for p in path if isinstance(p, str) and p.startswith("block_")), None)
        key = f"aux_moe_load_layer{layer.split('_')[1]}" if layer else "aux_moe_load"
        if key not in metrics:
            raise KeyError(f"router bias update needs {key!r} in the step metrics")
        if out is None:
            out = jax.tree.map(lambda x: x, new_params)
        old, new = old_params, out
        for p in path:
            old, new = old[p], new[p]
        new["router_bias"] = router_bias_update(old["router_bias"], metrics[key], node.opts.bias_update_rate)
    return new_params if out is None else out
