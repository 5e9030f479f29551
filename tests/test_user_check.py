"""The check on an LLM user's message (envs/llm_users.py: check_turn, run by CheckedUser): it flags each way a user
breaks (a stop before the needed write, a fact the task does not hold, the agent's voice or template syntax, nothing);
a flagged message is asked again, and an episode whose user still breaks is left out and counted, never scored as the
agent's; no scripted persona trips it (the gold agent fast, the SFT agent slow); a scripted run is token for token
what it was; what the users cost is reported (llm_users.user_report); and scripts/user_check.py, which measures the
check on a real LLM user, counts, resumes and reports what it ran.

Run:  pytest tests/test_user_check.py            # ~1-2 min on 2 busy cores: the persona sweep is most of it
      pytest tests/test_user_check.py -m slow    # the SFT agent (runs/sft/adapter, or $MUA_RL_SFT_ADAPTER)
"""
import json
import math
import os
import random
from types import SimpleNamespace

import pytest
import torch

import envs
import rollout
import users as U
from envs import llm_users as L
from chat_server import FakeServer
from fault_server import BREAKS, FaultServer

ORDER = next(t for t in envs.make_tasks("retail", "test", 14) if t.scenario == "change_order_payment")
LOOKUP = next(t for t in envs.make_tasks("retail", "test", 14) if t.scenario == "order_status_total")
CONFIRM = f"Please confirm: modify pending order payment (order id {ORDER.hidden_facts['order_id']}; payment method " \
          f"id {ORDER.hidden_facts['payment_method']}). Yes or no?"


def view(*agent_said, task=ORDER):
    """The agent's view of a conversation: the task's opening, then each agent message answered by "Ok.", ending on
    the agent's last message."""
    out = [{"role": "user", "content": task.opening}]
    for k, text in enumerate(agent_said):
        out += [{"role": "assistant", "content": text}] + [{"role": "user", "content": "Ok."}] * (k < len(agent_said) - 1)
    return out


def check(said, messages=(), task=ORDER, writes=0):
    env = envs.make_env(task)
    env.writes = [None] * writes               # the writes made so far: all check_turn reads of them is how many
    return L.check_turn(task, env, list(messages), said)


# ---------------------------------------------------------------- the rule, case by case

def test_a_stop_before_the_needed_write_is_flagged_and_the_legit_stops_are_not():
    assert check(U.STOP) == "early_stop"                                         # a stop for an opening
    assert check("Yes, please go ahead. ###STOP###", view(CONFIRM)) == "early_stop"   # yes + stop: τ²-bench #182
    assert check("Yes, please go ahead.", view(CONFIRM)) == ""
    assert check("Thanks. ###STOP###", view(CONFIRM), writes=1) == ""             # the write happened
    done = "Done: modify pending order payment (order id ...)."
    assert check("Thanks, bye! ###STOP###", view(CONFIRM, done)) == ""            # reported done (true or not)
    assert check("Ok. ###STOP###", view("Sorry, I cannot change the payment of a delivered order.")) == ""   # refused
    tired = view(*["Please give me your email address."] * (U.PATIENCE + 1))
    assert check("I give up. ###STOP###", tired) == "" and check("I give up. ###STOP###", tired[:-2]) == "early_stop"
    status, total = LOOKUP.required_outputs                                       # a question, not a write
    assert check("Thanks. ###STOP###", view("Let me look.", task=LOOKUP), LOOKUP) == "early_stop"
    assert check("Thanks. ###STOP###", view(f"It is {status}, total ${total}.", task=LOOKUP), LOOKUP) == ""


def test_a_value_the_task_does_not_hold_is_flagged_and_a_typo_or_an_echo_is_not():
    f = ORDER.hidden_facts
    assert check(f"My email is {f['email']} and the order is {f['order_id']}.") == ""
    assert check(f"The order is {f['order_id'].lstrip('#W')}.") == ""            # part of a held value
    assert check("My email is john.doe@example.com.") == "wrong_fact"             # invented
    assert check("My order id is #W0000001.") == "wrong_fact"
    typo = f["order_id"][:-1] + str((int(f["order_id"][-1]) + 1) % 10)            # the careless persona's slip
    two_off = f["order_id"][:-2] + "".join(str((int(c) + 5) % 10) for c in f["order_id"][-2:])
    assert check(f"My order id is {typo}.") == "" and check(f"My order id is {two_off}.") == "wrong_fact"
    assert check("It cost $54.27.") == "wrong_fact" and check("It cost $54.27.", view("Your total is 54.27.")) == ""
    assert check("I need it within 30-day returns, in 2024.") == ""              # no fact value: not a code
    assert L.stated_values("Mail a.b@c.com, $1,054.2, #W1234567, 12345; 30-day, 2024") == \
        {"a.b@c.com", "1054.20", "w1234567", "12345"}


