"""Ablations of the main job: a grid of config variants x seeds, one training subprocess per run,
then a results table (mean ± std over seeds) and overlaid learning curves.

    python -m experiments.ablate --config=configs/grpo_synth.py --sweep=loss:grpo,dr_grpo,dapo,gspo,cispo,ppo --seeds=3

    python -m experiments.ablate --config=configs/grpo_synth.py --sweep=attention:dense,nsa,squid \\
        --seeds=2 --set train.steps=30 --set eval.every=10
    python -m experiments.ablate --config=configs/grpo_synth.py:loss=dapo \\
        --sweep=rollout.group_size:4,8,16 --sweep=model.attention.kind:dense,squid --seed_list=0,2
    python -m experiments.ablate --config=configs/grpo_synth.py --sweep=loss:grpo,dapo --seeds=3 \\
        --launcher=ray --ray_address=auto --gpus_per_run=1

Each run is ``python -m experiments.train --config=<file>[:<arg>] --config.<field>=<value> ...
--config.seed=<s> --config.workdir=<out_dir>/<label>/seed<s>``, run one after the other
(``--launcher=local``, the default) or, with ``--launcher=ray``, as Ray tasks running side by side
(see "On a Ray cluster" below).

Sweeps (``--sweep=KEY:V1,V2,...``; several flags make their cartesian product). KEY is

  1. a config field, by its dotted path (``rollout.group_size``), passed as ``--config.KEY=V``;
  2. else the end of exactly one field's path (``attention.kind`` -> ``model.attention.kind``;
     an ending shared by several fields, e.g. ``steps``, is an error that lists them);
  3. else a name of the config file's argument (grpo_synth.py: ``loss``, ``attention``, ``mlp``),
     passed after the ':' of ``--config`` and combined with the argument given there
     (``--config=configs/grpo_synth.py:attention=nsa,loss=dapo``).

  Prefer ``attention`` (the argument) to ``model.attention.kind`` in grpo_synth.py: the argument
  also sets NSA's block sizes for these short sequences, the field alone keeps the module's
  defaults. Values are split at commas outside brackets (``--sweep=task.levels:(1,),(1,2)``) and
  parsed as the field's type (int, float, bool, str, tuple); every variant's config is built and
  checked by the job's `validate_config` before the first run starts.

Fixed overrides for every run: ``--set FIELD=VALUE`` (repeatable, resolved like sweep keys; a
``--config.FIELD=VALUE`` flag means the same). Seeds: ``--seeds=N`` (0..N-1, default 1) or
``--seed_list=0,2``.

Layout: ``--out_dir`` (default ``runs/ablate/<name>``; ``--name`` defaults to the sweep keys joined
by '+') holds ``<label>/seed<s>/``, the run's workdir, with ``log.txt`` (the run's stdout and
stderr, appended over attempts), ``command.txt`` (the exact command of the latest attempt) and
``ablate_status.json`` (exit code, seconds and log tail of the latest attempt). A label is
``field=value`` joined by ',' (e.g. ``loss=dapo,model.attention.kind=nsa``), with characters
other than letters, digits and ``._=,+@-`` replaced by '_'.

Resuming: run the same command again. A run whose summary.json says completed is skipped; a
run that started (its workdir has config.json or checkpoints) is continued with
``--config.resume=True``; a failed run (non-zero exit) is recorded with its log tail and the grid
goes on (the exit status is then 1). Ctrl-C (or SIGTERM) stops the current run with one SIGINT
(it saves a checkpoint at the end of its step; Ctrl-C again kills it), writes the partial table
and exits with status 130. ``--dry_run`` prints the commands; ``--table_only`` rebuilds the table
and figure from the run directories without running anything.

On a Ray cluster (``pip install -e ".[distributed]"``): ``--launcher=ray`` runs each run's command,
the same as above, in a Ray task that asks for ``--cpus_per_run`` CPUs (default 1) and
``--gpus_per_run`` GPUs (default 0; a run given GPUs sees only those, through
CUDA_VISIBLE_DEVICES), so Ray starts as many runs at once as the cluster has room for (submitted in
the grid's order). Without ``--ray_address`` a Ray instance is started on this machine for the grid
(with all its CPUs and GPUs) and stopped at the end. Across machines: ``ray start --head`` on one,
``ray start --address=<head>:6379`` on each of the others, then ``--ray_address=auto`` on the head
(or ``<head>:6379``, or ``ray://<head>:10001`` from a machine outside the cluster). Every node
needs the checkout and its Python environment at the same path, and ``--out_dir`` on a file
system all of them share: a task works in the directory ablate was started from, and the table
is read from the run directories. A run sees the environment of its Ray worker (the variables set
where the Ray instance or ``ray start`` was started). A line is printed as each run ends. A run
whose worker or node is lost (Ray reports the task failed by the system: the worker crashed, the
node died) is started again, resuming, up to ``--max_retries`` times (default 3), then recorded as
failed; a run whose command exits non-zero is recorded as failed, as above, and not retried.
Resuming, Ctrl-C (one SIGINT to each running run, through a stop file in ``--out_dir``; the waiting
ones do not start), the run directories, the table and the recorded command (which leaves out the
launcher's flags) are as with the local launcher. An address nothing answers at, or a run needing
more than any node has, is an error before any run starts.

Writes into the runs' directory (``--out_dir``, default runs/ablate/<name>/) by default, so a
trial never replaces the committed tables; ``--publish`` writes results/ and docs/figures/ instead,
``--results_dir`` / ``--fig_dir`` any other directories (the PNG next to the JSON unless
``--fig_dir``; see `experiments.cli.output_paths`). With ``--publish``:

  results/ablate_<name>.json   the command, sweep, overrides, seeds; per run its label, variant,
                               seed, workdir, status, final metrics and curves ({tag: [[step,
                               value], ...]} of the metric and best-of-n at every eval, and of
                               rollout/pass@1 and rollout/reward as means over <= 100 windows of
                               steps); the per-variant table rows
  results/ablate_<name>.md     the table as markdown, headed by the exact command
  results/ablate_<name>.csv    the table as CSV (means and sample stds in separate columns)
  docs/figures/ablate_<name>.png  one line per variant (mean over its seeds, min-max shaded) in
                               panels: the metric, best-of-n, the training reward

Table columns, per variant, as mean ± sample std over its completed seeds (one seed: its value;
read from each run's tb/metrics.jsonl and summary.json): the final (last eval's) value of ``--metric`` (default
eval_fresh/pass@1 when every run logged it, else eval/pass@1) and of best-of-n of the same eval
set (``<set>/best_of_<eval.num_samples>``), the first step at which the metric reached
``--threshold`` (default 0.1; "k/n reached", the mean over the runs that reached it), the final
eval's mean completion length (``<set>/length``, tokens), and the wall time in minutes
(summary.json's `seconds`: the last attempt's, for a resumed run). `plot_ablation(data, path)`
and `markdown_table(data)` redraw the figure and table from the JSON alone.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import csv
import dataclasses
import difflib
import hashlib
import importlib.util
import io
import itertools
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from experiments.cli import FLAG_ALIASES, output_paths, summary
from experiments.plot_training import find_jsonl_dir, mean_series, run_series, value_label
from experiments.summarize_runs import _mean_std
from rlcode.train.metrics import read_jsonl

DEFAULT_THRESHOLD = 0.1
TRAIN_MODULE = "experiments.train"
TRAIN_TAGS = ("rollout/pass@1", "rollout/reward")  # per-step training scalars kept (thinned) in the JSON
REWARD_TAG = "rollout/reward"
CURVE_POINTS = 100  # at most this many points per thinned training curve
RESERVED = {"seed": "--seeds / --seed_list", "workdir": "--out_dir", "resume": "rerunning the same command"}
STATUS_FILE = "ablate_status.json"
LOG_TAIL_LINES = 30


class AblationError(ValueError):
    """A sweep or override the ablation cannot run (raised before any run starts)."""


# ------------------------------------------------------------------------------ config handling


def split_config_spec(spec: str) -> tuple[str, str | None]:
    """'configs/x.py:a=1,b=2' -> ('configs/x.py', 'a=1,b=2'); no ':' -> (path, None), as config_flags."""
    path, sep, arg = spec.partition(":")
    return path, (arg if sep else None)


def load_config_module(path: str) -> Any:
    if not os.path.isfile(path):
        raise AblationError(f"config file {path!r} not found (relative to {os.getcwd()})")
    name = "ablate_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0]) + "_config"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def config_leaves(cfg: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted path -> value of every field of a ConfigDict that is not itself a ConfigDict."""
    import ml_collections  # noqa: PLC0415

    out = {}
    for name, value in cfg.items():
        if isinstance(value, ml_collections.ConfigDict):
            out.update(config_leaves(value, prefix + name + "."))
        else:
            out[prefix + name] = value
    return out


