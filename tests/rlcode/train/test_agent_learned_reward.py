"""The agent job against a learned reward: the reward model scores an episode's change (its unified
diff after the task's instruction) and the tests pay nothing, but still decide success (gold)."""

import difflib

import pytest

from support.local_executor import LocalExecutor
from support.reward_models import save_tiny_reward_model

from configs.agent_repo import get_config
from rlcode.checks import ConfigError
from rlcode.envs import harness
from rlcode.envs.tasks import repo as repo_tasks
from rlcode.feedback import reward_model as rm
from rlcode.tokenizer import ByteTokenizer
from rlcode.train import agent
from rlcode.train.episodes import episode_kwargs, grade_episode


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory):
    return save_tiny_reward_model(tmp_path_factory.mktemp("rm") / "model", max_len=512)


@pytest.mark.slow
def test_the_reward_model_scores_the_episodes_change_and_the_tests_stay_gold(reward_dir):
    cfg = get_config("base=bytes")
    cfg.reward.update(source="reward_model", reward_model=reward_dir, preference_weight=3.0)
    tok, pool = ByteTokenizer(), LocalExecutor()
    task = repo_tasks.generate_task(1, difficulty=1, split="train")
    turns = repo_tasks.expert_turns(task, cfg.agent.expert_style)
    traj = harness.run_episode(task, harness.ScriptedPolicy(tok, turns), pool, tok,
                               **dict(episode_kwargs(cfg), max_turns=len(turns)))
    ep = grade_episode(task, traj, pool, cfg)
    # The expert's change is the reference solution: its diff, written here from the task alone.
    diff = "".join(line for path in sorted(task.solution_files) for line in difflib.unified_diff(
        task.files[path].splitlines(keepends=True), task.solution_files[path].splitlines(keepends=True),
        fromfile=f"a/{path}", tofile=f"b/{path}"))
    # Scored alone, as the job scores each episode (a batch of other shapes sums in another order).
    want = rm.load_reward_model(reward_dir, batch_size=1).score([task.instruction], [diff])[0]
    assert ep.terms["preference"] == pytest.approx(3.0 * float(want), rel=1e-5, abs=1e-6)
    assert ep.terms["tests"] == 0.0 and ep.success and ep.valid
    assert ep.reward == pytest.approx(sum(ep.terms.values()))


def test_a_learned_reward_needs_its_directory(tmp_path):
    cfg = get_config("base=bytes")
    cfg.reward.update(source="reward_model")
    with pytest.raises(ConfigError, match="reward_model"):
        agent.validate_config(cfg)
    cfg.reward.reward_model = str(tmp_path / "missing")
    with pytest.raises(ConfigError, match="no such directory"):
        agent.validate_config(cfg)
