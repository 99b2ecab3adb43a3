"""rlcode.envs.harness: the scripted expert solves every level through the episode loop (the
held-out tests then pass on its copy), the policy mask is exactly the sampled tokens, parallel
calls run concurrently and answer in call order, malformed calls are counted, budgets end
episodes, and self-summarisation splits an episode into consistent segments.

Commands go through `LocalExecutor`, a test double running them with `subprocess.run` in the
working copy (no isolation; the sandbox is tested on its own)."""

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time

import pytest

from rlcode import tokenizer as tk
from rlcode.envs import harness, tools
from rlcode.envs.tasks import repo as rt
from support.local_executor import LocalExecutor, Result  # this test directory is on sys.path


TOK = tk.ByteTokenizer()
BIG = dict(max_context_tokens=1 << 17, max_response_tokens=4096)


def assistant(text="", *calls):
    return {"role": "assistant", "content": text,
            "tool_calls": [{"name": name, "arguments": args} for name, args in calls]}


def heldout_result(task, workdir, tmp_path):
    """pytest on the held-out tests in a grading copy of the agent's final working copy."""
    grading = tmp_path / f"grade_{os.path.basename(workdir)}"
    shutil.copytree(workdir, grading)
    paths = rt.write_heldout_tests(task, grading)
    proc = subprocess.run([sys.executable, "-B", "-m", "pytest", "-q", "-p", "no:cacheprovider", *paths],
                          cwd=grading, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})  # as the grader runs it
    return proc.returncode, proc.stdout


def check_segment_consistency(seg):
    """ids/mask/turn_index align; the ids and mask are the template's rendering of the messages."""
    assert len(seg.ids) == len(seg.policy_mask) == len(seg.turn_index)
    ids, mask = TOK.encode_chat(seg.messages, add_generation_prompt=False)
    assert seg.ids == ids
    assert seg.policy_mask == mask
    assert seg.turn_index == sorted(seg.turn_index)


# ---------------------------------------------------------------------------------------------
# the expert through the harness

EXPERT_TASKS = [(1, "train"), (2, "train"), (3, "train"), (1, "eval"), (2, "eval"), (3, "eval")]


@pytest.mark.parametrize("difficulty, split", EXPERT_TASKS)
def test_expert_solves_each_level(tmp_path, difficulty, split):
    task = rt.generate_task(5, difficulty=difficulty, split=split)
    rc, out = heldout_result(task, rt.materialize(task, tmp_path), tmp_path)
    assert rc == 1, "the starting copy must fail the held-out tests"
    traj = harness.expert_demonstration(task, LocalExecutor(), TOK, root=tmp_path)
    assert traj.end_reason == "submitted" and traj.submitted
    assert traj.num_turns == len(rt.expert_turns(task))
    assert (traj.num_malformed_calls, traj.num_tool_errors, traj.num_infra_errors) == (0, 0, 0)
    assert len(traj.segments) == 1 and traj.num_summaries == 0
    assert not os.path.exists(os.path.join(traj.workdir, rt.HELDOUT_DIR))
    for path, text in task.solution_files.items():
        assert open(os.path.join(traj.workdir, path)).read() == text
    tests_runs = [c.observation for c in traj.tool_calls if c.name == "run_tests"]
    assert tests_runs[0].startswith("exit code: 1") and tests_runs[-1].startswith("exit code: 0")
    lint = [c.observation for c in traj.tool_calls if c.name == "lint"][0]
    assert lint.splitlines()[-1].startswith("0 problem(s)")
    rc, out = heldout_result(task, traj.workdir, tmp_path)
    assert rc == 0, out
    # The chat is an SFT demonstration in the tokenizer's message format.
    messages = traj.segments[0].messages
    assert [m["role"] for m in messages[:2]] == ["system", "user"] and messages[1]["content"] == task.instruction
    roles = [m["role"] for m in messages[2:]]
    assert roles == ["assistant", "tool"] * (traj.num_turns - 1) + ["assistant"]
    check_segment_consistency(traj.segments[0])