def split_values(text: str) -> list[str]:
    """Split at commas outside (), [] and {}: 'a,(1,2),b' -> ['a', '(1,2)', 'b']."""
    items, depth, current = [], 0, []
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            items.append("".join(current))
            current = []
        else:
            current.append(ch)
    items.append("".join(current))
    return [item.strip() for item in items]


def parse_value(text: str, current: Any) -> Any:
    """`text` parsed as the type of the field's current value, as config_flags parses
    `--config.<field>=<text>`: bool (true/false/1/0, any case), int, float, tuple (a Python
    literal), str (as is). Raises ValueError naming the expected type, and for a field holding
    None, which config_flags cannot override."""
    from absl import flags  # noqa: PLC0415

    if isinstance(current, bool):
        parser, kind = flags.BooleanParser(), "bool"
    elif isinstance(current, int):
        parser, kind = flags.IntegerParser(), "int"
    elif isinstance(current, float):
        parser, kind = flags.FloatParser(), "float"
    elif isinstance(current, str):
        return text
    elif isinstance(current, (tuple, list)):
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            raise ValueError(f"{text!r} is not a tuple literal such as (1, 2)") from None
        if not isinstance(value, (tuple, list)):
            raise ValueError(f"{text!r} is not a tuple literal such as (1, 2) or (1,)")
        return tuple(value)
    else:  # None (or a dict, ...): config_flags defines no flag for such a field
        raise ValueError(f"{text!r}: the field holds {current!r}, which the job's command line cannot override "
                         "(config_flags needs a bool, int, float, str or tuple default)")
    try:
        return parser.parse(text)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{text!r} is not a valid {kind} ({e})") from None


def combine_args(*args: str | None) -> str | None:
    """Config-file arguments 'a=1,b=2' merged left to right; a later name replaces an earlier one."""
    items: dict[str, str] = {}
    seen_any = False
    for arg in args:
        if arg is None:
            continue
        seen_any = True
        for item in filter(None, (x.strip() for x in arg.split(","))):
            name = item.partition("=")[0]
            items.pop(name, None)
            items[name] = item
    return ",".join(items.values()) if seen_any else None


@dataclasses.dataclass
class ConfigContext:
    """The config file of the ablation: its module, the argument given in --config, the base
    config's fields."""

    path: str
    arg: str | None
    module: Any
    leaves: dict[str, Any]

    @classmethod
    def load(cls, spec: str) -> ConfigContext:
        path, arg = split_config_spec(spec)
        module = load_config_module(path)
        return cls(path, arg, module, config_leaves(cls.get_config(module, arg)))

    @staticmethod
    def get_config(module: Any, arg: str | None) -> Any:
        return module.get_config(arg) if arg is not None else module.get_config()

    def arg_names(self) -> set[str] | None:
        """Names the config argument accepts, from the module's ARGS ('name=value' examples); None
        when the module has no ARGS."""
        args = getattr(self.module, "ARGS", None)
        return None if args is None else {a.partition("=")[0] for a in args}

    def try_arg(self, item: str) -> Exception | None:
        try:
            self.get_config(self.module, combine_args(self.arg, item))
        except Exception as e:  # noqa: BLE001 (any failure of get_config rejects the value)
            return e
        return None


@dataclasses.dataclass
class Axis:
    """One swept (or fixed, for --set) key: `target` is the field's full path (kind 'field') or
    the config argument's name (kind 'arg'); `texts` as given, `values` parsed."""

    key: str
    target: str
    kind: str
    texts: list[str]
    values: list[Any]

    def describe(self) -> dict:
        return {"key": self.key, "target": self.target, "kind": self.kind,
                "values": [_jsonable(v) for v in self.values]}


def resolve_key(key: str, ctx: ConfigContext, texts: Sequence[str] = (), what: str = "--sweep") -> Axis:
    """The Axis of `key` with values `texts` (see the module docstring for the rules). Raises
    AblationError for a reserved, ambiguous or unknown key, or a value of the wrong type."""
    key = key.strip()
    if not key:
        raise AblationError(f"{what}: empty key")
    target = FLAG_ALIASES.get(f"--config.{key}", f"--config.{key}")[len("--config."):]
    reserved = target if target in RESERVED else key if key in RESERVED else None
    if reserved:
        raise AblationError(f"{what} {key}: set by the ablation itself; use {RESERVED[reserved]}")
    if target in ctx.leaves:
        return _field_axis(key, target, texts, ctx, what)
    suffix = [p for p in ctx.leaves if p.endswith("." + key)]
    if len(suffix) == 1:
        return _field_axis(key, suffix[0], texts, ctx, what)
    if len(suffix) > 1:
        raise AblationError(f"{what} key {key!r} is ambiguous: it ends the paths of {len(suffix)} config fields "
                            f"({', '.join(sorted(suffix))}); give the full path")
    names = ctx.arg_names()
    errors = {text: ctx.try_arg(f"{key}={text}") for text in texts}
    if (names is not None and key in names) or (names is None and texts and not all(errors.values())):
        bad = {t: e for t, e in errors.items() if e is not None}
        if bad:
            details = "; ".join(f"{key}={t}: {str(e).splitlines()[-1] if str(e) else type(e).__name__}"
                                for t, e in bad.items())
            raise AblationError(f"{what} {key}: the config argument of {ctx.path} rejects {details}")
        return Axis(key, key, "arg", list(texts), list(texts))
    candidates = sorted(ctx.leaves) + sorted({p.rsplit(".", 1)[-1] for p in ctx.leaves}) + sorted(names or ())
    near = list(dict.fromkeys(difflib.get_close_matches(key, candidates, n=5, cutoff=0.5) +
                              [p for p in sorted(ctx.leaves) if key in p][:5]))[:6]
    hint = f"; nearest: {', '.join(near)}" if near else ""
    args = f" or a config argument ({', '.join(sorted(names))})" if names else ""
    raise AblationError(f"{what}: unknown key {key!r}: not a field of {ctx.path}, the end of one field's path"
                        f"{args}{hint}")


def _field_axis(key: str, path: str, texts: Sequence[str], ctx: ConfigContext, what: str) -> Axis:
    values = []
    for text in texts:
        try:
            values.append(parse_value(text, ctx.leaves[path]))
        except ValueError as e:
            raise AblationError(f"{what} {key}: value {e} for {path} (currently {ctx.leaves[path]!r})") from None
    return Axis(key, path, "field", list(texts), values)


def parse_sweep(spec: str, ctx: ConfigContext) -> Axis:
    """'KEY:V1,V2,...' -> Axis."""
    key, sep, values = spec.partition(":")
    texts = split_values(values) if sep else []
    if not sep or not any(texts) or any(t == "" for t in texts):
        raise AblationError(f"--sweep={spec!r}: expected KEY:VALUE1,VALUE2,... (no empty values)")
    if len(set(texts)) < len(texts):
        raise AblationError(f"--sweep={spec!r}: a value is listed twice")
    return resolve_key(key, ctx, texts)


