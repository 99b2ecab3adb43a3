"""A tiny configuration of the main job (configs/grpo_synth.py) for tests; also a script.

    python tiny_job.py WORKDIR STEPS [name=value ...]

runs `rlcode.train.loop.run` on it (values are Python literals, e.g. `rollout.async_mode=True
mesh.data=8`) and prints the result as one JSON line. Tests run it in subprocesses to send
signals to a real job, or to give it 8 fake CPU devices (set XLA_FLAGS before starting it).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_config(arg=None):
    """configs/grpo_synth.py's config for `arg`, with base=bytes unless `arg` names a base: the
    tests shrink the model, and a pretrained base would fix its shape."""
    from experiments.ablate import combine_args, load_config_module  # noqa: PLC0415

    # Not support.job_config: this module also runs as a script, where `support` is not importable.
    return load_config_module(os.path.join(ROOT, "configs", "grpo_synth.py")).get_config(combine_args("base=bytes", arg))


def tiny_config(workdir, steps=3, arg=None, **overrides):
    """The main job's config shrunk to seconds: a 1-layer model, level-1 tasks, 2 prompts x 4
    samples, no SFT (`sft__steps=2` for a 2-step warm start), 4 eval tasks x 4 samples. `overrides` use '__' for '.'."""
    cfg = load_config(arg)
    cfg.workdir = str(workdir)
    cfg.model.update(d_model=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, ffw_dim=64)
    cfg.task.update(levels=(1,), num_train=24, num_eval=4, num_fresh=0, max_prompt_len=160)
    cfg.sampling.max_new_tokens = 48
    # One train-batch length (the prompt and completion limits fit in 256): a 4-step job then
    # compiles its scoring and train step once instead of once per distinct length.
    cfg.rollout.update(prompts_per_step=2, group_size=4, trim_multiple=256)
    cfg.sandbox.workers = 2
    cfg.sft.update(steps=0, batch_size=4, cache_dir=os.path.join(str(workdir), "sft_cache"), warmup_steps=1)
    cfg.train.steps = steps
    cfg.eval.update(every=2, num_samples=4, ks=(1, 4), prompts_per_batch=4)
    cfg.log.update(text_every=1, num_texts=2)
    cfg.checkpoint.update(every=1, keep=3)
    for key, value in overrides.items():
        set_field(cfg, key.replace("__", "."), value)
    return cfg


def set_field(cfg, dotted, value):
    *path, last = dotted.split(".")
    node = cfg
    for name in path:
        node = node[name]
    node[last] = value


if __name__ == "__main__":
    workdir, steps, *rest = sys.argv[1:]
    cfg = tiny_config(workdir, int(steps))
    for item in rest:
        key, _, value = item.partition("=")
        set_field(cfg, key, ast.literal_eval(value))
    from rlcode.train import loop

    result = loop.run(cfg)
    print(json.dumps(dataclasses.asdict(result)), flush=True)
