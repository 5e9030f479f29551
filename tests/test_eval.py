"""eval.py: pass^k by hand, bootstrap CI, paired comparisons, pass^k of the oracle agent, the report, and the
--smoke run. BFCL's world: tests/test_bfcl.py."""
import copy
import json
import os
import re
from types import SimpleNamespace

import pytest
import torch

import common
import envs
import eval as ev
import rollout


# ----------------------------------------------------------------------------- pass^k

def test_pass_hat_k_by_hand():
    # one task, c=2 of n=4: pass^1 = 2/4, pass^2 = C(2,2)/C(4,2) = 1/6, pass^3 = 0
    assert ev.pass_hat_k({"a": [1, 0, 1, 0]}, 1) == pytest.approx(0.5)
    assert ev.pass_hat_k({"a": [1, 0, 1, 0]}, 2) == pytest.approx(1 / 6)
    assert ev.pass_hat_k({"a": [1, 0, 1, 0]}, 3) == 0.0
    # mean over tasks: (3/4 + 1) / 2 and (C(3,2)/C(4,2) + 1) / 2 = (1/2 + 1) / 2
    two = {"a": [1, 1, 1, 0.5], "b": [1.0, 1.0, 1.0, 1.0]}       # 0.5 (shaped credit) is not a success
    assert ev.pass_hat_k(two, 1) == pytest.approx(0.875)
    assert ev.pass_hat_k(two, 2) == pytest.approx(0.75)
    assert ev.pass_hat_k(list(two.values()), 4) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        ev.pass_hat_k(two, 5)


def test_bootstrap_ci_brackets_the_estimate():
    results = {f"t{i}": [1, 1] if i < 3 else [0, 1] for i in range(10)}   # pass^1 = 0.65, pass^2 = 0.3
    s = ev.summarize(results, n_boot=500, seed=1)
    assert s["n_tasks"] == 10 and s["trials"] == 2
    assert s["pass^k"][1] == pytest.approx(0.65) and s["pass^k"][2] == pytest.approx(0.3)
    for k in (1, 2):
        lo, hi = s["ci"][k]
        assert 0.0 <= lo < s["pass^k"][k] < hi <= 1.0
    same = ev.summarize({f"t{i}": [1, 1] for i in range(5)}, n_boot=100)   # no spread across tasks
    assert same["ci"][1] == [1.0, 1.0]


def test_paired_difference_by_hand():
    a = {"t1": [1], "t2": [1], "t3": [0], "t4": [1], "t5": [0]}
    b = {"t1": [0], "t2": [1], "t3": [0], "t4": [0], "t5": [1]}
    d = ev.paired_difference(a, b, n_boot=2000)
    assert d["diff"] == pytest.approx(1 / 5) and (d["only_a"], d["only_b"]) == (2, 1)
    assert d["mcnemar_p"] == pytest.approx(1.0)            # 2 vs 1 of 3 discordant: 2 * P(X <= 1) = 1
    assert -1.0 <= d["ci"][0] < d["diff"] < d["ci"][1] <= 1.0
    ten = {f"t{i}": [1] for i in range(10)}
    none = {f"t{i}": [0] for i in range(10)}
    d = ev.paired_difference(ten, none, n_boot=200)
    assert d["diff"] == 1.0 and d["ci"] == [1.0, 1.0] and d["mcnemar_p"] == pytest.approx(2 / 2 ** 10)
    same = ev.paired_difference(ten, ten, n_boot=200)
    assert same["diff"] == 0.0 and same["ci"] == [0.0, 0.0] and same["mcnemar_p"] == 1.0
    # trials pair up episode by episode: (1, 0) against (0, 1) is two discordant episodes, difference 0
    d = ev.paired_difference({"t": [1, 0]}, {"t": [0, 1]}, n_boot=100)
    assert d["diff"] == 0.0 and (d["only_a"], d["only_b"]) == (1, 1)
    with pytest.raises(ValueError):
        ev.paired_difference({"t1": [1]}, {"t2": [1]})


