"""Evaluate a policy on a completion-task source: pass@k, per difficulty, with sample transcripts.

    python -m experiments.evaluate --run runs/grpo_synth --tasks synth
    python -m experiments.evaluate --hf path/to/checkpoint --tasks humaneval --prompt chat --samples 10 --k 1,5,10

The policy is a run's checkpoint (``--run``: its config.json, tokenizer and latest checkpoint, or
``--step``, or ``--warm_start``: the SFT warm start the run began RL from) or a Hugging Face
checkpoint directory (``--hf``, `rlcode.models.hf.load_checkpoint` with its tokenizer files). The tasks come from any completion source
(`rlcode.envs.tasks.protocol`): ``synth`` (the held-out behaviours of the synthesis suite, at the
run's task levels) or ``humaneval`` (``--split``, default test); or, for an agent run, ``repo``
(the run's held-out task families), ``repo_fresh`` (new seeds of its train families, the run's
``eval_fresh`` tasks; ``--limit N`` evaluates the first N, more than the run evaluated allowed) or
``mined`` (the test split of ``--mined_dir``), played as
episodes by the agent job's own evaluation (pass@1 = success and pass@n; per level pass@1); a
Hugging Face checkpoint plays them with the settings of ``--agent_config``, its own tokenizer and
the built-in chat template. Every task gets ``--samples`` completions at ``--temperature``; each
is graded in the sandbox through the task's trusted-verdict checks, and pass@k is the unbiased
estimator (Chen et al. 2021) for each ``--k`` <= samples.

Devices: sampling runs on a mesh of the local devices (``--mesh``, default ``data=-1``: every
device data-parallel; e.g. ``data=2,tensor=2``), the parameters placed by their logical axes
(`on_mesh`), the prompt batch rounded up to a multiple of data x fsdp.

Prompts: ``completion`` (the base-model prompt, which the policy continues) or ``chat`` (HumanEval's
user turn rendered with the tokenizer's chat template; the reply's code is extracted from a fence,
a restated function or a body). A task whose prompt is longer than ``--max_prompt_len`` tokens is
left out and counted.

Output: a table on stdout, and ``evaluate.json`` (every task's n, c and pass@k, the tables, the
settings and the policy's origin) plus ``evaluate.md`` (the tables and a few transcripts) in
``--out`` (default ``runs/evaluate/<tasks>-<time>``). ``--publish NAME`` also writes
``results/evaluate_<NAME>.json`` and ``.md``: committed results change only when asked.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from experiments.cli import summary

SOURCES = ("synth", "humaneval", "repo", "repo_fresh", "mined")
COMPLETION = ("synth", "humaneval")  # the synthesis job's policies; repo and mined: the agent job's
PROMPT_STYLES = ("completion", "chat")
NUM_TRANSCRIPTS = 4


def _parse_ks(text: str) -> tuple[int, ...]:
    try:
        ks = tuple(sorted({int(k) for k in text.split(",") if k.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--k must be comma-separated integers, got {text!r}") from None
    if not ks or ks[0] < 1:
        raise argparse.ArgumentTypeError(f"--k values must be >= 1, got {text!r}")
    return ks


def _parse_mesh(text: str) -> dict[str, int]:
    from rlcode.sharding import MESH_AXES

    sizes: dict[str, int] = {}
    for part in filter(None, text.split(",")):
        axis, _, size = part.partition("=")
        if axis not in MESH_AXES or not size.lstrip("-").isdigit():
            raise argparse.ArgumentTypeError(f"--mesh takes axis=size pairs over {', '.join(MESH_AXES)} "
                                             f"(size >= 1, or -1 for the remaining devices), got {text!r}")
        sizes[axis] = int(size)
    return sizes


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m experiments.evaluate", description=summary(__doc__),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    origin = p.add_mutually_exclusive_group(required=True)
    origin.add_argument("--run", help="a run directory of the synthesis or agent job (config.json + checkpoints/)")
    origin.add_argument("--hf", help="a Hugging Face checkpoint directory (config.json, safetensors, tokenizer)")
    p.add_argument("--step", type=int, default=None, help="the run's checkpoint step (default: the latest)")
    p.add_argument("--warm_start", action="store_true",
                   help="evaluate the SFT warm start the run began RL from (its summary.json's sft.path)")
    p.add_argument("--tasks", choices=SOURCES, default="synth", help="the task source")
    p.add_argument("--split", default=None, help="humaneval: all, train or test (default test)")
    p.add_argument("--mined_dir", default=os.path.join(".cache", "mined"),
                   help="mined: a cache prepared by experiments.prepare_mined (its test split is evaluated)")
    p.add_argument("--agent_config", default=None,
                   help="--hf on repo / mined tasks: the agent config file for the episodes (turns, context, "
                        "tools, rewards; default configs/agent_repo.py of this checkout)")
    p.add_argument("--limit", type=int, default=None, help="evaluate the first N tasks only")
    p.add_argument("--bugs", choices=("standard", "varied"), default="standard",
                   help="repo / repo_fresh: varied plants each level-1 fix task's bug from the wider set of "
                        "rlcode.envs.tasks.repo.generate_task (same seeds): a probe of whether the policy reads the "
                        "broken line or recalls it, not a benchmark")
    p.add_argument("--prompt", choices=PROMPT_STYLES, default="completion", help="prompt style")
    p.add_argument("--samples", type=int, default=8, help="completions per task (n)")
    p.add_argument("--k", type=_parse_ks, default=(1, 4, 8), help="comma-separated k of pass@k (each <= n)")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top_p", type=float, default=0.95)
    p.add_argument("--max_new_tokens", type=int, default=None, help="default: the run's, else 512")
    p.add_argument("--max_prompt_len", type=int, default=None, help="default: the run's, else 2048")
    p.add_argument("--batch", type=int, default=4, help="prompts per sampling batch (each with n samples)")
    p.add_argument("--mesh", type=_parse_mesh, default={"data": -1},
                   help="the device mesh sampling runs on, e.g. data=4 or data=2,tensor=2 (axes data, fsdp, "
                        "tensor, expert; -1 = the remaining devices; default data=-1: every local device "
                        "data-parallel). --batch is rounded up to a multiple of data x fsdp")
    p.add_argument("--workers", type=int, default=2, help="sandbox workers")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per graded completion")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="output directory (default runs/evaluate/<tasks>-<time>)")
    p.add_argument("--publish", default=None, metavar="NAME",
                   help="also write results/evaluate_NAME.json and .md (committed evidence)")
    args = p.parse_args(argv)
    if args.samples < 1:
        p.error(f"--samples must be >= 1, got {args.samples}")
    if args.k[-1] > args.samples:
        p.error(f"--k {max(args.k)} exceeds --samples {args.samples}")
    if args.temperature <= 0 or not 0 < args.top_p <= 1:
        p.error("--temperature must be > 0 and --top_p in (0, 1]")
    if args.batch < 1 or args.workers < 1 or args.timeout <= 0:
        p.error("--batch and --workers must be >= 1 and --timeout > 0")
    if (args.step is not None or args.warm_start) and not args.run:
        p.error("--step and --warm_start apply to --run only")
    if args.step is not None and args.warm_start:
        p.error("--step and --warm_start name different policies; give one")
    if args.tasks not in COMPLETION and args.prompt == "chat":
        p.error(f"--tasks {args.tasks} plays agent episodes in the built-in chat format; --prompt does not apply")
    if args.bugs != "standard" and args.tasks not in ("repo", "repo_fresh"):
        p.error(f"--bugs {args.bugs} applies to the generated repository tasks (--tasks repo or repo_fresh)")
    if args.agent_config is not None and not (args.hf and args.tasks not in COMPLETION):
        p.error("--agent_config applies to --hf with --tasks repo or mined (a run brings its own config)")
    if args.tasks not in COMPLETION and args.k != (1, args.samples) and args.k != (1,):
        p.error(f"--tasks {args.tasks}: the agent's evaluation reports pass@1 and pass@n; use --k 1,{args.samples}")
    if args.prompt == "chat" and args.tasks != "humaneval":
        p.error("--prompt chat is available for --tasks humaneval")
    if args.split is not None and args.tasks != "humaneval":
        p.error("--split applies to --tasks humaneval (synth evaluates its held-out behaviours)")
    if args.publish is not None and not args.publish.replace("_", "").replace("-", "").isalnum():
        p.error(f"--publish NAME must be letters, digits, '-' or '_', got {args.publish!r}")
    return args


# ------------------------------------------------------------------------------ the policy


@dataclasses.dataclass
class Policy:
    graphdef: Any
    params: Any
    tokenizer: Any
    origin: dict[str, Any]
    max_new_tokens: int
    max_prompt_len: int
    levels: tuple[int, ...]
    seed: int
    config: Any = None  # the run's config (a run), None for a Hugging Face directory


def load_run(path: str, step: int | None, job: str = "synth", warm_start: bool = False) -> Policy:
    """The policy of a run of `job` ("synth" or "agent"): its model section, tokenizer and
    checkpoint `step` (or, `warm_start`, the SFT warm start it began RL from)."""
    from flax import nnx

    from rlcode.tokenizer import job_tokenizer
    from rlcode.train.workdir import load_run_model, load_run_warm_start

    config_path = os.path.join(path, "config.json")
    if not os.path.exists(config_path):
        raise SystemExit(f"--run {path}: no config.json (not a run directory)")
    with open(config_path) as f:
        kind = json.load(f).get("job", "synth")
    if kind != job:
        raise SystemExit(f"--run {path}: a {kind!r} run; these tasks need a {job!r} run")
    try:
        if warm_start:
            cfg, model, sft_path = load_run_warm_start(path)
            origin = {"run": os.path.abspath(path), "step": 0, "warm_start": sft_path}
        else:
            cfg, model, step = load_run_model(path, step)
            origin = {"run": os.path.abspath(path), "step": int(step)}
    except ValueError as e:
        raise SystemExit(f"--run {e}") from None
    graphdef, state = nnx.split(model)
    tokenizer = job_tokenizer(cfg.get("tokenizer", "byte"), cfg.model.get("init_from", ""))
    if job == "agent":
        return Policy(graphdef, state, tokenizer, origin,
                      int(cfg.agent.max_response_tokens), int(cfg.agent.max_context_tokens), tuple(cfg.task.levels),
                      int(cfg.seed), cfg)
    return Policy(graphdef, state, tokenizer, origin,
                  int(cfg.sampling.max_new_tokens), int(cfg.task.max_prompt_len), tuple(cfg.task.levels), int(cfg.seed),
                  cfg)


def load_hf(path: str) -> Policy:
    from flax import nnx

    from rlcode.models.hf import load_checkpoint
    from rlcode.tokenizer import load_tokenizer

    model = load_checkpoint(path)
    graphdef, state = nnx.split(model)
    return Policy(graphdef, state, load_tokenizer(path), {"hf": os.path.abspath(path)}, 512, 2048, (1, 2, 3), 0)


def on_mesh(policy: Policy, sizes: dict[str, int]) -> tuple[Policy, dict[str, int]]:
    """The policy placed on a mesh of the local devices (`rlcode.sharding`): each parameter
    sharded by its logical axes and the model's activations pinned to the mesh, so the sampler
    (the same jitted functions as on one device) splits its batch over data x fsdp and its heads
    over tensor. Returns the policy and the mesh's axis sizes; one device: the policy unchanged."""
    import jax
    from flax import nnx

    from rlcode.sharding import make_mesh, mesh_config
    from rlcode.train.step import split_on_mesh

    devices = jax.devices()
    if -1 not in sizes.values():  # explicit sizes: the first that many devices
        sizes = {"data": 1, **sizes}
        devices = devices[: math.prod(sizes.values())]
    try:
        mesh = make_mesh(mesh_config(**sizes), devices)
    except ValueError as e:
        raise SystemExit(f"--mesh: {e}") from None
    shape = {axis: int(n) for axis, n in mesh.shape.items()}
    if mesh.size == 1:
        return policy, shape
    graphdef, params = split_on_mesh(nnx.merge(policy.graphdef, policy.params), mesh)
    return dataclasses.replace(policy, graphdef=graphdef, params=params), shape