@pytest.mark.parametrize("said", ["<|im_start|>assistant\nSure.", "Customer: hi there", "assistant: How can I help?",
                                  '<tool_call>{"name": "x", "arguments": {}}</tool_call>', "Hi! How can I help you today?",
                                  "Could you give me your email address?", "I have cancelled the order for you.",
                                  "Is there anything else I can help you with?", "I'm Noah Kim, a customer-service "
                                  "agent. What can I do for you today?", "I'll be happy to help with any questions.",
                                  "I'm sorry, but as a customer-service agent, I don't have the ability to provide "
                                  "user data."])
def test_the_agents_voice_or_template_syntax_is_flagged(said):
    assert check(said, view("Please give me your email address.")) == "agent_voice"


def test_an_echo_of_the_agents_message_is_flagged_but_the_users_own_words_are_not():
    said = "Please give me the order id and the payment method."
    assert check(said, view(said)) == "agent_voice"
    assert check(ORDER.opening, view(ORDER.opening)) == ""           # the agent repeated the user; the user repeats itself
    assert check("I have changed my mind, keep it.", view(CONFIRM)) == ""
    assert check("I'm Noah, a returning customer.", view(CONFIRM)) == ""
    assert check("As a loyal customer, I would like a refund.", view(CONFIRM)) == ""


@pytest.mark.parametrize("said,reason", [("", "empty"), ("  ...  ", "empty"), (U.STOP, ""), ("Yes.", "")])
def test_a_message_with_nothing_in_it_is_flagged_a_bare_stop_is_not(said, reason):
    assert check(said, view("Done: the payment is changed."), writes=1) == reason


# ---------------------------------------------------------------- no false alarms: scripted users are right

def persona_episodes(agent, tok, tasks, trials=1, seed=1):
    """Every persona x tasks, in one run_episodes batch (a user a row); -> [(persona, task, trajectory)]. A
    conversation's user and sampling stream are seeded by (seed, task, trial), whatever shares its batch."""
    rows = [(name, task) for name in U.PERSONAS for task in tasks]
    trajs = rollout.run_episodes(agent, tok, [task for _, task in rows], group_size=trials, seed=seed,
                                 user=[envs.UserFactory(f"scripted:{name}") for name, _ in rows], progress=False,
                                 max_turns=14, max_context=8192)
    return [(*rows[t.group], t) for t in trajs]


def no_flags(episodes):
    flags = [(p, t.task_id, i, reason, t.messages[i]["content"]) for p, task, t in episodes
             for i, reason in L.check_episode(task, t)]
    turns = sum(m["role"] == "user" for _, _, t in episodes for m in t.messages)
    print(f"\n{len(episodes)} episodes, {turns} user messages checked, {len(flags)} flagged {flags[:3]}")
    return flags


def test_no_scripted_persona_trips_the_check_with_the_gold_agent(tok):
    """Every persona x both domains x every scenario (9 tasks a domain), the gold agent: 108 episodes, 0 flags."""
    tasks = envs.make_tasks("retail", "train", 9) + envs.make_tasks("airline", "train", 9)
    episodes = persona_episodes(rollout.OracleAgent(tok), tok, tasks)
    assert len(episodes) >= 100 and all(t.stop_reason == "user_stop" for _, _, t in episodes)
    assert no_flags(episodes) == []


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_no_scripted_persona_trips_the_check_with_the_sft_agent(temperature):
    """The cold-start agent (runs/sft/adapter, or $MUA_RL_SFT_ADAPTER) errs, asks oddly, lies that it is done; the
    scripted personas answer it as designed, and the check still flags none of their messages: every named persona
    (7 with mindful) x 8 held-out CPU tasks, greedy and at T = 0.7."""
    import common
    import sampler
    adapter = os.environ.get("MUA_RL_SFT_ADAPTER", "runs/sft/adapter")
    if not os.path.isfile(os.path.join(adapter, "adapter_config.json")):
        pytest.skip(f"no SFT adapter at {adapter}: python sft.py, or set MUA_RL_SFT_ADAPTER")
    model, tok = rollout.load_model()
    model = rollout.load_adapter(model, adapter).eval()
    agent = sampler.make_agent("fast", model, tok, temperature, common.CPU_LIMITS["max_new_tokens"])
    tasks = envs.held_out_tasks(["retail", "airline"], 4, common.CPU_TIERS.split(","))
    episodes = persona_episodes(agent, tok, tasks)
    assert len(episodes) == 8 * len(U.PERSONAS) and no_flags(episodes) == []