def test_policy_mask_is_exactly_the_sampled_tokens(tmp_path):
    task = rt.generate_task(2, difficulty=2)
    outputs = []
    policy = harness.ScriptedPolicy(TOK, rt.expert_turns(task))

    def recording(ids):
        out = policy(ids)
        outputs.append(list(out))
        return out

    traj = harness.run_episode(task, recording, LocalExecutor(), TOK, max_turns=20, root=tmp_path, **BIG)
    seg = traj.segments[0]
    sampled = [t for t, m in zip(seg.ids, seg.policy_mask) if m]
    assert sampled == [t for out in outputs for t in out]
    # Each generation is preceded by exactly the context the policy saw.
    for context, out in zip(policy.contexts, outputs):
        assert seg.ids[:len(context)] == context
        assert seg.ids[len(context):len(context) + len(out)] == out
        assert set(seg.policy_mask[:len(context)]) <= {0, 1} and seg.policy_mask[len(context) - 1] == 0
    # Masked tokens: assistant content, tool-call blocks, <|im_end|>; never tool output.
    runs, start = [], None
    for i, m in enumerate(seg.policy_mask + [0]):
        if m and start is None:
            start = i
        if not m and start is not None:
            runs.append((start, i))
            start = None
    assert len(runs) == traj.num_turns
    header = [TOK.im_start_id] + TOK.encode("assistant\n")
    for (a, b), turn in zip(runs, traj.turns):
        assert seg.ids[a - len(header):a] == header
        assert seg.ids[b - 1] == TOK.im_end_id
        assert TOK.decode(seg.ids[a:b - 1]) == turn.text
        assert set(seg.turn_index[a:b]) == {turn.index}
    data = bytes(t if t < 256 else 0 for t in seg.ids)
    answered = [c for c in traj.tool_calls if c.turn < traj.turns[-1].index]  # the last turn is not answered
    assert len(answered) == len(traj.tool_calls) - 1
    for call in answered:  # observations are in the context and never masked in
        observed = call.observation.encode()
        at = data.find(observed)
        assert at > 0 and not any(seg.policy_mask[at:at + len(observed)])
        assert set(seg.turn_index[at:at + len(observed)]) == {call.turn}
    check_segment_consistency(seg)


def test_sampled_ids_are_kept_verbatim(tmp_path):
    """A call the policy spells differently from the template (spacing, key order) runs, and the
    trajectory keeps the policy's own ids, not a re-rendering."""
    task = rt.generate_task(0, difficulty=1)
    call = '{ "arguments" : {"path": "."},  "name":"list_dir" }'
    turn1 = TOK.encode("Looking. ") + [TOK.tool_call_start_id] + TOK.encode(call) + [TOK.tool_call_end_id, TOK.im_end_id]
    turn2 = harness.ScriptedPolicy(TOK, []).render(assistant("", ("submit", {})))
    traj = harness.run_episode(task, harness.ScriptedPolicy(TOK, [turn1, turn2]), LocalExecutor(), TOK,
                               max_turns=5, root=tmp_path, **BIG)
    seg = traj.segments[0]
    assert [t for t, m in zip(seg.ids, seg.policy_mask) if m] == turn1 + turn2
    assert traj.tool_calls[0].name == "list_dir" and traj.tool_calls[0].status == "ok"
    assert traj.segments[0].messages[2]["tool_calls"] == [{"name": "list_dir", "arguments": {"path": "."}}]
    assert traj.submitted


# ---------------------------------------------------------------------------------------------
# concurrency and ordering

class BarrierExecutor:
    """Runs `echo`-like commands only when `parties` of them wait at once: if calls of a turn
    were executed one after another the barrier would break. The first call answers last."""

    def __init__(self, parties):
        self.barrier = threading.Barrier(parties, timeout=10)
        self.finished = []
        self.lock = threading.Lock()

    def run(self, argv, *, files=None, stdin=None, timeout, workdir=None):
        self.barrier.wait()
        command = argv[-1]
        if "first" in command:
            time.sleep(0.3)
        with self.lock:
            self.finished.append(command)
        return Result(f"out of {command}\n", "", 0, "ok")


