"""The main job: SFT warm start, then RL of a code-writing policy, evaluated on held-out tasks.

    python -m experiments.train --config=configs/grpo_synth.py

Everything is in `rlcode.train.loop.run` (or `rlcode.train.agent.run` for a config with
``job = "agent"``, e.g. configs/agent_repo.py); this script parses the config and prints where the
results went. See configs/grpo_synth.py for the options (objective, async sampling, mesh, ...).
"""

from __future__ import annotations

import json
import sys

from absl import app, logging
from ml_collections import config_flags

from experiments.cli import translate_aliases

_CONFIG = config_flags.DEFINE_config_file("config", "configs/grpo_synth.py", "Experiment config.")


def main(argv):
    del argv
    # Checkpoint libraries log every file operation at INFO; the job's own progress is enough.
    logging.set_verbosity(logging.WARNING)
    from rlcode.train import agent, loop  # noqa: PLC0415 (after flag parsing: a bad flag fails fast)

    job = agent if _CONFIG.value.get("job", "synth") == "agent" else loop
    try:
        result = job.run(_CONFIG.value)
    except KeyboardInterrupt:
        # Before the RL loop (SFT, compilation) or a second Ctrl-C: nothing half-written is kept.
        print(f"aborted; checkpoints saved so far are in {_CONFIG.value.workdir}/checkpoints "
              "(continue with --config.resume=True)", file=sys.stderr)
        return 130
    first, last = result.first_eval or {}, result.last_eval or {}
    n = _CONFIG.value.eval.num_samples
    keys = ["eval/pass@1", f"eval/best_of_{n}"] + (["eval_fresh/pass@1"] if job is agent else [])
    table = {k: (first.get(k), last.get(k)) for k in keys}
    print(json.dumps({"workdir": result.workdir, "steps": result.steps_done, "completed": result.completed,
                      "interrupted": result.interrupted, "minutes": round(result.seconds / 60, 2),
                      "start -> end": table}, indent=2))
    return 0


if __name__ == "__main__":
    sys.argv[:] = translate_aliases(sys.argv)  # config_flags reads its overrides from sys.argv
    sys.exit(app.run(main))