AGENT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "agent_repo.py")


def load_hf_agent(path: str, config_path: str | None) -> Policy:
    """A Hugging Face checkpoint as an agent policy: the episodes' settings (turns, context and
    response lengths, tools, rewards, levels) from an agent config file, the checkpoint's own
    tokenizer, and the built-in chat template (`rlcode.tokenizer.Tokenizer.encode_builtin_chat`:
    the model's special tokens, in the project's tool-calling format)."""
    from experiments.ablate import AblationError, load_config_module

    try:
        cfg = load_config_module(config_path or AGENT_CONFIG).get_config()
    except AblationError as e:
        raise SystemExit(f"--agent_config: {e}") from None
    if cfg.get("job") != "agent":
        raise SystemExit(f"--agent_config {config_path}: not an agent config (job={cfg.get('job')!r})")
    cfg.model.init_from, cfg.tokenizer = os.path.abspath(path), "init_from"
    policy = load_hf(path)
    return dataclasses.replace(policy, max_new_tokens=int(cfg.agent.max_response_tokens),
                               max_prompt_len=int(cfg.agent.max_context_tokens), levels=tuple(cfg.task.levels),
                               seed=int(cfg.seed), config=cfg)


# ------------------------------------------------------------------------------ tasks and prompts


def build_tasks(args: argparse.Namespace, policy: Policy) -> list[Any]:
    if args.tasks == "humaneval":
        from rlcode.envs.tasks import humaneval

        tasks = humaneval.load(args.split or "test")
    else:
        from rlcode.envs.tasks import synth

        tasks = synth.make_split("eval", args.limit or 64, seed=policy.seed,
                                 levels=tuple(l for l in policy.levels if l in synth.LEVELS) or (1,))
    return tasks[: args.limit] if args.limit is not None else tasks