def test_paired_difference_on_shares_and_metrics_that_do_not_always_apply():
    """facts asked for is a share, asked before writing is None where an agent made no write: the difference is the
    mean over the trials both have a value for, and the sign test counts where either was higher."""
    a = {"t1": [1.0, 0.5], "t2": [None, 1.0], "t3": [0.0, None]}
    b = {"t1": [0.5, 0.5], "t2": [0.0, 0.0], "t3": [1.0, 1.0]}
    d = ev.paired_difference(a, b, n_boot=500)
    # per task: t1 (0.5 + 0) / 2 = 0.25, t2 (1 - 0) = 1, t3 (0 - 1) = -1; mean 0.25 / 3
    assert d["diff"] == pytest.approx(0.25 / 3) and d["n_tasks"] == 3
    assert (d["only_a"], d["only_b"]) == (2, 1) and d["mcnemar_p"] == pytest.approx(1.0)
    assert ev.paired_difference({"t": [None]}, {"t": [1.0]}) is None     # nothing pairs up


def test_paired_bootstrap_is_tighter_than_two_independent_intervals():
    """Two agents that mostly agree: the paired CI of the difference excludes 0 where the unpaired
    reading (comparing the two agents' own CIs) could not tell them apart."""
    import random
    rng = random.Random(0)
    base = [int(rng.random() < 0.4) for _ in range(48)]
    better = [1 if x else int(i % 4 == 0) for i, x in enumerate(base)]     # solves all of base's, and more
    a, b = ({f"t{i}": [v] for i, v in enumerate(r)} for r in (better, base))
    d = ev.paired_difference(a, b, n_boot=4000)
    sa, sb = ev.summarize(a, 4000), ev.summarize(b, 4000)
    assert d["only_b"] == 0 and d["ci"][0] > 0 and d["mcnemar_p"] < 0.05
    assert sa["ci"][1][0] < sb["ci"][1][1]               # the two marginal CIs overlap


@pytest.fixture(scope="module")
def tok():
    return rollout.load_tokenizer()


class SilentAgent(rollout.TextAgent):
    def respond(self, task, messages):
        return "I cannot help with that."


# ----------------------------------------------------------------------------- pass^k on envs

@pytest.fixture(scope="module")
def tasks():
    from envs import ours
    return [t for d in ours.DOMAINS for t in ours.make_tasks(d, "test", 2)]


def test_oracle_agent_passes_every_held_out_task(tasks, tok):
    from rollout import OracleAgent
    r = ev.evaluate(OracleAgent(tok), tok, tasks, trials=2, progress=False, n_boot=50, max_turns=8, max_context=3072)
    assert r["overall"]["pass^k"] == {1: 1.0, 2: 1.0} and r["overall"]["n_tasks"] == 4
    assert set(r["per_domain"]) == {"retail", "airline"} and r["failures"] == [] and r["rechecked"] == 0
    assert sum(s["n_tasks"] for s in r["per_scenario"].values()) == 4
    from envs import ours                                                  # every write the oracle makes, it confirms first
    n_write = 2 * sum(any(a.name in ours.WRITE_TOOLS[t.domain] for a in t.gold_actions) for t in tasks)
    b = r["behaviour"]["all"]
    assert n_write and b["asked_first"] == {"mean": 1.0, "n": n_write}
    assert {m: b[m]["mean"] for m in ("pass1", "correct_state", "finished")} == dict.fromkeys(("pass1", "correct_state", "finished"), 1.0)
    assert b["turns"]["mean"] == r["calls"]["turns"] / 8 and set(r["behaviour"]) == {"all", "retail", "airline"}
    assert r["stop_reasons"] == {"user_stop": 8}                   # the oracle reports, then the user stops
    # the oracle makes exactly the gold calls, each executed without error
    assert r["calls"] == {"turns": r["calls"]["turns"], "ok": 2 * sum(len(t.gold_actions) for t in tasks),
                          "err": 0, "malformed": 0}


def test_the_ceiling_is_the_gold_agents_score_under_each_user_at_the_evals_limits(tok):
    """eval.ceiling runs the gold agent on the eval's tasks under a user: at a cap with room it passes every task
    under every persona; at a cap below its longest episode it cannot, and the ceiling says so; an LLM user has none."""
    import argparse
    import envs
    tasks = [t for d in envs.WORLDS["ours"].domains for t in envs.make_tasks(d, "test", 3, ["medium"])]
    args = argparse.Namespace(trials=2, seed=0, max_turns=20, max_context=8192)
    for user in ("scripted", "scripted:curious", "scripted:train", "none"):
        c = ev.ceiling(tok, tasks, user, args)
        b = c["behaviour"]["all"]
        assert (b["pass1"]["mean"], b["pass1"]["n"], c["episodes"]) == (1.0, 12, 12), (user, c)
        assert b["facts_asked"]["mean"] == (None if user == "none" else 1.0) and c["longest"] <= 20
    short = ev.ceiling(tok, tasks, "scripted:curious", argparse.Namespace(**{**vars(args), "max_turns": 6}))
    assert short["behaviour"]["all"]["pass1"]["mean"] < 1 and short["stop_reasons"].get("max_turns")
    assert ev.ceiling(tok, tasks, "openai:gpt-4o", args) is None
    table = ev.ceiling_markdown({"scripted:curious": short})
    assert "| gold agent | scripted:curious | all | 12 |" in table and "| gold agent | scripted:curious | airline |" in table


