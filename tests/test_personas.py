"""The scripted personas (users.PERSONAS): one table in the code and in docs/personas.md, split train / held-out;
each seeded and deterministic and doing what its row says; scripted:train draws a training persona per conversation;
a user or persona added docs/reference.md's way is valid everywhere; and the gold agent solves every persona, in both
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
TRAIN = [n for n, b in users.PERSONAS.items() if users.split_of(b) == "train"]
HELD_OUT = [n for n, b in users.PERSONAS.items() if users.split_of(b) == "held-out"]


def say(text):
    """The agent's view of a conversation whose last agent message is text (what a scripted user reads)."""
    return [{"role": "assistant", "content": text}]


def task_of(scenario, domain="retail", split="test"):
    return next(t for t in ours.make_tasks(domain, split, 40) if t.scenario == scenario)


def test_one_table_split_like_tasks_and_the_same_in_docs():
    assert len(users.PERSONAS) >= 5 and len(HELD_OUT) >= 2 and TRAIN and "default" in TRAIN
    assert all(isinstance(b, users.Behaviour) and all(getattr(b, a) in users.AXES[a] for a in users.Behaviour._fields)
               for b in users.PERSONAS.values())                              # a persona is a row of known values
    assert len(set(users.PERSONAS.values())) == len(users.PERSONAS)           # no two rows the same user
    assert set(users.Behaviour._fields) == set(users.AXES) and set(users.WORDS) == set(users.AXES["words"])
    with open(os.path.join(ROOT, "docs", "personas.md")) as f:
        page = f.read()
    assert users.persona_table() in page and users.axes_table() in page       # docs show the code's tables


def test_a_held_out_persona_keeps_a_value_no_training_row_can_draw():
    """UserVille's split: held out means a whole behaviour. Every held-out persona has a value that no row of the
    training population has, and the population is every combination of training values, the training personas
    among them."""
    rows = users.population()
    drawn = {(a, getattr(r, a)) for r in rows for a in users.Behaviour._fields}
    assert all(users.AXES[a][v].split == "train" for a, v in drawn)
    assert len(rows) == math.prod(sum(v.split == "train" for v in users.AXES[a].values()) for a in users.AXES)
    assert {users.PERSONAS[n] for n in TRAIN} <= set(rows)
    for name in HELD_OUT:
        unseen = [a for a in users.Behaviour._fields if (a, getattr(users.PERSONAS[name], a)) not in drawn]
        assert unseen, name
    for name in TRAIN:
        assert not users.held_out_values(users.PERSONAS[name]), name


def test_scripted_population_draws_a_row_per_conversation_by_seed():
    task = task_of("change_order_payment")
    rows = {s: envs.make_user("scripted:population", task, seed=s).behaviour for s in range(400)}
    assert set(rows.values()) == set(users.population())                     # 400 draws reach all of them
    assert all(envs.make_user("scripted:population", task, seed=s).behaviour == r for s, r in rows.items())
    assert {envs.make_user("scripted:population", task, seed=s).label for s in range(5)} == {"population"}


def test_a_row_written_out_is_a_user_and_training_refuses_a_held_out_value(capsys):
    task = task_of("change_order_payment")
    u = envs.make_user("scripted:gives=one_last/words=other", task, seed=0)
    assert u.behaviour == users.PERSONAS["default"]._replace(gives="one_last", words="other")
    for spec in ("scripted:population", "scripted:train", "scripted:chatty", "scripted:gives=one_first/words=casual"):
        assert _check(spec, training=True) is None, spec
    for spec in ("scripted:curious", "scripted:heldout", "scripted:gives=one_last", "scripted:confirms=bare_no",
                 "scripted:default+literal"):
        assert _check(spec, training=False) is None, spec                  # eval may use them
        assert _check(spec, training=True) == "exit 2", spec                # no stage trains on them
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 5 and all("held" in e for e in err), err
    for spec in ("scripted:gives=sometimes", "scripted:mood=grumpy", "scripted:nobody"):
        assert _check(spec, training=False) == "exit 2", spec


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
    u = envs.make_user("scripted:terse", task, seed=0)
    r = u.reply(say("Please give me your email address."))
    assert all(str(v) in r for v in task.hidden_facts.values()), r              # everything, asked or not
    assert not r.lower().startswith(("hi", "hello", "my ")) and len(r.split()) < 8 * len(task.hidden_facts)


