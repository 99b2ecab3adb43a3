"""Pretrain a base model on Python code, then export it as a Hugging Face checkpoint.

    python -m experiments.prepare_corpus                                 # once: corpus + tokenizer
    python -m experiments.pretrain --config=configs/pretrain_code.py     # ~2 h on 2 cores
    python -m experiments.pretrain --config.train.max_minutes=60         # one sitting of an hour ...
    python -m experiments.pretrain --config.resume=True                  # ... continued later

Everything is in `rlcode.train.pretrain.run` (the engine's loop over packed rows of the corpus,
checkpoints every ``checkpoint.every`` steps, held-out bits per byte every ``eval.every``); at
the end of every sitting the latest checkpoint is exported with its tokenizer to
``<workdir>/base`` (config.json, model.safetensors, tokenizer files, pretrain.json).

``--publish`` also copies that export to ``--publish_dir`` (default ``checkpoints/code_base``, the
committed base the RL jobs start from), but only once the run has done all of ``train.steps``, so
a partial run never replaces it. Config errors are one line on stderr and exit status 2, as in experiments.train.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Any

from absl import app, flags, logging

from experiments import train as train_cli
from experiments.cli import translate_aliases

DEFAULT_CONFIG = "configs/pretrain_code.py"
PUBLISHED = os.path.join("checkpoints", "code_base")

flags.DEFINE_bool("publish", False, "copy the finished run's export to --publish_dir (committed evidence)")
flags.DEFINE_string("publish_dir", PUBLISHED, "where --publish copies the export")


def publish(base: str, target: str = PUBLISHED) -> None:
    """Replace `target` by a copy of the export `base` (written beside it, then renamed)."""
    tmp = target.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(base, tmp)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)


def main(config: Any) -> int:
    if flags.FLAGS.print_config:
        train_cli.print_config(config, train_cli._config_spec(sys.argv, DEFAULT_CONFIG))
        return 0
    logging.set_verbosity(logging.WARNING)
    from rlcode.checks import ConfigError  # noqa: PLC0415
    from rlcode.train import pretrain  # noqa: PLC0415

    try:
        result = pretrain.run(config)
    except ConfigError as e:
        return train_cli.config_failure(e)
    except KeyboardInterrupt:
        print(f"aborted; checkpoints saved so far are in {config.workdir}/checkpoints "
              "(continue with --config.resume=True)", file=sys.stderr)
        return 130
    base = os.path.join(result.workdir, pretrain.BASE_DIR)
    last = result.last_eval or {}
    print(json.dumps({"workdir": result.workdir, "steps": result.steps_done, "completed": result.completed,
                      "stopped": result.stopped, "minutes": round(result.seconds / 60, 2),
                      "heldout_bpb": last.get("heldout/bpb"), "base": base if result.steps_done else None}, indent=2))
    if flags.FLAGS.publish:
        if not result.completed:
            print(f"--publish: the run is not finished ({result.steps_done} of {config.train.steps} steps); "
                  f"{flags.FLAGS.publish_dir} is left as it is", file=sys.stderr)
            return 1
        publish(base, flags.FLAGS.publish_dir)
        print(f"published {base} -> {flags.FLAGS.publish_dir}")
    return 0


if __name__ == "__main__":
    sys.argv[:] = translate_aliases(sys.argv)
    app.run(main, flags_parser=lambda argv: train_cli.flags_parser(argv, DEFAULT_CONFIG))