def test_calls_of_one_turn_run_concurrently_and_answer_in_order(tmp_path):
    task = rt.generate_task(0, difficulty=1)
    turn = assistant("Two at once.", ("run", {"command": "echo first"}), ("run", {"command": "echo second"}),
                     ("run", {"command": "echo third"}))
    executor = BarrierExecutor(3)
    traj = harness.run_episode(task, harness.ScriptedPolicy(TOK, [turn, assistant("", ("submit", {}))]), executor,
                               TOK, max_turns=5, root=tmp_path, **BIG)
    assert [c.status for c in traj.tool_calls[:3]] == ["ok"] * 3, traj.tool_calls
    assert executor.finished[-1] == "echo first"  # finished last ...
    tool_message = traj.segments[0].messages[3]
    assert tool_message["role"] == "tool"
    expected = [f"exit code: 0\n--- stdout ---\nout of echo {w}" for w in ("first", "second", "third")]
    assert tool_message["content"] == harness.format_tool_message(expected)  # ... but answers first
    assert tool_message["content"].count("<tool_response>") == 3


def test_parallel_sleeps_overlap(tmp_path):
    task = rt.generate_task(0, difficulty=1)
    # Each command prints when it started and ended: the calls overlap when both started before
    # either ended, a fact the machine's load cannot change.
    stamped = "date +%s.%N"
    command = f"{stamped}; sleep 1; {stamped}"
    turn = assistant("", ("run", {"command": command}), ("run", {"command": command}))
    traj = harness.run_episode(task, harness.ScriptedPolicy(TOK, [turn, assistant("", ("submit", {}))]),
                               LocalExecutor(), TOK, max_turns=3, root=tmp_path, **BIG)
    assert [c.status for c in traj.tool_calls] == ["ok", "ok", "ok"]
    spans = [[float(v) for v in re.findall(r"^\d+\.\d+$", c.observation, re.M)] for c in traj.tool_calls[:2]]
    assert all(len(s) == 2 for s in spans), [c.observation for c in traj.tool_calls]
    assert max(s[0] for s in spans) < min(s[1] for s in spans), spans


class CountingExecutor:
    """Records how many commands run at once; may report the sandbox's per-worker uids."""

    def __init__(self, distinct_uids):
        self.distinct_uids = distinct_uids
        self.active = 0
        self.peak = 0
        self.lock = threading.Lock()

    def guarantees(self):
        return {"distinct_uid_per_worker": self.distinct_uids}

    def run(self, argv, *, files=None, stdin=None, timeout, workdir=None):
        with self.lock:
            self.active += 1
            self.peak = max(self.peak, self.active)
        time.sleep(0.2)
        with self.lock:
            self.active -= 1
        return Result("done\n", "", 0, "ok")


@pytest.mark.parametrize("distinct_uids, setting, peak", [
    (True, "auto", 1), (False, "auto", 3), (True, None, 3), (False, 2, 2)])
def test_command_concurrency(tmp_path, distinct_uids, setting, peak):
    task = rt.generate_task(0, difficulty=1)
    turn = assistant("", *[("run", {"command": f"echo {i}"}) for i in range(3)], ("list_dir", {}))
    executor = CountingExecutor(distinct_uids)
    traj = harness.run_episode(task, harness.ScriptedPolicy(TOK, [turn]), executor, TOK, max_turns=1,
                               root=tmp_path, command_concurrency=setting, **BIG)
    assert executor.peak == peak
    assert [c.status for c in traj.tool_calls] == ["ok"] * 4


# ---------------------------------------------------------------------------------------------
# malformed calls, errors, infra

