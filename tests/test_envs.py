"""envs/ours.py: gold replays score 1, doing nothing scores 0, one wrong argument scores 0 with a diff
naming the field, Envs share no state, malformed calls never raise or change the DB, and the
train/test splits are disjoint. Runs in ~20 s on 2 CPU cores."""
import json
import random

import pytest

from envs import ours
import users
from envs.ours import Env

PER_SCENARIO = 3                                     # tasks per scenario and domain in the replay tests
TASKS = [t for d in ours.DOMAINS for t in ours.make_tasks(d, "train", PER_SCENARIO * len(ours.SCENARIOS[d]))]
ONE_EACH = {(t.domain, t.scenario): t for t in TASKS}.values()


def gold_writes(task):
    return [a for a in task.gold_actions if a.name in ours.WRITE_TOOLS[task.domain]]


def replay(task, actions):
    env = Env(task)
    for a in actions:
        obs = env.step(a.name, a.arguments)
        assert isinstance(obs, str)
    return env


@pytest.mark.parametrize("task", TASKS, ids=lambda t: f"{t.scenario}-{t.id[-2:]}")
def test_gold_replay_scores_one(task):
    env = Env(task)
    for a in task.gold_actions:
        obs = env.step(a.name, a.arguments)
        assert not obs.startswith("Error"), (a, obs)
    said = [f"Done. For your records: {', '.join(task.required_outputs)}."]
    score = env.score(said)
    assert score == (1.0, True, "", {}), score.wrong
    assert [w.name for w in env.writes] == [w.name for w in gold_writes(task)]


@pytest.mark.parametrize("task", ONE_EACH, ids=lambda t: t.scenario)
def test_a_solved_episode_cut_off_at_the_cap_scores_zero(task):
    """τ²'s rule: the gold writes made and the outputs said still score 0 if the conversation did not end
    itself (the turn cap, the context limit, an error); the user's stop, the agent's or a transfer ends it."""
    env, said = replay(task, task.gold_actions), [f"Done: {', '.join(task.required_outputs)}."]
    for stop in ours.ENDED:
        assert env.score(said, stop_reason=stop) == (1.0, True, "", {})
    for stop in ("max_turns", "context_limit", "error"):       # the end state is right all the same
        assert env.score(said, stop_reason=stop) == (0.0, True, f"ended by {stop}: τ² scores a conversation cut "
                                                                "short 0", {})


@pytest.mark.parametrize("task", ONE_EACH, ids=lambda t: t.scenario)
def test_doing_nothing(task):
    env = Env(task)
    if gold_writes(task):                            # the DB must change: saying things is not enough
        score = env.score([" ".join(task.required_outputs)])
        assert score.reward == 0.0 and not score.correct_state
        assert score.wrong != "" and "missing required output" not in score.wrong
    else:                                            # refusal / lookup: correct only if the outputs were said
        score = env.score([])
        assert score.reward == 0.0 and not score.correct_state
        assert score.wrong.startswith("missing required output")
        assert env.score([f"Here is what I found: {' '.join(task.required_outputs)}."]) == (1.0, True, "", {})


def _another(table, pred):
    return next(k for k, row in sorted(table.items()) if pred(row))