def encode_prompt(task: Any, tokenizer: Any, style: str) -> list[int]:
    if style == "chat":
        from rlcode.envs.tasks import humaneval

        return list(tokenizer.apply_chat_template(humaneval.chat_messages(task), add_generation_prompt=True))
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    return bos + tokenizer.encode(task.completion_prompt())


# ------------------------------------------------------------------------------ evaluation


def sample_all(policy: Policy, prompts: list[list[int]], args: argparse.Namespace, max_new: int,
               progress) -> list[list[str]]:
    """`args.samples` decoded completions per prompt (batches of `args.batch` prompts, padded to
    the longest prompt rounded up to 64, so few shapes compile). Prompt i samples with key
    fold_in(key(seed), i), so the completions depend on the seed, not on the batching."""
    import jax
    import jax.numpy as jnp

    from rlcode.sampling import SamplingConfig, sample

    tok = policy.tokenizer
    cfg = SamplingConfig(max_new_tokens=max_new, temperature=args.temperature, top_k=0, top_p=args.top_p,
                         stop_ids=tuple(tok.stop_ids), pad_id=tok.pad_id)
    key = jax.random.key(args.seed)
    out: list[list[str]] = []
    n = args.samples
    for start in range(0, len(prompts), args.batch):
        chunk = prompts[start:start + args.batch]
        width = -(-max(len(p) for p in chunk) // 64) * 64
        rows = chunk + [chunk[-1]] * (args.batch - len(chunk))  # fixed batch shape; extra rows dropped
        arr = np.full((len(rows), width), tok.pad_id, np.int32)
        for i, p in enumerate(rows):
            arr[i, : len(p)] = p
        lengths = np.asarray([len(p) for p in rows], np.int32)
        # One key per prompt, from its index: the samples do not depend on --batch or the mesh.
        keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(start, start + len(rows)))
        res = jax.device_get(sample(policy.graphdef, policy.params, jnp.asarray(arr), jnp.asarray(lengths),
                                    keys, group_size=n, cfg=cfg))
        tokens, lens = np.asarray(res.tokens), np.asarray(res.lengths)
        for i in range(len(chunk)):
            texts = []
            for j in range(n):
                ids = [int(t) for t in tokens[i * n + j, : lens[i * n + j]] if int(t) not in tok.stop_ids]
                texts.append(tok.decode(ids, skip_special=True))
            out.append(texts)
        progress(len(out), len(prompts))
    return out