def test_malformed_calls_are_answered_and_counted(tmp_path):
    task = rt.generate_task(0, difficulty=1)
    S, E = tk.TOOL_CALL_START, tk.TOOL_CALL_END
    text = (f"Trying things. {S}{{not json}}{E} {S}[1, 2]{E} {S}{{\"arguments\": {{}}}}{E} "
            f"{S}{{\"name\": \"read_file\", \"arguments\": [\"x\"]}}{E} "
            f"{S}{{\"name\": \"teleport\", \"arguments\": {{}}}}{E} "
            f"{S}{{\"name\": \"read_file\", \"arguments\": {{}}}}{E} "
            f"{S}{{\"name\": \"read_file\", \"arguments\": {{\"path\": 7}}}}{E} "
            f"{S}{{\"name\": \"read_file\", \"arguments\": {{\"path\": \"missing.py\"}}}}{E} "
            f"{S}{{\"name\": \"list_dir\", \"arguments\": {{}}}}{E} {E} {S}{{\"name\": \"list_dir\"")
    turns = [text, assistant("", ("submit", {}))]
    traj = harness.run_episode(task, harness.ScriptedPolicy(TOK, turns), LocalExecutor(), TOK, max_turns=5,
                               root=tmp_path, **BIG)
    calls = traj.tool_calls[:-1]
    assert [c.error for c in calls] == ["invalid_json", "not_an_object", "missing_name", "invalid_arguments",
                                        "unknown_tool", "invalid_arguments", "invalid_arguments", None, None,
                                        "unopened_tag", "unclosed_tag"]
    assert [c.status for c in calls] == ["malformed"] * 7 + ["error", "ok", "malformed", "malformed"]
    assert traj.num_malformed_calls == 9 and traj.num_tool_errors == 1
    assert traj.submitted and traj.num_turns == 2
    content = traj.segments[0].messages[3]["content"]
    assert content == harness.format_tool_message([c.observation for c in calls])
    assert "unknown tool 'teleport'" in calls[4].observation and "'path' must be string" in calls[6].observation
    assert calls[8].observation.startswith(".:")
    check_segment_consistency_ids_only(traj.segments[0])


def check_segment_consistency_ids_only(seg):
    """For a non-canonical assistant output: every non-assistant message still renders exactly."""
    assert len(seg.ids) == len(seg.policy_mask) == len(seg.turn_index)
    position = 0
    for message in seg.messages:
        if message["role"] == "assistant":
            header = TOK.encode_chat([], add_generation_prompt=True)[0]
            assert seg.ids[position:position + len(header)] == header
            position += len(header)
            while seg.policy_mask[position]:
                position += 1
            if seg.ids[position] == TOK.im_end_id:  # a closing the harness added
                position += 1
            assert seg.ids[position:position + 1] == TOK.encode("\n")
            position += 1
        else:
            ids, mask = TOK.encode_chat([message], add_generation_prompt=False)
            assert seg.ids[position:position + len(ids)] == ids and not any(seg.policy_mask[position:position + len(ids)])
            position += len(ids)
    assert position == len(seg.ids)


def test_turn_without_calls_gets_a_reminder(tmp_path):
    task = rt.generate_task(0, difficulty=1)
    traj = harness.run_episode(task, harness.ScriptedPolicy(TOK, ["I think it is fine.", assistant("", ("submit", {}))]),
                               LocalExecutor(), TOK, max_turns=5, root=tmp_path, **BIG)
    assert traj.num_no_call_turns == 1 and traj.submitted
    assert traj.segments[0].messages[3] == {"role": "user", "content": harness.NO_CALL_REMINDER}
    check_segment_consistency(traj.segments[0])


def test_executor_failure_flags_the_episode(tmp_path):
    class Lost:
        def run(self, argv, **kwargs):
            raise OSError("worker lost")

    task = rt.generate_task(0, difficulty=1)
    turns = [assistant("", ("run_tests", {}), ("list_dir", {})), assistant("", ("submit", {}))]
    traj = harness.run_episode(task, harness.ScriptedPolicy(TOK, turns), Lost(), TOK, max_turns=5, root=tmp_path, **BIG)
    assert traj.num_infra_errors == 1 and traj.infra_failure
    assert traj.tool_calls[1].status == "ok" and traj.submitted


def test_each_episode_gets_its_own_copy(tmp_path):
    task = rt.generate_task(0, difficulty=1)
    edit = task.edits[0]
    turns = [assistant("", ("edit_file", {"path": edit.path, "old": edit.old, "new": edit.new})),
             assistant("", ("submit", {}))]
    first = harness.run_episode(task, harness.ScriptedPolicy(TOK, turns), LocalExecutor(), TOK, max_turns=3,
                                root=tmp_path, **BIG)
    second = harness.run_episode(task, harness.ScriptedPolicy(TOK, turns[1:]), LocalExecutor(), TOK, max_turns=3,
                                 root=tmp_path, **BIG)
    assert first.workdir != second.workdir
    assert open(os.path.join(first.workdir, edit.path)).read() == task.solution_files[edit.path]
    assert open(os.path.join(second.workdir, edit.path)).read() == task.files[edit.path]


