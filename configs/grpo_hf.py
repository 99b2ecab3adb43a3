"""GRPO on the synthesis tasks from a pretrained Hugging Face checkpoint: a GPU job.

    python -m experiments.train --config=configs/grpo_hf.py:model=qwen2.5-coder-0.5b \\
        --config.model.init_from=/models/Qwen2.5-Coder-0.5B-Instruct

The argument after ':' is a comma-separated list of `name=value` choices:

  model=<name>   qwen2.5-coder-0.5b (default), qwen3-0.6b or llama3.2-1b: the family's published
                 size, used for the memory estimate before loading; the checkpoint's config.json
                 decides the architecture when it loads (rlcode.models.hf).
  loss=<recipe>  as in configs/grpo_synth.py (default grpo).

Everything else is the main job (configs/grpo_synth.py) with what a pretrained model changes:
its own tokenizer (`tokenizer="init_from"`), no SFT warm start (a pretrained coder already
writes Python; set --config.sft.steps to warm it up on the job's demonstrations anyway),
bfloat16 compute over float32 parameters, a learning rate of 1e-6, longer prompts and
completions in tokens, parameters sharded over all devices (fsdp=-1). The KL reference is the
loaded model. Llama's tokenizer lacks the <tool_call> tokens of the agent job's chat format; the
synthesis job does not need them.
"""

import importlib.util
import os

from rlcode.checks import parse_config_arg

# The published shapes, in the model section's field names (see configs/model.py).
MODELS = {
    "qwen2.5-coder-0.5b": dict(vocab_size=151936, d_model=896, num_layers=24, num_heads=14, num_kv_heads=2,
                               head_dim=64, ffw_dim=4864, rope_theta=1_000_000.0, qkv_bias=True, tie_embeddings=True),
    "qwen3-0.6b": dict(vocab_size=151936, d_model=1024, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
                       ffw_dim=3072, rope_theta=1_000_000.0, qk_norm=True, tie_embeddings=True),
    "llama3.2-1b": dict(vocab_size=128256, d_model=2048, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                        ffw_dim=8192, rope_theta=500_000.0, rope_scaling="llama3", rope_factor=32.0,
                        rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_position=8192,
                        tie_embeddings=True),
}
ARGS = tuple(f"model={name}" for name in MODELS)


def _main_job():
    spec = importlib.util.spec_from_file_location("grpo_synth", os.path.join(os.path.dirname(__file__), "grpo_synth.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def get_config(arg=None):
    choices = parse_config_arg(arg, {"model": "qwen2.5-coder-0.5b", "loss": "grpo"})
    if choices["model"] not in MODELS:
        raise ValueError(f"config argument model={choices['model']!r}: expected one of {sorted(MODELS)}")
    # The main job's fields without its warm start: this config names its own model and tokenizer.
    cfg = _main_job().get_config(f"base=bytes,loss={choices['loss']}")
    cfg.workdir = f"runs/grpo_hf/{choices['model']}"
    cfg.tokenizer = "init_from"
    cfg.model.update(MODELS[choices["model"]], dtype="bfloat16", param_dtype="float32")
    cfg.model.init_from = ""  # required: --config.model.init_from=<checkpoint directory>
    cfg.mesh.update(data=1, fsdp=-1)
    cfg.sft.steps = 0
    cfg.optim.update(lr=1e-6, warmup_steps=5)
    cfg.task.max_prompt_len = 256
    cfg.sampling.max_new_tokens = 256
    cfg.rollout.update(prompts_per_step=32, group_size=8)
    cfg.train.microbatches = 4
    cfg.sandbox.workers = 8
    return cfg