def parse_set(spec: str, ctx: ConfigContext) -> Axis:
    """'KEY=VALUE' -> an Axis of one value."""
    key, sep, value = spec.partition("=")
    if not sep:
        raise AblationError(f"--set {spec!r}: expected FIELD=VALUE")
    return resolve_key(key, ctx, [value], what="--set")


# ------------------------------------------------------------------------------ the grid


def safe_label(text: str) -> str:
    """A directory name: characters other than letters, digits and ._=,+@- become '_'; a long
    name is cut and completed by a hash of the whole."""
    label = re.sub(r"[^A-Za-z0-9._=,+@-]", "_", text) or "default"
    if label.startswith(("-", ".")):
        label = "_" + label
    if len(label) > 120:
        label = label[:100] + "-" + hashlib.sha1(text.encode()).hexdigest()[:10]
    return label


@dataclasses.dataclass
class Variant:
    label: str
    variant: dict[str, Any]  # target -> value (the swept keys only)
    arg: str | None  # the config argument
    fields: list[tuple[str, str, Any]]  # (path, text, value) of --set and swept fields, in order


@dataclasses.dataclass
class Run:
    label: str
    variant: dict[str, Any]
    seed: int
    workdir: str
    arg: str | None
    fields: list[tuple[str, str, Any]]


def make_variants(ctx: ConfigContext, axes: Sequence[Axis], sets: Sequence[Axis]) -> list[Variant]:
    """The cartesian product of the sweep axes (first axis slowest), with the --set overrides."""
    set_args = combine_args(*(f"{a.target}={a.texts[0]}" for a in sets if a.kind == "arg")) if any(
        a.kind == "arg" for a in sets) else None
    set_fields = [(a.target, a.texts[0], a.values[0]) for a in sets if a.kind == "field"]
    targets = [a.target for a in axes]
    if len(set(targets)) < len(targets):
        raise AblationError(f"--sweep: a key is swept twice ({', '.join(targets)})")
    clash = set(targets) & {a.target for a in sets}
    if clash:
        raise AblationError(f"{', '.join(sorted(clash))}: both swept and fixed by --set")
    variants, labels = [], {}
    for combo in itertools.product(*(range(len(a.texts)) for a in axes)):
        chosen = [(a, i) for a, i in zip(axes, combo)]
        arg_items = [f"{a.target}={a.texts[i]}" for a, i in chosen if a.kind == "arg"]
        arg = combine_args(ctx.arg, set_args, *arg_items)
        fields = set_fields + [(a.target, a.texts[i], a.values[i]) for a, i in chosen if a.kind == "field"]
        text = ",".join(f"{a.target}={a.texts[i]}" for a, i in chosen) or "default"
        label = safe_label(text)
        if label in labels:
            raise AblationError(f"variants {labels[label]!r} and {text!r} have the same directory name {label!r}")
        labels[label] = text
        variants.append(Variant(label, {a.target: a.values[i] for a, i in chosen}, arg, fields))
    return variants


def config_argv(config_path: str, arg: str | None, fields: Sequence[tuple[str, str, Any]]) -> list[str]:
    """The config flags of a variant: --config=<file>[:<arg>] and --config.<field>=<text>."""
    spec = config_path if arg is None else f"{config_path}:{arg}"
    return [f"--config={spec}"] + [f"--config.{path}={text}" for path, text, _ in fields]


def build_config(config_path: str, arg: str | None, fields: Sequence[tuple[str, str, Any]]) -> Any:
    """The config a run of this variant gets (before seed and workdir): the config module's
    get_config(arg) with the field overrides applied by config_flags from the very flags the
    run is given, so a flag the job would reject fails here."""
    from absl import flags  # noqa: PLC0415
    from ml_collections import config_flags  # noqa: PLC0415

    argv = ["ablate", *config_argv(config_path, arg, fields)]
    values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "Experiment config.", flag_values=values, sys_argv=argv)
    values(argv)
    return values.config


JOB_MODULES = {"synth": "rlcode.train.loop", "agent": "rlcode.train.agent",  # as experiments/train.py picks
               "pretrain": "rlcode.train.pretrain"}


def validate_variants(ctx: ConfigContext, variants: Sequence[Variant]) -> None:
    """Build every variant's config and run its job's own config check (`validate_config` of
    rlcode.train.loop, or of rlcode.train.agent for ``job = "agent"``) on it as the engine
    resolves it (a ``model.init_from`` checkpoint's architecture); raise AblationError naming the
    variant on the first failure."""
    for v in variants:
        try:
            cfg = build_config(ctx.path, v.arg, v.fields)
            job = importlib.import_module(JOB_MODULES.get(cfg.get("job", "synth"), JOB_MODULES["synth"]))
            if hasattr(job, "validate_config"):
                from rlcode.train.engine import resolve_config  # noqa: PLC0415

                job.validate_config(resolve_config(cfg))
        except Exception as e:  # noqa: BLE001
            lines = [line for line in str(e).splitlines() if line.strip()]
            raise AblationError(f"variant {v.label}: {type(e).__name__}: {lines[-1] if lines else ''}") from None


def make_runs(variants: Sequence[Variant], seeds: Sequence[int], out_dir: str) -> list[Run]:
    """Seed-major order: every variant's first seed before any second seed, so a partial grid
    already compares all variants."""
    return [Run(v.label, v.variant, s, os.path.join(out_dir, v.label, f"seed{s}"), v.arg, v.fields)
            for s in seeds for v in variants]


def run_command(run: Run, config_path: str, resume: bool, train_module: str = TRAIN_MODULE,
                python: str = sys.executable) -> list[str]:
    cmd = [python, "-m", train_module, *config_argv(config_path, run.arg, run.fields)]
    cmd += [f"--config.seed={run.seed}", f"--config.workdir={run.workdir}"]
    if resume:
        cmd.append("--config.resume=True")
    return cmd