def pass_at_k_table(n: np.ndarray, c: np.ndarray, ks: Sequence[int]) -> dict[str, float]:
    from rlcode.train.metrics import pass_at_k

    return {f"pass@{k}": float(np.mean(pass_at_k(n, c, k))) for k in ks}


def evaluate(args: argparse.Namespace, policy: Policy, pool: Any, log=print) -> dict[str, Any]:
    from rlcode.train.rollout import Grader

    tasks = build_tasks(args, policy)
    max_new = args.max_new_tokens or policy.max_new_tokens
    max_len = args.max_prompt_len or policy.max_prompt_len
    encoded = [(t, encode_prompt(t, policy.tokenizer, args.prompt)) for t in tasks]
    kept = [(t, p) for t, p in encoded if len(p) <= max_len]
    if not kept:
        raise SystemExit(f"no task prompt fits --max_prompt_len {max_len} tokens")
    log(f"{len(kept)} of {len(tasks)} {args.tasks} tasks fit {max_len} prompt tokens; "
        f"{args.samples} samples each, up to {max_new} new tokens")
    t0 = time.perf_counter()
    texts = sample_all(policy, [p for _, p in kept], args, max_new,
                       lambda done, total: print(f"\rsampled {done}/{total} tasks", end="", file=sys.stderr, flush=True))
    print(file=sys.stderr)
    t1 = time.perf_counter()
    grader = Grader(pool, timeout=args.timeout)
    flat_tasks = [t for t, _ in kept for _ in range(args.samples)]
    frac, valid, timed_out, counts = grader.grade(flat_tasks, [s for row in texts for s in row])
    t2 = time.perf_counter()
    solved = ((frac >= 1.0) & valid).reshape(len(kept), args.samples)
    n = np.full(len(kept), args.samples, np.int64)
    c = solved.sum(1).astype(np.int64)
    ks = [k for k in args.k if k <= args.samples]
    by_level: dict[str, dict[str, float]] = {}
    for level in sorted({t.difficulty for t, _ in kept}):
        rows = np.asarray([t.difficulty == level for t, _ in kept])
        by_level[str(level)] = {"tasks": int(rows.sum()), **pass_at_k_table(n[rows], c[rows], ks)}
    per_task = [{"task_id": t.task_id, "difficulty": t.difficulty, "n": int(n[i]), "c": int(c[i])}
                for i, (t, _) in enumerate(kept)]
    transcripts = [{"task_id": t.task_id, "prompt": t.completion_prompt(), "completion": texts[i][0],
                    "passed": bool(solved[i, 0])} for i, (t, _) in enumerate(kept[:NUM_TRANSCRIPTS])]
    return {
        "source": args.tasks, "split": args.split or ("test" if args.tasks == "humaneval" else "eval"),
        "policy": policy.origin, "prompt": args.prompt,
        "settings": {"samples": args.samples, "k": ks, "temperature": args.temperature, "top_p": args.top_p,
                     "max_new_tokens": max_new, "max_prompt_len": max_len, "seed": args.seed, "timeout": args.timeout},
        "tasks": {"evaluated": len(kept), "left_out_too_long": len(tasks) - len(kept)},
        "overall": pass_at_k_table(n, c, ks), "by_difficulty": by_level,
        "grading": {"infra": int((~valid).sum()), "timeouts": int(timed_out.sum()),
                    "forged_report": int(counts.get("forged_report", 0))},
        "seconds": {"sample": round(t1 - t0, 2), "grade": round(t2 - t1, 2)},
        "per_task": per_task, "transcripts": transcripts,
    }


