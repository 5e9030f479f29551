"""The scripted personas (users.PERSONAS): one table in the code and in docs/personas.md, split train / held-out;
each seeded and deterministic and doing what its row says; scripted:train draws a training persona per conversation;
a user or persona added the README's way is valid everywhere; and the gold agent solves every persona, in both
domains and the easy and medium tiers, with slack under the turn cap (its longest episodes are printed: -s)."""
import argparse
import math
import os
import re
import zlib

import pytest

import common
import envs
from envs import ours
from envs import oracle
import rollout
import users

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = [n for n, p in users.PERSONAS.items() if p.split == "train"]
HELD_OUT = [n for n, p in users.PERSONAS.items() if p.split == "held-out"]


def say(text):
    """The agent's view of a conversation whose last agent message is text (what a scripted user reads)."""
    return [{"role": "assistant", "content": text}]


def task_of(scenario, domain="retail", split="test"):
    return next(t for t in ours.make_tasks(domain, split, 40) if t.scenario == scenario)


def test_one_table_split_like_tasks_and_the_same_in_docs():
    assert len(users.PERSONAS) >= 5 and len(HELD_OUT) >= 2 and TRAIN
    assert set(TRAIN) | set(HELD_OUT) == set(users.PERSONAS) and "default" in TRAIN
    assert all(issubclass(p.cls, users.ScriptedUser) and p.reveals and p.confirms and p.speaks
               for p in users.PERSONAS.values())
    assert len({p.cls for p in users.PERSONAS.values()}) == len(users.PERSONAS)    # no two rows the same user
    with open(os.path.join(ROOT, "docs", "personas.md")) as f:
        assert users.persona_table() in f.read()                                  # docs show the code's table


def test_plain_scripted_is_the_default_persona_and_unchanged():
    task = task_of("change_order_payment")
    for spec in ("scripted", "scripted:default"):
        assert type(users.make_user(spec, task, seed=4)) is users.ScriptedUser


@pytest.mark.parametrize("name", list(users.PERSONAS))
def test_each_persona_is_deterministic_given_its_seed_and_varies_with_it(name):
    tok = rollout.load_tokenizer()
    tasks = ours.make_tasks("airline", "test", 4, ["medium"]) + ours.make_tasks("retail", "test", 4, ["medium"])
    runs = [rollout.run_episodes(rollout.OracleAgent(tok), tok, tasks, user=envs.UserFactory(f"scripted:{name}"), seed=s,
                                 progress=False, max_turns=30, max_context=8192) for s in (1, 1, 2)]
    said = [[[m["content"] for m in t.messages if m["role"] == "user"] for t in run] for run in runs]
    assert said[0] == said[1]                                   # same seed: the same words
    assert said[0] != said[2]                                   # another seed: other phrasing somewhere


def test_terse_gives_every_fact_at_the_first_question_in_bare_words():
    task = task_of("exchange_item")
    u = users.make_user("scripted:terse", task, seed=0)
    r = u.reply(say("Please give me your email address."))
    assert all(str(v) in r for v in task.hidden_facts.values()), r              # everything, asked or not
    assert not r.lower().startswith(("hi", "hello", "my ")) and len(r.split()) < 8 * len(task.hidden_facts)


def test_chatty_gives_one_fact_a_reply_with_an_aside_and_asks_back_before_confirming():
    task = task_of("change_order_payment")
    u = users.make_user("scripted:chatty", task, seed=0)
    first = u.first_message()
    assert any(a in first for a in users.ChattyUser.ASIDES)
    r = u.reply(say("Please give me your email address, the order id and the payment method to use."))
    facts = task.hidden_facts
    assert facts["email"] in r and facts["order_id"] not in r and facts["payment_method"] not in r   # the first asked
    assert any(a in r for a in users.ChattyUser.ASIDES)
    r = u.reply(say("Please give me your email address, the order id and the payment method to use."))   # again:
    # the first asked that it has not given yet
    assert facts["order_id"] in r and facts["payment_method"] not in r
    confirm = oracle.confirmation(task, task.gold_actions[-1])
    assert u.reply(say(confirm)).startswith(users.ChattyUser.BACK)
    assert u.reply(say(confirm)).startswith(users.ChattyUser.YES)