def test_asked_before_writing_reads_the_order_of_request_and_write():
    call = lambda name: [{"name": name, "arguments": {}}]                                  # noqa: E731
    ask = {"role": "assistant", "content": "Please confirm: cancel order #W1 (reason: no longer needed). Yes or no?"}
    look = {"role": "assistant", "content": "<tool_call>...</tool_call>", "tool_calls": call("get_order_details")}
    write = {"role": "assistant", "content": "<tool_call>...</tool_call>", "tool_calls": call("cancel_pending_order")}
    yes, user = {"role": "user", "content": "Yes."}, {"role": "user", "content": "Cancel #W1, please."}
    asked = lambda *msgs, domain="retail": common.asked_before_writing(SimpleNamespace(domain=domain, messages=[user, *msgs]))  # noqa: E731
    assert asked(look, ask, yes, write) is True
    assert asked(look, write, ask, yes) is False                   # the request came after the write
    assert asked(look, dict(write, content=ask["content"] + " <tool_call>...</tool_call>")) is False   # same turn: no answer yet
    assert asked(dict(look, content=ask["content"] + " <tool_call>...</tool_call>"), write) is False   # asked, but acted at once
    assert asked(look, ask, yes) is None                           # no write, nothing to count
    assert asked(ask, yes, write, domain="tau2-retail") is None    # no write list for τ²'s tools


class WriteAndWaitAgent(rollout.TextAgent):
    """Makes the gold calls at once, asking nothing and confirming nothing, then never says it is done."""

    def respond(self, task, messages):
        n = sum(bool(m.get("tool_calls")) for m in messages if m["role"] == "assistant")
        if n == len(task.gold_actions):
            return "Let me check one more thing."
        a = task.gold_actions[n]
        return "<tool_call>" + json.dumps({"name": a.name, "arguments": a.arguments}) + "</tool_call>"


def test_behaviour_metrics_tell_apart_agents_that_each_miss_something(tasks, tok):
    """Episodes whose answers are known, 2 easy and 2 medium tasks (the medium openings withhold their ids). The
    oracle does it all. WriteAndWait leaves the right end state but, never reporting, runs to the turn cap: pass^1 0
    and correct end state 1, the gap τ²'s rule opens; it wrote without asking and asked for no fact. Silent writes
    nothing (asked before writing does not apply) and asks nothing. Paired: the oracle's gain over WriteAndWait is
    all pass^1, finishing and asking, none of it the end state."""
    from rollout import OracleAgent
    run = lambda agent: ev.evaluate(agent, tok, tasks, trials=1, max_turns=8, max_context=3072,   # noqa: E731
                                    progress=False, n_boot=20)
    got = {name: run(agent) for name, agent in [("oracle", OracleAgent(tok)), ("writer", WriteAndWaitAgent(tok)),
                                                ("silent", SilentAgent(tok))]}
    mean = lambda name, group="all": {m: v["mean"] for m, v in got[name]["behaviour"][group].items()}   # noqa: E731
    assert mean("oracle") == {"pass1": 1.0, "correct_state": 1.0, "finished": 1.0, "asked_first": 1.0,
                              "facts_asked": 1.0, "turns": mean("oracle")["turns"], "repeated_questions": 0.0}
    assert mean("writer") == {"pass1": 0.0, "correct_state": 1.0, "finished": 0.0, "asked_first": 0.0,
                              "facts_asked": 0.0, "turns": 8.0, "repeated_questions": 0.0}
    assert mean("silent") == {"pass1": 0.0, "correct_state": 0.0, "finished": 0.0, "asked_first": None,
                              "facts_asked": 0.0, "turns": 8.0, "repeated_questions": 0.0}
    b = got["oracle"]["behaviour"]
    assert (b["all"]["asked_first"]["n"], b["all"]["facts_asked"]["n"], b["retail"]["facts_asked"]["n"]) == (4, 2, 1)
    assert got["writer"]["stop_reasons"] == {"max_turns": 4} and got["writer"]["metrics"]["correct_state"] == \
        {t.id: [1.0] for t in tasks}
    results = {name: {"tau": got[name]} for name in ("writer", "oracle")}
    domain_of = {t.id: t.domain for t in tasks}
    diff = {m: ev.pair_up(results, domain_of, metric=m)[0]["oracle - writer"]["diff"] for m in ev.METRICS if m != "turns"}
    assert diff == {"pass1": 1.0, "correct_state": 0.0, "finished": 1.0, "asked_first": 1.0, "facts_asked": 1.0,
                    "repeated_questions": 0.0}