def evaluate_agent(args: argparse.Namespace, policy: Policy, pool: Any, log=print) -> dict[str, Any]:
    """`args.samples` episodes of the agent run's policy per task (repository tasks: the run's
    held-out families; mined: the prepared cache's test split), with the agent job's own
    evaluation (`rlcode.train.agent.evaluate`: success = pass@1, pass@n, per level)."""
    import jax

    from rlcode.session_sampling import SessionSampler
    from rlcode.train import agent

    cfg = policy.config
    tasks = agent_tasks(args, cfg)
    cfg.eval.num_samples = args.samples
    sampler = SessionSampler(policy.graphdef, policy.tokenizer, rows=args.batch * args.samples,
                             max_context=cfg.agent.max_context_tokens, max_response=cfg.agent.max_response_tokens,
                             temperature=args.temperature, mode=cfg.agent.prefill)
    log(f"{len(tasks)} {args.tasks} tasks, {args.samples} episodes each")
    t0 = time.perf_counter()
    episodes: list = []
    m = agent.evaluate(tasks, sampler, policy.params, jax.random.key(args.seed), pool, policy.tokenizer, cfg, "eval",
                       keep=episodes)
    n = args.samples
    solved = np.asarray([e.success for e in episodes]).reshape(len(tasks), n)
    per_task = [{"task_id": t.task_id, "difficulty": t.difficulty, "n": n, "c": int(solved[i].sum())}
                for i, t in enumerate(tasks)]
    transcripts = [{"task_id": t.task_id, "prompt": t.instruction, "completion": episode_text(episodes[i * n]),
                    "passed": bool(solved[i, 0])} for i, t in enumerate(tasks[:NUM_TRANSCRIPTS])]
    ks = sorted({1, n})
    overall = {f"pass@{k}": float(m[f"eval/pass@{k}"]) for k in ks}
    by_level = {}
    for level in sorted({t.difficulty for t in tasks}):
        count = sum(t.difficulty == level for t in tasks)
        by_level[str(level)] = {"tasks": count, "pass@1": float(m[f"eval/success_L{level}"])}  # pass@1 only
    return {
        "source": args.tasks, "split": {"mined": "test", "repo_fresh": "eval_fresh"}.get(args.tasks, "eval"),
        "policy": policy.origin,
        "prompt": "agent", "settings": {"samples": n, "k": ks, "temperature": args.temperature, "top_p": 1.0,
                                        "bugs": args.bugs,
                                        "max_new_tokens": policy.max_new_tokens, "max_prompt_len": policy.max_prompt_len,
                                        "seed": args.seed, "timeout": args.timeout},
        "tasks": {"evaluated": len(tasks), "left_out_too_long": 0}, "overall": overall, "by_difficulty": by_level,
        "by_family": by_family(tasks, episodes, n),
        "grading": {k.split("/", 1)[1]: v for k, v in m.items() if any(w in k for w in ("infra", "timeout", "hack"))},
        "episode_metrics": m,
        "seconds": {"total": round(time.perf_counter() - t0, 2)}, "per_task": per_task, "transcripts": transcripts,
    }