def test_careless_mistypes_its_first_digit_fact_and_corrects_it_next():
    task = task_of("change_order_payment")
    email = task.hidden_facts["email"]
    u = users.make_user("scripted:careless", task, seed=0)
    r = u.reply(say("Please give me your email address."))
    assert email not in r and "@" in r                                            # one digit off
    wrong = re.search(r"\S+@\S+\w", r)[0]
    assert len(wrong) == len(email) and sum(a != b for a, b in zip(wrong, email)) == 1
    r = u.reply(say("Thanks, one moment."))                                        # whatever the agent said
    assert f"it is {email}, not {wrong}" in r
    assert "Sorry" not in u.reply(say("Please give me the order id."))            # corrected once


def test_literal_answers_only_a_fact_named_by_its_own_name_and_says_a_bare_no():
    task = task_of("change_order_payment")
    u = users.make_user("scripted:literal", task, seed=0)
    oid = task.hidden_facts["order_id"]
    assert oid not in u.reply(say("Which order is it?"))                          # the default user would answer
    assert oid in users.make_user("scripted", task, seed=0).reply(say("Which order is it?"))
    assert oid in u.reply(say("Please give me the order id."))
    r = u.reply(say(f"Please confirm: pay order {oid} with another card. Yes or no?"))
    assert r in users.LiteralUser.NO                                              # no hint at what is missing
    assert users.make_user("scripted", task, seed=0).reply(
        say(f"Please confirm: pay order {oid} with another card. Yes or no?")) not in users.ScriptedUser.NO
    assert u.reply(say(oracle.confirmation(task, task.gold_actions[-1]))) in users.LiteralUser.YES


def test_the_gold_agent_reads_a_yes_only_in_a_personas_yes():
    """A question back, a nudge, an aside or a no that the gold agent took for a yes would make it write before
    the user approved; every persona's yes it must take for one."""
    for p in users.PERSONAS.values():
        for phrase in p.cls.YES:
            assert oracle._is_yes(phrase), phrase
        others = (*p.cls.NO, *p.cls.NUDGE, *getattr(p.cls, "BACK", ()), *getattr(p.cls, "ASIDES", ()))
        for phrase in others:
            assert not oracle._is_yes(phrase), phrase


def test_scripted_train_draws_a_training_persona_per_conversation_by_seed():
    task = task_of("cancel_order")
    drawn = {s: type(users.make_user("scripted:train", task, seed=s)) for s in range(60)}
    assert set(drawn.values()) == {users.PERSONAS[n].cls for n in TRAIN}           # every one, none held out
    assert all(type(users.make_user("scripted:train", task, seed=s)) is c for s, c in drawn.items())   # seeded
    held = {type(users.make_user("scripted:heldout", task, seed=s)) for s in range(60)}
    assert held == {users.PERSONAS[n].cls for n in HELD_OUT}


def _check(user, training):
    """common.check_args on --user alone -> None, or the one line it printed on exit 2."""
    try:
        common.check_args(argparse.Namespace(user=user), training=training)
    except SystemExit as e:
        assert e.code == 2
        return "exit 2"
    return None


def test_a_persona_set_with_no_training_persona_is_one_line(monkeypatch, capsys):
    assert _check("scripted:train", training=True) is None
    monkeypatch.setattr(users, "PERSONAS", {n: p._replace(split="held-out") for n, p in users.PERSONAS.items()})
    assert _check("scripted:train", training=True) == "exit 2"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--user" in err[0] and "no training persona" in err[0], err


class ToyPersona(users.ScriptedUser):
    """A persona added the README's way: a ScriptedUser subclass (here: it shouts) and a row in users.PERSONAS."""
    YES = ("YES, GO AHEAD.",)

    def reply(self, messages):
        return super().reply(messages).upper().replace(users.STOP.upper(), users.STOP)


class ToyUser(users.User):
    """A user kind added the README's way: a users.User subclass and a row in users.USER_KINDS. It gives every fact
    in its first message and says yes to anything, then stops once it hears "Done"."""

    def first_message(self):
        return self.task.opening + " " + " ".join(f"My {k} is {v}." for k, v in self.task.hidden_facts.items())

    def reply(self, messages):
        return f"Thanks. {users.STOP}" if messages[-1]["content"].startswith("Done") else "Yes."


