"""BFCL-v3 multi-turn as a world (envs/benchmarks/bfcl_domains.py): BFCL's checker scores its ground truth 1 and corruptions 0,
calls become BFCL's python strings safely, and the gold agent passes all four categories through run_episodes
(BFCL's questions as the user, miss_func's held-back functions arriving in their turn); a silent agent and one
that loops past BFCL's step limit score 0."""
import pytest

from envs.benchmarks import bfcl_domains as bfcl
import eval as ev
import rollout
import envs

N = 5


@pytest.fixture(scope="module")
def tok():
    return rollout.load_tokenizer()


@pytest.fixture(scope="module")
def base():
    return envs.make_tasks("bfcl-base", "test", N)


def test_checker_scores_the_ground_truth_1_and_corruptions_0(base):
    assert [t.id for t in base] == [f"multi_turn_base_{i}" for i in range(N)]
    as_steps = lambda turns: [[[c] for c in t] for t in turns]     # noqa: E731; one call a step, as our loop runs
    assert [bfcl.score(t.entry, as_steps(t.truth), t.truth)["valid"] for t in base] == [True] * N
    assert bfcl.score(base[0].entry, as_steps(base[0].truth), base[0].truth)["valid"]   # no state leaks between runs
    for t in base:
        assert not bfcl.score(t.entry, as_steps([turn[:-1] for turn in t.truth]), t.truth)["valid"]   # a call missing
        assert bfcl.score(t.entry, as_steps(t.truth[:-1]), t.truth)["error_type"] == "multi_turn:force_terminated"
    wrong = [[c.replace("'temp'", "'tmp'") for c in base[0].truth[0]]] + base[0].truth[1:]
    assert wrong != base[0].truth and not bfcl.score(base[0].entry, as_steps(wrong), base[0].truth)["valid"]
    with pytest.raises(SystemExit, match="evaluation only"):
        envs.make_tasks("bfcl-base", "train", 1)


def test_calls_become_bfcl_python_strings_and_unsafe_names_are_refused():
    allowed = {"cd", "mv"}
    assert bfcl.to_python_call("cd", {"folder": "x"}, allowed) == "cd(folder='x')"
    assert bfcl.to_python_call("mv", {"source": "a b", "n": [1, 2.5], "f": True}, allowed) == \
        "mv(source='a b',n=[1, 2.5],f=True)"
    assert bfcl.to_python_call("__import__('os').system", {}, allowed) is None
    assert bfcl.to_python_call("cd", {"x=1) or (": 1}, allowed) is None


def test_env_records_each_call_per_turn_on_bfcls_file_system(base):
    env = bfcl.make_env(base[0])
    out = [env.step("cd", {"folder": "document"}), env.step("mkdir", {"dir_name": "temp"}),
           env.step("mv", {"source": "final_report.pdf", "destination": "temp"})]
    assert env.decoded == [[["cd(folder='document')"], ["mkdir(dir_name='temp')"],
                            ["mv(source='final_report.pdf',destination='temp')"]]]
    assert "moved to 'temp/final_report.pdf'" in out[2]
    assert env.step("rm -rf", {}).startswith("Error") and len(env.decoded[0]) == 3      # refused, not run
    score = env.score(stop_reason="max_turns")
    assert score.reward == 0.0 and "cut short" in score.wrong
    looping = bfcl.make_env(base[0])
    for _ in range(bfcl.MAX_STEPS + 1):                       # BFCL force-terminates a turn of too many calls
        looping.step("pwd", {})
    score = looping.score(stop_reason="user_stop")
    assert score.reward == 0.0 and not score.correct_state and f"more than {bfcl.MAX_STEPS} calls" in score.wrong


def test_gold_agent_passes_all_four_categories_through_run_episodes(tok):
    tasks = [t for d in bfcl.DOMAINS for t in envs.make_tasks(d, "test", 2)]
    trajs = rollout.run_episodes(rollout.OracleAgent(tok), tok, tasks, max_turns=80, max_context=10**6,
                                 progress=False)
    print({t.task_id: (t.reward, t.turns) for t in trajs})
    assert [t.reward for t in trajs] == [1.0] * 8 and {t.stop_reason for t in trajs} == {"user_stop"}
    miss_func = next(t for t in tasks if t.domain == "bfcl-miss-func")
    turn, held = next(iter(miss_func.entry["missed_function"].items()))
    assert not {f["name"] for f in held} & {f["name"] for f in miss_func.entry["function"]}   # not offered up front
    traj = next(t for t in trajs if t.task_id == miss_func.id)
    query = [m["content"] for m in traj.messages if m["role"] == "user"][int(turn)]
    assert all(f'"name": "{f["name"]}"' in query for f in held)          # they arrive in their turn's message
    assert [] in envs.make_tasks("bfcl-miss-param", "test", 1)[0].truth   # a turn to answer, not to call


class SilentAgent(rollout.TextAgent):
    def respond(self, task, messages):
        return "I cannot help with that."


class LoopingAgent(rollout.TextAgent):
    def respond(self, task, messages):
        return '<tool_call>{"name": "pwd", "arguments": {}}</tool_call>'


def test_silent_and_looping_agents_score_0_and_eval_reports_beside_the_paper(tok, base):
    silent = ev.evaluate(SilentAgent(tok), tok, base[:2], trials=1, max_turns=20, max_context=10**6, progress=False,
                         n_boot=10)
    assert silent["overall"]["pass^k"] == {1: 0.0}
    assert {f["diff"] for f in silent["failures"]} == {"multi_turn:empty_turn_model_response"}
    looping = rollout.run_episodes(LoopingAgent(tok), tok, base[:1], max_turns=bfcl.MAX_STEPS + 2,
                                   max_context=10**6, progress=False)[0]
    assert looping.reward == 0.0 and looping.diff.startswith("ended by max_turns")
    gold = ev.evaluate(rollout.OracleAgent(tok), tok, base[:2], trials=1, max_turns=80, max_context=10**6,
                       progress=False, n_boot=10)
    text = ev.paper_tables({"gold": {"tau": gold}})
    print(text)
    assert "| bfcl-base | 2 | 100.0 |" in text and "Qwen3-8B 11.8 -> MUA-RL-8B 14.6" in text
