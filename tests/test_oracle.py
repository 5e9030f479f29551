"""Our world's gold agent (envs/oracle.py): it solves every scenario through the real loop and scripted user, with only
its own tokens trained, and its confirmations say back what the user asked for; it solves them too with a persona no
training uses, and with no user at all, asking and confirming nothing (sft.py --user none's cold start)."""
import json
import re

import pytest

import envs
from envs import ours
from envs import oracle
import rollout
import users


@pytest.mark.parametrize("user", ["scripted", "scripted:curious"])
def test_oracle_solves_tasks_of_every_scenario(user):
    for key, words in users.FACT_KEYWORDS.items():                 # its questions use the user's keywords
        assert any(w in oracle.QUESTIONS.get(key, words[0]) for w in words), key
    tok = rollout.load_tokenizer()
    agent = rollout.OracleAgent(tok)
    for domain in ours.DOMAINS:
        tasks = ours.make_tasks(domain, "train", 3 * len(ours.SCENARIOS[domain]), seed=5)   # 3 per scenario
        trajs = rollout.run_episodes(agent, tok, tasks, user=envs.UserFactory(user), seed=0, progress=False,
                                     max_turns=30, max_context=8192)
        bad = [(t.task_id, t.scenario, t.stop_reason, t.diff[:200]) for t in trajs if t.reward != 1.0]
        print(domain, f"{len(trajs) - len(bad)}/{len(trajs)} solved")
        assert not bad, bad
        for t in trajs:                                           # the agent's tokens, and only them, are trained
            assert len(t.loss_mask) == len(t.token_ids) and 0 < sum(t.loss_mask) < len(t.token_ids)


def test_bag_confirmation_says_the_request_back_before_the_sum():
    """add_bags: the oracle's confirmation repeats the user's own words "add K more checked bag(s) to
    reservation R" and then the sum to the new total; other writes name only the call."""
    seen = set()
    for t in ours.make_tasks("airline", "train", 60, seed=1):
        write = t.gold_actions[-1]
        text = oracle.confirmation(t, write)
        if t.scenario != "add_bags":
            assert "more checked bag" not in text, text
            continue
        request = re.search(r"add (\d) more checked bags? to reservation \w+", t.opening)
        total = write.arguments["total_baggages"]
        assert text.startswith(f"Please confirm: {request[0]}, "), text
        assert f"{total - int(request[1])} + {request[1]} = {total}" in text, text
        seen.add(request[1])
    assert seen == {"1", "2"}                                      # both requests were checked


def test_with_no_user_the_oracle_asks_nothing_confirms_nothing_and_its_report_ends_the_episode():
    """users.NoUser gives the whole task up front and any agent text ends the episode: the oracle's turns are the
    gold calls, then one report, which the env scores 1 (agent_stop is an ending, not a cut)."""
    tok = rollout.load_tokenizer()
    for domain in ours.DOMAINS:
        tasks = ours.make_tasks(domain, "train", 2 * len(ours.SCENARIOS[domain]), seed=3)
        for task, t in zip(tasks, rollout.run_episodes(rollout.OracleAgent(tok), tok, tasks, user=envs.UserFactory("none"), progress=False,
                                                       max_turns=30, max_context=8192)):
            said = [m for m in t.messages if m["role"] == "assistant"]
            assert (t.reward, t.stop_reason, t.turns) == (1.0, "agent_stop", len(task.gold_actions) + 1), task.scenario
            assert [c["tool_calls"][0] for c in said[:-1]] == [{"name": a.name, "arguments": a.arguments}
                                                              for a in task.gold_actions]
            assert not said[-1]["tool_calls"] and not users.asks_confirmation(said[-1]["content"])
            for m, a in zip(said, task.gold_actions):     # a write's turn says its plan, as a confirmation would
                if a.name in ours.WRITE_TOOLS[domain]:
                    assert m["content"].startswith(f"I will {oracle.plan(task, a)}.\n<tool_call>"), m["content"]
                    assert oracle.confirmation(task, a) == f"Please confirm: {oracle.plan(task, a)}. Yes or no?"


def test_sft_user_none_keeps_every_oracle_conversation(tmp_path):
    """sft.py --user none's data: each train task of the CPU preset's tiers solved alone, every conversation kept."""
    import sft
    args = sft.parse_args(["--user", "none", "--tasks-per-scenario", "3", "--out", str(tmp_path)])
    rows = sft.make_data(args, rollout.load_tokenizer())
    stats = json.loads((tmp_path / "data_stats.json").read_text())
    assert stats["kept"] == stats["tried"] == len(rows) == 6 and stats["acceptance_rate"] == 1.0
    first = json.loads((tmp_path / "data.jsonl").read_text().splitlines()[0])["messages"]
    assert first[1]["role"] == "user" and "Everything you may need:" in first[1]["content"]
    assert [m["role"] for m in first[2:]] == ["assistant", "tool"] * 3 + ["assistant"]   # 3 calls, then the report


def test_the_curious_persona_withholds_ids_answers_one_fact_and_asks_back():
    """scripted:curious, which no training uses: its opening names the request without the ids an easy opening
    gives, it reveals one asked fact at a time (the last asked), and meets the first request to confirm with a
    question; asked again, it decides by ScriptedUser's rule, then waits for the report."""
    task = next(t for t in ours.make_tasks("retail", "test", 8) if t.scenario == "cancel_order")
    u = envs.make_user("scripted:curious", task, seed=2)
    first = u.first_message()
    assert u.behaviour.opens == "request" and "cancel" in first
    assert not any(v in first for v in task.hidden_facts.values())            # the default opening names them
    assert task.hidden_facts["order_id"] in task.opening
    say = lambda text: [{"role": "assistant", "content": text}]                 # noqa: E731
    r = u.reply(say("Please give me your email address, the order id and the reason."))
    assert task.hidden_facts["reason"] in r and task.hidden_facts["email"] not in r   # one fact: the last asked
    confirm = oracle.confirmation(task, task.gold_actions[-1])
    assert u.reply(say(confirm)) in users.WORDS["other"].back
    assert u.reply(say(confirm)) in users.WORDS["other"].yes
    assert users.STOP not in u.reply(say("One moment."))
    assert users.STOP in u.reply(say(oracle.report(task)))
    assert envs.make_user("scripted", task, seed=2).first_message() != first