def test_a_checked_scripted_user_gives_the_same_trajectories_and_draws_no_random_number(tok):
    """The check's wrapper on a scripted user (CheckedUser: each of its messages checked): the same tokens,
    messages, rewards and stop reasons as without it, nothing flagged, torch's and Python's RNG untouched. (A run
    never checks a scripted user, and its episodes carry none of the check's or the cost's counters; this shows
    the check would not matter if it did.)"""
    tasks = envs.make_tasks("retail", "train", 7) + envs.make_tasks("airline", "train", 5)

    def checked(task, seed, env):
        return L.CheckedUser(envs.make_user("scripted:train", task, seed), env, 2)
    plain = rollout.run_episodes(rollout.OracleAgent(tok), tok, tasks, group_size=2,
                                 user=envs.UserFactory("scripted:train"), seed=5, progress=False,
                                 max_turns=30, max_context=8192)
    states = random.getstate(), torch.get_rng_state()
    same = rollout.run_episodes(rollout.OracleAgent(tok), tok, tasks, group_size=2, user=checked, seed=5,
                                progress=False, max_turns=30, max_context=8192)
    assert random.getstate() == states[0] and torch.equal(torch.get_rng_state(), states[1])
    assert [(t.token_ids, t.loss_mask, t.messages, t.reward, t.stop_reason) for t in same] == \
        [(t.token_ids, t.loss_mask, t.messages, t.reward, t.stop_reason) for t in plain]
    assert all(t.stats["user_flags"] == {} and t.stats["user_asked_again"] == 0 and t.stats["user_checks"] == []
               and not t.failed for t in same)
    assert not {"user_flags", "user_asked_again", "user_checks", "user_usage"} & {k for t in plain for k in t.stats}
    assert L.user_report(plain, wall_s=10.0) == {}                  # and a step's line shows no users' cost


# ---------------------------------------------------------------- a user server that breaks, on a schedule

@pytest.fixture(scope="module")
def tasks():
    return envs.make_tasks("retail", "train", 2) + envs.make_tasks("airline", "train", 2)


def llm_episodes(tok, tasks, srv, retries=2):
    make_user = envs.UserFactory("openai:scripted", {"base_url": srv.url, "api_key": "k", "timeout": 5.0,
                                                     "check_retries": retries})
    return rollout.run_episodes(rollout.OracleAgent(tok), tok, tasks, user=make_user, progress=False,
                                max_turns=30, max_context=8192)


@pytest.fixture(scope="module")
def clean(tok, tasks):
    with FaultServer(tasks) as srv:
        trajs = llm_episodes(tok, tasks, srv)
    assert all(t.reward == 1.0 and not t.failed and t.stats["user_flags"] == {} for t in trajs)
    return trajs, srv.requests


@pytest.mark.parametrize("reason", list(BREAKS))
def test_each_kind_of_break_is_caught_and_a_re_ask_that_mends_it_gives_the_clean_episode(tok, tasks, clean, reason):
    """Each conversation's first reply (k = 1) comes back broken once: the check flags it for its reason, it is asked
    again (the correction in the chat), and the episode is token for token the clean one, reward included."""
    breaks = {(t.id, 1): (reason, 1) for t in tasks} | {(tasks[0].id, 0): (reason, 1)}   # and one opening
    with FaultServer(tasks, breaks=breaks) as srv:
        trajs = llm_episodes(tok, tasks, srv)
    assert srv.outcomes[f"broke {reason}"] == len(tasks) + 1 and srv.requests == clean[1] + len(tasks) + 1
    assert [(t.token_ids, t.reward, t.stop_reason) for t in trajs] == [(t.token_ids, t.reward, t.stop_reason)
                                                                      for t in clean[0]]
    assert [t.stats["user_flags"] for t in trajs] == [{reason: 2}] + [{reason: 1}] * (len(tasks) - 1)
    assert all(not t.failed and t.stats["user_asked_again"] == sum(t.stats["user_flags"].values()) for t in trajs)
    shown = [c for t in trajs for c in t.stats["user_checks"]]       # the message each try stands before
    assert [f["said"] for c in shown for f in c["flagged"]] == [BREAKS[reason]] * (len(tasks) + 1)
    assert all(t.messages[c["at"]]["role"] == "user" for t in trajs for c in t.stats["user_checks"])
    report = L.user_report(trajs, wall_s=10.0)
    assert report["user_flags"] == {reason: len(tasks) + 1} and report["user_asked_again"] == len(tasks) + 1
    assert report["left_out"] == {} and report["user_requests"] == srv.requests