def read_summary(workdir: str) -> dict | None:
    try:
        with open(os.path.join(workdir, "summary.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def run_state(workdir: str) -> str:
    """'completed' (summary.json says so: skip), 'started' (config.json or checkpoints exist:
    continue with resume=True) or 'new'."""
    summary = read_summary(workdir)
    if summary and summary.get("completed"):
        return "completed"
    if os.path.exists(os.path.join(workdir, "config.json")) or os.path.isdir(os.path.join(workdir, "checkpoints")):
        return "started"
    return "new"


def log_tail(path: str, lines: int = LOG_TAIL_LINES, start: int = 0) -> str:
    """The last `lines` lines of the file from byte `start` (progress-bar carriage returns as
    line breaks)."""
    try:
        with open(path, "rb") as f:
            f.seek(start)
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    rows = [r for r in text.replace("\r", "\n").split("\n") if r.strip()]
    return "\n".join(rows[-lines:])


class Interrupted(Exception):
    """The user stopped the grid (Ctrl-C or SIGTERM)."""


# What a Ray task's `execute` starts the command through, to give it the state a shell would. (1)
# It dies with the worker (Linux's parent-death signal, kept across exec): a worker or node that
# is lost leaves no process behind to race the retry for the run directory. (2) Signals are
# unblocked: Ray's workers block SIGINT, and a child inherits that, so the run would never see
# the one SIGINT that stops it with a checkpoint. Then it execs the command: same process, same argv.
IN_RAY_TASK = """\
import ctypes, os, signal, sys
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
except (OSError, AttributeError):
    pass  # not Linux: no such signal
if os.getppid() != int(sys.argv[1]):
    os._exit(1)  # the parent died before the signal was armed
signal.pthread_sigmask(signal.SIG_SETMASK, ())
signal.signal(signal.SIGINT, signal.SIG_DFL)
os.execvp(sys.argv[2], sys.argv[2:])
"""


def _wait(proc: subprocess.Popen, stop_file: str | None = None) -> int | None:
    """proc.wait(), in short slices: a KeyboardInterrupt that is raised in this thread without a
    signal is delivered within a fraction of a second. None (the process still running) once
    `stop_file` exists."""
    while True:
        try:
            return proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            if stop_file and os.path.exists(stop_file):
                return None


def execute(run: Run, cmd: Sequence[str], say=print, in_ray_task: bool = False, stop_file: str | None = None) -> dict:
    """Run `cmd` with its output appended to <workdir>/log.txt; Ctrl-C (or `stop_file` appearing)
    sends the child one SIGINT (it checkpoints and exits), a Ctrl-C after that kills it, then
    Interrupted is raised. Returns (and writes to <workdir>/ablate_status.json) {"status",
    "returncode", "seconds", "log_tail"}. `in_ray_task`: the child is started through IN_RAY_TASK
    (it dies with this process)."""
    os.makedirs(run.workdir, exist_ok=True)
    with open(os.path.join(run.workdir, "command.txt"), "w") as f:
        f.write(shlex.join(cmd) + "\n")
    log_path = os.path.join(run.workdir, "log.txt")
    t0 = time.perf_counter()
    with open(log_path, "ab") as log:
        start = log.tell()
        log.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(cmd)}\n".encode())
        log.flush()
        # Its own session: a terminal's Ctrl-C reaches only this process, which forwards exactly
        # one SIGINT (a second signal would make the job abort without its checkpoint).
        argv = [sys.executable, "-c", IN_RAY_TASK, str(os.getpid()), *cmd] if in_ray_task else list(cmd)
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            returncode = _wait(proc, stop_file)
        except KeyboardInterrupt:
            returncode = None
        interrupted = returncode is None
        if interrupted:
            say(f"  interrupted: stopping {run.label} seed {run.seed} (it saves a checkpoint); "
                "Ctrl-C again kills it")
            try:
                proc.send_signal(signal.SIGINT)
                returncode = _wait(proc)
            except KeyboardInterrupt:
                proc.kill()
                returncode = proc.wait()
    seconds = time.perf_counter() - t0
    summary = read_summary(run.workdir)
    if summary and summary.get("completed") and returncode == 0:
        status = "completed"
    elif interrupted:
        status = "interrupted"
    else:
        status = "failed"
    info = {"status": status, "returncode": returncode, "seconds": seconds,
            "log_tail": "" if status == "completed" else log_tail(log_path, start=start)}
    with open(os.path.join(run.workdir, STATUS_FILE), "w") as f:
        json.dump(info, f, indent=1)
    if interrupted:
        raise Interrupted(info)
    return info


def run_status(workdir: str) -> dict:
    """Status of a run directory without running it: completed / failed / interrupted /
    incomplete / missing, with the log tail of a failure."""
    summary = read_summary(workdir)
    if summary and summary.get("completed"):
        return {"status": "completed"}
    try:
        with open(os.path.join(workdir, STATUS_FILE)) as f:
            info = json.load(f)
        if info.get("status") in ("failed", "interrupted"):
            return {"status": info["status"], "returncode": info.get("returncode"),
                    "log_tail": info.get("log_tail", "")}
    except (OSError, ValueError):
        pass
    return {"status": "incomplete" if os.path.isdir(workdir) else "missing"}


# ------------------------------------------------------------------------------ launchers


LAUNCHERS = ("local", "ray")
RAY_FLAGS = ("--ray_address", "--cpus_per_run", "--gpus_per_run", "--max_retries")
LAUNCH_FLAGS = ("--launcher", *RAY_FLAGS)  # left out of the recorded command
DEFAULT_MAX_RETRIES = 3
CONNECT_TIMEOUT = 5.0  # seconds to reach a cluster's address before ray.init is tried


def prepare(run: Run, config_path: str, train_module: str) -> tuple[str, list[str]]:
    """(run_state, command) of a run about to start: a started run is continued with resume=True."""
    state = run_state(run.workdir)
    return state, run_command(run, config_path, state == "started", train_module)


def report(head: str, info: dict, say) -> bool:
    """Print the line of a finished run (with the log tail of a failure); True when it completed."""
    minutes = info["seconds"] / 60
    if info["status"] == "completed":
        say(f"{head}: completed in {minutes:.1f} min")
        return True
    why = f"exit {info['returncode']}" if info.get("returncode") is not None else info.get("error", "lost")
    say(f"{head}: FAILED ({why}) after {minutes:.1f} min; last lines:\n"
        + textwrap.indent(info["log_tail"][-2000:], "    "))
    return False


def launch_local(runs: Sequence[Run], config_path: str, train_module: str, say) -> int:
    """Run the grid here, one run after the other. Returns the number of failed runs."""
    t_grid = time.perf_counter()
    failed = 0
    for i, run in enumerate(runs, 1):
        head = f"[{i}/{len(runs)}] {run.label} seed {run.seed}"
        state, cmd = prepare(run, config_path, train_module)
        if state == "completed":
            say(f"{head}: completed before, skipped")
            continue
        elapsed = (time.perf_counter() - t_grid) / 60
        say(f"{head}: {'resuming' if state == 'started' else 'starting'} (grid elapsed {elapsed:.1f} min; "
            f"log {os.path.join(run.workdir, 'log.txt')})")
        failed += not report(head, execute(run, cmd, say), say)
    return failed


def import_ray() -> Any:
    """The ray module, or AblationError saying how to install it."""
    try:
        import ray  # noqa: PLC0415
    except ImportError as e:
        raise AblationError(f"--launcher=ray needs the ray package ({e}); install it with "
                            "pip install -e \".[distributed]\"") from None
    return ray


def check_ray_address(address: str) -> str:
    """`address` as given to --ray_address: '' (a local instance), 'auto', HOST:PORT or
    ray://HOST:PORT. Returns it, or raises AblationError."""
    if address in ("", "auto"):
        return address
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit():
        raise AblationError(f"--ray_address={address!r}: expected auto, HOST:PORT or ray://HOST:PORT "
                            "(empty: start a Ray instance on this machine)")
    return address


def _reach(address: str, target: str) -> None:
    """Open (and close) a TCP connection to `target` (HOST:PORT, or ray://HOST:PORT): ray.init
    retries an address nothing listens on for minutes, this says so at once."""
    import socket  # noqa: PLC0415

    host, _, port = target.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT).close()
    except (OSError, ValueError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e) or type(e).__name__
        via = "" if target == address else f" (found at {target})"
        raise AblationError(f"--ray_address={address}: cannot reach the Ray cluster{via}: {reason}; is its head "
                            "node up (ray start --head)?") from None


def _cluster_target(address: str) -> str | None:
    """The HOST:PORT that 'auto' would connect to (RAY_ADDRESS, else the cluster `ray start`
    last started here), or None when Ray cannot tell."""
    env = os.environ.get("RAY_ADDRESS", "")
    if env and env not in ("auto", "local"):
        return env
    try:
        from ray._private.services import canonicalize_bootstrap_address  # noqa: PLC0415
    except ImportError:
        return None
    try:
        return canonicalize_bootstrap_address(address)
    except ConnectionError:
        raise AblationError(f"--ray_address={address}: no running Ray cluster found; start one (ray start --head) "
                            "or give its HOST:PORT") from None
    except Exception:  # noqa: BLE001 (Ray's resolution changed: leave it to ray.init)
        return None


def check_ray(address: str) -> Any:
    """The ray module, once it is known to be installed and the cluster at `address` (not '', a
    local instance) to be listening; else AblationError. Cheap: before anything is built or run."""
    ray = import_ray()
    if address and not ray.is_initialized():
        target = _cluster_target(address) if address == "auto" else address
        if target:
            _reach(address, target)
    return ray


