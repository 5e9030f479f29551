"""ACEBench's agent category through our loop (envs/benchmarks/acebench_domains.py): the cases and the upstream flaws we work
around, the gold path replayed by an oracle agent under ACEBench's own checker, doing nothing, a wrong last
write, fresh sandboxes, ACEBench's user prompt, the report, and (slow) two episodes with llama.cpp as the user.

Run:  pytest tests/test_acebench.py -s            # needs ACEBench's files: ../shared/acebench or $ACEBENCH_DIR
      pytest tests/test_acebench.py -m slow -s    # two multi-turn episodes against llama.cpp's server
"""
import pytest

import envs
from envs.benchmarks import acebench_domains as ace
import rollout
import users
from chat_server import FakeServer


def _have_data() -> bool:
    try:
        return bool(ace.data_dir())
    except SystemExit:
        return False


pytestmark = pytest.mark.skipif(not _have_data(), reason="ACEBench's files not found: set ACEBENCH_DIR to a clone "
                                                         "of github.com/chenchen0103/ACEBench")
MT, MS = ace.DOMAINS
SIZES = {MT: 30, MS: 20}
# Upstream flaws met loading each domain (all mile_stone strings parse once their apostrophes are escaped):
# multi-turn 8 strings "merchant_name='Domino's'" (cases 8-15); multi-step 6 ('Domino's', 'Today's', "Don't ...
# afternoon's"); class names "Reminderpi" (mt 7), "BaseAPI" (mt 9), "ReminderAPI" (ms 0, 1).
FLAWS = {MT: {"mile_stone not Python": 8, "mile_stone repaired": 8, "ground_truth class misspelt": 2},
         MS: {"mile_stone not Python": 6, "mile_stone repaired": 6, "ground_truth class misspelt": 2}}
# Cases whose gold mile_stone path, replayed exactly, does NOT reach their ground_truth (upstream data, not us):
#   mt 6, ms 16         the path never calls login_device() but the device starts logged out
#   ms 0, 1             the path orders product 'Super Supreme'; the menu (and ground_truth) says 'Super Supreme Pizza'
#   ms 12, 13           the path never calls login_food_platform(), so the order fails
#   ms 14, 15, 17       the path deletes the earliest message (3); the question and ground_truth delete the latest (4)
GOLD_FAILS = {f"{MT}-agent_multi_turn_6"} | {f"{MS}-agent_multi_step_{i}" for i in (0, 1, 12, 13, 14, 15, 16, 17)}


@pytest.fixture(scope="module")
def tok():
    return rollout.load_tokenizer()


class GoldAgent(rollout.TextAgent):
    """The oracle agent: each turn is the task's oracle_reply (the gold path's next call, then a closing text)."""

    def respond(self, task, messages):
        return ace.oracle_reply(task, messages)


def process(traj) -> float:
    """The process score run_episodes copied from the score's extras into the trajectory's stats."""
    return traj.stats["extras"]["process"]


def replay(task, calls=None):
    env = ace.make_env(task)
    for name, args in calls if calls is not None else [c for step in task.gold_paths[0] for c in step]:
        env.step(name, args)
    return env


def test_cases_splits_and_upstream_flaws():
    for d in ace.DOMAINS:
        tasks = ace.make_tasks(d, "test", 10**6)
        assert len(tasks) == SIZES[d] and [t.id for t in ace.make_tasks(d, "base", 3)] == [t.id for t in tasks[:3]]
        assert tasks[0].id == f"{d}-agent_{d.split('-', 1)[1].replace('-', '_')}_0" and tasks[0].tier == d[9:]
        assert ace.data_flaws(d) == FLAWS[d]
        assert [len(p) for t in tasks for p in t.gold_paths] == [   # every string read: none dropped
            len(p) for _, a in ace.load_cases(d) for p in (a["mile_stone"] if isinstance(a["mile_stone"][0], list)
                                                           else [a["mile_stone"]])]
        assert all(set(next(iter(g)) for g in t.ground_truth) <= set(t.case["involved_classes"]) for t in tasks)
    with pytest.raises(SystemExit, match="no train split"):
        ace.make_tasks(MT, "train", 5)
    with pytest.raises(SystemExit, match="unknown ACEBench domain"):
        ace.make_tasks("acebench-normal", "test", 5)


def test_a_missing_data_dir_says_where_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv("ACEBENCH_DIR", str(tmp_path))
    with pytest.raises(SystemExit, match="chenchen0103/ACEBench and set ACEBENCH_DIR"):
        ace.data_dir()