def test_a_user_that_never_mends_is_left_out_counted_and_never_scored_as_the_agents(tok, tasks, tmp_path):
    """The second task's first reply is broken every time: 1 try + 2 re-asks, then the episode ends, marked
    user_broke with its reason, and rl.py leaves it out of its group (sample_groups) while the rest trains; past
    --max-sim-failures a step stops with one line. No rollout is lost."""
    import rl
    args = SimpleNamespace(seed=0, group_size=1, draw=len(tasks), max_draws=1, tasks=len(tasks), screen=0,
                           rollouts=None, out=str(tmp_path), user="openai:scripted", max_turns=30, max_context=8192,
                           reward="binary", max_sim_failures=0.25, user_workers=256)
    with FaultServer(tasks, breaks={(tasks[1].id, 1): ("early_stop", math.inf)}) as srv:
        trajs = llm_episodes(tok, tasks, srv)
        user = envs.UserFactory("openai:scripted", {"base_url": srv.url, "api_key": "k", "check_retries": 2})
        drawn, left = rl.sample_groups(rl.Sampling(rollout.OracleAgent(tok), tok, user), {"all": tasks}, 0, args)
    broke = trajs[1]
    assert len(trajs) == len(tasks) and [t.failed for t in trajs] == ["", "user_broke", "", ""]
    assert broke.stop_reason == "error" and broke.stats["user_broke"] == "early_stop" and "UserBroke" in broke.stats["error"]
    assert broke.stats["user_flags"] == {"early_stop": 3} and broke.stats["user_asked_again"] == 2
    assert broke.stats["user_checks"] == [{"at": len(broke.messages), "broke": "early_stop",   # no message reached
                                           "flagged": [{"said": BREAKS["early_stop"], "reason": "early_stop"}] * 3}]
    assert all(t.reward == 1.0 for t in trajs if not t.failed)
    assert L.user_report(trajs)["left_out"] == {"early_stop": 1}
    assert [t.task_id for t in left] == [tasks[1].id] and tasks[1].id not in {t.task_id for g in drawn for t in g}

    args.max_sim_failures = 0.2                                     # 1 of 4 left out is more than that: one line
    with FaultServer(tasks, breaks={(tasks[1].id, 1): ("early_stop", math.inf)}) as srv, \
            pytest.raises(SystemExit) as stop:
        user = envs.UserFactory("openai:scripted", {"base_url": srv.url, "api_key": "k", "check_retries": 2})
        rl.sample_groups(rl.Sampling(rollout.OracleAgent(tok), tok, user), {"all": tasks}, 0, args)
    print(stop.value)
    assert str(stop.value).startswith("step 1: 1 of 4 rollouts left out") and "--max-sim-failures 0.2" in str(stop.value)
    assert "early_stop" in str(stop.value) and "\n" not in str(stop.value)


def test_an_evaluation_leaves_out_a_broken_users_task_and_stops_past_max_sim_failures(tok, tasks):
    import eval as ev
    make_user = lambda srv: envs.UserFactory("openai:scripted", {"base_url": srv.url, "api_key": "k",  # noqa: E731
                                                                 "check_retries": 1})
    broken = {(tasks[2].id, 1): ("wrong_fact", math.inf)}
    with FaultServer(tasks, breaks=broken) as srv:
        r = ev.evaluate(rollout.OracleAgent(tok), tok, tasks, trials=1, user=make_user(srv), progress=False, n_boot=10,
                        price=[2.5, 10.0], max_turns=8, max_context=3072)
    assert r["tasks_lost"] == 1 and tasks[2].id not in r["rewards"] and r["overall"]["pass^k"][1] == 1.0
    u = r["users"]
    assert u["left_out"] == {"wrong_fact": 1} and u["user_flags"] == {"wrong_fact": 2} and u["user_asked_again"] == 1
    assert u["user_dollars"] == pytest.approx((2.5 * u["user_prompt_tokens"] + 10 * u["user_completion_tokens"]) / 1e6)
    assert 0 < u["user_wait_s"] <= r["seconds"] and 0 < u["user_wait_share"] <= 1
    table = ev.markdown({"gold": {"tau": r}})
    assert "| gold | " in table and "| wrong_fact 2 | wrong_fact 1 |" in table
    with FaultServer(tasks, breaks=broken) as srv, pytest.raises(SystemExit, match="^evaluation: 1 of 4 rollouts left"):
        ev.evaluate(rollout.OracleAgent(tok), tok, tasks, trials=1, user=make_user(srv), progress=False, n_boot=10,
                    max_sim_failures=0.2, max_turns=8, max_context=3072)