def test_facts_asked_counts_the_withheld_facts_the_agent_asked_for():
    """cancel_trip's opening names no id: of user_id, reservation_id and reason, the agent asked for two (the
    words the scripted user listens for); a tool call's arguments are not asking. Given in the opening (or with
    no user, every fact up front), nothing is withheld and the metric does not apply."""
    from envs import ours
    import users
    task = next(t for t in ours.make_tasks("airline", "test", 8) if t.scenario == "cancel_trip")
    ask = lambda *said, opening=task.opening: ev.facts_asked(task, SimpleNamespace(messages=[   # noqa: E731
        {"role": "user", "content": opening}] + [{"role": "assistant", "content": x} for x in said]))
    assert ask("What is your user id?", '<tool_call>{"reason": "x"}</tool_call>', "And the reservation id?") == \
        pytest.approx(2 / 3)
    assert ask("Sure, one moment.") == 0.0 and ask("Why? Your reservation id and user id, please.") == 1.0
    assert ask("Hello.", opening=users.NoUser(task).first_message()) is None
    retail = next(t for t in ours.make_tasks("retail", "test", 2) if t.scenario == "cancel_order")
    assert ev.facts_asked(retail, SimpleNamespace(messages=[{"role": "user", "content": retail.opening}])) is None


def test_grid_of_agents_and_users_is_the_two_by_two(tasks, tok):
    """Two agents, each evaluated with the scripted user and with none: pairs only within a user, and one grid
    per paired metric. With nobody to answer, the oracle writes at once and finishes; WriteAndWait's write
    then scores too."""
    from rollout import OracleAgent
    results = {}
    for name, agent in [("oracle", OracleAgent(tok)), ("writer", WriteAndWaitAgent(tok))]:
        for user in ("scripted", "none"):
            results[f"{name} @ {user}"] = {"tau": ev.evaluate(agent, tok, tasks, trials=1, user=envs.UserFactory(user), max_turns=8,
                                                              progress=False, n_boot=20, max_context=3072)}
    pairs = {m: ev.pair_up(results, {t.id: t.domain for t in tasks}, metric=m)[0] for m in ("pass1", "asked_first")}
    assert list(pairs["pass1"]) == ["writer - oracle @ scripted", "writer - oracle @ none"]
    assert [d["diff"] for d in pairs["pass1"].values()] == [-1.0, 0.0]
    assert results["oracle @ none"]["tau"]["behaviour"]["all"]["asked_first"] == {"mean": 0.0, "n": 4}
    table = ev.markdown(results, pairs)
    assert "| pass^1, all tasks: agent, evaluated with | scripted | none |" in table
    assert "| oracle | 1.000 | 1.000 |" in table and "| writer | 0.000 | 1.000 |" in table
    assert "| asked before writing, all tasks: agent, evaluated with | scripted | none |" in table


class FlakyAgent(rollout.TextAgent):
    """Silent on a task's first `trials` conversations, the oracle on any later one (the re-run)."""

    def __init__(self, tokenizer, trials):
        from rollout import OracleAgent
        super().__init__(tokenizer)
        self.oracle, self.trials, self.seen, self.count = OracleAgent(tokenizer), trials, {}, {}

    def respond(self, task, messages):
        if id(messages) not in self.seen:    # a conversation's messages list lives as long as it does
            self.seen[id(messages)] = self.count[task.id] = self.count.get(task.id, 0) + 1
        if self.seen[id(messages)] <= self.trials:
            return "Hello."
        return self.oracle.respond(task, messages)


