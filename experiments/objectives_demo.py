"""Objectives demo: train a tabular policy on the sequence bandit with any published recipe.

    python -m experiments.objectives_demo --config=configs/objectives_demo.py:dapo

Exercises the whole objectives library the way a trainer does: G samples per prompt, group or GAE
advantages, several epochs of mini-batch updates (so ratios leave 1 and clipping acts), gradient
accumulation over micro-batches with the (numerator, denominator) contract, an optional
reference-KL term, DAPO dynamic sampling and overlong shaping, and stale sampling parameters
corrected with TIS/MIS. Prints a table while it runs and writes `metrics.jsonl` (one line per
logged step, flushed as it goes) and `summary.json` into `--config.workdir`.
"""

from __future__ import annotations

import collections
import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import app
from ml_collections import config_flags

from rlcode import advantages as adv_lib
from rlcode import losses
from rlcode.envs import sequence_bandit as bandit
from rlcode.recipes import ShapingConfig

_CONFIG = config_flags.DEFINE_config_file("config", "configs/objectives_demo.py", "Experiment config.")

COLUMNS = ("step", "reward", "greedy", "exact", "len", "clip_lo", "clip_hi", "kl_old", "is_ess", "eta_s")


def _uses_values(cfg: ml_collections.ConfigDict) -> bool:
    return cfg.advantage.estimator == "gae" or cfg.loss.value_coef > 0


def _make_update(objective: losses.ObjectiveConfig, optimizer: optax.GradientTransformation):
    def terms_fn(params, mb):
        logits = params["logits"][mb["prompt"]]
        logp = losses.logprobs_from_logits(logits, mb["tokens"])
        return losses.objective_terms(
            objective,
            logp,
            mb["old_logp"],
            mb["adv"],
            mb["mask"],
            behavior_logp=mb.get("beh_logp"),
            ref_logp=mb.get("ref_logp"),
            entropy=losses.entropy_from_logits(logits),
            values=params["value"][mb["prompt"]] if "value" in params else None,
            old_values=mb.get("old_values"),
            returns=mb.get("returns"),
        )

    @jax.jit
    def update(params, opt_state, microbatches):
        _, grads, metrics = losses.accumulate_gradients(terms_fn, params, microbatches)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, metrics

    return update


def _draw_batch(cfg, targets, sampler_params, rollout, rng, key):
    """Sample prompts x G completions; with dynamic sampling keep only informative groups."""
    P, G = cfg.rollout.prompts_per_step, cfg.rollout.group_size
    draws = cfg.rollout.max_draws if cfg.shaping.dynamic_sampling else 1
    kept: list[dict[str, np.ndarray]] = []
    spare: list[dict[str, np.ndarray]] = []
    for _ in range(draws):
        key, sub = jax.random.split(key)
        prompts = np.repeat(rng.choice(targets.shape[0], size=P, replace=False), G)
        out = jax.device_get(rollout(sampler_params, jnp.asarray(prompts), sub))
        groups = [{k: v[g * G : (g + 1) * G] for k, v in dict(prompt=prompts, **out).items()} for g in range(P)]
        for grp in groups:
            informative = grp["reward"].max() > grp["reward"].min()
            (kept if informative or not cfg.shaping.dynamic_sampling else spare).append(grp)
        if len(kept) >= P:
            break
    valid_groups = len(kept)
    # Too few informative groups after max_draws: pad with degenerate ones masked out of the loss.
    kept = (kept + spare)[:P]
    batch = {k: np.concatenate([g[k] for g in kept]) for k in kept[0]}
    batch["valid"] = np.repeat(np.arange(P) < min(valid_groups, P), G)
    return batch, key