# ---------------------------------------------------------------------------------------------
# budgets

def looping_turns(n):
    return [assistant(f"Look {i}.", ("list_dir", {})) for i in range(n)]


def test_max_turns_ends_the_episode(tmp_path):
    task = rt.generate_task(0, difficulty=1)
    policy = harness.ScriptedPolicy(TOK, looping_turns(10))
    traj = harness.run_episode(task, policy, LocalExecutor(), TOK, max_turns=3, root=tmp_path, **BIG)
    assert traj.end_reason == "max_turns" and not traj.submitted
    assert traj.num_turns == 3 == len(policy.contexts) and len(traj.tool_calls) == 3
    # No tool message is appended after the last turn: the segment ends with its closing.
    assert traj.segments[0].messages[-1]["role"] == "assistant"
    check_segment_consistency(traj.segments[0])


def test_response_limit_truncates_a_turn(tmp_path):
    task = rt.generate_task(0, difficulty=1)
    runaway = TOK.encode("x" * 500)  # no stop id
    traj = harness.run_episode(task, harness.ScriptedPolicy(TOK, [runaway]), LocalExecutor(), TOK, max_turns=1,
                               max_context_tokens=1 << 17, max_response_tokens=64, root=tmp_path)
    seg = traj.segments[0]
    assert traj.num_truncated_turns == 1 and traj.turns[0].truncated and traj.turns[0].num_generated == 64
    assert sum(seg.policy_mask) == 64
    last = max(i for i, m in enumerate(seg.policy_mask) if m)
    assert seg.ids[last + 1] == TOK.im_end_id and seg.policy_mask[last + 1] == 0  # closing, not sampled
    stopped = TOK.encode("short") + [TOK.im_end_id] + TOK.encode("ignored after the stop")
    traj = harness.run_episode(task, harness.ScriptedPolicy(TOK, [stopped]), LocalExecutor(), TOK, max_turns=1,
                               max_context_tokens=1 << 17, max_response_tokens=64, root=tmp_path)
    assert sum(traj.segments[0].policy_mask) == len(TOK.encode("short")) + 1 and traj.num_truncated_turns == 0


def test_context_budget_ends_the_episode_without_summaries(tmp_path):
    task = rt.generate_task(0, difficulty=1)
    base = len(TOK.encode_chat([{"role": "system", "content": harness.render_system_prompt()},
                                {"role": "user", "content": task.instruction}], add_generation_prompt=False)[0])
    limit = base + 1200
    policy = harness.ScriptedPolicy(TOK, looping_turns(50))
    traj = harness.run_episode(task, policy, LocalExecutor(), TOK, max_turns=50, max_context_tokens=limit,
                               max_response_tokens=200, summary_prompt=None, root=tmp_path)
    assert traj.end_reason == "context" and len(traj.segments) == 1 and traj.num_summaries == 0
    assert 2 <= traj.num_turns < 50
    assert len(traj.segments[0].ids) <= limit
    assert all(len(c) + 200 + 1 + 1 <= limit for c in policy.contexts)
    header = 1 + len(TOK.encode("assistant\n"))
    assert len(traj.segments[0].ids) + header + 200 + 2 > limit  # one more turn would not have fit
    check_segment_consistency(traj.segments[0])


def test_total_token_budget_ends_the_episode(tmp_path):
    task = rt.generate_task(0, difficulty=1)
    traj = harness.run_episode(task, harness.ScriptedPolicy(TOK, looping_turns(50)), LocalExecutor(), TOK,
                               max_turns=50, max_total_tokens=9000, root=tmp_path, **BIG)
    assert traj.end_reason == "token_budget" and 1 <= traj.num_turns < 50
    assert len(traj.ids) <= 9000 and len(traj.ids) + 4096 > 9000


def test_context_too_small_for_the_prompt_is_rejected(tmp_path):
    task = rt.generate_task(0, difficulty=1)
    with pytest.raises(ValueError, match="max_context_tokens=500 is too small"):
        harness.run_episode(task, harness.ScriptedPolicy(TOK, []), LocalExecutor(), TOK, max_turns=3,
                            max_context_tokens=500, max_response_tokens=100, root=tmp_path)
    assert os.listdir(tmp_path) == []  # the copy made for the episode is removed again