def agent_tasks(args: argparse.Namespace, cfg: Any) -> list:
    """The tasks an agent evaluation plays: the mined test split, or the run's fresh / held-out
    repository tasks (the first --limit; for repo_fresh, more than the run's own with a larger
    --limit), with --bugs varied the same seeds with their bug drawn from the wider set."""
    from rlcode.envs.tasks import mined
    from rlcode.envs.tasks import repo as repo_tasks
    from rlcode.train import agent

    if args.tasks == "mined":
        tasks = mined.load_prepared(args.mined_dir, splits=("test",))["test"]
    elif args.tasks == "repo_fresh":  # the run's eval_fresh tasks, and more of them with --limit
        cfg.task.num_fresh = args.limit if args.limit is not None else cfg.task.num_fresh
        tasks = agent.build_tasks(cfg, sets=("eval_fresh",))["eval_fresh"]
    else:
        tasks = agent.build_tasks(cfg, sets=("eval",))["eval"]
    tasks = tasks[: args.limit] if args.limit is not None else tasks
    if not tasks:
        raise SystemExit(f"no {args.tasks} task to evaluate")
    if args.bugs != "standard":
        tasks = [repo_tasks.generate_task(t.seed, difficulty=t.difficulty, split=t.split, bugs=args.bugs) for t in tasks]
    return tasks