def test_chatty_gives_one_fact_a_reply_with_an_aside_and_asks_back_before_confirming():
    task = task_of("change_order_payment")
    u = envs.make_user("scripted:chatty", task, seed=0)
    first = u.first_message()
    assert any(a in first for a in users.WORDS["chatty"].asides)
    r = u.reply(say("Please give me your email address, the order id and the payment method to use."))
    facts = task.hidden_facts
    assert facts["email"] in r and facts["order_id"] not in r and facts["payment_method"] not in r   # the first asked
    assert any(a in r for a in users.WORDS["chatty"].asides)
    r = u.reply(say("Please give me your email address, the order id and the payment method to use."))   # again:
    # the first asked that it has not given yet
    assert facts["order_id"] in r and facts["payment_method"] not in r
    confirm = oracle.confirmation(task, task.gold_actions[-1])
    assert u.reply(say(confirm)).startswith(users.WORDS["chatty"].back)
    assert u.reply(say(confirm)).startswith(users.WORDS["chatty"].yes)


def test_one_random_gives_one_fact_a_reply_in_an_order_its_seed_draws():
    """gives=one_random (attempt 4's change): one fact a reply, drawn among those asked and not given yet, so no order
    of asking is rewarded by every training user; asked again only for a fact it gave, it gives that one again."""
    task = task_of("change_order_payment")
    ask = say("Please give me your email address, the order id and the payment method to use.")
    facts, firsts = task.hidden_facts, set()
    for seed in range(30):
        u = envs.make_user("scripted:gives=one_random", task, seed=seed)
        said = [u.reply(ask) for _ in range(3)]
        told = [[k for k in ("email", "order_id", "payment_method") if facts[k] in r] for r in said]
        assert all(len(t) == 1 for t in told), said                                # one a reply
        assert sorted(t[0] for t in told) == ["email", "order_id", "payment_method"]   # none twice while some are left
        firsts.add(told[0][0])
        again = u.reply(say("Please give me the order id."))                      # given already: that one again
        assert facts["order_id"] in again and facts["email"] not in again
    assert firsts == {"email", "order_id", "payment_method"}                      # every order is drawn
    assert envs.make_user("scripted:gives=one_random", task, seed=4).reply(ask) == \
        envs.make_user("scripted:gives=one_random", task, seed=4).reply(ask)       # seeded


def test_careless_mistypes_its_first_digit_fact_and_corrects_it_next():
    task = task_of("change_order_payment")
    email = task.hidden_facts["email"]
    u = envs.make_user("scripted:careless", task, seed=0)
    r = u.reply(say("Please give me your email address."))
    assert email not in r and "@" in r                                            # one digit off
    wrong = re.search(r"\S+@\S+\w", r)[0]
    assert len(wrong) == len(email) and sum(a != b for a, b in zip(wrong, email)) == 1
    r = u.reply(say("Thanks, one moment."))                                        # whatever the agent said
    assert f"it is {email}, not {wrong}" in r
    assert "Sorry" not in u.reply(say("Please give me the order id."))            # corrected once


def test_literal_answers_only_a_fact_named_by_its_own_name_and_says_a_bare_no():
    task = task_of("change_order_payment")
    u = envs.make_user("scripted:literal", task, seed=0)
    oid = task.hidden_facts["order_id"]
    assert oid not in u.reply(say("Which order is it?"))                          # the default user would answer
    assert oid in envs.make_user("scripted", task, seed=0).reply(say("Which order is it?"))
    assert oid in u.reply(say("Please give me the order id."))
    r = u.reply(say(f"Please confirm: pay order {oid} with another card. Yes or no?"))
    assert r in users.WORDS["formal"].no                                              # no hint at what is missing
    assert envs.make_user("scripted", task, seed=0).reply(
        say(f"Please confirm: pay order {oid} with another card. Yes or no?")) not in users.WORDS["plain"].no
    assert u.reply(say(oracle.confirmation(task, task.gold_actions[-1]))) in users.WORDS["formal"].yes