def test_failures_keep_db_diffs_and_rescued_ones_are_flagged(tasks, tok):
    r = ev.evaluate(FlakyAgent(tok, 2), tok, tasks, trials=2, max_turns=12, recheck=3, progress=False, n_boot=50,
                    max_context=3072)
    assert r["overall"]["pass^k"] == {1: 0.0, 2: 0.0}
    assert len(r["failures"]) == 8 and r["rechecked"] == 3 and r["user_sim_suspects"] == 3
    from envs import ours
    by_id = {t.id: t for t in tasks}
    writes = [f for f in r["failures"]
              if any(a.name in ours.WRITE_TOOLS[f["domain"]] for a in by_id[f["task_id"]].gold_actions)]
    assert writes and all(f["diff"] for f in writes)             # the gold write never happened: a diff says so
    flagged = [f for f in r["failures"] if f["user_sim_suspect"]]
    assert len(flagged) == 6 and all(f["rechecked"] for f in flagged)   # 3 tasks x 2 failed trials


def test_report_table_and_plot(tmp_path, monkeypatch):
    tau = {"overall": ev.summarize({"a": [1, 0], "b": [1, 1]}, 20), "rechecked": 1, "user_sim_suspects": 0,
           "per_domain": {"retail": ev.summarize({"a": [1, 0], "b": [1, 1]}, 20)},
           "per_tier": {"easy": ev.summarize({"a": [1, 0]}, 20), "medium": ev.summarize({"b": [1, 1]}, 20)},
           "per_scenario": {"cancel_order": ev.summarize({"a": [1, 0]}, 20), "return_item": ev.summarize({"b": [1, 1]}, 20)},
           "calls": {"turns": 40, "ok": 10, "err": 6, "malformed": 2},
           "behaviour": {"all": {m: {"mean": 0.5, "n": 4} for m in ev.METRICS} | {"asked_first": {"mean": 2 / 3, "n": 3},
                                                                                   "facts_asked": {"mean": None, "n": 0}}}}
    results = {"base": {"tau": tau}, "rl": {"tau": tau}}
    pairs = {"pass1": {"rl - base": ev.paired_difference({"a": [1, 0], "b": [1, 1]}, {"a": [0, 0], "b": [1, 1]}, 100)}}
    table = ev.markdown(results, pairs)
    assert "| rl - base | +0.250 | [" in table and "| 1 | 0 | 1.0000 |" in table and "difference in pass^1" in table
    assert "| base | 0.750 [" in table and "| return_item | 1 | 1.000 | 1.000 |" in table
    assert "| 25 / 15 / 5 (40 turns) | 0 of 1 rechecked |" in table
    assert "| easy pass^1 | medium pass^1 |" in table and "(retail: 2, easy: 1, medium: 1)" in table
    assert "| rl | all | 4 | 0.500 | 0.500 | 0.500 | 0.667 (3) | - | 0.500 |" in table   # behaviour: n where fewer
    assert "evaluated with |" not in table                                               # one user: no grid
    drawn = []
    monkeypatch.setattr(ev.common, "save_figure", lambda fig, path, **kw: drawn.append((fig, path)))
    ev.plot(results, str(tmp_path / "p.png"), pairs["pass1"])
    (fig, path), = drawn
    overall, per_domain, paired = fig.axes
    assert [b.get_height() for b in overall.patches] == [0.75, 0.75]          # each agent's pass^1
    assert [t.get_text() for t in overall.get_xticklabels()] == ["base", "rl"]
    assert [b.get_height() for b in per_domain.patches] == [0.75, 0.75]       # retail, for each agent
    assert "pass^1" in overall.get_title() and "per domain" in per_domain.get_title()
    x, y = paired.lines[0].get_data()                                          # the errorbar's point
    assert list(x) == [0.25] and [t.get_text() for t in paired.texts] == ["+0.250"]   # rl - base, as the table says
    assert [t.get_text() for t in paired.get_yticklabels()] == ["rl - base"] and path.endswith("p.png")