def test_a_re_ask_sends_the_flagged_message_the_correction_and_a_seeded_higher_temperature():
    """What OpenAIUser.ask_again sends: the chat, then its flagged message and the reason's correction; temperature
    llm_users.AGAIN_TEMPERATURE and the attempt as the seed (a reproducible draw, not the same greedy answer)."""
    with FakeServer("ok") as srv:
        user = L.OpenAIUser(ORDER, "m", base_url=srv.url, api_key="k", timeout=2.0)
        user.ask_again(view(CONFIRM), "Yes. ###STOP###", "early_stop", 2)
        user.reply(view(CONFIRM))
    again, plain = (r["body"] for r in srv.requests)
    assert again["messages"] == L.user_sim_messages(ORDER, view(CONFIRM)) + [
        {"role": "assistant", "content": "Yes. ###STOP###"}, {"role": "system", "content": L.CORRECTIONS["early_stop"]}]
    assert (again["temperature"], again["seed"]) == (L.AGAIN_TEMPERATURE, 2)
    assert plain["temperature"] == 0.0 and "seed" not in plain


def test_the_measuring_script_counts_a_user_that_always_breaks_resumes_and_reports_only_finished_tasks(tok, tasks,
                                                                                                      tmp_path):
    """scripts/user_check.py on two tasks, the gold agent as its agent: the first task's user always speaks as the
    agent at its first reply. Without the check that message is flagged afterwards; with it the episode is left out;
    no way of asking again mends it (this server's break is always there). Run again, it reads its records back and
    asks the server nothing; with --report-only, a task one run has not finished is not reported."""
    from scripts import user_check as uc
    two = tasks[:2]
    with FaultServer(two, breaks={(two[0].id, 1): ("agent_voice", math.inf)}) as srv:
        args = SimpleNamespace(user="openai:scripted", user_base_url=srv.url, user_timeout=5.0, retries=2, seed=0,
                               out=str(tmp_path), shard=None, report_only=False, sample=0)
        off, on = uc.run_arms(rollout.OracleAgent(tok), tok, two, args)
        r = uc.report(two, off, on, args)
        ran = srv.requests
        again = uc.run_arms(rollout.OracleAgent(tok), tok, two, args)
        assert srv.requests == ran and [t.token_ids for t in again[1].values()] == [t.token_ids for t in on.values()]
        lines = (tmp_path / "on.jsonl").read_text().splitlines()
        (tmp_path / "on.jsonl").write_text(lines[0] + "\n")            # the second task's run with the check: lost
        args.report_only = True
        assert [list(run) for run in uc.run_arms(rollout.OracleAgent(tok), tok, two, args)] == [[two[0].id]] * 2
        assert srv.requests == ran
    assert on[two[0].id].failed == "user_broke" and not on[two[1].id].failed and off[two[1].id].reward == 1.0
    assert r["flags_off"]["agent_voice"]["turns_n"] == 1 and r["flags_off"]["any"]["episodes_n"] == 1
    assert r["left_out_on"] == {"agent_voice": 1} and r["mended_on"] == {} and r["asked_again"] == 1
    assert all(w["mended"] == 0 and w["still"] == {"agent_voice": 1} for w in r["ways"].values())
    assert r["pass1"]["on"]["n"] == 1 and r["pass1"]["off"]["n"] == 2 and r["left_out_scored_off"]["n"] == 1
    assert [json.loads(x)["reason"] for x in (tmp_path / "flagged.jsonl").read_text().splitlines()] == ["agent_voice"]
    assert "| agent_voice | " in (tmp_path / "report.md").read_text()