def test_the_gold_agent_reads_a_yes_only_in_a_personas_yes():
    """A question back, a nudge, an aside or a no that the gold agent took for a yes would make it write before
    the user approved; every persona's yes it must take for one."""
    for words in users.WORDS.values():
        for phrase in words.yes:
            assert oracle._is_yes(phrase), phrase
        for phrase in (*words.no, *words.nudge, *words.back, *words.asides):
            assert not oracle._is_yes(phrase), phrase


def test_scripted_train_draws_a_training_persona_per_conversation_by_seed():
    task = task_of("cancel_order")
    drawn = {s: envs.make_user("scripted:train", task, seed=s).label for s in range(60)}
    assert set(drawn.values()) == set(TRAIN)                                         # every one, none held out
    assert all(envs.make_user("scripted:train", task, seed=s).label == n for s, n in drawn.items())   # seeded
    held = {envs.make_user("scripted:heldout", task, seed=s).label for s in range(60)}
    assert held == set(HELD_OUT)


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
    monkeypatch.setattr(users, "PERSONAS", {n: b._replace(words="formal") for n, b in users.PERSONAS.items()})
    assert _check("scripted:train", training=True) == "exit 2"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--user" in err[0] and "no training persona" in err[0], err


LOUD = users.Words(greet=("HEY! ",), yes=("YES, GO AHEAD.",), no=("NO!",), thanks=("THANKS!",), nudge=("WELL?",),
                   wait=("DO IT NOW.",), back=("WHAT?",), fact="MY {key} IS {value}.")


class ToyUser(users.User):
    """A user kind added docs/reference.md's way: a users.User subclass, a builder, and a row in envs.USER_KINDS. It
    gives every fact in its first message and says yes to anything, then stops once it hears "Done"."""

    def first_message(self):
        return self.task.opening + " " + " ".join(f"My {k} is {v}." for k, v in self.task.hidden_facts.items())

    def reply(self, messages):
        return f"Thanks. {users.STOP}" if messages[-1]["content"].startswith("Done") else "Yes."


def toy_user(task, seed, arg, *, env=None):
    return ToyUser(task)


def test_a_user_and_a_persona_added_the_readme_way_work_everywhere(monkeypatch):
    for spec in ("scripted:toy", "toy"):                       # not there yet: bad input
        assert _check(spec, training=False) == "exit 2"
    # a persona docs/reference.md's way: a value on an axis (its words) and a row in users.PERSONAS
    monkeypatch.setitem(users.AXES, "words", {**users.AXES["words"], "loud": users.Value("train", "loud")})
    monkeypatch.setitem(users.WORDS, "loud", LOUD)
    monkeypatch.setitem(users.PERSONAS, "toy", users.PERSONAS["default"]._replace(words="loud"))
    monkeypatch.setitem(envs.USER_KINDS, "toy", envs.UserKind(f"{__name__}:toy_user", "", "a toy"))
    for spec in ("scripted:toy", "toy", "scripted:train"):
        assert _check(spec, training=True) is None, spec       # sft.py and rl.py may train on them
    assert "toy" in envs.user_help() and "toy" in users.persona_table()
    assert "toy" in {envs.make_user("scripted:train", task_of("cancel_order"), seed=s).label for s in range(80)}
    assert "loud" in {envs.make_user("scripted:population", task_of("cancel_order"), seed=s).behaviour.words
                      for s in range(200)}                                   # the population draws the new value
    tok = rollout.load_tokenizer()
    tasks = ours.make_tasks("retail", "test", 2, ["medium"])
    for spec, cls in (("scripted:toy", users.ScriptedUser), ("toy", ToyUser)):
        assert type(envs.make_user(spec, tasks[0], seed=0)) is cls
        trajs = rollout.run_episodes(rollout.OracleAgent(tok), tok, tasks, user=envs.UserFactory(spec), progress=False,
                                     max_turns=30, max_context=8192)
        assert [t.reward for t in trajs] == [1.0, 1.0], [t.diff for t in trajs]
        said = [m["content"] for t in trajs for m in t.messages if m["role"] == "user"]
        assert any("YES, GO AHEAD." in s for s in said) if spec == "scripted:toy" else said[0].startswith(tasks[0].opening)


