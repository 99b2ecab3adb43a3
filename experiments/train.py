"""The main job: SFT warm start, then RL of a code-writing policy, evaluated on held-out tasks.

    python -m experiments.train --config=configs/grpo_synth.py

Everything is in `rlcode.train.loop.run` (or `rlcode.train.agent.run` for a config with
``job = "agent"``, e.g. configs/agent_repo.py, and `rlcode.train.usage.run` for ``job = "usage"``,
configs/usage_rl.py); this script parses the config and prints where the
results went. See configs/grpo_synth.py for the options (objective, async sampling, mesh, ...).

A config the job cannot run (an unknown field, a value of the wrong type or out of range, a batch
that does not fit in memory, a resume with changed settings) stops the script before any work
with one line on stderr, ``config error: ...`` naming the field, and exit status 2.
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any

from absl import app, flags, logging
from ml_collections import config_flags

from experiments.cli import translate_aliases
from rlcode.checks import ConfigError, unknown_field_error

DEFAULT_CONFIG = "configs/grpo_synth.py"
# Defined once per process: run as `python -m experiments.train`, this module is __main__ and may
# be imported again as experiments.train (by experiments.pretrain), which must not redefine it.
if "print_config" not in flags.FLAGS:
    flags.DEFINE_bool(
        "print_config", False, "Print the resolved config (the file, its argument and every override): each "
        "field's value, its valid values and the config file's comment on it, then exit without running anything.")
CONFIG_ERROR_STATUS = 2
# --config.a.b=v, --config.a.b v, and absl's --noconfig.a.b for a boolean field.
_OVERRIDE = re.compile(r"^--?(?:no)?config\.([^=]+)")


# The config files a job of this script runs, whose `ARGS` (the choices after ':') --help lists.
JOB_CONFIGS = ("configs/grpo_synth.py", "configs/agent_repo.py", "configs/grpo_hf.py", "configs/pretrain_code.py",
               "configs/usage_rl.py")


def config_help(configs: tuple[str, ...] = JOB_CONFIGS) -> str:
    """The --config flag's help: the syntax, then each job config's choices after ':' (its ARGS)."""
    from experiments.ablate import load_config_module  # noqa: PLC0415

    parts = [f"Experiment config: FILE[:NAME=VALUE,...] (default {DEFAULT_CONFIG}); then --config.FIELD=VALUE "
             "overrides any field, and --print_config shows them all. Choices after ':' (each config's "
             "docstring says what they mean):"]
    for path in configs:
        if not os.path.exists(path):
            continue
        try:
            module = load_config_module(path)
        except Exception as e:  # noqa: BLE001  (help must print whatever one config does)
            parts.append(f"{path}: (cannot be loaded: {type(e).__name__})")
            continue
        choices: dict[str, list[str]] = {}
        for arg in getattr(module, "ARGS", ()):
            for part in str(arg).split(","):  # an entry may combine choices (base=code,levels=123)
                name, _, value = part.partition("=")
                if value and value not in choices.setdefault(name, []):
                    choices[name].append(value)
        if choices:
            parts.append(f"{path}: " + ", ".join(f"{n}={'|'.join(v)}" for n, v in choices.items()) + ";")
    return " ".join(parts)


def _config_spec(argv: list[str], default: str = DEFAULT_CONFIG) -> str:
    """The --config=<file>[:<arg>] of a command line (the last one wins, as in absl)."""
    spec = default
    for i, arg in enumerate(argv[1:], 1):
        if arg.startswith(("--config=", "-config=")):
            spec = arg.partition("=")[2]
        elif arg in ("--config", "-config") and i + 1 < len(argv):
            spec = argv[i + 1]
    return spec


def _last_line(error: Exception) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


def _base_config(spec: str) -> Any:
    """The config file's get_config(arg), without overrides (ConfigError if it fails)."""
    values = flags.FlagValues()
    argv = ["train", f"--config={spec}"]
    try:
        config_flags.DEFINE_config_file("config", None, "Experiment config.", flag_values=values, sys_argv=argv)
        values(argv)
    except (flags.Error, ValueError, KeyError, AttributeError, OSError) as e:
        raise ConfigError(f"--config={spec}: {_last_line(e)}") from None
    return values.config


def _paths(cfg: Any, prefix: str = "") -> list[str]:
    out = []
    for name, value in cfg.items():
        out.append(prefix + name)
        if hasattr(value, "items"):
            out += _paths(value, prefix + name + ".")
    return out


def parse_config(argv: list[str], flag_values: flags.FlagValues = flags.FLAGS, default: str = DEFAULT_CONFIG) -> Any:
    """The config of a command line: ``--config=<file>[:<arg>]`` (default `default`)
    and ``--config.<field>=<value>`` overrides, applied by ml_collections' config_flags, which
    defines the flag on `flag_values` and parses all of `argv` there. Raises ConfigError for a
    config file whose get_config fails, an unknown field (naming the closest fields; config_flags
    would fail with a traceback while defining the flag) or a value it cannot parse."""
    argv = list(argv)
    spec = _config_spec(argv, default)
    known = _paths(_base_config(spec))
    for arg in argv[1:]:
        match = _OVERRIDE.match(arg)
        if match and match.group(1) not in known:
            raise unknown_field_error(match.group(1), known)
    if not any(a.startswith(("--config=", "-config=")) or a in ("--config", "-config") for a in argv[1:]):
        argv.insert(1, f"--config={spec}")
    help_text = config_help() if any(a in ("--help", "-h", "--helpfull", "-help") for a in argv[1:]) else "Experiment config."
    config_flags.DEFINE_config_file("config", None, help_text, flag_values=flag_values, sys_argv=argv)
    try:
        flag_values(argv)
    except flags.Error as e:
        message = _last_line(e)
        match = re.match(r"flag --config\.([^=]+)=(.*?): (.*)$", message)
        raise ConfigError(f"{match.group(1)}={match.group(2)}: {match.group(3)}" if match else message) from None
    return flag_values["config"].value