# ---------------------------------------------------------------------------------------------
# self-summarisation

@pytest.mark.parametrize("difficulty", [2, 3])
def test_self_summarisation_segments(tmp_path, difficulty):
    task = rt.generate_task(1, difficulty=difficulty)
    turns = rt.expert_turns(task)
    response = 700
    base = len(TOK.encode_chat([{"role": "system", "content": harness.render_system_prompt()},
                                {"role": "user", "content": task.instruction}], add_generation_prompt=False)[0])
    limit = base + 4 * response + 900
    summary = "I ran the tests and read the files; the fix is known."
    policy = harness.ScriptedPolicy(TOK, turns, summary=summary)
    traj = harness.run_episode(task, policy, LocalExecutor(), TOK, max_turns=20, max_context_tokens=limit,
                               max_response_tokens=response, root=tmp_path)
    assert traj.end_reason == "submitted" and traj.num_turns == len(turns)
    assert traj.num_summaries >= 1 and len(traj.segments) == traj.num_summaries + 1
    summaries = [t for t in traj.turns if t.kind == "summary"]
    assert all(t.text == summary for t in summaries)
    for k, seg in enumerate(traj.segments):
        assert len(seg.ids) <= limit
        check_segment_consistency(seg)
        if k > 0:
            assert seg.messages[:2] == traj.segments[0].messages[:2]
            assert seg.messages[2] == {"role": "user", "content": harness.SUMMARY_HEADER + summary}
        if k < len(traj.segments) - 1:
            # A segment ends with the summary request and the summary, which is sampled (mask 1).
            assert seg.messages[-2] == {"role": "user", "content": harness.SUMMARY_PROMPT}
            assert seg.messages[-1]["content"] == summary
            tail = TOK.encode(summary) + [TOK.im_end_id]
            n = len(tail) + 1
            assert seg.ids[-n:-1] == tail and seg.policy_mask[-n:] == [1] * len(tail) + [0]
    # turn indices continue across segments; the masked tokens of all segments are every generation
    indices = [sorted({k for k, m in zip(s.turn_index, s.policy_mask) if m}) for s in traj.segments]
    flat = [k for ks in indices for k in ks]
    assert flat == list(range(len(traj.turns)))
    assert sum(sum(s.policy_mask) for s in traj.segments) == sum(t.num_generated for t in traj.turns)
    rc, out = heldout_result(task, traj.workdir, tmp_path)
    assert rc == 0, out


def test_oversized_observation_is_cut_to_keep_room_for_a_summary(tmp_path):
    task = rt.generate_task(0, difficulty=1)
    response = 300
    base = len(TOK.encode_chat([{"role": "system", "content": harness.render_system_prompt()},
                                {"role": "user", "content": task.instruction}], add_generation_prompt=False)[0])
    limit = base + 4 * response + 600
    turns = [assistant("", ("run", {"command": "python3 -c \"print('z' * 6000)\""})), assistant("", ("submit", {}))]
    traj = harness.run_episode(task, harness.ScriptedPolicy(TOK, turns, summary="Printed many z."), LocalExecutor(),
                               TOK, max_turns=5, max_context_tokens=limit, max_response_tokens=response,
                               root=tmp_path)
    first = traj.segments[0]
    tool_message = first.messages[3]
    assert tool_message["role"] == "tool" and "[... observation cut to fit the context window]" in tool_message["content"]
    assert traj.tool_calls[0].observation.count("z") > 5000  # the record keeps the whole observation
    assert traj.num_summaries == 1 and traj.submitted and all(len(s.ids) <= limit for s in traj.segments)
    for seg in traj.segments:
        check_segment_consistency(seg)


def test_system_prompt_lists_every_tool():
    prompt = harness.render_system_prompt()
    for line in tools.render_tool_docs().splitlines():
        assert line in prompt
        assert json.loads(line)["name"] in tools.TOOLS
    assert "<tool_call>" in prompt and "<tool_response>" in prompt


# ---------------------------------------------------------------------------------------------
# integration with the real sandbox pool