@contextlib.contextmanager
def ray_connection(address: str):
    """The connection runs are launched through. A process already connected to Ray (a program
    that calls `main` after ray.init) keeps its connection; else '' starts a Ray instance on this
    machine for the grid and stops it afterwards, and 'auto', HOST:PORT or ray://HOST:PORT
    connects to a running cluster (and disconnects afterwards). Yields the ray module; raises
    AblationError (one line) when ray is missing or the cluster cannot be reached."""
    import logging  # noqa: PLC0415

    ray = check_ray(address)
    if ray.is_initialized():
        yield ray
        return
    if not address:
        kwargs = {"address": "local", "include_dashboard": False, "log_to_driver": False,
                  "logging_level": logging.WARNING}
    elif address.startswith("ray://"):
        kwargs = {"address": address}
    else:
        kwargs = {"address": address, "log_to_driver": False, "logging_level": logging.WARNING}
    sigterm = signal.getsignal(signal.SIGTERM)  # ray.init installs its own handler
    try:
        ray.init(**kwargs)
    except Exception as e:  # noqa: BLE001 (any failure to connect is the user's to fix)
        signal.signal(signal.SIGTERM, sigterm)
        lines = [line for line in str(e).splitlines() if line.strip()]
        where = f"--ray_address={address}" if address else "a local Ray instance"
        raise AblationError(f"{where}: ray.init failed: {type(e).__name__}: {lines[0] if lines else ''}") from None
    try:
        yield ray
    finally:
        ray.shutdown()
        signal.signal(signal.SIGTERM, sigterm)


