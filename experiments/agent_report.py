"""Report of agent RL runs (configs/agent_repo.py): learning curves, prefill accounting, and the
prefill cost of each sampler replayed on the same recorded episodes.

    python -m experiments.agent_report --runs runs/agent_repo/seed0 --publish   # results/agent_repo.json
    python -m experiments.agent_report --config configs/agent_repo.py --expert 4,8 --out runs/replay.json

Reads only what the runs logged (`tb/metrics.jsonl`, `summary.json`, `config.json` and
`episodes.jsonl`, the turns the sampler was asked to generate at every `log.record_every`-th
step) and writes runs/agent_repo/agent_repo.json (`--out`; results/agent_repo.json with `--publish`):

* ``curves``: {tag: [[step, value], ...]} of the first run for eval_fresh/success, eval/success,
  rollout/success, the tool outcomes of each (read_ok, edit_ok, tool_errors), the prefill token
  counts per step of the three samplers, the saved fraction, step/sample/prefill seconds;
  ``summary``: start (SFT) and end of every run's success and eval_fresh tool outcomes (edit-hint
  follow-ups and copies included), per-family success and pass@k with the change, RL minutes, mean prefill tokens per step by sampler.
* ``replay``: the recorded turns of the first run prefilled again by
  `rlcode.session_sampling.replay_prefill` in each mode – ``documents`` (squid, each distinct read file encoded once and
  its KV reused across the group's episodes and turns), ``incremental`` (a dense sampler with a
  per-episode KV cache: every new token prefilled, files included) and ``full`` (the whole
  context prefilled every turn) – with the same model shape, after a warm-up pass that compiles
  every shape, in round-robin rounds (medians). Prefill time does not depend on the weights, so
  the replay uses the config's freshly initialised model. ``replay.whole_cache`` times the same
  prefills with samplers that read every slot of the cache (``bounded=False``) instead of the
  span the contexts hold, alternating with them: ``bounded_speedup`` per mode.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence

import ml_collections
import numpy as np
from flax import nnx

from experiments.cli import PUBLISH_HELP, output_paths, summary
from rlcode.models.transformer import init_model
from rlcode.tokenizer import ByteTokenizer
from rlcode.envs import harness
from rlcode.envs.tasks import repo as repo_tasks
from rlcode.sandbox import fstree
from rlcode.session_sampling import PREFILL_MODES, replay_prefill, turns_from_segments
from rlcode.train.agent import build_tasks
from rlcode.train.episodes import episode_kwargs
from rlcode.train.metrics import read_json_lines, read_jsonl

# The published reports (experiments.figures draws each): the byte-level policy's run, the runs
# from the pretrained code base with the compact expert, and the default job (the recovering expert).
REPORT_NAMES = ("agent_repo", "agent_repo_code", "agent_recover")

# The tool outcomes (read_ok, edit_ok: share of episodes with a read / edit that succeeded;
# tool_errors per episode) show whether a policy names real files long before any success.
TOOL_TAGS = ("read_ok", "edit_ok", "tool_errors", "hint_follow_ups", "hint_copies")
CURVE_TAGS = ("eval_fresh/success", "eval/success", "eval_fresh/pass@1", "eval/pass@1", "rollout/success",
              *(f"{p}/{t}" for p in ("eval_fresh", "eval", "rollout") for t in TOOL_TAGS),
              "rollout/reward", "rollout/turns", "rollout/malformed_calls", "prefill/tokens_full",
              "prefill/tokens_incremental", "prefill/tokens_documents", "prefill/saved_vs_incremental",
              "prefill/saved_vs_full", "prefill/seconds", "decode/seconds", "time/step_s", "time/sample_s",
              "time/train_s", "time/rl_minutes", "train/is_ess", "train/kl_ref")
# Also kept: each task family's fresh-task success and pass@k for every k the runs logged.
CURVE_PREFIXES = ("eval_fresh/success_", "eval_fresh/pass@")


def _kept(tag: str) -> bool:
    return tag in CURVE_TAGS or tag.startswith(CURVE_PREFIXES)


def curves(run_dir: str) -> dict[str, list[list[float]]]:
    out: dict[str, list[list[float]]] = {}
    for rec in read_jsonl(os.path.join(run_dir, "tb")):
        for tag, value in rec.items():
            if _kept(tag) and value is not None:
                out.setdefault(tag, []).append([int(rec["step"]), float(value)])
    return out


def parse_steps(text: str | None) -> tuple[int, int] | None:
    """--mean_steps: "N" (steps 1..N) or "A-B" (steps A..B) -> (first, last); None: every step."""
    if text is None:
        return None
    first, _, last = text.rpartition("-") if "-" in text else ("1", "", text)
    if not (first.isdigit() and last.isdigit()) or not 1 <= int(first) <= int(last):
        raise argparse.ArgumentTypeError(f"--mean_steps takes N or A-B with 1 <= A <= B, got {text!r}")
    return int(first), int(last)


def run_summary(run_dir: str, c: dict, mean_steps: tuple[int, int] | None = None) -> dict:
    """Start, end, change and best of the evaluations; per-step means of the prefill counts and
    times over every step, or over the steps first..last of `mean_steps` (two runs compared on
    the same steps)."""
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    out = {"run": run_dir, "completed": summary["completed"], "steps": summary["steps_done"],
           "minutes_total": summary["seconds"] / 60}
    per_step = {tag: [v for step, v in c.get(tag, []) if mean_steps is None or mean_steps[0] <= step <= mean_steps[1]]
                for tag in CURVE_TAGS}
    out["mean_over_steps"] = len(per_step["time/sample_s"])
    evaluated = ("eval_fresh/success", "eval/success", *(f"eval_fresh/{t}" for t in TOOL_TAGS),
                 *sorted(t for t in c if t.startswith(CURVE_PREFIXES)))
    for tag in evaluated:
        if c.get(tag):
            start, end = c[tag][0][1], c[tag][-1][1]
            out[tag] = {"start": start, "end": end, "change": end - start, "best": max(v for _, v in c[tag])}
    if c.get("time/rl_minutes"):
        out["rl_minutes"] = c["time/rl_minutes"][-1][1]
    for mode in ("full", "incremental", "documents"):
        vals = per_step[f"prefill/tokens_{mode}"]
        if vals:
            out[f"prefill_tokens_per_step_{mode}"] = float(np.mean(vals))
    for tag in ("rollout/success", "time/step_s", "time/sample_s", "prefill/seconds", "decode/seconds"):
        vals = per_step[tag]
        if vals:
            out[f"mean_{tag.replace('/', '_')}"] = float(np.mean(vals))
    return out


def expert_record(cfg, num_tasks: int, group: int, pool) -> list[dict]:
    """Recorded turns of batches of the scripted expert: each batch is `num_tasks` train tasks x
    `group` episodes (the expert's episodes of one task are identical, as a group's episodes are
    wherever they read the same files)."""
    tok = ByteTokenizer()
    tasks = build_tasks(cfg, sets=("train",), num_train=num_tasks)["train"]
    kwargs = episode_kwargs(cfg)
    segments = []
    for task in tasks:
        turns = repo_tasks.expert_turns(task, cfg.agent.expert_style)
        traj = harness.run_episode(task, harness.ScriptedPolicy(tok, turns), pool, tok,
                                   **dict(kwargs, max_turns=len(turns)))
        try:
            segments += [traj.segments[0]] * group
        finally:
            fstree.remove(traj.workdir)  # the episode's tree may be deeper than rmtree can recurse
    return [{"step": "expert", "turns": [{str(r): v for r, v in call.items()} for call in turns_from_segments(segments)]}]


def run_config(run_dir: str) -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(json.load(open(os.path.join(run_dir, "config.json"))))


def replay(run_dir: str | None, rounds: int, max_turn_sets: int | None, recorded: list[dict] | None = None,
           cfg: ml_collections.ConfigDict | None = None, warmup: bool = True) -> dict:
    """Replay `recorded` turns (default: the run's episodes.jsonl) with the model shape and agent
    settings of `cfg` (default: the run's config.json). Without `warmup` the timed rounds include
    the compilations (a check of the token counts, not a measurement)."""
    cfg = run_config(run_dir) if cfg is None else cfg
    if recorded is None:
        recorded = read_json_lines(os.path.join(run_dir, "episodes.jsonl"))
    if max_turn_sets:
        recorded = recorded[:max_turn_sets]
    turns = [t for rec in recorded for t in rec["turns"]]
    if not turns:
        raise ValueError(f"{run_dir}/episodes.jsonl holds no recorded turns (log.record_every = 0?)")
    model = init_model(cfg.model, 0)
    graphdef, params = nnx.split(model)
    tok = ByteTokenizer()
    rows = max(int(r) for t in turns for r in t) + 1
    kwargs = dict(max_context=cfg.agent.max_context_tokens, rows=rows)
    # Episodes of one recorded step start from empty caches; replay each step's turns separately.
    steps = [rec["turns"] for rec in recorded]

    def one_pass(mode, bounded=True):
        t0, stats = time.perf_counter(), None
        for step_turns in steps:
            s = replay_prefill(graphdef, params, tok, step_turns, mode=mode, bounded=bounded, **kwargs)
            stats = s if stats is None else stats + s
        return time.perf_counter() - t0, stats

    out = {}
    whole = {}  # the same prefills reading every cache slot instead of the span the contexts hold
    for mode in PREFILL_MODES:  # warm-up: compiles every shape of the mode
        out[mode] = {"warmup_s": one_pass(mode)[0] if warmup else None, "times_s": []}
        whole[mode] = {"warmup_s": one_pass(mode, bounded=False)[0] if warmup else None, "times_s": []}
    for _ in range(rounds):
        for mode in PREFILL_MODES:
            for record, bounded in ((out, True), (whole, False)):
                seconds, stats = one_pass(mode, bounded)
                record[mode]["times_s"].append(seconds)
                record[mode]["tokens"] = int(stats["tokens_prefilled"] + stats["tokens_documents_encoded"])
    for mode in PREFILL_MODES:
        out[mode]["seconds"] = statistics.median(out[mode]["times_s"])
        whole[mode]["seconds"] = statistics.median(whole[mode]["times_s"])
        whole[mode]["bounded_speedup"] = whole[mode]["seconds"] / out[mode]["seconds"]
    out["whole_cache"] = whole
    out["recorded_steps"] = [rec["step"] for rec in recorded]
    out["turns"] = len(turns)
    out["episodes_per_step"] = rows
    for base in ("incremental", "full"):
        out[f"speedup_vs_{base}"] = out[base]["seconds"] / out["documents"]["seconds"]
        out[f"tokens_saved_vs_{base}"] = 1 - out["documents"]["tokens"] / out[base]["tokens"]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=summary(__doc__))
    p.add_argument("--runs", default="", help="comma-separated run directories (the first is replayed)")
    p.add_argument("--config", default=None, help="instead of --runs: an agent config file whose scripted expert "
                   "is replayed (--expert), with no run")
    p.add_argument("--out", default=None, help="JSON path (default runs/agent_repo/agent_repo.json)")
    p.add_argument("--publish", action="store_true", help=PUBLISH_HELP.replace("<name>", "<--name>"))
    p.add_argument("--name", default="agent_repo", choices=REPORT_NAMES,
                   help="the report's name: runs/<name>/<name>.json, or results/<name>.json with --publish "
                        "(agent_repo: the byte-level policy's runs; agent_repo_code: the pretrained base's with "
                        "the compact expert; agent_recover: the default job, its expert recovering from a refused "
                        "edit)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no_warmup", action="store_true", help="no untimed pass first: the times include compilation "
                   "(to check the token counts quickly)")
    p.add_argument("--max_turn_sets", type=int, default=None, help="replay only the first N recorded steps")
    p.add_argument("--no_replay", action="store_true")
    p.add_argument("--mean_steps", type=parse_steps, default=None, help="N or A-B: per-step means (prefill "
                   "tokens, sampling and step seconds) over steps 1..N or A..B of every run, e.g. to compare a "
                   "run with --config.agent.prefill=incremental against the same seed's run on the steps both "
                   "made (after the first steps' compilations)")
    p.add_argument("--expert", default="", help="P,G: also replay batches of the scripted expert on P train "
                   "tasks x G episodes each (episodes that read the right files)")
    a = p.parse_args(argv)
    runs = [r for r in a.runs.split(",") if r]
    if bool(runs) == bool(a.config):
        p.error("give --runs or --config")
    if a.config and not a.expert:
        p.error("--config replays the scripted expert only: add --expert P,G")
    out, _ = output_paths(a.name, False, a.out, None, a.publish)  # the figure: experiments.figures
    data = {"command": "python -m experiments.agent_report " + " ".join(argv if argv is not None else sys.argv[1:])}
    if runs:
        per_run = [curves(r) for r in runs]
        data.update(runs=runs, curves=per_run[0],
                    summary=[run_summary(r, c, a.mean_steps) for r, c in zip(runs, per_run)])
        cfg = run_config(runs[0])
    else:
        from experiments.ablate import load_config_module  # noqa: PLC0415

        cfg = load_config_module(a.config).get_config()
        data.update(runs=[], curves={}, summary=[])
    data["config"] = {k: v for k, v in cfg.to_dict().items() if k in ("task", "agent", "rollout", "train")}
    if runs and not a.no_replay:
        data["replay"] = replay(runs[0], a.rounds, a.max_turn_sets, warmup=not a.no_warmup)
    if a.expert:
        from rlcode.train.engine import default_pool  # noqa: PLC0415

        P, G = (int(x) for x in a.expert.split(","))
        pool = default_pool(cfg.sandbox.workers, cfg.sandbox.timeout)
        try:
            recorded = expert_record(cfg, P, G, pool)
        finally:
            pool.close()
        data["replay_expert"] = replay(None, a.rounds, None, recorded, cfg=cfg, warmup=not a.no_warmup)
        data["replay_expert"]["tasks"], data["replay_expert"]["group"] = P, G
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(data, f, indent=1)
    for s in data["summary"]:
        print(json.dumps(s))
    for name in ("replay", "replay_expert"):
        if name not in data:
            continue
        r = data[name]
        print(f"{name} of {r['turns']} turns ({len(r['recorded_steps'])} steps x {r['episodes_per_step']} episodes):")
        print("| sampler | prefill tokens | seconds (median) | reading the whole cache | speed-up |")
        print("|---|---|---|---|---|")
        for mode in PREFILL_MODES:
            w = r["whole_cache"][mode]
            print(f"| {mode} | {r[mode]['tokens']} | {r[mode]['seconds']:.2f} | {w['seconds']:.2f} | "
                  f"{w['bounded_speedup']:.2f}x |")
        print(f"documents vs incremental: {r['speedup_vs_incremental']:.2f}x faster, "
              f"{100 * r['tokens_saved_vs_incremental']:.1f}% fewer tokens; vs full: {r['speedup_vs_full']:.2f}x, "
              f"{100 * r['tokens_saved_vs_full']:.1f}% fewer")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