def test_pairs_per_domain_keep_each_domains_tasks_together():
    """rl gains 2 airline tasks and loses 2 retail ones: 0 overall, +1 and -1 per domain."""
    domain_of = {"a1": "airline", "a2": "airline", "r1": "retail", "r2": "retail"}
    tau = lambda r: {"rewards": r, "metrics": {"pass1": r}}                                # noqa: E731
    results = {"sft": {"tau": tau({"a1": [0], "a2": [0], "r1": [1], "r2": [1]})},
               "rl": {"tau": tau({"a1": [1], "a2": [1], "r1": [0], "r2": [0]})}}
    pairs, per_domain = ev.pair_up(results, domain_of)
    assert pairs["rl - sft"]["diff"] == 0 and pairs["rl - sft"]["only_a"] == 2 == pairs["rl - sft"]["only_b"]
    assert per_domain["rl - sft (airline)"]["diff"] == 1 and per_domain["rl - sft (airline)"]["n_tasks"] == 2
    assert per_domain["rl - sft (retail)"]["diff"] == -1 and per_domain["rl - sft (retail)"]["only_b"] == 2
    assert ev.pair_up(results, dict.fromkeys(domain_of, "retail"))[1] == {}     # one domain: no split


def test_smoke_run_writes_everything_and_a_killed_run_resumes_agent_by_user(tmp_path, monkeypatch):
    """A smoke run writes its files and skips a missing adapter. Rerun with the same arguments, eval.py reads what
    it evaluated before and runs only what is left (here the one label whose record a kill lost), as does a rerun
    with fewer or more users; other arguments start over."""
    argv = ["--smoke", "--agents", "base,sft", "--sft-adapter", str(tmp_path / "none"), "--user", "scripted,none",
            "--domains", "airline", "--out", str(tmp_path)]
    first = ev.main(argv)
    assert list(first) == ["base @ scripted", "base @ none"]          # the missing SFT adapter is skipped
    saved = json.loads((tmp_path / "results.json").read_text())
    o = saved["agents"]["base @ scripted"]["tau"]["overall"]
    assert o["n_tasks"] == 1 and o["trials"] == 2 and 0.0 <= o["pass^k"]["1"] <= 1.0
    for name in ("args.json", "results.md", "eval.png", "failures_base___scripted.jsonl", "episodes_base___none.jsonl"):
        assert (tmp_path / name).exists(), name
    assert set(saved["ceiling"]) == {"scripted", "none"}              # the gold agent under each user, at the
    assert saved["ceiling"]["none"]["longest"] == 1                   # smoke preset's 1-turn cap
    assert "| gold agent | none | all | 2 |" in (tmp_path / "results.md").read_text()
    fails = [json.loads(l) for l in (tmp_path / "failures_base___scripted.jsonl").read_text().splitlines()]
    assert len(fails) == saved["agents"]["base @ scripted"]["tau"]["n_failed"] and all("diff" in f for f in fails)

    evaluate, ran = ev.evaluate, []
    monkeypatch.setattr(ev, "evaluate", lambda *a, **kw: ran.append(a[4].spec) or evaluate(*a, **kw))
    (tmp_path / "done" / "base___none.pkl").unlink()
    again = ev.main(argv)
    assert ran == ["none"] and list(again) == list(first)   # the same numbers, but wall time (the users' waits too)
    same = lambda r: re.sub(r"(user_wait_s|user_wait_share)(['\"]): [-\de.]+", r"\1\2: 0",  # noqa: E731
                            json.dumps({k: {**v["tau"], "seconds": 0} for k, v in r.items()}, default=str, sort_keys=True))
    assert same(again) == same(first)
    alone = ev.main(argv[:5] + ["--user", "none"] + argv[7:])       # one user of those: read back, as label "base"
    assert ran == ["none"] and same(alone) == same({"base": first["base @ none"]})

    def stop(*a, **kw):
        ran.append(a[4].spec)
        raise KeyboardInterrupt
    monkeypatch.setattr(ev, "evaluate", stop)
    with pytest.raises(KeyboardInterrupt):
        ev.main(argv[:-2] + ["--seed", "1", "--out", str(tmp_path)])
    assert ran == ["none", "scripted"]


def test_an_agent_is_read_back_only_while_its_adapter_files_are_unchanged(tmp_path, capsys):
    """runs/rl/adapter trained again (another rl.py run, the same path) is evaluated again, not read back: the
    saved evaluation carries its adapter's digest. An edit to a file that is not the adapter's (its model card)
    changes nothing; the base model, which has no adapter, is read back."""
    adapter = tmp_path / "rl" / "adapter"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text("{}")
    (adapter / "adapter_model.safetensors").write_bytes(b"weights of the first run")
    (adapter / "README.md").write_text("a model card: not the weights")
    args = ev.parse_args(["--agents", "base,rl", "--rl-adapter", str(adapter), "--out", str(tmp_path / "eval")])
    os.makedirs(tmp_path / "eval" / "done")
    read_back = lambda name: ev.done_before(args, name, "scripted", ev.adapter_digest(name, args))   # noqa: E731
    for name in ("base", "rl"):
        ev.save_done(args, name, "scripted", {"of": name}, ev.adapter_digest(name, args))
    assert read_back("rl") == {"of": "rl"}
    (adapter / "README.md").write_text("edited")
    assert read_back("rl") == {"of": "rl"}
    (adapter / "adapter_model.safetensors").write_bytes(b"weights of the second run")
    capsys.readouterr()
    assert read_back("rl") is None
    assert "its adapter changed" in capsys.readouterr().out
    assert read_back("base") == {"of": "base"}