def config_failure(error: ConfigError) -> int:
    """Print `error` as the one-line config error of every entry point; its exit status."""
    print(f"config error: {error}", file=sys.stderr, flush=True)
    return CONFIG_ERROR_STATUS


def flags_parser(argv: list[str], default: str = DEFAULT_CONFIG) -> Any:
    """absl's flags parser for an entry point whose --config defaults to `default`: the parsed
    config, or exit with the one-line config error."""
    try:
        return parse_config(argv, default=default)
    except ConfigError as e:
        sys.exit(config_failure(e))


def _job_schema(config: Any) -> dict[str, Any]:
    """The schema the job checks `config` against (field -> rlcode.checks.Spec, nested); {} when it
    cannot be built (the job's own check then names the problem)."""
    from rlcode.train import agent, loop, pretrain, usage  # noqa: PLC0415
    from rlcode.train.schema import job_schema  # noqa: PLC0415

    job = config.get("job", "synth")
    try:
        if job == "pretrain":
            return pretrain.pretrain_schema(config)
        if job == "usage":
            return job_schema(config, {**loop.SYNTH_SECTIONS, **usage.USAGE_SECTIONS})
        return job_schema(config, agent.AGENT_SECTIONS if job == "agent" else loop.SYNTH_SECTIONS)
    except ConfigError:
        return {}


def _config_comments(path: str) -> dict[str, str]:
    """field path -> the comment on its line in the config file (`cfg.a.b = ...  # comment`)."""
    comments = {}
    try:
        lines = open(path, encoding="utf-8").read().splitlines()
    except OSError:
        return comments
    for line in lines:
        match = re.match(r"\s*cfg\.([\w.]+)\s*=.*?#\s*(.+)$", line)
        if match:
            comments[match.group(1)] = match.group(2).strip()
    return comments


def print_config(config: Any, spec: str, out=None) -> None:
    """Every leaf of `config`, one per line: `path = value`, then `# valid: ...` (the job's schema)
    and the config file's own comment on the field where it has one."""
    from rlcode.checks import flatten  # noqa: PLC0415

    out = out or sys.stdout
    schema = _job_schema(config)
    comments = _config_comments(spec.partition(":")[0])

    def spec_of(path: str) -> Any:
        node: Any = schema
        for part in path.split("."):
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return None if isinstance(node, dict) else node

    lines = [f"# --config={spec} (job: {config.get('job', 'synth')})"]
    for path, value in sorted(flatten(config.to_dict()).items()):
        field_spec = spec_of(path)
        notes = ([f"valid: {field_spec.describe()}"] if field_spec is not None else []) + (
            [comments[path]] if path in comments else [])
        text_value = repr(value) if isinstance(value, str) else json.dumps(value, default=str)
        lines.append(f"{path} = {text_value}" + (f"  # {'; '.join(notes)}" if notes else ""))
    try:
        print("\n".join(lines), file=out)
    except BrokenPipeError:  # `... --print_config | head`: the reader has what it wanted
        sys.stdout = open(os.devnull, "w")


def main(config: Any) -> int:
    if flags.FLAGS.print_config:
        from rlcode.train.engine import resolve_config  # noqa: PLC0415

        print_config(resolve_config(config), _config_spec(sys.argv))
        return 0
    # Checkpoint libraries log every file operation at INFO; the job's own progress is enough.
    logging.set_verbosity(logging.WARNING)
    from rlcode.train import agent, loop, usage  # noqa: PLC0415 (after flag parsing: a bad flag fails fast)
    from kernels import _triton  # noqa: PLC0415

    _triton.configure()  # a model with impl "triton": compiled on a CUDA GPU, interpreted elsewhere

    if config.get("job", "synth") == "pretrain":  # e.g. configs/pretrain_code.py: experiments.pretrain's job
        from experiments import pretrain  # noqa: PLC0415

        return pretrain.main(config)
    job = {"agent": agent, "usage": usage}.get(config.get("job", "synth"), loop)
    try:
        result = job.run(config)
    except ConfigError as e:
        return config_failure(e)
    except KeyboardInterrupt:
        # Before the RL loop (SFT, compilation) or a second Ctrl-C: nothing half-written is kept.
        resume = "" if job is usage else " (continue with --config.resume=True)"
        print(f"aborted; checkpoints saved so far are in {config.workdir}/checkpoints{resume}", file=sys.stderr)
        return 130
    first, last = result.first_eval or {}, result.last_eval or {}
    n = config.eval.num_samples
    keys = ["eval/pass@1", f"eval/best_of_{n}"] + (["eval_fresh/pass@1"] if job is agent else [])
    table = {k: (first.get(k), last.get(k)) for k in keys}
    print(json.dumps({"workdir": result.workdir, "steps": result.steps_done, "completed": result.completed,
                      "interrupted": result.interrupted, "minutes": round(result.seconds / 60, 2),
                      "start -> end": table}, indent=2))
    return 0


if __name__ == "__main__":
    sys.argv[:] = translate_aliases(sys.argv)  # config_flags reads its overrides from sys.argv
    app.run(main, flags_parser=flags_parser)