def first_edit(episode: Any) -> dict[str, Any] | None:
    """The arguments of the episode's first well-formed ``edit_file`` call (None: no edit)."""
    return next((c.arguments for c in episode.trajectory.tool_calls
                 if c.name == "edit_file" and c.status in ("ok", "error") and c.arguments), None)


def by_family(tasks: Sequence[Any], episodes: Sequence[Any], n: int) -> dict[str, dict[str, float]]:
    """Per task family (the episodes of task i are episodes[i * n:(i + 1) * n]): tasks, pass@1,
    edit_ok (an edit applied) and first_edit_exact: the first edit's `old` text is the line the
    task's reference fix replaces, i.e. the policy named the broken line as the file has it
    (rather than a line remembered from other tasks). The last is only defined for one-edit tasks
    with a reference (generated and mined tasks): NaN otherwise. hint_copied: of the edits made
    right after a failed edit that showed the file's closest text, the share that copied it (NaN:
    no such edit)."""
    from rlcode.train.episodes import called_ok, hint_follow_ups  # noqa: PLC0415

    out: dict[str, dict[str, float]] = {}
    for family in sorted({getattr(t, "family", "") for t in tasks}):
        rows = [i for i, t in enumerate(tasks) if getattr(t, "family", "") == family]
        eps = [(tasks[i], e) for i in rows for e in episodes[i * n:(i + 1) * n]]
        exact = [(first_edit(e) or {}).get("old") == t.edits[0].old for t, e in eps if len(getattr(t, "edits", ())) == 1]
        follow = np.sum([hint_follow_ups(e.trajectory) for _, e in eps], axis=0)
        out[family or "-"] = {
            "tasks": len(rows), "pass@1": float(np.mean([e.success for _, e in eps])),
            "edit_ok": float(np.mean([called_ok(e.trajectory, "edit_file") for _, e in eps])),
            "first_edit_exact": float(np.mean(exact)) if exact else float("nan"),
            "hint_copied": float(follow[1] / follow[0]) if follow[0] else float("nan")}
    return out


def episode_text(episode: Any, limit: int = 400) -> str:
    """An episode as text: each turn the policy generated, then each of its tool calls with the
    start of the observation (cut at `limit` characters), and how the episode ended."""
    traj = episode.trajectory
    calls: dict[int, list] = {}
    for call in traj.tool_calls:
        calls.setdefault(call.turn, []).append(call)
    lines = []
    for turn in traj.turns:
        lines.append(f"# turn {turn.index} ({turn.kind}{', truncated' if turn.truncated else ''})")
        lines.append(turn.text.rstrip("\n"))
        for call in calls.get(turn.index, []):
            obs = call.observation if len(call.observation) <= limit else call.observation[:limit] + " [...]"
            lines.append(f"# -> {call.name or '?'}: {call.status}" + (f" ({call.error})" if call.error else ""))
            lines += [f"#    {line}" for line in obs.rstrip("\n").splitlines()]
    lines.append(f"# end: {traj.end_reason}; reward {episode.reward:.3f}; flags {list(episode.flags)}")
    return "\n".join(lines)