def test_a_published_adapter_is_the_trained_one_in_bf16_and_loads_as_an_agent(tmp_path, tiny, capsys):
    """scripts/publish_adapter.py: the weights in bf16, each the fp32 one rounded; SHA256SUMS right and one line per
    adapter when published again; SOURCES.md names the command and both digests; the copy loads into the fp32 model
    (PEFT casts it up) as eval.py's --agents entry does; a missing adapter is one line and exit 2, nothing written."""
    import hashlib

    from safetensors.torch import load_file

    from conftest import with_lora
    from scripts import publish_adapter as pub
    src, dst = tmp_path / "trained", tmp_path / "published" / "broad-step-8"
    with_lora(tiny).save_pretrained(str(src))
    fp32 = load_file(str(src / pub.WEIGHTS))
    for _ in range(2):
        digest = pub.publish(str(src), str(dst), "python rl.py --steps 8")
    bf16 = load_file(str(dst / pub.WEIGHTS))
    assert bf16.keys() == fp32.keys() and all(v.dtype == torch.bfloat16 for v in bf16.values())
    assert all(torch.equal(bf16[k], v.to(torch.bfloat16)) for k, v in fp32.items())
    assert any(not torch.equal(bf16[k].float(), v) for k, v in fp32.items())        # rounded: not the same bits
    assert (tmp_path / "published" / "SHA256SUMS").read_text() == f"{digest}  broad-step-8/{pub.WEIGHTS}\n"
    assert digest == hashlib.sha256((dst / pub.WEIGHTS).read_bytes()).hexdigest()
    sources = (tmp_path / "published" / "SOURCES.md").read_text()
    assert sources.count("broad-step-8") == 1 and "python rl.py --steps 8" in sources
    assert pub.sha256(str(src / pub.WEIGHTS)) in sources and digest in sources
    model = rollout.load_adapter(copy.deepcopy(tiny), str(dst))
    loaded = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert len(loaded) == len(bf16) and all(p.dtype == torch.float32 for p in loaded.values())
    assert all(torch.equal(loaded[n], bf16[n.replace(".default", "")].float()) for n in loaded)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        pub.publish(str(tmp_path / "nowhere"), str(tmp_path / "out" / "x"), "python rl.py")
    assert e.value.code == 2 and capsys.readouterr().err.count("\n") == 1 and not (tmp_path / "out").exists()