def test_expert_through_the_sandbox_pool(tmp_path, sandbox_pool):
    pool = sandbox_pool  # the suite's shared pool (tests/conftest.py)
    task = rt.generate_task(4, difficulty=3)
    traj = harness.expert_demonstration(task, pool, TOK, root=tmp_path)
    assert traj.end_reason == "submitted"
    assert (traj.num_malformed_calls, traj.num_tool_errors, traj.num_infra_errors) == (0, 0, 0), traj.tool_calls
    runs = [c.observation for c in traj.tool_calls if c.name == "run_tests"]
    assert runs[0].startswith("exit code: 1") and runs[-1].startswith("exit code: 0"), runs
    rc, out = heldout_result(task, traj.workdir, tmp_path)
    assert rc == 0, out
    # A symlink planted by a sandboxed command does not let the file tools out of the copy.
    marker = tmp_path / "host_marker.txt"
    turns = [assistant("", ("run", {"command": f"ln -s /etc etc_link; echo leaked > {marker}"})),
             assistant("", ("read_file", {"path": "etc_link/hostname"}), ("list_dir", {"path": "etc_link"})),
             assistant("", ("submit", {}))]
    traj = harness.run_episode(task, harness.ScriptedPolicy(TOK, turns), pool, TOK, max_turns=5,
                               root=tmp_path, **BIG)
    assert os.path.islink(os.path.join(traj.workdir, "etc_link"))
    assert [c.status for c in traj.tool_calls[1:3]] == ["error", "error"]
    assert all("outside the repository" in c.observation for c in traj.tool_calls[1:3])
    if pool.guarantees().get("readonly_host_filesystem"):
        assert not marker.exists()


# ---------------------------------------------------------------------------------------------
# compact expert, compact prompt, document spans


@pytest.mark.parametrize("difficulty", [1, 3])
def test_compact_expert_solves_and_marks_read_files_as_documents(tmp_path, difficulty):
    task = rt.generate_task(2, difficulty=difficulty)
    registry = {n: tools.TOOLS[n] for n in ("read_file", "edit_file", "run_tests", "submit")}
    prompt = harness.render_system_prompt(registry, compact=True)
    assert "edit_file(path, old, new)" in prompt and "read_file(path, start_line=, end_line=)" in prompt
    assert "grep" not in prompt
    traj = harness.expert_demonstration(task, LocalExecutor(), TOK, root=tmp_path, style="compact",
                                        system_prompt=prompt, registry=registry)
    assert traj.end_reason == "submitted" and traj.num_turns == 4 and traj.num_malformed_calls == 0
    rc, out = heldout_result(task, traj.workdir, tmp_path)
    assert rc == 0, out
    seg = traj.segments[0]
    reads = [c for c in traj.tool_calls if c.name == "read_file"]
    assert reads and [TOK.decode(seg.ids[a:b]) for a, b in seg.documents] == [c.observation for c in reads]
    # Only the read files: no other observation (edits, tests) is a document.
    assert all(seg.policy_mask[a:b] == [0] * (b - a) for a, b in seg.documents)


def test_documents_are_passed_to_the_policy_and_cut_observations_are_not_documents(tmp_path):
    task = rt.generate_task(0, difficulty=1)
    path = next(p for p in task.files if not p.startswith("tests") and not p.endswith("__init__.py"))
    seen = []

    def policy(ids, documents):
        seen.append(list(documents))
        return harness.ScriptedPolicy(TOK, [assistant("", ("read_file", {"path": path}))]).render(
            assistant("", ("read_file", {"path": path})))

    traj = harness.run_episode(task, policy, LocalExecutor(), TOK, max_turns=2, root=tmp_path, pass_documents=True,
                               **BIG)
    assert seen[0] == [] and len(seen[1]) == 1 and traj.segments[0].documents == seen[1]
    # A context too small for the whole file: the observation is cut, so it is not a document.
    a, b = seen[1][0]
    traj = harness.run_episode(task, policy, LocalExecutor(), TOK, max_turns=2, root=tmp_path, pass_documents=True,
                               max_context_tokens=b + 100, max_response_tokens=120, summary_prompt=None)
    obs = [c.observation for c in traj.tool_calls]
    shown = TOK.decode(traj.segments[0].ids)
    assert obs and obs[0] not in shown and traj.segments[0].documents == []