def wrong_run(task):
    """Replay the gold actions with one argument wrong; return (env, what the agent said, field the diff must name)."""
    db, actions = ours.load_db(task.domain, task.split), [ours.Action(a.name, dict(a.arguments)) for a in task.gold_actions]
    writes = [a for a in actions if a.name in ours.WRITE_TOOLS[task.domain]]
    said = [" ".join(task.required_outputs)]
    if not writes:                                   # lookup / refusal: look at (or act on) the wrong record
        lookup = actions[-1]
        if task.domain == "airline":                 # wrong reservation, which can be cancelled: the agent does
            rid = _another(db["reservations"], lambda r: r["status"] == "active" and r["insurance"])
            return replay(task, actions + [ours.act("cancel_reservation", reservation_id=rid)]), said, "status"
        own = db["users"][db["orders"][lookup.arguments["order_id"]]["user_id"]]["orders"]
        oid = next(o for o in own if db["orders"][o]["status"] == "pending")
        if task.scenario.startswith("refuse"):       # wrong order, which is pending: the agent cancels it
            actions.append(ours.act("cancel_pending_order", order_id=oid, reason="no longer needed"))
            return replay(task, actions), said, "status"
        lookup.arguments["order_id"] = oid           # info: reports the wrong order's status and total
        o = db["orders"][oid]
        return replay(task, actions), [f"It is {o['status']}, total {o['payment_history'][0]['amount']:.2f}"], \
            "missing required output"
    w, args = writes[-1], writes[-1].arguments
    if w.name == "cancel_pending_order":
        args["reason"], field = next(r for r in ours.REASONS if r != args["reason"]), "cancel_reason"
    elif w.name == "modify_pending_order_address":
        args["zip"], field = "00001", "address.zip"
    elif w.name == "modify_pending_order_payment":
        paid = db["orders"][args["order_id"]]["payment_history"][0]["payment_method_id"]
        user = db["users"][db["orders"][args["order_id"]]["user_id"]]
        args["payment_method_id"] = next(p for p in user["payment_methods"] if p not in (paid, args["payment_method_id"]))
        field = "payment_history"
    elif w.name == "return_delivered_order_items":
        user = db["users"][db["orders"][args["order_id"]]["user_id"]]
        args["payment_method_id"] = next(k for k, m in user["payment_methods"].items() if m["type"] == "gift_card")
        field = "return_payment_method_id"
    elif w.name == "exchange_delivered_order_items":
        order = db["orders"][args["order_id"]]
        product = next(i["product_id"] for i in order["items"] if i["item_id"] == args["item_ids"][0])
        args["new_item_ids"] = [_another(db["products"][product]["variants"], lambda v: v["available"] and v["item_id"]
                                         not in args["item_ids"] + args["new_item_ids"])]
        field = "exchange_new_items"
    elif w.name == "update_reservation_baggages":
        args["total_baggages"], field = args["total_baggages"] + 1, "total_baggages"
    elif w.name == "cancel_reservation":
        args["reservation_id"] = _another(db["reservations"], lambda r: r["status"] == "active" and r["insurance"]
                                          and r["reservation_id"] != args["reservation_id"])
        field = "status"
    elif w.name == "update_reservation_flights":
        res, dates = db["reservations"][args["reservation_id"]], db["flights"][args["flight_number"]]["dates"]
        args["date"] = next(d for d in ours.DATES if d not in (res["date"], args["date"])
                            and dates[d]["seats"][res["cabin"]] >= len(res["passengers"]))
        field = "date"
    elif w.name == "book_reservation":
        args["insurance"], field = not args["insurance"], "insurance"
    else:
        raise AssertionError(f"no wrong-argument rule for {w.name}")
    return replay(task, actions), said, field


@pytest.mark.parametrize("task", ONE_EACH, ids=lambda t: t.scenario)
def test_one_wrong_argument_scores_zero_and_diff_names_the_field(task):
    env, said, field = wrong_run(task)
    score = env.score(said)
    assert score.reward == 0.0 and field in score.wrong, score.wrong
    print(f"{task.scenario}: {score.wrong.splitlines()[0]}")


def test_shaped_reward_gives_partial_credit():
    task = next(t for t in TASKS if t.scenario == "move_and_cancel")
    first_write = next(i for i, a in enumerate(task.gold_actions) if a.name in ours.WRITE_TOOLS["retail"])
    env = replay(task, task.gold_actions[:first_write + 1])
    assert env.score([]).reward == 0.0
    shaped = Env(task, shaped=True)
    for a in task.gold_actions[:first_write + 1]:
        shaped.step(a.name, a.arguments)
    score = shaped.score([])
    assert score.reward == 0.5 and not score.correct_state
    assert "cancelled" in score.wrong and "address" not in score.wrong