def test_a_user_and_a_persona_added_the_readme_way_work_everywhere(monkeypatch):
    for spec in ("scripted:toy", "toy"):                       # not there yet: bad input
        assert _check(spec, training=False) == "exit 2"
    monkeypatch.setitem(users.PERSONAS, "toy", users.Persona(ToyPersona, "train", "as default", "as default", "loud"))
    monkeypatch.setitem(users.USER_KINDS, "toy", users.UserKind(lambda task, seed, arg, **kw: ToyUser(task), "",
                                                                "a toy"))
    for spec in ("scripted:toy", "toy", "scripted:train"):
        assert _check(spec, training=True) is None, spec       # sft.py and rl.py may train on them
    assert "toy" in users.user_help() and "toy" in users.persona_table()
    assert ToyPersona in {type(users.make_user("scripted:train", task_of("cancel_order"), seed=s)) for s in range(80)}
    tok = rollout.load_tokenizer()
    tasks = ours.make_tasks("retail", "test", 2, ["medium"])
    for spec, cls in (("scripted:toy", ToyPersona), ("toy", ToyUser)):
        assert type(users.make_user(spec, tasks[0], seed=0)) is cls
        trajs = rollout.run_episodes(rollout.OracleAgent(tok), tok, tasks, user=envs.UserFactory(spec), progress=False,
                                     max_turns=30, max_context=8192)
        assert [t.reward for t in trajs] == [1.0, 1.0], [t.diff for t in trajs]
        said = [m["content"] for t in trajs for m in t.messages if m["role"] == "user"]
        assert any("YES, GO AHEAD." in s for s in said) if cls is ToyPersona else said[0].startswith(tasks[0].opening)


# ----------------------------------------------------------------------------- the ceiling: every persona solvable

CAP = 30                 # the paper's turn cap; the test asserts 1.5 x the gold agent's longest episode fits under it
N_TASKS = 30             # held-out tasks per persona x domain x tier


def gold_episode(task, spec, seed, cap=CAP):
    """The gold agent (oracle.oracle_reply) against a user, as rollout.run_episodes runs it but on messages alone
    (no tokenizer: 720 episodes in seconds): its text turn is answered by the user, its tool call by the env.
    -> (reward, agent turns, stop reason, what a careful agent would not have done: a hidden fact used in a call
    before the user told it (the gold agent knows every value, a careful agent only what it was told, so it must ask
    until it hears it), a write before the user said yes to it)."""
    env, user = ours.Env(task), users.make_user(spec, task, seed)
    messages, turns, stop, guessed = [{"role": "user", "content": user.first_message()}], 0, "max_turns", []
    writes = 0
    while turns < cap:
        text = oracle.oracle_reply(task, messages)
        turns += 1
        calls, _ = rollout.parse_tool_calls(text)
        messages.append({"role": "assistant", "content": text, "tool_calls": calls})
        if calls:
            heard = " ".join(m["content"] for m in messages if m["role"] == "user").lower()
            guessed += [k for k, v in task.hidden_facts.items() if oracle._uses(v, ours.Action(**calls[0]))
                        and not oracle._heard(v, heard)]
            writes += calls[0]["name"] in ours.WRITE_TOOLS[task.domain]
            guessed += ["a write the user had not said yes to"] * (writes > sum(user.confirmed))   # its own count
            messages.append({"role": "tool", "content": env.step(calls[0]["name"], calls[0]["arguments"])})
            continue
        said = user.reply(messages)
        messages.append({"role": "user", "content": said})
        if users.STOP in said:
            stop = "user_stop"
            break
    said = [users.visible_text(m["content"]) for m in messages if m["role"] == "assistant"]
    return env.reward(said, stop_reason=stop), turns, stop, guessed


def test_gold_episode_is_run_episodes_on_messages():
    """The fast loop below scores and counts turns as the real rollout loop does (a few episodes of each persona)."""
    tok = rollout.load_tokenizer()
    tasks = ours.make_tasks("retail", "test", 2, ["medium"]) + ours.make_tasks("airline", "test", 2, ["medium"])
    for name in users.PERSONAS:
        trajs = rollout.run_episodes(rollout.OracleAgent(tok), tok, tasks, user=envs.UserFactory(f"scripted:{name}"), seed=3,
                                     max_turns=CAP, progress=False, max_context=8192)
        for task, t in zip(tasks, trajs):
            seed = zlib.crc32(f"3|{task.id}|0".encode())              # run_episodes' user seed, trial 0
            assert gold_episode(task, f"scripted:{name}", seed)[:3] == (t.reward, t.turns, t.stop_reason), (name, task.id)


