"""A question asked again, and the users no stage met. users.repeated_questions counts an agent's questions for a fact
the user had already given (a person would; every stage records it: eval.py's metric, rl.py's per-user metrics, the
viewer); the held-out persona `mindful` (patience "remembers") says so, gives the fact again, and leaves at the
third; scripted:heldout-population draws a row with a held-out value per conversation, and the gold agent solves a
seeded sample of 200 of its rows at the CPU limits with slack (-s prints its longest episodes)."""
import math
import random

import common
import envs
from envs import ours
import eval as ev
import rl
import rollout
import users
from tests.test_personas import row_spec, say, task_of


def conversation(*turns):
    """A conversation from (role, text) pairs."""
    return [{"role": role, "content": text} for role, text in turns]


def test_a_conversation_with_a_known_count_of_questions_asked_again():
    task = task_of("change_order_payment")
    email, order = task.hidden_facts["email"], task.hidden_facts["order_id"]
    messages = conversation(
        ("user", task.opening),
        ("assistant", "Please give me your email address and the order id."),        # 1: nothing given yet
        ("user", f"My email is {email}."),
        ("assistant", "Thanks. Could you give me the order id?"),                      # 3: not given yet: fine
        ("user", f"My order id is {order}."),
        ("assistant", "What is your email address again?"),                            # 5: given at 2: again
        ("user", f"I said, {email}."),
        ("assistant", "<tool_call>{\"name\": \"find_user_id_by_email\"}</tool_call>"),   # 7: a call asks nothing
        ("tool", "{}"),
        ("assistant", f"Please confirm: pay order id {order} with the gift card. Yes or no?"),   # 9: a confirmation
        ("user", "Yes."),
        ("assistant", f"Done: order id {order} now paid by gift card."),                # 11: a report, no question
        ("user", "Thanks."),
        ("assistant", "Can you tell me the order id and your email once more?"),       # 13: both given: again, once
    )
    assert users.repeated_questions(task, messages) == [5, 13]
    insurance = task_of("book_flight", "airline")
    short = conversation(("user", "Yes."), ("assistant", "Please tell me whether you want insurance."))
    # "yes" alone gives no insurance: a short value counts only beside a word for its fact
    assert users.repeated_questions(insurance, short) == []
    assert users.repeated_questions(insurance, conversation(
        ("user", "My insurance is yes."), ("assistant", "Please tell me whether you want insurance."))) == [1]


def test_the_gold_agent_asks_again_for_nothing_under_every_persona_and_the_loop_records_it():
    """Through run_episodes (which keeps the indices in stats["repeated_at"]) and eval.py's metric: the gold agent
    asks only for what it has not heard, under every named persona and the held-out population."""
    tok = rollout.load_tokenizer()
    tasks = [t for d in ours.DOMAINS for t in ours.make_tasks(d, "test", 6, ["easy", "medium"])]
    for spec in [f"scripted:{name}" for name in users.PERSONAS] + ["scripted:heldout-population"]:
        trajs = rollout.run_episodes(rollout.OracleAgent(tok), tok, tasks, group_size=2, user=envs.UserFactory(spec),
                                     progress=False, max_turns=30, max_context=8192)
        assert all(t.reward == 1.0 for t in trajs), spec
        assert [t.stats["repeated_at"] for t in trajs] == [[]] * len(trajs), spec
        assert {ev.episode_metrics(task, t)["repeated_questions"] for task, t in zip(
            [t for t in tasks for _ in range(2)], trajs)} == {0}


class Repeater(rollout.TextAgent):
    """An agent that forgets: it asks for the email address every turn, whatever it heard."""

    def respond(self, task, messages):
        return "Please give me your email address."


def test_an_agent_that_asks_again_is_counted_in_eval_and_rl_metrics_and_marked_in_the_viewer():
    from scripts import viewer
    tok, task = rollout.load_tokenizer(), task_of("change_order_payment")
    trajs = rollout.run_episodes(Repeater(tok), tok, [task], user=envs.UserFactory("scripted:default"),
                                 progress=False, max_turns=5, max_context=8192)
    assert trajs[0].stats["repeated_at"] == [4, 6, 8, 10]      # turns 2-5 (message 0: the system prompt)
    assert ev.episode_metrics(task, trajs[0])["repeated_questions"] == 4
    assert rl.by_user(trajs)["default"]["repeated"] == 4.0 and rl.mean_repeated(trajs) == 4.0
    page = viewer.conversation(trajs[0], viewer.load_vocab(rollout.DEFAULT_MODEL))
    assert page.count("asks again for a fact the user gave") == 4 and page.count('class="turn assistant again"') == 4