def test_envs_share_no_state():
    task = next(t for t in TASKS if t.scenario == "book_flight")
    a, b = Env(task), Env(task)
    fresh = ours.load_db(task.domain, task.split)
    write = gold_writes(task)[0]                                # book_reservation: passengers is a list
    args = json.loads(json.dumps(write.arguments))
    assert not a.step(write.name, args).startswith("Error")
    args["passengers"][0]["first_name"] = "MUTATED"           # the caller's objects never reach the DB
    assert "MUTATED" not in json.dumps(a.db)
    assert b.db == fresh and a.db != fresh and b.writes == [] and len(a.writes) == 1
    assert ours.load_db(task.domain, task.split) == fresh     # nor does the shared DB text change
    assert a.gold_db() is not b.gold_db() and a.gold_db() == b.gold_db()


JUNK = [None, 3.5, -1, 10**9, True, [], {}, "", "x" * 5000, [[[[]]]], {"a": {"b": 1}}, "#W0000000", "ZZZZZZ"]


def malformed_calls(domain, rng, n):
    """n tool calls that must all be refused: junk names and arguments, broken gold calls, policy breaks."""
    tasks = ours.make_tasks(domain, "train", 60, seed=0)
    base = [a for t in tasks for a in t.gold_actions]
    db = ours.load_db(domain, "train")
    calls = []
    while len(calls) < n:
        a = rng.choice(base)
        args = json.loads(json.dumps(a.arguments))
        kind = rng.randrange(7)
        if kind == 0:
            calls.append((rng.choice([None, 7, "", a.name.upper(), a.name + " ", "rm -rf", "x" * 999]), args))
        elif kind == 1:
            calls.append((a.name, rng.choice([None, [], 42, "junk", "{not json", '"text"', "[1, 2]", "[" * 5000,
                                              [args], json.dumps(args)[:-1]])))
        elif kind == 2 and args:
            del args[rng.choice(list(args))]
            calls.append((a.name, args))
        elif kind == 3:
            args[rng.choice(["extra", "user", "order_id ", 0, ""])] = "x"
            calls.append((a.name, args))
        elif kind == 4 and args:                                   # a value of the wrong type or shape
            k = rng.choice(list(args))
            args[k] = rng.choice([j for j in JUNK if type(j) is not type(args[k]) or j in ("", "x" * 5000)])
            calls.append((a.name, args))
        elif kind == 5:                                            # a well-formed id that does not exist
            ids = [k for k in args if k.endswith("_id") or k in ("flight_number", "date", "email", "reason", "cabin")]
            if ids:
                args[rng.choice(ids)] = rng.choice(["#W0000000", "ZZZZZZ", "nobody_0000", "2024-01-01", "MU000", "maybe"])
                calls.append((a.name, args))
        else:
            calls.append(rng.choice(policy_breaks(db, domain, rng)))
    return calls