def test_the_published_adapters_come_back_from_history_with_their_sha256(tmp_path, capsys):
    """scripts/adapters.sh: every adapter a SHA256SUMS under docs/steps/ lists, most of them out of the tree, is
    written back from git's objects into a clone's tree (the default) and into OUT: each weight file with the digest
    listed (hashed here, not by the script), each config as the commit before its deletion holds it, a
    damaged copy written again, the clone's status as before. An attempt with none is refused in one line, exit 2,
    nothing written; eval.py refuses a published adapter not yet back in one line that names the script."""
    import glob
    import hashlib
    import shutil
    import subprocess
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    git = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=repo, capture_output=True, text=True)
    if git.returncode != 0 or git.stdout.strip() != "false":
        pytest.skip("not a git clone with its whole history: the adapters live there")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--local", repo, str(clone)], check=True)
    shutil.copy(os.path.join(repo, "scripts", "adapters.sh"), clone / "scripts")       # the script as it is now
    status = lambda: subprocess.run(["git", "status", "--porcelain"], cwd=clone, capture_output=True, text=True).stdout
    before = status()                                  # empty once the script is committed
    tracked = clone / "docs/steps/attempt4/adapters/narrow-sft/adapter_model.safetensors"
    tracked.write_bytes(tracked.read_bytes()[:100])                                      # damaged
    for root in (clone, tmp_path / "out"):
        env = {**os.environ, **({"OUT": str(root)} if root != clone else {})}
        run = subprocess.run(["bash", "scripts/adapters.sh"], cwd=clone, env=env, capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        listed = 0
        for sums in glob.glob(str(clone / "docs/steps/attempt*/adapters/SHA256SUMS")):
            folder = os.path.relpath(os.path.dirname(sums), clone)
            for digest, weights in (line.split() for line in open(sums)):
                assert hashlib.sha256((root / folder / weights).read_bytes()).hexdigest() == digest
                config = os.path.join(folder, os.path.dirname(weights), "adapter_config.json")
                deleted = subprocess.run(["git", "log", "-1", "--diff-filter=D", "--format=%H", "--", config],
                                         cwd=clone, capture_output=True, text=True, check=True).stdout.strip()
                held = subprocess.run(["git", "show", f"{deleted}^:{config}" if deleted else f"HEAD:{config}"],
                                      cwd=clone, capture_output=True, check=True).stdout
                assert (root / config).read_bytes() == held
                listed += 1
        assert listed == 14                   # attempts 3, 4, 5 and 6: 3 + 3 + 6 + 2 (6 grows as checkpoints publish)
    assert status() == before                 # the damaged tracked copy is whole again; the rest are ignored
    env = {**os.environ, "OUT": str(tmp_path / "none")}
    bad = subprocess.run(["bash", "scripts/adapters.sh", "attempt9"], cwd=clone, env=env, capture_output=True,
                         text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and not (tmp_path / "none").exists()
    with pytest.raises(SystemExit) as e:
        ev.parse_args(["--agents", str(tmp_path / "none" / "docs/steps/attempt5/adapters/narrow-s0-step-8")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "bash scripts/adapters.sh" in err


def test_openai_endpoint_agent_against_a_local_fake_server(tasks, tok):
    """OpenAIAgent speaks plain chat to any OpenAI-compatible server: tool results go out as user turns."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(body)
            text = ('<tool_call>{"name": "get_user_details", "arguments": {"user_id": "nobody"}}</tool_call>'
                    if len(seen) == 1 else "Sorry, I cannot help.")
            out = json.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                              "choices": [{"index": 0, "finish_reason": "stop",
                                           "message": {"role": "assistant", "content": text}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *a):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        agent = rollout.OpenAIAgent(tok, "fake-model", base_url=f"http://127.0.0.1:{server.server_port}/v1", api_key="k")
        r = ev.evaluate(agent, tok, tasks[:1], trials=1, max_turns=2, progress=False, n_boot=10, max_context=3072)
    finally:
        server.shutdown()
    assert len(seen) == 2 and seen[0]["model"] == "fake-model"
    assert [m["role"] for m in seen[0]["messages"]] == ["system", "user"]
    assert "<tools>" in seen[0]["messages"][0]["content"]
    last = seen[1]["messages"][-1]
    assert last["role"] == "user" and last["content"].startswith("<tool_response>\nError")
    assert r["overall"]["pass^k"][1] == 0.0 and r["stop_reasons"] == {"max_turns": 1}


def test_a_task_whose_user_simulator_failed_leaves_pass_k_and_is_counted(tasks, tok):
    """An LLM user server that fails one conversation (a 401 is not retried): that task is left out of pass^k
    and of the pairing, counted as a simulator failure, not scored 0; the other tasks score as usual."""
    from chat_server import FakeServer
    from rollout import TextAgent

    class Reporter(TextAgent):                 # ends every conversation by its first message
        def respond(self, task, messages):
            return "I cannot help with that."
    n = {"requests": 0}

    def answer(body):
        n["requests"] += 1
        return "401" if n["requests"] == 2 else {"content": "Thanks. ###STOP###"}
    with FakeServer(answer) as srv:
        r = ev.evaluate(Reporter(tok), tok, tasks, trials=1, user=envs.UserFactory("openai:m", {"base_url": srv.url}),
                        progress=False, n_boot=20, user_workers=1, max_turns=8, max_context=3072)
    assert r["sim_failures"] == 1 and r["tasks_lost"] == 1
    assert r["overall"]["n_tasks"] == len(tasks) - 1 and len(r["rewards"]) == len(tasks) - 1
    assert tasks[1].id not in r["rewards"]          # the second opening asked is the one that failed
    assert all(v == [0.0] for v in r["rewards"].values())    # refusing solves none: the lost task is not among them