# ----------------------------------------------------------------------------- the ceiling: every persona solvable

CAP = 30                 # the paper's turn cap; the test asserts 1.5 x the gold agent's longest episode fits under it
N_TASKS = 30             # held-out tasks per persona x domain x tier
EASY_MEDIUM = 5          # held-out tasks per population row x domain x tier
POPULATION_DRAWS = 200   # the population's episodes at the CPU limits, every row among them


def gold_episode(task, spec, seed, cap=CAP):
    """The gold agent (oracle.oracle_reply) against a user, as rollout.run_episodes runs it but on messages alone
    (no tokenizer: 720 episodes in seconds): its text turn is answered by the user, its tool call by the env.
    -> (reward, agent turns, stop reason, what a careful agent would not have done: a hidden fact used in a call
    before the user told it (the gold agent knows every value, a careful agent only what it was told, so it must ask
    until it hears it), a write before the user said yes to it)."""
    env, user = ours.Env(task), envs.make_user(spec, task, seed)
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
    return env.score(said, stop_reason=stop).reward, turns, stop, guessed


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


@pytest.mark.slow      # a sweep: 30 tasks a persona x domain x tier, ~17 s alone
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
    for name, b in users.PERSONAS.items():
        print(f"{name:10s} {users.split_of(b):9s} " + " ".join(f"{longest[name, d, t]:13d}" for d in ours.DOMAINS
                                                      for t in ("easy", "medium")))
    for tier in ("easy", "medium"):
        top = max(v for (_, _, t), v in longest.items() if t == tier)
        print(f"{tier}: longest {top}, a cap with 1.5x slack: {math.ceil(1.5 * top)}")
    assert not bad, bad[:5]
    assert 1.5 * max(longest.values()) <= CAP, longest


def row_spec(b):
    """A population row as the user spec that plays it alone."""
    return "scripted:" + "/".join(f"{axis}={value}" for axis, value in b._asdict().items())


@pytest.mark.slow      # a sweep over every row, ~30 s alone
def test_the_gold_agent_solves_the_whole_training_population_with_slack():
    """Every row of scripted:population on EASY_MEDIUM tasks of each domain x tier (the fast loop above): solved,
    ended by the user, nothing used before it was told, and 1.5 x the longest episode within CAP."""
    rows, longest, bad = users.population(), 0, []
    for domain in ours.DOMAINS:
        for tier in ("easy", "medium"):
            tasks = ours.make_tasks(domain, "test", EASY_MEDIUM, [tier])
            for i, b in enumerate(rows):
                runs = [gold_episode(t, row_spec(b), seed=i * 100 + j) for j, t in enumerate(tasks)]
                bad += [(b, t.id, r) for t, r in zip(tasks, runs) if r[0] != 1.0 or r[2] != "user_stop" or r[3]]
                longest = max([longest] + [r[1] for r in runs])
    print(f"\nthe gold agent against the {len(rows)} rows of the population, {EASY_MEDIUM} tasks each of "
          f"{len(ours.DOMAINS)} domains x 2 tiers: longest episode {longest} turns (cap with 1.5x slack "
          f"{math.ceil(1.5 * longest)})")
    assert not bad, bad[:5]
    assert 1.5 * longest <= CAP