def ray_capacity(ray: Any, cpus: float, gpus: float) -> tuple[str, int]:
    """(a description of the cluster, how many runs of `cpus` CPUs and `gpus` GPUs fit on it at
    once). Raises AblationError when no node can hold one run (Ray would wait forever)."""
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    fits = sum(int(min(r.get("CPU", 0) // cpus if cpus else math.inf, r.get("GPU", 0) // gpus if gpus else math.inf))
               for r in nodes if r.get("CPU", 0) >= cpus and r.get("GPU", 0) >= gpus)
    total_cpu, total_gpu = (sum(r.get(k, 0) for r in nodes) for k in ("CPU", "GPU"))
    about = f"{len(nodes)} node(s), {total_cpu:g} CPUs, {total_gpu:g} GPUs"
    if not fits:
        largest = ", ".join(sorted({f"{r.get('CPU', 0):g} CPUs + {r.get('GPU', 0):g} GPUs" for r in nodes})) or "none"
        raise AblationError(f"no node of the Ray cluster ({about}) has {cpus:g} CPU(s) and {gpus:g} GPU(s) for one "
                            f"run (its nodes: {largest}); lower --cpus_per_run / --gpus_per_run")
    return about, fits


def run_in_ray_task(run: dict, cmd: list[str], cwd: str, stop_file: str | None = None) -> dict | None:
    """The body of a run's Ray task: `execute` from `cwd`, the directory ablate was started in
    (the checkout, at the same path on every node), the run's process tied to this worker and
    stopped (one SIGINT) when `stop_file` appears. None, and nothing run, when it exists already."""
    import socket  # noqa: PLC0415

    try:
        os.chdir(cwd)
    except OSError as e:
        raise RuntimeError(f"node {socket.gethostname()}: cannot enter {cwd} ({e.strerror}); every node needs "
                           "the checkout at the same path") from None
    if stop_file and os.path.exists(stop_file):
        return None
    return execute(Run(**run), cmd, in_ray_task=True, stop_file=stop_file)


def record_lost(run: Run, error: str, seconds: float) -> dict:
    """Record (in <workdir>/ablate_status.json, as `execute` records a failure) a run whose Ray
    task was lost more often than --max_retries allows."""
    log_path = os.path.join(run.workdir, "log.txt")
    tail = log_tail(log_path)
    info = {"status": "failed", "returncode": None, "seconds": seconds, "error": error,
            "log_tail": (tail + "\n" if tail else "") + f"ablate: the run's Ray task was lost: {error}"}
    os.makedirs(run.workdir, exist_ok=True)
    with open(os.path.join(run.workdir, STATUS_FILE), "w") as f:
        json.dump(info, f, indent=1)
    return info


def _ray_error(e: Exception) -> str:
    """One line: the exception's type and first line (for an exception the task itself raised,
    that one's: the wrapper's first line only names the task)."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException) and cause is not e:
        e = cause
    lines = [line for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[0].strip() if lines else ''}"[:300]


def _settle(ray: Any, refs: Sequence[Any], timeout: float | None = None) -> None:
    """Wait (in short slices, so Ctrl-C is seen) until every task of `refs` has ended."""
    end = None if timeout is None else time.monotonic() + timeout
    refs = list(refs)
    while refs and (end is None or time.monotonic() < end):
        _, refs = ray.wait(refs, num_returns=len(refs), timeout=0.5)


def launch_ray(ray: Any, runs: Sequence[Run], config_path: str, train_module: str, say, out_dir: str,
               cpus: float = 1.0, gpus: float = 0.0, max_retries: int = DEFAULT_MAX_RETRIES) -> int:
    """Run the grid as Ray tasks, as many at once as the cluster's CPUs and GPUs allow (each task
    asks for `cpus` and `gpus`), each task running what `launch_local` runs (`execute`). A task
    lost with its worker or node (or failing in Ray itself) is started again, resuming, up to
    `max_retries` times, then recorded as failed; a run whose command fails is recorded as failed
    and not retried. Returns the number of failed runs.

    Ctrl-C creates a stop file in `out_dir` (the grid's directory, on the file system every node
    shares), which each running task answers by sending its run one SIGINT and a waiting task by
    not starting (Ray's own cancellation of a running task, a KeyboardInterrupt raised in it, is
    not reliably delivered); a second Ctrl-C kills the tasks' workers, and with them their runs."""
    n = len(runs)
    todo = []
    for i, run in enumerate(runs, 1):
        if run_state(run.workdir) == "completed":
            say(f"[{i}/{n}] {run.label} seed {run.seed}: completed before, skipped")
        else:
            todo.append(run)
    if not todo:
        return 0
    about, fits = ray_capacity(ray, cpus, gpus)
    say(f"Ray cluster: {about}; {len(todo)} run(s) of {cpus:g} CPU(s) + {gpus:g} GPU(s) each, up to {fits} at "
        f"a time (each run's output: its log.txt)")
    # By module name, also when this file runs as __main__: the workers import it. Retries are
    # counted here, so Ray's own are off.
    body = importlib.import_module(__spec__.name if __spec__ else __name__).run_in_ray_task
    task = ray.remote(body)
    cwd = os.getcwd()
    stop_file = os.path.join(os.path.abspath(out_dir), f".ablate_stop_{os.getpid()}_{time.time_ns()}")
    pending: dict[Any, tuple[Run, int, float]] = {}  # task -> (run, attempt, submitted)
    done, failed = n - len(todo), 0

    def submit(run: Run, attempt: int) -> bool:
        state, cmd = prepare(run, config_path, train_module)
        if state == "completed":  # a lost task whose run had finished
            return False
        ref = task.options(num_cpus=cpus, num_gpus=gpus, max_retries=0, name=f"ablate {run.label} seed{run.seed}"
                           ).remote(dataclasses.asdict(run), cmd, cwd, stop_file)
        pending[ref] = (run, attempt, time.perf_counter())
        return True

    for run in todo:
        submit(run, 1)
    try:
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=0.5)
            for ref in ready:
                run, attempt, t0 = pending.pop(ref)
                name = f"{run.label} seed {run.seed}"
                try:
                    info = ray.get(ref)
                except ray.exceptions.RayError as e:
                    error = _ray_error(e)
                    if attempt <= max_retries:
                        say(f"[{done}/{n}] {name}: lost ({error}); retrying ({attempt} of {max_retries})")
                        if submit(run, attempt + 1):
                            continue
                        summary = read_summary(run.workdir) or {}
                        info = {"status": "completed", "seconds": summary.get("seconds") or 0.0}
                    else:
                        info = record_lost(run, error, time.perf_counter() - t0)
                done += 1
                failed += not report(f"[{done}/{n}] {name}", info, say)
    except KeyboardInterrupt:
        say(f"interrupted: stopping {len(pending)} run(s) (a running one saves a checkpoint); Ctrl-C again kills them")
        try:
            os.makedirs(os.path.dirname(stop_file), exist_ok=True)
            with open(stop_file, "w") as f:
                f.write(f"Ctrl-C at {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
            _settle(ray, pending)
        except KeyboardInterrupt:
            for ref in pending:
                ray.cancel(ref, force=True)
            _settle(ray, pending, timeout=30)
        raise
    finally:
        with contextlib.suppress(OSError):
            os.remove(stop_file)
    return failed


# ------------------------------------------------------------------------------ results


def _finite(x: Any) -> float | None:
    return float(x) if x is not None and math.isfinite(float(x)) else None


def _jsonable(v: Any) -> Any:
    if isinstance(v, tuple):
        return [_jsonable(x) for x in v]
    if isinstance(v, float):
        return _finite(v)
    return v


def thin(steps: Sequence[int], values: Sequence[float], points: int = CURVE_POINTS) -> tuple[list[int], list[float]]:
    """At most `points` points: the mean value over consecutive windows of ceil(n / points)
    logged steps, at each window's last step (NaN values ignored; an all-NaN window is NaN)."""
    n = len(steps)
    if n <= points:
        return list(steps), list(values)
    w = math.ceil(n / points)
    out_s, out_v = [], []
    for i in range(0, n, w):
        chunk = np.asarray(values[i:i + w], np.float64)
        out_s.append(int(steps[min(i + w, n) - 1]))
        out_v.append(float(np.nanmean(chunk)) if np.isfinite(chunk).any() else math.nan)
    return out_s, out_v


def choose_metric(run_dirs: Sequence[str]) -> str:
    """eval_fresh/pass@1 when every run that logged eval/pass@1 also logged it, else eval/pass@1."""
    seen_eval = seen_fresh = 0
    for d in run_dirs:
        try:
            records = read_jsonl(find_jsonl_dir(d))
        except (FileNotFoundError, OSError):
            continue
        keys = set().union(*records) if records else set()
        seen_eval += "eval/pass@1" in keys
        seen_fresh += "eval/pass@1" in keys and "eval_fresh/pass@1" in keys
    return "eval_fresh/pass@1" if seen_eval and seen_fresh == seen_eval else "eval/pass@1"


def first_reach(steps: Sequence[int], values: Sequence[float], threshold: float) -> int | None:
    """The first step whose value is >= threshold, or None."""
    for s, v in zip(steps, values):
        if v is not None and math.isfinite(v) and v >= threshold:
            return int(s)
    return None


def run_results(workdir: str, metric: str, threshold: float) -> dict:
    """Final metrics and curves of one run directory (empty when it logged nothing yet)."""
    prefix = metric.split("/", 1)[0]
    out: dict[str, Any] = {"final": {}, "curves": {}, "best_of_key": None}
    try:
        jsonl_dir = find_jsonl_dir(workdir)
    except FileNotFoundError:
        return out
    records = read_jsonl(jsonl_dir)
    keys = set().union(*records) if records else set()
    best = sorted((k for k in keys if re.fullmatch(re.escape(prefix) + r"/best_of_\d+", k)),
                  key=lambda k: int(k.rsplit("_", 1)[1]))
    best_key = best[-1] if best else None
    length_key = f"{prefix}/length"
    tags = [metric] + ([best_key] if best_key else []) + [length_key] + list(TRAIN_TAGS)
    series = run_series(workdir, tags)
    curves = {}
    for tag in [metric, best_key]:
        if tag in series:
            curves[tag] = [[s, _finite(v)] for s, v in zip(*series[tag])]
    for tag in TRAIN_TAGS:
        if tag in series:
            pairs = [(s, v) for s, v in zip(*series[tag]) if s >= 0]
            s, v = thin([p[0] for p in pairs], [p[1] for p in pairs])
            curves[tag] = [[a, _finite(b)] for a, b in zip(s, v)]
    last = lambda tag: _finite(series[tag][1][-1]) if tag in series and series[tag][1] else None
    final = {"metric": last(metric), "best_of": last(best_key) if best_key else None, "length": last(length_key),
             "steps_to_threshold": first_reach(*series[metric], threshold) if metric in series else None}
    summary = read_summary(workdir)
    if summary and summary.get("seconds") is not None:
        final["minutes"] = summary["seconds"] / 60
    else:
        walls = [r["wall_time"] for r in records if "wall_time" in r]
        final["minutes"] = (max(walls) - min(walls)) / 60 if len(walls) > 1 else None
    if summary:
        final["steps_done"] = summary.get("steps_done")
    else:
        final["steps_done"] = max(r["step"] for r in records) if records else None
    out.update(final=final, curves=curves, best_of_key=best_key)
    return out


def _stat(values: Sequence[float | None]) -> dict:
    vals = [v for v in values if v is not None]
    if not vals:
        return {"mean": None, "std": None, "n": 0}
    mean, std = _mean_std(vals)
    return {"mean": mean, "std": std if len(vals) > 1 else None, "n": len(vals)}  # no sample std of one value


def aggregate(runs: Sequence[dict]) -> list[dict]:
    """Per-variant rows (in the runs' first-seen label order), over the completed runs."""
    order: dict[str, list[dict]] = {}
    for r in runs:
        order.setdefault(r["label"], []).append(r)
    rows = []
    for label, group in order.items():
        done = [r for r in group if r["status"] == "completed"]
        reach = [r["final"].get("steps_to_threshold") for r in done]
        steps = _stat(reach)
        steps["reached"] = sum(x is not None for x in reach)
        steps["n"] = len(done)
        rows.append({
            "label": label, "variant": group[0]["variant"], "seeds": [r["seed"] for r in group],
            "runs": len(group), "completed": len(done), "failed": sum(r["status"] == "failed" for r in group),
            "final": _stat([r["final"].get("metric") for r in done]),
            "best_of": _stat([r["final"].get("best_of") for r in done]),
            "steps_to_threshold": steps,
            "length": _stat([r["final"].get("length") for r in done]),
            "minutes": _stat([r["final"].get("minutes") for r in done]),
        })
    return rows


def summarize_grid(runs: Sequence[dict], metric: str | None = None, threshold: float = DEFAULT_THRESHOLD,
                   **meta: Any) -> dict:
    """The results dict (the JSON) of `runs`: [{label, variant, seed, workdir}, ...]; each run's
    status comes from its directory. `meta` (command, sweep, overrides, seeds, ...) is copied in."""
    metric = metric or choose_metric([r["workdir"] for r in runs])
    out_runs = []
    best_keys = []
    for r in runs:
        entry = {"label": r["label"], "variant": {k: _jsonable(v) for k, v in r["variant"].items()},
                 "seed": r["seed"], "workdir": r["workdir"], **run_status(r["workdir"])}
        res = run_results(r["workdir"], metric, threshold)
        entry["final"], entry["curves"] = res["final"], res["curves"]
        if res["best_of_key"]:
            best_keys.append(res["best_of_key"])
        out_runs.append(entry)
    prefix = metric.split("/", 1)[0]
    best = max(set(best_keys), key=best_keys.count) if best_keys else f"{prefix}/best_of_n"
    data = dict(meta)
    data.update(metric=metric, best_of=best, length=f"{prefix}/length", train_tag=REWARD_TAG, threshold=threshold,
                runs=out_runs, table=aggregate(out_runs))
    return data


# ------------------------------------------------------------------------------ table and figure


def _fmt(stat: dict, digits: int = 3) -> str:
    if not stat or stat.get("mean") is None:
        return "—"
    if stat["n"] < 2:
        return f"{stat['mean']:.{digits}f}"
    return f"{stat['mean']:.{digits}f} ± {stat['std']:.{digits}f}"


def mean_std_text(values: Sequence[float | None], digits: int = 3) -> str:
    """The table cell of `values` (None skipped): mean ± sample std, one value alone, "—" for none."""
    return _fmt(_stat(values), digits)


def _steps_text(stat: dict) -> str:
    text = f"{stat['reached']}/{stat['n']} reached"
    return text + (f", {_fmt(dict(stat, n=stat['reached']), 0)}" if stat["reached"] else "")


def markdown_table(data: dict) -> str:
    """The results table of `data` (the JSON dict) as markdown, headed by the command."""
    m, thr = data["metric"], data["threshold"]
    lines = []
    if data.get("command"):
        lines += [f"`{data['command']}`", ""]
    lines += [f"| variant | seeds completed | final {m} | final {data['best_of']} | steps to {m} ≥ {thr:g} "
              f"| mean length ({data['length']}) | wall time (min) |",
              "|---|---|---|---|---|---|---|"]
    for row in data["table"]:
        done = f"{row['completed']}/{row['runs']}" + (f" ({row['failed']} failed)" if row["failed"] else "")
        lines.append(f"| {row['label']} | {done} | {_fmt(row['final'])} | {_fmt(row['best_of'])} | "
                     f"{_steps_text(row['steps_to_threshold'])} | {_fmt(row['length'], 1)} | "
                     f"{_fmt(row['minutes'], 1)} |")
    lines += ["", f"Mean ± sample std over each variant's completed seeds; final = last evaluation. "
              f"Steps to threshold: first evaluated step with {m} ≥ {thr:g}, mean over the seeds that reached it."]
    failed = [r for r in data["runs"] if r["status"] not in ("completed", "missing")]
    missing = [r for r in data["runs"] if r["status"] == "missing"]
    if failed or missing:
        lines += ["", "Not completed:"]
        if missing:
            lines.append(f"- {len(missing)} run(s) not started: "
                         + ", ".join(f"{r['label']} seed {r['seed']}" for r in missing))
        for r in failed:
            tail = (r.get("log_tail") or "").strip().splitlines()
            lines.append(f"- {r['label']} seed {r['seed']}: {r['status']}"
                         + (f" (exit {r['returncode']})" if r.get("returncode") is not None else "")
                         + (f": `{tail[-1][:200]}`" if tail else "") + f" — {r['workdir']}")
    return "\n".join(lines) + "\n"


CSV_STATS = ("final", "best_of", "steps_to_threshold", "length", "minutes")


def csv_table(data: dict) -> str:
    """The table as CSV: label, the swept keys, run counts, then mean and std per column."""
    keys = list(dict.fromkeys(k for row in data["table"] for k in row["variant"]))
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    header = ["label", *keys, "runs", "completed", "failed"]
    for name in CSV_STATS:
        header += ([f"{name}_reached"] if name == "steps_to_threshold" else []) + [f"{name}_mean", f"{name}_std"]
    writer.writerow(header)
    for row in data["table"]:
        line = [row["label"], *[json.dumps(row["variant"].get(k)) if isinstance(row["variant"].get(k), list)
                                else row["variant"].get(k) for k in keys], row["runs"], row["completed"], row["failed"]]
        for name in CSV_STATS:
            stat = row[name]
            if name == "steps_to_threshold":
                line.append(stat["reached"])
            line += ["" if stat["mean"] is None else stat["mean"], "" if stat["std"] is None else stat["std"]]
        writer.writerow(line)
    return out.getvalue()


def _panel_runs(data: dict, label: str, tag_of) -> list[tuple[list[int], list[float]]]:
    runs = [r for r in data["runs"] if r["label"] == label]
    done = [r for r in runs if r["status"] == "completed"]
    out = []
    for r in done or runs:
        tag = tag_of(r)
        if tag and r["curves"].get(tag):
            pts = r["curves"][tag]
            out.append(([p[0] for p in pts], [math.nan if p[1] is None else p[1] for p in pts]))
    return out


def plot_ablation(data: dict, path: str) -> str:
    """Draw the ablation figure of `data` (the JSON dict) into the PNG `path`: per variant the
    mean over its completed seeds (all its runs if none completed) with the min-max band, in
    panels for the metric, best-of-n and the training reward. Returns `path`."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415
    from matplotlib.figure import Figure  # noqa: PLC0415

    def best_tag(r):
        return next((t for t in r["curves"] if "/best_of_" in t), None)

    panels = [(data["metric"], lambda r: data["metric"]), (data["best_of"], best_tag),
              (f"{data['train_tag']} (training)", lambda r: data["train_tag"])]
    labels = [row["label"] for row in data["table"]]
    height = max(3.8, 0.25 * len(labels) + 1.0) + (0.5 if data.get("command") else 0)
    fig = Figure(figsize=(5.0 * len(panels) + 2.5, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels), squeeze=False).ravel()
    for ax, (title, tag_of) in zip(axes, panels):
        for i, label in enumerate(labels):
            per_run = _panel_runs(data, label, tag_of)
            if not per_run:
                continue
            steps, avg = mean_series(per_run)
            if not steps:
                continue
            lookups = [dict(zip(s, v)) for s, v in per_run]
            stack = np.array([[lk[s] for s in steps] for lk in lookups], np.float64)
            color = f"C{i % 10}"
            ax.plot(steps, avg, color=color, lw=1.8, label=f"{label} (n={len(per_run)})")
            if len(per_run) > 1:
                ax.fill_between(steps, np.nanmin(stack, axis=0), np.nanmax(stack, axis=0), color=color,
                                alpha=0.15, lw=0)
        if title == data["metric"]:
            ax.axhline(data["threshold"], color="gray", ls=":", lw=1)
        ax.set_title(title)
        ax.set_xlabel("RL step")
        ax.set_ylabel(value_label(title))
        ax.grid(alpha=0.3)
    handles, names = axes[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, names, loc="outside right upper", fontsize="small")
    fig.suptitle(f"ablation: mean over seeds, min-max shaded (threshold {data['threshold']:g})")
    if data.get("command"):
        fig.supxlabel("\n".join(textwrap.wrap(data["command"], 75 * len(panels))), fontsize="x-small",
                      family="monospace")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=130)
    return path


def write_outputs(data: dict, json_path: str, png_path: str) -> dict[str, str]:
    """results JSON, .md and .csv next to it, and the PNG. Returns {kind: path}."""
    base = os.path.splitext(json_path)[0]
    paths = {"json": json_path, "md": base + ".md", "csv": base + ".csv", "png": png_path}
    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    with open(paths["json"], "w") as f:
        json.dump(data, f, indent=1, allow_nan=False)
    with open(paths["md"], "w") as f:
        f.write(markdown_table(data))
    with open(paths["csv"], "w", newline="") as f:
        f.write(csv_table(data))
    plot_ablation(data, png_path)
    return paths


# ------------------------------------------------------------------------------ command line


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m experiments.ablate", description=summary(__doc__),
                                     allow_abbrev=False)
    parser.add_argument("--config", default="configs/grpo_synth.py", help="config file[:argument]")
    parser.add_argument("--sweep", action="append", default=[], help="KEY:V1,V2,... (repeatable: cartesian grid)")
    parser.add_argument("--set", action="append", default=[], dest="sets", metavar="FIELD=VALUE",
                        help="fixed override for every run (repeatable)")
    parser.add_argument("--seeds", type=int, default=None, help="seeds 0..N-1 (default 1)")
    parser.add_argument("--seed_list", default=None, help="comma-separated seeds, e.g. 0,2")
    parser.add_argument("--name", default=None, help="default: the sweep keys joined by '+'")
    parser.add_argument("--out_dir", default=None, help="default: runs/ablate/<name>")
    parser.add_argument("--metric", default=None, help="default: eval_fresh/pass@1 if logged, else eval/pass@1")
    parser.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD, help="for steps-to-threshold")
    parser.add_argument("--results_dir", default=None, help="default: the --out_dir of the runs")
    parser.add_argument("--fig_dir", default=None, help="default: next to the JSON")
    parser.add_argument("--publish", action="store_true",
                        help="write the table and figure to results/ and docs/figures/ (the committed evidence)")
    parser.add_argument("--dry_run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("--table_only", action="store_true", help="rebuild table and figure from the run directories")
    parser.add_argument("--launcher", choices=LAUNCHERS, default="local",
                        help="local: the runs one after the other on this machine; ray: as Ray tasks, "
                             "concurrently as the cluster's resources allow")
    parser.add_argument("--ray_address", default=None,
                        help="with --launcher=ray: empty (default) starts a Ray instance on this machine; auto, "
                             "HOST:PORT or ray://HOST:PORT connects to a running cluster")
    parser.add_argument("--cpus_per_run", type=float, default=None,
                        help="with --launcher=ray: CPUs each run asks Ray for (default 1)")
    parser.add_argument("--gpus_per_run", type=float, default=None,
                        help="with --launcher=ray: GPUs each run asks Ray for (default 0; Ray sets the run's "
                             "CUDA_VISIBLE_DEVICES)")
    parser.add_argument("--max_retries", type=int, default=None,
                        help=f"with --launcher=ray: times a run lost with its worker or node is started again "
                             f"(resuming; default {DEFAULT_MAX_RETRIES}); a run whose command fails is not retried")
    parser.add_argument("--train_module", default=TRAIN_MODULE, help=argparse.SUPPRESS)
    args, unknown = parser.parse_known_args(argv)
    for item in unknown:  # --config.FIELD=VALUE, as on experiments.train's command line
        if item.startswith("--config.") and "=" in item:
            args.sets.append(item[len("--config."):])
        else:
            parser.error(f"unrecognized argument {item!r}")
    if args.seeds is not None and args.seed_list is not None:
        parser.error("give --seeds or --seed_list, not both")
    if args.seed_list is not None:
        try:
            args.seed_values = [int(s) for s in args.seed_list.split(",") if s.strip()]
        except ValueError:
            parser.error(f"--seed_list={args.seed_list!r}: expected comma-separated integers")
    else:
        if args.seeds is not None and args.seeds < 1:
            parser.error("--seeds must be >= 1")
        args.seed_values = list(range(args.seeds or 1))
    if not args.seed_values or len(set(args.seed_values)) < len(args.seed_values):
        parser.error("seeds must be distinct and at least one")
    if args.dry_run and args.table_only:
        parser.error("give --dry_run or --table_only, not both")
    given = [flag for flag in RAY_FLAGS if getattr(args, flag[2:]) is not None]
    if args.launcher != "ray" and given:
        parser.error(f"{', '.join(given)}: only with --launcher=ray")
    if args.cpus_per_run is not None and not args.cpus_per_run > 0:
        parser.error(f"--cpus_per_run={args.cpus_per_run:g}: must be > 0")
    if args.gpus_per_run is not None and not args.gpus_per_run >= 0:
        parser.error(f"--gpus_per_run={args.gpus_per_run:g}: must be >= 0")
    if args.max_retries is not None and args.max_retries < 0:
        parser.error(f"--max_retries={args.max_retries}: must be >= 0")
    try:
        args.ray_address = check_ray_address(args.ray_address or "")
    except AblationError as e:
        parser.error(str(e))
    return args


def recorded_command(argv: Sequence[str]) -> str:
    """The command line that produces the runs: without --dry_run / --table_only, and without the
    launcher's flags, which decide where the runs execute, not what they compute (so the table is
    the same whichever launcher ran them)."""
    keep, value_next = [], False
    for a in argv:
        if value_next:
            value_next = False
        elif a.split("=", 1)[0] in LAUNCH_FLAGS:
            value_next = "=" not in a
        elif a not in ("--dry_run", "--table_only"):
            keep.append(a)
    return shlex.join(["python", "-m", "experiments.ablate", *keep])


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    say = lambda msg: print(msg, flush=True)
    try:
        if args.launcher == "ray" and not (args.dry_run or args.table_only):
            check_ray(args.ray_address)  # before the variants' configs are built
        ctx = ConfigContext.load(args.config)
        axes = [parse_sweep(s, ctx) for s in args.sweep]
        sets = [parse_set(s, ctx) for s in args.sets]
        variants = make_variants(ctx, axes, sets)
        validate_variants(ctx, variants)
    except AblationError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    name = safe_label(args.name or "+".join(a.key for a in axes) or "default")
    out_dir = args.out_dir or os.path.join("runs", "ablate", name)
    runs = make_runs(variants, args.seed_values, out_dir)
    results_name = f"ablate_{name}"
    if args.publish and (args.results_dir or args.fig_dir):
        print("error: --publish writes results/ and docs/figures/; drop --results_dir/--fig_dir (or --publish)",
              file=sys.stderr)
        return 2
    json_path, png_path = output_paths(
        results_name, False,
        None if args.publish else os.path.join(args.results_dir or out_dir, results_name + ".json"),
        os.path.join(args.fig_dir, results_name + ".png") if args.fig_dir else None, args.publish)
    meta = {"command": recorded_command(argv), "config": args.config, "name": name, "out_dir": out_dir,
            "sweep": [a.describe() for a in axes],
            "overrides": {a.target: _jsonable(a.values[0]) for a in sets}, "seeds": args.seed_values}

    if args.dry_run:
        for run in runs:
            state = run_state(run.workdir)
            cmd = run_command(run, ctx.path, state == "started", args.train_module)
            if state == "completed":
                say(f"# completed, skipped: {run.label} seed {run.seed}")
            say(("# " if state == "completed" else "") + shlex.join(cmd))
        return 0

    def finish() -> dict:
        data = summarize_grid([dataclasses.asdict(r) for r in runs], args.metric, args.threshold, **meta)
        paths = write_outputs(data, json_path, png_path)
        say(markdown_table(data))
        say("wrote " + ", ".join(paths.values()))
        return data

    if args.table_only:
        finish()
        return 0

    def on_sigterm(signum, frame):
        raise KeyboardInterrupt

    try:
        with contextlib.ExitStack() as stack:
            if args.launcher == "ray":
                ray = stack.enter_context(ray_connection(args.ray_address))
                launch = lambda: launch_ray(  # noqa: E731
                    ray, runs, ctx.path, args.train_module, say, out_dir, cpus=args.cpus_per_run or 1.0,
                    gpus=args.gpus_per_run or 0.0,
                    max_retries=DEFAULT_MAX_RETRIES if args.max_retries is None else args.max_retries)
            else:
                launch = lambda: launch_local(runs, ctx.path, args.train_module, say)  # noqa: E731
            previous = signal.signal(signal.SIGTERM, on_sigterm)
            t_grid = time.perf_counter()
            try:
                failed = launch()
            except (Interrupted, KeyboardInterrupt):
                say("interrupted: writing the partial table (rerun the same command to continue)")
                finish()
                return 130
            finally:
                signal.signal(signal.SIGTERM, previous)
    except AblationError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    say(f"grid done in {(time.perf_counter() - t_grid) / 60:.1f} min" + (f"; {failed} run(s) failed" if failed else ""))
    finish()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
