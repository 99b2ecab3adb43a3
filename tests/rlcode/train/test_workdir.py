"""Comparing a resumed run's config with the saved one, across fields added since it was saved."""

import json

import pytest

from rlcode.checks import flatten
from rlcode.train import workdir
from support import job_config, tiny_job


def test_a_run_saved_before_fields_were_added_resumes_with_their_neutral_values(tmp_path):
    new = json.loads(json.dumps(tiny_job.tiny_config(tmp_path).to_dict(), default=list))
    flat = flatten(new)

    def flat_config(name, arg=None):
        return flatten(json.loads(json.dumps(job_config(name, arg).to_dict(), default=list)))

    agent, pretrain = flat_config("agent_repo", "base=bytes"), flat_config("pretrain_code")
    # The table holds the configs' own values for the runs saved before the fields existed: the RL
    # jobs' with base=bytes (every such run trained a fresh byte-level policy), the pretraining
    # job's own fields from its config.
    for key, value in workdir.ADDED_FIELDS.items():
        assert key in flat or key in agent or key in pretrain, key
        for config in (flat, agent) if key in flat or key in agent else (pretrain,):
            if key in config:
                assert workdir._same(config[key], value), (key, config[key])
    old = json.loads(json.dumps(new))
    old.pop("tokenizer")
    old.pop("lora")
    old["task"].pop("source")
    for key in ("init_from", "qkv_bias", "rope_scaling", "rope_factor", "rope_low_freq_factor",
                "rope_high_freq_factor", "rope_original_max_position"):
        old["model"].pop(key)
    assert workdir.config_changes(old, new) == {}
    changed = json.loads(json.dumps(new))
    changed["model"]["qkv_bias"] = True
    changed["lora"]["rank"] = 8
    assert sorted(workdir.config_changes(old, changed)) == ["lora.rank", "model.qkv_bias"]
    assert workdir.config_changes(old, changed)["lora.rank"] == ("(absent)", 8)


def test_warm_start_caches_written_before_the_added_fields_stay_valid(tmp_path):
    import types

    import numpy as np

    from rlcode.train import sft

    cfg = tiny_job.tiny_config(tmp_path)
    old = cfg.model.to_dict()
    for key in workdir.ADDED_FIELDS:
        if key.startswith("model."):
            old.pop(key[len("model."):])
    demos = types.SimpleNamespace(arrays=lambda: [np.arange(6)])
    assert sft.cache_key(cfg.model, cfg.sft, demos, 0) == sft.cache_key(old, cfg.sft, demos, 0)
    cfg.model.qkv_bias = True  # a model that differs is another cache entry
    assert sft.cache_key(cfg.model, cfg.sft, demos, 0) != sft.cache_key(old, cfg.sft, demos, 0)


@pytest.mark.parametrize("sft_seed, used", [(-1, 3), (0, 0)])
def test_the_engine_warms_up_with_the_warm_start_seed(tmp_path, monkeypatch, sft_seed, used):
    import types

    from rlcode.train import engine, sft

    cfg = tiny_job.tiny_config(tmp_path)
    cfg.seed, cfg.sft.seed, cfg.sft.steps = 3, sft_seed, 2
    seeds = []

    def load_or_train(model_cfg, sft_cfg, demos, seed, **kwargs):
        seeds.append(seed)
        return "params", {"cached": True, "history": [{"step": 2, "nll": 0.5}]}

    monkeypatch.setattr(sft, "load_or_train", load_or_train)
    ctx = types.SimpleNamespace(cfg=cfg, say=lambda m: None, writer=types.SimpleNamespace(scalars=lambda *a: None))
    assert engine._warm_start(ctx, demos="demos")[0] == "params" and seeds == [used]


def test_the_warm_start_seed_is_the_runs_unless_sft_seed_names_one(tmp_path):
    """sft.seed = -1 (default): the run's seed; >= 0: that seed, so RL seeds share one warm start.
    The cache key holds the seed used, not the field: caches written before it stay valid."""
    import types

    import numpy as np

    from rlcode.train import sft

    cfg = tiny_job.tiny_config(tmp_path)
    cfg.seed = 3
    assert cfg.sft.seed == -1 and sft.warm_start_seed(cfg) == 3
    cfg.sft.seed = 0
    assert sft.warm_start_seed(cfg) == 0
    demos = types.SimpleNamespace(arrays=lambda: [np.arange(6)])
    old = cfg.sft.to_dict()
    old.pop("seed")  # a config written before the field
    assert sft.cache_key(cfg.model, cfg.sft, demos, 0) == sft.cache_key(cfg.model, old, demos, 0)
    assert sft.cache_key(cfg.model, cfg.sft, demos, 0) != sft.cache_key(cfg.model, cfg.sft, demos, 3)
    changed = json.loads(json.dumps(cfg.to_dict()))
    legacy = json.loads(json.dumps(changed))
    legacy["sft"].pop("seed")
    changed["sft"]["seed"] = -1
    assert workdir.config_changes(legacy, changed) == {}  # resuming an older run with the default
    changed["sft"]["seed"] = 0
    assert workdir.config_changes(legacy, changed) == {"sft.seed": ("(absent)", 0)}