def test_the_gold_agent_solves_every_persona_with_slack():
    """pass^1 = 1 on N_TASKS held-out tasks of each persona x domain x tier (easy, medium), every episode ended by
    the user, no fact used before it was told, and 1.5 x the longest episode within CAP. The longest episodes are what the turn caps are set from."""
    longest, bad = {}, []
    for name in users.PERSONAS:
        for domain in ours.DOMAINS:
            for tier in ("easy", "medium"):
                tasks = ours.make_tasks(domain, "test", N_TASKS, [tier])
                assert len(tasks) == N_TASKS
                runs = [gold_episode(t, f"scripted:{name}", seed=i) for i, t in enumerate(tasks)]
                bad += [(name, t.id, t.scenario, r) for t, r in zip(tasks, runs)
                        if r[0] != 1.0 or r[2] != "user_stop" or r[3]]
                longest[name, domain, tier] = max(r[1] for r in runs)
    print("\nthe gold agent's longest episode (agent turns) and the cap with 1.5x slack, over", N_TASKS,
          "held-out tasks each:")
    print(f"{'persona':10s} {'split':9s} " + " ".join(f"{d[:6]}/{t:6s}" for d in ours.DOMAINS for t in ("easy", "medium")))
    for name, p in users.PERSONAS.items():
        print(f"{name:10s} {p.split:9s} " + " ".join(f"{longest[name, d, t]:13d}" for d in ours.DOMAINS
                                                      for t in ("easy", "medium")))
    for tier in ("easy", "medium"):
        top = max(v for (_, _, t), v in longest.items() if t == tier)
        print(f"{tier}: longest {top}, a cap with 1.5x slack: {math.ceil(1.5 * top)}")
    assert not bad, bad[:5]
    assert 1.5 * max(longest.values()) <= CAP, longest


def test_the_cpu_presets_limits_leave_the_gold_agent_slack_on_their_tasks():
    """The CPU presets' episode limits (common.CPU_LIMITS, on common.CPU_TIERS) are set from the gold agent: through
    the real loop, at those limits, it solves N_TASKS held-out tasks of each persona x domain; 1.5 x its longest
    episode fits the turn cap, its longest message the tokens a turn, and its longest conversation plus a turn the
    context with room to spare (x 1.2)."""
    tok, limits = rollout.load_tokenizer(), common.CPU_LIMITS
    turns, message, length, failed = 0, 0, 0, []
    for name in users.PERSONAS:
        tasks = [t for d in ours.DOMAINS for t in ours.make_tasks(d, "test", N_TASKS, common.CPU_TIERS.split(","))]
        assert len(tasks) == 2 * N_TASKS
        for t in rollout.run_episodes(rollout.OracleAgent(tok), tok, tasks, user=envs.UserFactory(f"scripted:{name}"), progress=False,
                                      max_turns=limits["max_turns"], max_context=limits["max_context"]):
            failed += [(name, t.task_id, t.stop_reason)] * (t.reward != 1.0)
            turns, length = max(turns, t.turns), max(length, len(t.token_ids))
            message = max([message] + [len(tok(m["content"])["input_ids"]) for m in t.messages
                                        if m["role"] == "assistant"])
    print(f"\nthe gold agent on {common.CPU_TIERS}: longest episode {turns} turns, message {message} tokens, "
          f"conversation {length} tokens; the CPU limits: {limits}")
    assert not failed, failed[:5]
    assert 1.5 * turns <= limits["max_turns"] and message < limits["max_new_tokens"]
    assert 1.2 * (length + limits["max_new_tokens"]) <= limits["max_context"], (length, limits)


def test_a_list_of_users_runs_each_tasks_episode_with_its_own_user_as_alone():
    """run_episodes(user=[spec per task]) (rl.py's curve: every user's episodes in one batch) gives each task the
    episode it gets when run alone under its spec."""
    tok = rollout.load_tokenizer()
    tasks = ours.make_tasks("retail", "test", 2, ["medium"]) + ours.make_tasks("airline", "test", 2, ["medium"])
    specs = ["scripted:chatty", "scripted:curious"]
    together = rollout.run_episodes(rollout.OracleAgent(tok), tok, tasks * 2, user=[envs.UserFactory(u) for u in specs for _ in tasks],
                                    seed=5, progress=False, max_turns=30, max_context=8192)
    alone = [t for u in specs for t in rollout.run_episodes(rollout.OracleAgent(tok), tok, tasks, user=envs.UserFactory(u), seed=5,
                                                            progress=False, max_turns=30, max_context=8192)]
    assert [t.messages for t in together] == [t.messages for t in alone]
    assert together[0].messages != together[len(tasks)].messages          # the two users differ on the same task