def policy_breaks(db, domain, rng):
    """Well-formed calls that the policy's hard rules refuse."""
    if domain == "retail":
        o = {s: rng.choice([o for o in db["orders"].values() if o["status"] == s])
             for s in ("pending", "delivered", "processed", "cancelled")}
        item = lambda s: o[s]["items"][0]["item_id"]                                    # noqa: E731
        sold_out = next(v["item_id"] for v in db["products"][o["delivered"]["items"][0]["product_id"]]["variants"].values()
                        if not v["available"])
        pm = lambda s: o[s]["payment_history"][0]["payment_method_id"]                  # noqa: E731
        return [("cancel_pending_order", {"order_id": o[s]["order_id"], "reason": "no longer needed"})
                for s in ("delivered", "processed", "cancelled")] + [
            ("return_delivered_order_items", {"order_id": o["pending"]["order_id"], "item_ids": [item("pending")],
                                              "payment_method_id": pm("pending")}),
            ("exchange_delivered_order_items", {"order_id": o["delivered"]["order_id"], "item_ids": [item("delivered")],
                                                "new_item_ids": [sold_out], "payment_method_id": pm("delivered")}),
            ("modify_pending_order_payment", {"order_id": o["pending"]["order_id"], "payment_method_id": pm("pending")}),
            ("modify_pending_order_address", {"order_id": o["delivered"]["order_id"], "address1": "1 A St",
                                              "city": "X", "state": "TX", "zip": "12345"}),
            ("return_delivered_order_items", {"order_id": o["delivered"]["order_id"], "item_ids": [item("delivered")] * 2,
                                              "payment_method_id": pm("delivered")})]
    r = rng.choice([r for r in db["reservations"].values() if not r["insurance"] and r["cabin"] == "economy"])
    card = next(iter(db["users"][r["user_id"]]["payment_methods"]))
    other = next(f for f in db["flights"].values() if f["origin"] != r["origin"])
    pax = r["passengers"]
    return [("cancel_reservation", {"reservation_id": r["reservation_id"]}),
            ("update_reservation_baggages", {"reservation_id": r["reservation_id"], "total_baggages": 0,
                                             "payment_method_id": card}),
            ("update_reservation_flights", {"reservation_id": r["reservation_id"], "flight_number": other["flight_number"],
                                            "date": r["date"], "payment_method_id": card}),
            ("update_reservation_flights", {"reservation_id": r["reservation_id"], "flight_number": r["flight_number"],
                                            "date": r["date"], "payment_method_id": card}),
            ("update_reservation_passengers", {"reservation_id": r["reservation_id"], "passengers": pax + pax}),
            ("book_reservation", {"user_id": r["user_id"], "flight_number": r["flight_number"], "date": "2024-05-10",
                                  "cabin": "economy", "passengers": pax, "payment_method_id": card, "insurance": False,
                                  "total_baggages": 0}),
            ("book_reservation", {"user_id": r["user_id"], "flight_number": r["flight_number"], "date": r["date"],
                                  "cabin": "economy", "passengers": [], "payment_method_id": card, "insurance": False,
                                  "total_baggages": 0}),
            ("send_certificate", {"user_id": r["user_id"], "amount": 0})]


@pytest.mark.parametrize("domain", ours.DOMAINS)
def test_fuzzed_malformed_calls_raise_nothing_and_change_nothing(domain):
    rng = random.Random(1234)
    calls = malformed_calls(domain, rng, 700)
    env = Env(ours.make_tasks(domain, "train", 1)[0])
    fresh = ours.load_db(domain, "train")
    crashes = 0
    for name, args in calls:
        try:
            obs = env.step(name, args)
        except Exception:                                          # counted, so the failure message says how many
            crashes += 1
            continue
        benign = name == "search_direct_flight" and obs.startswith("No direct flights")
        assert isinstance(obs, str) and (obs.startswith("Error:") or benign), (name, args, obs[:200])
    assert crashes == 0
    assert env.db == fresh and env.writes == [] and ours.db_hash(env.db) == ours.db_hash(fresh)
    print(f"{domain}: {len(calls)} malformed calls, {crashes} crashes, DB unchanged")


def test_every_single_fuzzed_write_leaves_the_db_unchanged():
    """Per call (not just at the end): a refused write must not leave a partial change behind."""
    for domain in ours.DOMAINS:
        rng, env = random.Random(99), Env(ours.make_tasks(domain, "train", 1)[0])
        fresh = ours.load_db(domain, "train")
        for name, args in malformed_calls(domain, rng, 150):
            if name in ours.WRITE_TOOLS[domain]:
                env.step(name, args)
                assert env.db == fresh, (name, args)


