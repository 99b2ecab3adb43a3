"""Both jobs start from a Hugging Face checkpoint (model.init_from) with its own tokenizer."""

import json
import types

import jax
import numpy as np
import pytest
from flax import nnx

from rlcode.checks import ConfigError
from rlcode.models import hf
from rlcode.train import agent, loop, sft
from support import config_module, hf_families, tiny_job


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Qwen2 checkpoint whose vocabulary is its tokenizer's (with the Qwen chat tokens)."""
    path = tmp_path_factory.mktemp("qwen2")
    tok = hf_families.write_tokenizer(path, "qwen")
    hf_families.write_checkpoint(path, "qwen2", vocab_size=tok.get_vocab_size(), seed=7)
    return str(path)


def test_the_checkpoint_decides_the_architecture_and_the_starting_weights(checkpoint):
    section = tiny_job.tiny_config("/tmp/unused").model
    section.init_from = checkpoint
    resolved = hf.resolve_model_section(section)
    want = hf.model_config_from_hf(hf.read_config(checkpoint))
    for name in hf.ARCHITECTURE_FIELDS:
        assert resolved[name] == want[name], name
    assert section.num_layers == 1 and resolved.num_layers == 2 and resolved.qkv_bias and not section.qkv_bias
    assert resolved.dtype == section.dtype and resolved.attention.kind == section.attention.kind
    model = hf.initial_model(resolved, seed=0)
    loaded = hf.load_checkpoint(checkpoint, dtype=resolved.dtype, param_dtype=resolved.param_dtype)
    a, b = nnx.to_pure_dict(nnx.state(model)), nnx.to_pure_dict(nnx.state(loaded))
    jax.tree.map(np.testing.assert_array_equal, a, b)
    # The SFT cache depends on the starting weights: another checkpoint is another key.
    demos = types.SimpleNamespace(arrays=lambda: [np.zeros((2, 3), np.int32)])
    key = sft.cache_key(resolved, sft.sft_config(), demos, 0)
    assert sft.cache_key(dict(resolved.to_dict(), init_from=""), sft.sft_config(), demos, 0) != key


@pytest.mark.slow
def test_the_synthesis_job_trains_from_the_checkpoint_with_its_tokenizer(tmp_path, checkpoint, sandbox_pool):
    cfg = tiny_job.tiny_config(tmp_path / "run", steps=1, sft__steps=2, eval__every=0, model__init_from=checkpoint,
                               tokenizer="init_from", eval__at_start=False, eval__at_end=False)  # not checked here
    result = loop.run(cfg, pool=sandbox_pool)
    assert result.completed
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    config = hf.read_config(checkpoint)
    assert saved["model"]["num_layers"] == config["num_hidden_layers"] == 2  # not the tiny job's 1 layer
    assert saved["model"]["vocab_size"] == config["vocab_size"] and saved["model"]["qkv_bias"] is True


def test_the_agent_job_accepts_a_checkpoint_whose_tokenizer_has_its_chat_tokens(tmp_path, checkpoint):
    cfg, _ = load_config_file("agent_repo")
    cfg.model.init_from = checkpoint
    cfg.tokenizer = "init_from"
    cfg.model = hf.resolve_model_section(cfg.model)
    agent.validate_config(cfg, 1, [])
    llama = tmp_path / "llama"
    tok = hf_families.write_tokenizer(llama, "llama")
    hf_families.write_checkpoint(llama, "llama", vocab_size=tok.get_vocab_size())
    cfg.model.init_from = str(llama)
    cfg.model = hf.resolve_model_section(cfg.model)
    with pytest.raises(ConfigError, match="built-in <\\|im_start\\|> / <tool_call> chat format"):
        agent.validate_config(cfg, 1, [])
    cfg.tokenizer = "init_from"
    cfg.model.init_from = ""
    with pytest.raises(ConfigError, match="tokenizer.*needs model.init_from"):
        agent.validate_config(cfg, 1, [])


def load_config_file(name, arg=None):
    module = config_module(name)
    return module.get_config(arg), module


def test_the_pretrained_configs_need_a_checkpoint_and_take_its_architecture(checkpoint):
    _, module = load_config_file("grpo_hf")
    for arg in module.ARGS:
        cfg, _ = load_config_file("grpo_hf", arg)
        assert cfg.tokenizer == "init_from" and cfg.model.dtype == "bfloat16"
        with pytest.raises(ConfigError, match="needs model.init_from"):
            loop.validate_config(cfg, 1, [])
        cfg.model.init_from = checkpoint
        cfg.model = hf.resolve_model_section(cfg.model)
        loop.validate_config(cfg, 1, [])
        assert cfg.model.num_layers == 2  # the checkpoint's, not the family's published 16-28
    with pytest.raises(ValueError, match="model='gpt2'"):
        load_config_file("grpo_hf", "model=gpt2")