def test_gold_path_through_run_episodes_scores_one_except_the_flawed_paths(tok):
    """The oracle agent replays each case's first gold path, one call a turn, then closes; multi-turn's oracle
    user ends on that text, multi-step ends on it by itself. ACEBench's checker scores 1 on all but GOLD_FAILS;
    the process score (the gold path made, in order) is 1 on every case, flawed or not."""
    for d in ace.DOMAINS:
        tasks = ace.make_tasks(d, "test", 10**6)
        trajs = rollout.run_episodes(GoldAgent(tok), tok, tasks, user=envs.UserFactory("oracle"), max_turns=30, max_context=10**6,
                                     progress=False)
        assert {t.task_id for t in trajs if t.reward != 1.0} == {i for i in GOLD_FAILS if i.startswith(d)}
        assert all(process(t) == 1.0 for t in trajs)
        assert {t.stop_reason for t in trajs} == {"user_stop" if d == MT else "agent_stop"}
        assert [t.stats["tool_calls"] for t in trajs] == [sum(map(len, t.gold_paths[0])) for t in tasks]
        assert all(t.stats["tool_errors"] == 0 for t in trajs)
        print(f"\n{d}: gold path {sum(t.reward for t in trajs):.0f}/{len(trajs)}")


def test_doing_nothing_scores_zero_everywhere():
    """Doing nothing passes no case. ACEBench records the sandbox state only once a call has run, so no calls
    means no state and its eval fails "wrong number of class". Even recording the untouched sandboxes passes
    none: every one of the 50 ground truths holds a change (a message, reminder, order, login or booking)."""
    for d in ace.DOMAINS:
        for task in ace.make_tasks(d, "test", 10**6):
            env = ace.make_env(task)
            score = env.score([], stop_reason="user_stop")
            assert score.reward == 0.0 and score.extras == {"process": 0.0}
            assert "wrong number of class" in score.wrong
            env.ran = True                        # as if a call had run: the initial state against ground_truth
            score = env.score([], stop_reason="user_stop")
            assert score.reward == 0.0 and "wrong" in score.wrong


def test_a_wrong_argument_in_the_last_call_scores_zero():
    """On every case the gold path passes: the same path with the last string argument of its last call
    changed scores 0, and its process score loses exactly that last step."""
    n = 0
    for d in ace.DOMAINS:
        for task in ace.make_tasks(d, "test", 10**6):
            if task.id in GOLD_FAILS:
                continue
            calls = [c for step in task.gold_paths[0] for c in step]
            name, args = calls[-1]
            key = [k for k, v in args.items() if isinstance(v, str)][-1]
            env = replay(task, calls[:-1] + [(name, {**args, key: args[key] + " (wrong)"})])
            steps = len(task.gold_paths[0])
            score = env.score([], stop_reason="user_stop")
            assert score.reward == 0.0 and score.wrong, task.id
            assert score.extras["process"] == pytest.approx((steps - 1) / steps), task.id
            n += 1
    assert n == 50 - len(GOLD_FAILS)


def test_reward_cut_short_shaped_and_why():
    task = ace.make_tasks(MT, "test", 1)[0]
    env = replay(task)
    assert env.score(["Done."], stop_reason="user_stop") == (1.0, True, "", {"process": 1.0})
    score = env.score(["Done."], stop_reason="max_turns")        # τ²'s rule; ACEBench's own verdict: the state is right
    assert score.reward == 0.0 and score.correct_state and "max_turns" in score.wrong
    assert score.extras == {"process": 1.0}
    half = ace.AceEnv(task, shaped=True)
    for name, args in [c for step in task.gold_paths[0][:2] for c in step]:
        half.step(name, args)
    assert half.score([], stop_reason="user_stop").reward == pytest.approx(2 / len(task.gold_paths[0]))


def test_fresh_sandboxes_do_not_leak_between_envs():
    task = ace.make_tasks(MT, "test", 1)[0]
    a, b = replay(task), ace.make_env(task)
    assert a.score([]).reward == 1.0
    b.ran = True                                          # b's sandbox as built: nothing of a's calls
    state = {next(iter(s)): s for s in b.state()}
    assert state["BaseApi"]["BaseApi"]["wifi"] is False and "7" not in state["MessageApi"]["MessageApi"]["inbox"]
    assert b.score([]).reward == 0.0 and replay(task).score([]).reward == 1.0   # and a third replays as the first did
    assert a.sandbox["MessageApi"] is not b.sandbox["MessageApi"]


def test_step_never_raises_and_reaches_every_app():
    task = ace.make_tasks(MT, "test", 1)[0]
    env = ace.make_env(task)
    for name, args in [("no_such_tool", {}), ("_load_scenario", {"scenario": {}}), ("send_message", {"x": 1}),
                       ("delete_message", {}), (None, {}), ("send_message", "not a dict")]:
        assert env.step(name, args).startswith("Error: "), name
    assert env.state() == []                              # nothing ran: ACEBench would record no state yet
    assert '"status": true' in env.step("turn_on_wifi", {})
    assert all(i.wifi for i in env.sandbox.values())      # BaseApi's method on every app, as ACEBench runs it