def run(cfg: ml_collections.ConfigDict, verbose: bool = True) -> list[dict[str, Any]]:
    """Train and return the logged history (a list of metric dicts, one per logged step)."""
    # The sections the library reads, converted once into their frozen, validated dataclasses.
    objective = losses.ObjectiveConfig.from_config(cfg.loss)
    advantage = adv_lib.AdvantageConfig.from_config(cfg.advantage)
    shaping = ShapingConfig.from_config(cfg.shaping)
    P, G = cfg.rollout.prompts_per_step, cfg.rollout.group_size
    B = P * G
    n_mini, n_micro = cfg.train.minibatches, cfg.train.microbatches
    if B % (n_mini * n_micro):
        raise ValueError(f"prompts_per_step*group_size={B} must divide into minibatches*microbatches={n_mini * n_micro}")
    if cfg.rollout.prompts_per_step > cfg.task.num_prompts:
        raise ValueError("rollout.prompts_per_step must be <= task.num_prompts")
    T = cfg.task.max_len
    targets = bandit.make_targets(cfg.seed, cfg.task.num_prompts, T, cfg.task.vocab)
    targets_j = jnp.asarray(targets)
    rng = np.random.default_rng(cfg.seed)
    key = jax.random.key(cfg.seed)

    params = {"logits": jnp.zeros((cfg.task.num_prompts, T, cfg.task.vocab), jnp.float32)}
    if _uses_values(cfg):
        params["value"] = jnp.zeros((cfg.task.num_prompts, T), jnp.float32)
    ref_logits = params["logits"]
    optimizer = optax.adam(cfg.train.lr)
    opt_state = optimizer.init(params)
    update = _make_update(objective, optimizer)
    use_behavior = cfg.train.staleness > 0 or cfg.loss.is_mode != "none"

    @jax.jit
    def rollout(p, prompts, k):
        tokens, logp, mask = bandit.sample(k, p["logits"][prompts])
        return {"tokens": tokens, "beh_logp": logp, "mask": mask, "reward": bandit.rewards(tokens, targets_j[prompts])}

    @jax.jit
    def prepare(p, batch):
        """Old-policy log-probs, reference log-probs, shaped rewards, advantages."""
        prompts, tokens = batch["prompt"], batch["tokens"]
        mask = batch["mask"] & batch["valid"][:, None]
        old_logp = losses.logprobs_from_logits(p["logits"][prompts], tokens)
        ref_logp = losses.logprobs_from_logits(ref_logits[prompts], tokens)
        reward = batch["reward"]
        if shaping.overlong_cache_length > 0:
            reward = reward + adv_lib.overlong_penalty(mask.sum(-1), T, shaping.overlong_cache_length)
        if objective.kl_coef > 0 and objective.kl_penalty == "reward":
            reward = losses.kl_reward_penalty(reward, batch["beh_logp"], ref_logp, mask, objective.kl_coef)
        old_values = p["value"][prompts] if "value" in p else None
        adv, returns = adv_lib.compute_advantages(advantage, reward, mask, G, values=old_values, valid=batch["valid"])
        out = {"prompt": prompts, "tokens": tokens, "mask": mask, "old_logp": old_logp, "adv": adv}
        if use_behavior:
            out["beh_logp"] = batch["beh_logp"]
        if objective.kl_coef > 0 and objective.kl_penalty == "loss":
            out["ref_logp"] = ref_logp
        if returns is not None:
            out["old_values"], out["returns"] = old_values, returns
        return out

    @jax.jit
    def greedy_reward(p):
        tokens = jnp.argmax(p["logits"], axis=-1)
        return bandit.rewards(tokens, targets_j).mean()

    os.makedirs(cfg.workdir, exist_ok=True)
    history: list[dict[str, Any]] = []
    past_params = collections.deque([params], maxlen=cfg.train.staleness + 1)
    start = time.time()
    if verbose:
        print(f"objective={cfg.objective} loss.kind={cfg.loss.kind} agg={cfg.loss.agg} "
              f"advantage={cfg.advantage.estimator}/{cfg.advantage.normalize} is_mode={cfg.loss.is_mode}")
        print(" ".join(f"{c:>8}" for c in COLUMNS))
    interrupted = False
    with open(os.path.join(cfg.workdir, "metrics.jsonl"), "w") as log:
        try:
            for step in range(1, cfg.train.steps + 1):
                batch, key = _draw_batch(cfg, targets, past_params[0], rollout, rng, key)
                prepared = prepare(params, {k: jnp.asarray(v) for k, v in batch.items()})
                step_metrics = []
                for _ in range(cfg.train.epochs):
                    perm = rng.permutation(B)
                    for chunk in np.split(perm, n_mini):
                        mbs = jax.tree.map(lambda x: x[chunk].reshape(n_micro, -1, *x.shape[1:]), prepared)
                        params, opt_state, metrics = update(params, opt_state, mbs)
                        step_metrics.append(metrics)
                past_params.append(params)
                if step % cfg.train.log_every and step != cfg.train.steps:
                    continue
                metrics = {k: float(np.mean([jax.device_get(m[k]) for m in step_metrics])) for k in step_metrics[0]}
                # Sample statistics over every drawn row, informative for the loss or not.
                row = {
                    "step": step,
                    "reward": float(batch["reward"].mean()),
                    "greedy": float(greedy_reward(params)),
                    "exact": float((batch["reward"] == 1.0).mean()),
                    "len": float(batch["mask"].sum(-1).mean()),
                    "informative_groups": float(batch["valid"].mean()),
                    "wall_s": time.time() - start,
                    **metrics,
                }
                history.append(row)
                log.write(json.dumps(row) + "\n")
                log.flush()
                if verbose:
                    eta = (time.time() - start) / step * (cfg.train.steps - step)
                    cells = [step, row["reward"], row["greedy"], row["exact"], row["len"],
                             metrics["clip_frac_low"], metrics["clip_frac_high"], metrics["approx_kl"],
                             metrics.get("is_ess_frac", float("nan")), eta]
                    print(" ".join(f"{c:>8d}" if isinstance(c, int) else f"{c:>8.3f}" for c in cells), flush=True)
        except KeyboardInterrupt:
            interrupted = True
            print("interrupted: the metrics logged so far are in", cfg.workdir)
    summary = {
        "objective": cfg.objective,
        "config": cfg.to_dict(),
        "interrupted": interrupted,
        "steps_done": history[-1]["step"] if history else 0,
        "initial_greedy_reward": float(greedy_reward({"logits": ref_logits})),
        "final_greedy_reward": history[-1]["greedy"] if history else float("nan"),
        "wall_s": time.time() - start,
    }
    with open(os.path.join(cfg.workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2, default=str)
    if verbose:
        print(f"greedy reward {summary['initial_greedy_reward']:.3f} -> {summary['final_greedy_reward']:.3f} "
              f"in {summary['wall_s']:.1f}s; logs in {cfg.workdir}")
    return history


def main(argv):
    del argv
    run(_CONFIG.value)


if __name__ == "__main__":
    app.run(main)