def test_mindful_says_so_gives_the_fact_again_and_leaves_at_the_third():
    task = task_of("change_order_payment")
    email = task.hidden_facts["email"]
    u = envs.make_user("scripted:mindful", task, seed=0)
    history = conversation(("user", u.first_message()))
    ask = "Please give me your email address."
    replies = []
    for _ in range(4):
        history.append({"role": "assistant", "content": ask})
        replies.append(u.reply(history))
        history.append({"role": "user", "content": replies[-1]})
        if users.STOP in replies[-1]:
            break
    assert replies[0] == f"My email is {email}."                                  # asked once: the fact
    for r in replies[1:3]:                                                        # again, twice: it says so, and
        assert r.startswith(users.TOLD) and email in r, r                         # gives it again
    assert users.STOP in replies[3] and "already told you" in replies[3]          # the third: it leaves
    patient = envs.make_user("scripted:default", task, seed=0)                    # today's rule: it just answers
    assert patient.reply(say(ask)) == patient.reply(say(ask)) == f"My email is {email}."


def test_the_heldout_population_is_every_row_with_a_heldout_value_drawn_per_conversation():
    rows, train = users.heldout_population(), set(users.population())
    everything = math.prod(len(users.AXES[a]) for a in users.AXES)
    assert len(rows) + len(train) == everything and not set(rows) & train
    assert all(users.held_out_values(b) for b in rows)
    held = [b for b in users.PERSONAS.values() if users.split_of(b) == "held-out"]
    assert set(held) <= set(rows) and users.PERSONAS["mindful"].patience == "remembers"   # the named: slices
    task = task_of("cancel_order")
    drawn = [envs.make_user("scripted:heldout-population", task, seed=s) for s in range(300)]
    assert {u.label for u in drawn} == {"heldout-population"}
    assert len({u.behaviour for u in drawn}) > 200 and {u.behaviour.patience for u in drawn} == {"replies", "remembers"}
    assert [u.behaviour for u in drawn[:20]] == [envs.make_user("scripted:heldout-population", task, seed=s).behaviour
                                                for s in range(20)]                  # seeded
    assert envs.check_user("scripted:heldout-population") is None                     # eval may use it
    assert "held out" in users.check_scripted("heldout-population", training=True)    # no stage trains on it


def test_the_gold_agent_solves_a_sample_of_200_heldout_rows_at_the_cpu_limits_with_slack():
    """200 rows of the held-out population drawn by a fixed seed, each on two tasks of the CPU preset's tiers (the
    domains alternating), through the real loop at common.CPU_LIMITS: every one solved, 1.5 x the longest episode
    within the turn cap, the longest message within the tokens a turn, the longest conversation x 1.15 (as the
    training population's check) within the context."""
    tok, limits = rollout.load_tokenizer(), common.CPU_LIMITS
    pool = [t for d in ours.DOMAINS for t in ours.make_tasks(d, "test", 30, common.CPU_TIERS.split(","))]
    rows = random.Random(0).sample(users.heldout_population(), 200)
    specs = [row_spec(b) for b in rows for _ in range(2)]
    tasks = [pool[(2 * k + j) % len(pool)] for k in range(len(rows)) for j in range(2)]
    trajs = rollout.run_episodes(rollout.OracleAgent(tok), tok, tasks, user=[envs.UserFactory(s) for s in specs],
                                 progress=False, max_turns=limits["max_turns"], max_context=limits["max_context"])
    turns, length = max(t.turns for t in trajs), max(len(t.token_ids) for t in trajs)
    message = max(len(tok(m["content"])["input_ids"]) for t in trajs for m in t.messages if m["role"] == "assistant")
    print(f"\nthe gold agent on {len(rows)} held-out population rows x 2 tasks: longest episode {turns} turns, "
          f"message {message} tokens, conversation {length} tokens; the CPU limits: {limits}")
    assert [(s, t.task_id) for s, t in zip(specs, trajs) if t.reward != 1.0] == []
    assert 1.5 * turns <= limits["max_turns"] and message < limits["max_new_tokens"]
    assert 1.15 * (length + limits["max_new_tokens"]) <= limits["max_context"]