def test_tools_policy_and_user_prompt_come_from_acebench():
    for d in ace.DOMAINS:
        for task in ace.make_tasks(d, "test", 10**6):
            env = ace.make_env(task)
            assert [t["function"]["name"] for t in env.tools] == [f["name"] for f in task.case["function"]]
            text = str(env.tools)
            assert all(f"'type': '{t}'" not in text for t in ("dict", "list", "float", "int", "tuple", "bool"))
            assert "[ApiName" not in env.policy and "Function Calls" not in env.policy
    travel, phone = ace.make_tasks(MT, "test", 30)[25], ace.make_tasks(MT, "test", 1)[0]
    assert "airline agent" in ace.policy(travel) and "mobile assistant" in ace.policy(phone)
    assert ace.user_prompt(phone).startswith("You are a user interacting with an agent.\n\nInstruction: Your name is")
    assert "round-trip" in ace.user_prompt(travel) and "finish conversation" in ace.user_prompt(travel)


def test_users_for_each_domain():
    mt, ms = ace.make_tasks(MT, "test", 1)[0], ace.make_tasks(MS, "test", 1)[0]
    for spec in ("scripted", "none", "local", "openai:m", "oracle"):
        u = ace.make_user(spec, ms)
        assert u.ends_on_text and u.first_message() == ms.instruction and users.STOP in u.reply([])
    for spec in ("scripted", "none", "local"):
        with pytest.raises(SystemExit, match="openai:MODEL"):
            ace.make_user(spec, mt)
    oracle = ace.make_user("oracle", mt)
    assert oracle.first_message() == mt.instruction
    assert oracle.reply([{"role": "assistant", "content": "Shall I send it?"}]) == "Yes, please go ahead."
    assert users.STOP in oracle.reply([{"role": "assistant", "content": "Sent."}])


def test_acebench_user_reads_its_prompt_and_ends_on_finish_conversation():
    task = ace.make_tasks(MT, "test", 1)[0]
    with FakeServer({"content": "Hi, I want to send a message to Frank."}, {"content": "finish conversation"}) as srv:
        user = ace.make_user("openai:sim", task, base_url=srv.url, api_key="k", timeout=5.0)
        first = user.first_message()
        said = user.reply([{"role": "user", "content": first},
                           {"role": "assistant", "content": "<tool_call>{}</tool_call>", "tool_calls": [{}]},
                           {"role": "tool", "content": "ok"}, {"role": "assistant", "content": "Sent it."}])
        ended = user.reply([{"role": "user", "content": first},
                            {"role": "assistant", "content": "finish conversation"}])
    sent = [r["body"]["messages"] for r in srv.requests]
    assert sent[0] == [{"role": "system", "content": ace.user_prompt(task)}, {"role": "user", "content": ace.GREETING}]
    assert sent[1][2:] == [{"role": "assistant", "content": first}, {"role": "user", "content": "Sent it."}]
    assert first == "Hi, I want to send a message to Frank." and users.STOP in said and users.STOP in ended
    assert len(srv.requests) == 2                          # the agent's own "finish conversation" asks no one


def test_report_prints_acebenchs_agent_score_beside_the_papers():
    s = {MT: {"pass1": 0.5, "n_tasks": 30, "extras": {"process": 0.7}},
         MS: {"pass1": 0.25, "n_tasks": 20, "extras": {"process": 0.6}}}
    out = ace.report(s)
    assert f"| {MT} | 30 | 50.0 | 70.0 |" in out and f"| {MS} | 20 | 25.0 | 60.0 |" in out
    assert "Agent (mean of the two, as ACEBench's summary): 37.5" in out and "39.2" in out and "53.3" in out
    assert "needs both domains" in ace.report({MT: s[MT]})


@pytest.mark.slow
def test_two_multi_turn_episodes_with_llama_cpp_as_the_user(llama_server, tok):
    """The bundled model behind llama.cpp's server plays ACEBench's user on a phone case and a travel case; the
    oracle agent replays the gold path and closes. Whatever the 135M user says, the episodes run through
    run_episodes and ACEBench scores them: 1 exactly when the user ended the conversation."""
    tasks = [ace.make_tasks(MT, "test", 30)[i] for i in (0, 20)]
    turns = max(sum(map(len, t.gold_paths[0])) for t in tasks) + 3
    user = envs.UserFactory("openai:smollm2", dict(base_url=llama_server, api_key="none", timeout=300.0,
                                                   max_retries=1, max_tokens=48))
    trajs = rollout.run_episodes(GoldAgent(tok), tok, tasks, user=user, max_turns=turns, max_context=10**6,
                                 progress=False)
    for task, t in zip(tasks, trajs):
        usage = t.stats["user_usage"]
        print("\n" + t.show(300) + f"\nuser usage: {usage}")
        assert t.stop_reason in ("user_stop", "max_turns")
        assert t.reward == (1.0 if t.stop_reason == "user_stop" else 0.0) and process(t) == 1.0
        assert t.messages[1]["role"] == "user" and t.messages[1]["content"].strip()   # the LLM user's opening
        assert usage["prompt_tokens"] >= len(tok(ace.user_prompt(task)).input_ids)    # ACEBench's user prompt