def markdown(report: dict[str, Any]) -> str:
    ks = report["settings"]["k"]
    head = "| difficulty | tasks | " + " | ".join(f"pass@{k}" for k in ks) + " |"
    rule = "|---" * (2 + len(ks)) + "|"
    cell = lambda r, k: f"{r[f'pass@{k}']:.3f}" if f"pass@{k}" in r else "-"  # noqa: E731
    rows = [f"| {lvl} | {r['tasks']} | " + " | ".join(cell(r, k) for k in ks) + " |"
            for lvl, r in report["by_difficulty"].items()]
    total = report["tasks"]["evaluated"]
    rows.append(f"| all | {total} | " + " | ".join(f"{report['overall'][f'pass@{k}']:.3f}" for k in ks) + " |")
    s = report["settings"]
    lines = [f"# {report['source']} ({report['split']}): {json.dumps(report['policy'])}", "",
             f"{s['samples']} samples per task at temperature {s['temperature']}, top-p {s['top_p']}, "
             f"{report['prompt']} prompts; pass@k is the unbiased estimator. "
             f"{report['tasks']['left_out_too_long']} tasks left out (prompt longer than {s['max_prompt_len']} tokens); "
             f"grading: {report['grading']}.", "", head, rule, *rows, ""]
    if report.get("by_family"):
        lines += ["| family | tasks | pass@1 | edit applied | first edit names the broken line | edit hint copied |",
                  "|---" * 6 + "|"]
        lines += [f"| {f} | {r['tasks']} | {r['pass@1']:.3f} | {r['edit_ok']:.3f} | {r['first_edit_exact']:.3f} | "
                  f"{r['hint_copied']:.3f} |" for f, r in report["by_family"].items()] + [""]
    lines += ["## Transcripts", ""]
    for t in report["transcripts"]:
        lines += [f"### {t['task_id']} (passed: {t['passed']})", "", "```python", t["prompt"].rstrip("\n"),
                  t["completion"].rstrip("\n"), "```", ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from rlcode.sandbox import Limits, SandboxPool  # the pool starts before anything imports jax

    out = args.out or os.path.join("runs", "evaluate", f"{args.tasks}-{time.strftime('%Y%m%d-%H%M%S')}")
    pool = SandboxPool(args.workers, Limits(wall_seconds=args.timeout + 5.0))
    try:
        if args.tasks in COMPLETION:
            policy = load_run(args.run, args.step, warm_start=args.warm_start) if args.run else load_hf(args.hf)
        elif args.run:
            policy = load_run(args.run, args.step, job="agent", warm_start=args.warm_start)
        else:
            policy = load_hf_agent(args.hf, args.agent_config)
        policy, mesh = on_mesh(policy, args.mesh)
        shards = mesh["data"] * mesh["fsdp"]
        if args.batch % shards:
            args.batch = -(-args.batch // shards) * shards
            print(f"--batch rounded up to {args.batch}, a multiple of the mesh's data x fsdp = {shards}")
        report = (evaluate if args.tasks in COMPLETION else evaluate_agent)(args, policy, pool)
        report["settings"].update(mesh=mesh, batch=args.batch)
    finally:
        pool.close()
    text = markdown(report)
    targets = [out] + (["results"] if args.publish else [])
    for folder in targets:
        os.makedirs(folder, exist_ok=True)
        stem = "evaluate" if folder == out else f"evaluate_{args.publish}"
        with open(os.path.join(folder, stem + ".json"), "w") as f:
            json.dump(report, f, indent=1)
        with open(os.path.join(folder, stem + ".md"), "w") as f:
            f.write(text)
    ks = report["settings"]["k"]
    print(" ".join(f"pass@{k}={report['overall'][f'pass@{k}']:.3f}" for k in ks)
          + f"  ({report['tasks']['evaluated']} tasks; by difficulty: "
          + ", ".join(f"L{l} {r['pass@1']:.3f}" for l, r in report["by_difficulty"].items()) + ")")
    for family, r in report.get("by_family", {}).items():
        print(f"  {family}: {r['tasks']} tasks, pass@1 {r['pass@1']:.3f}, edit_ok {r['edit_ok']:.3f}, "
              f"first edit names the broken line {r['first_edit_exact']:.3f}, "
              f"edit hint copied {r['hint_copied']:.3f}")
    print(f"wrote {os.path.join(out, 'evaluate.json')} and .md" + (" and results/evaluate_" + args.publish + ".*"
                                                                     if args.publish else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