def test_splits_are_disjoint_and_deterministic():
    for domain in ours.DOMAINS:
        train, test = ours.load_db(domain, "train"), ours.load_db(domain, "test")
        for table in ("users", "orders", "reservations"):
            assert not set(train.get(table, {})) & set(test.get(table, {}))
        assert not {u["email"] for u in train["users"].values()} & {u["email"] for u in test["users"].values()}
        for split, db in (("train", train), ("test", test)):
            for t in ours.make_tasks(domain, split, 50):
                ids = {v for a in t.gold_actions for k, v in a.arguments.items()
                       if k in ("user_id", "order_id", "reservation_id")}
                assert all(i in db["users"] or i in db.get("orders", {}) or i in db.get("reservations", {}) for i in ids)
        a, b = ours.make_tasks(domain, "test", 30, seed=3), ours.make_tasks(domain, "test", 60, seed=3)
        assert a == b[:30] and a != ours.make_tasks(domain, "test", 30, seed=4)


def test_task_fields_fit_the_user_simulators():
    scenarios = {(t.domain, t.scenario, t.tier) for t in TASKS}
    assert len(scenarios) >= 9 and {tier for _, _, tier in scenarios} == {"easy", "medium", "hard"}
    for t in TASKS:
        assert set(t.hidden_facts) <= set(users.FACT_KEYWORDS) and "###STOP###" in t.instruction
        assert len(t.confirm_terms) == len(gold_writes(t))
        for terms, write in zip(t.confirm_terms, gold_writes(t)):   # a correct confirmation can name every term
            alts = [x if isinstance(x, list) else [x] for x in terms.values()]
            assert all(any(str(a) in json.dumps(write.arguments) for a in alt) for alt in alts), (t.scenario, terms)
            # the values that make this write right rather than wrong must be among them
            decisive = [str(v) for k, v in write.arguments.items() if k in (
                "order_id", "reservation_id", "reason", "payment_method_id", "total_baggages", "date", "address1")]
            assert all(any(v in map(str, alt) for alt in alts) for v in decisive), (t.scenario, decisive, terms)
        ids = [v for k, v in t.hidden_facts.items() if k in ("order_id", "reservation_id", "email", "user_id")]
        if t.tier != "easy":                             # the agent has to ask for identifiers
            assert not all(i in t.opening for i in ids), t.opening
    many = ours.make_tasks("retail", "train", 3000)
    assert len({json.dumps([a.arguments for a in t.gold_actions]) for t in many}) > 1500


def test_policy_is_compact_and_tools_are_valid_schemas():
    for domain in ours.DOMAINS:
        assert 150 <= len(ours.POLICIES[domain].split()) <= 280
        names = [s["function"]["name"] for s in ours.tool_schemas(domain)]
        assert len(names) == len(set(names)) and ours.WRITE_TOOLS[domain] <= set(names)
        for s in ours.tool_schemas(domain):
            params = s["function"]["parameters"]
            assert s["type"] == "function" and params["type"] == "object"
            assert set(params["required"]) == set(params["properties"])
    env = Env(TASKS[0])
    assert env.step("calculate", {"expression": "2*(3.5+1)"}) == "9.0"
    assert env.step("calculate", {"expression": "__import__('os')"}).startswith("Error:")
    assert env.step("calculate", {"expression": "9**9**9"}).startswith("Error:")


def test_an_episode_is_scored_once_and_the_env_keeps_nothing_of_it(monkeypatch):
    """run_episodes calls env.score once an episode; score() is a function of the final state and the agent's
    texts: the env holds the same fields after it, and a second call returns the same Score."""
    import envs
    import rollout
    calls, real = [], Env.score

    def counted(env, *a, **kw):
        before = dict(vars(env))
        score = real(env, *a, **kw)
        assert vars(env).keys() == before.keys() and real(env, *a, **kw) == score
        calls.append(env.task.id)
        return score
    monkeypatch.setattr(Env, "score", counted)
    tok = rollout.load_tokenizer()
    tasks = ours.make_tasks("retail", "test", 3, ["medium"])
    trajs = rollout.run_episodes(rollout.OracleAgent(tok), tok, tasks, group_size=2, user=envs.UserFactory("scripted"),
                                 progress=False, max_turns=14, max_context=8192)
    assert sorted(calls) == sorted(t.task_id for t in trajs) and all(t.reward == 1.0 for t in trajs)