@pytest.mark.slow      # a sweep through the real loop, ~23 s alone
def test_the_cpu_presets_limits_leave_the_gold_agent_slack_on_their_tasks():
    """The CPU presets' episode limits (common.CPU_LIMITS, on common.CPU_TIERS) are set from the gold agent: through
    the real loop, at those limits, it solves N_TASKS held-out tasks of each persona x domain, and POPULATION_DRAWS
    tasks under every row of the training population (each row on as many tasks, the domains alternating); 1.5 x
    its longest episode fits the turn cap, its longest message the tokens a turn, and its longest conversation plus
    a turn the context with room to spare: x 1.2 under the named personas, x 1.15 under the population (its longest,
    a chatty row that asks back and mistypes, is 2,941 tokens: x 1.19; the limits stay those of attempts 1 and 2)."""
    tok, limits = rollout.load_tokenizer(), common.CPU_LIMITS
    turns, message, failed, length = 0, 0, [], {"named": 0, "population": 0}
    pool = [t for d in ours.DOMAINS for t in ours.make_tasks(d, "test", N_TASKS, common.CPU_TIERS.split(","))]
    assert len(pool) == 2 * N_TASKS
    rows = users.population()
    per_row = math.ceil(POPULATION_DRAWS / len(rows))
    runs = [(f"scripted:{name}", pool) for name in users.PERSONAS]
    runs += [(row_spec(b), [pool[(k * per_row + j) % len(pool)] for j in range(per_row)]) for k, b in enumerate(rows)]
    specs = [spec for spec, tasks in runs for _ in tasks]
    trajs = rollout.run_episodes(rollout.OracleAgent(tok), tok, [t for _, tasks in runs for t in tasks],
                                 user=[envs.UserFactory(s) for s in specs], progress=False,
                                 max_turns=limits["max_turns"], max_context=limits["max_context"])
    for spec, t in zip(specs, trajs):
        failed += [(spec, t.task_id, t.stop_reason)] * (t.reward != 1.0)
        turns, kind = max(turns, t.turns), "population" if spec.startswith("scripted:opens=") else "named"
        length[kind] = max(length[kind], len(t.token_ids))
        message = max([message] + [len(tok(m["content"])["input_ids"]) for m in t.messages
                                    if m["role"] == "assistant"])
    drawn = sum(s.startswith("scripted:opens=") for s in specs)
    print(f"\nthe gold agent on {common.CPU_TIERS}, {len(users.PERSONAS)} personas x {len(pool)} tasks and "
          f"{drawn} episodes of the population ({len(rows)} rows x {per_row}): longest episode {turns} turns, "
          f"message {message} tokens, conversation {length} tokens; the CPU limits: {limits}")
    assert drawn >= POPULATION_DRAWS
    assert not failed, failed[:5]
    assert 1.5 * turns <= limits["max_turns"] and message < limits["max_new_tokens"]
    assert 1.2 * (length["named"] + limits["max_new_tokens"]) <= limits["max_context"], (length, limits)
    assert 1.15 * (length["population"] + limits["max_new_tokens"]) <= limits["max_context"], (length, limits)


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


# ----------------------------------------------------------------------------- our own code's exceptions are bugs

class PlantedBug(RuntimeError):
    pass


@pytest.mark.parametrize("where", ["user", "opening", "env"])
def test_a_raising_scripted_user_or_env_stops_the_run_with_its_traceback(monkeypatch, where):
    """A scripted user (its opening or a reply) or our env that raises stops run_episodes, and so the stage, with that
    exception: never a left-out rollout, which would hide the bug as a missing 0 (only an LLM user's or the
    network's failure, a users.UserSimulatorError, is left out: tests/test_users.py)."""
    def planted(*a, **kw):
        raise PlantedBug(f"planted in the {where}")
    target = {"user": (users.ScriptedUser, "reply"), "opening": (users.ScriptedUser, "first_message"),
              "env": (ours.Env, "step")}[where]
    monkeypatch.setattr(*target, planted)
    tok = rollout.load_tokenizer()
    tasks = ours.make_tasks("retail", "test", 2, ["medium"])
    with pytest.raises(PlantedBug, match=f"planted in the {where}"):
        rollout.run_episodes(rollout.OracleAgent(tok), tok, tasks, group_size=2, user=envs.UserFactory("scripted:train"),
                             progress=False, max_turns=14, max_context=8192)
