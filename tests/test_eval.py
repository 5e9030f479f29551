"""eval.py: pass^k by hand, bootstrap CI, BFCL multi-turn (ground truth 100%, corruptions fail,
our Hermes -> python-call loop end to end), pass^k of the oracle agent, and the --smoke run."""
import ast
import json
from types import SimpleNamespace

import pytest

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


# ----------------------------------------------------------------------------- BFCL

N_BFCL = 5


@pytest.fixture(scope="module")
def bfcl():
    return ev.load_bfcl(N_BFCL)


def test_bfcl_ground_truth_scores_100_and_corruptions_fail(bfcl):
    entries, truth = bfcl
    assert [e["id"] for e in entries] == [f"multi_turn_base_{i}" for i in range(N_BFCL)]
    as_steps = lambda turns: [[t] if t else [] for t in turns]     # one step per turn, all its calls
    assert [ev.bfcl_score(e, as_steps(gt), gt)["valid"] for e, gt in zip(entries, truth)] == [True] * N_BFCL
    # scoring twice must not leak API state between runs (BFCL keeps instances in globals)
    assert ev.bfcl_score(entries[0], as_steps(truth[0]), truth[0])["valid"]
    for e, gt in zip(entries, truth):
        dropped = as_steps([t[:-1] for t in gt])                 # last call of every turn missing
        assert not ev.bfcl_score(e, dropped, gt)["valid"]
        assert ev.bfcl_score(e, as_steps(gt[:-1]), gt)["error_type"] == "multi_turn:force_terminated"
    first = truth[0][0]                                          # cd document, mkdir temp, mv report
    wrong = [c.replace("'temp'", "'tmp'") for c in first]
    assert wrong != first
    assert not ev.bfcl_score(entries[0], [[wrong]] + as_steps(truth[0][1:]), truth[0])["valid"]


def test_to_python_call_matches_bfcl_format_and_blocks_unsafe_names():
    allowed = {"cd", "mv"}
    assert ev.to_python_call({"name": "cd", "arguments": {"folder": "x"}}, allowed) == "cd(folder='x')"
    assert ev.to_python_call({"name": "mv", "arguments": {"source": "a b", "n": [1, 2.5], "f": True}},
                             allowed) == "mv(source='a b',n=[1, 2.5],f=True)"
    assert ev.to_python_call({"name": "__import__('os').system", "arguments": {}}, allowed) is None
    assert ev.to_python_call({"name": "cd", "arguments": {"x=1) or (": 1}}, allowed) is None


def hermes(call: str, entry: dict) -> str:
    """A ground-truth python call `sort('a.txt')` as our Hermes tool-call text."""
    node = ast.parse(call, mode="eval").body
    docs = entry["function"] + sum(entry.get("missed_function", {}).values(), [])   # miss_func: held-back ones too
    params = list(next(f for f in docs if f["name"] == node.func.id)["parameters"]["properties"])
    args = {params[i]: ast.literal_eval(a) for i, a in enumerate(node.args)}
    args.update({kw.arg: ast.literal_eval(kw.value) for kw in node.keywords})
    return "<tool_call>" + json.dumps({"name": node.func.id, "arguments": args}) + "</tool_call>"


class GroundTruthAgent(rollout.TextAgent):
    """Answers each BFCL turn with all of its ground-truth calls in one step, then a text reply."""

    def __init__(self, tokenizer, truth_by_id):
        super().__init__(tokenizer)
        self.truth = truth_by_id

    def respond(self, entry, messages):
        turn = sum(m["role"] == "user" for m in messages) - 1
        calls = self.truth[entry["id"]][turn]
        if messages[-1]["role"] == "tool" or not calls:
            return "Done."
        return "\n".join(hermes(c, entry) for c in calls)


class SilentAgent(rollout.TextAgent):
    def respond(self, entry, messages):
        return "I cannot help with that."


@pytest.fixture(scope="module")
def tok():
    return rollout.load_tokenizer()


def test_bfcl_loop_end_to_end(bfcl, tok, monkeypatch):
    entries, truth = bfcl
    monkeypatch.setattr(ev, "load_bfcl", lambda n, category: (entries[:n], truth[:n]))
    good = ev.evaluate_bfcl(GroundTruthAgent(tok, {e["id"]: gt for e, gt in zip(entries, truth)}), tok, 3,
                            progress=False, categories=["multi_turn_base"])
    assert good["accuracy"] == 1.0 and good["n"] == 3
    rec = good["records"][0]                 # Hermes JSON -> python calls, executed on BFCL's file system
    assert rec["decoded"][0] == [["cd(folder='document')", "mkdir(dir_name='temp')",
                                  "mv(source='final_report.pdf',destination='temp')"]]
    assert "moved to 'temp/final_report.pdf'" in rec["messages"][3]["content"]
    silent = ev.evaluate_bfcl(SilentAgent(tok), tok, 3, progress=False, categories=["multi_turn_base"])
    assert silent["accuracy"] == 0.0
    assert {r["error_type"] for r in silent["records"]} == {"multi_turn:empty_turn_model_response"}


class LoopingAgent(rollout.TextAgent):
    def respond(self, entry, messages):
        return '<tool_call>{"name": "pwd", "arguments": {}}</tool_call>'


def test_bfcl_too_many_steps_is_force_terminated(bfcl, tok, monkeypatch):
    entries, truth = bfcl
    monkeypatch.setattr(ev, "load_bfcl", lambda n, category: (entries[:n], truth[:n]))
    out = ev.evaluate_bfcl(LoopingAgent(tok), tok, 1, max_steps=3, progress=False, categories=["multi_turn_base"])
    rec = out["records"][0]
    assert rec["reason"] == "force_terminated" and len(rec["decoded"][0]) == 4   # 3 steps + the one over
    assert out["accuracy"] == 0.0 and rec["error_type"] == "multi_turn:force_terminated"


def test_bfcl_runs_all_four_multi_turn_categories_with_bfcls_checker(tok):
    """The paper's "BFCL-V3 Multi Turn" is four categories. Replaying each one's ground truth through our loop
    passes BFCL's checker: miss_func's held-back function arrives in its turn, miss_param's turn with nothing
    to call is answered in text, long_context runs on BFCL's long states."""
    firsts = {c: ev.load_bfcl(1, c) for c in ev.BFCL_CATEGORIES}
    entries = [e for es, _ in firsts.values() for e in es]
    assert [ev.bfcl_category(e) for e in entries] == list(ev.BFCL_CATEGORIES)
    truth = {e["id"]: gt for es, gts in firsts.values() for e, gt in zip(es, gts)}
    held = entries[1]["missed_function"]                                  # miss_func: not offered up front
    assert held and not {f["name"] for fs in held.values() for f in fs} & {f["name"] for f in entries[1]["function"]}
    assert [] in truth[entries[2]["id"]]                                 # miss_param: a turn to ask, not call
    out = ev.evaluate_bfcl(GroundTruthAgent(tok, truth), tok, 1, max_context=10**6, progress=False)
    assert out["per_category"] == {c: 1.0 for c in ev.BFCL_CATEGORIES} and out["accuracy"] == 1.0 and out["n"] == 4
    miss_func = next(r for r in out["records"] if r["id"] == entries[1]["id"])
    turn = int(next(iter(held)))                                         # its query lists the held-back docs
    query = [m["content"] for m in miss_func["messages"] if m["role"] == "user"][turn]
    assert all(f'"name": "{f["name"]}"' in query for f in held[str(turn)])
    silent = ev.evaluate_bfcl(SilentAgent(tok), tok, 1, max_context=10**6, progress=False)
    assert silent["per_category"] == {c: 0.0 for c in ev.BFCL_CATEGORIES}


# ----------------------------------------------------------------------------- pass^k on envs

@pytest.fixture(scope="module")
def tasks():
    import envs
    return [t for d in envs.DOMAINS for t in envs.make_tasks(d, "test", 2)]


def test_oracle_agent_passes_every_held_out_task(tasks, tok):
    from sft import OracleAgent
    r = ev.evaluate(OracleAgent(tok), tok, tasks, trials=2, progress=False, n_boot=50)
    assert r["overall"]["pass^k"] == {1: 1.0, 2: 1.0} and r["overall"]["n_tasks"] == 4
    assert set(r["per_domain"]) == {"retail", "airline"} and r["failures"] == [] and r["rechecked"] == 0
    assert sum(s["n_tasks"] for s in r["per_scenario"].values()) == 4
    import envs                                                  # every write the oracle makes, it confirms first
    n_write = 2 * sum(any(a.name in envs.WRITE_TOOLS[t.domain] for a in t.gold_actions) for t in tasks)
    assert n_write and r["writes"] == {"episodes": n_write, "asked_first": n_write}
    assert r["stop_reasons"] == {"user_stop": 8}                   # the oracle reports, then the user stops
    # the oracle makes exactly the gold calls, each executed without error
    assert r["calls"] == {"turns": r["calls"]["turns"], "ok": 2 * sum(len(t.gold_actions) for t in tasks),
                          "err": 0, "malformed": 0}


def test_asked_before_writing_reads_the_order_of_request_and_write():
    call = lambda name: [{"name": name, "arguments": {}}]                                  # noqa: E731
    ask = {"role": "assistant", "content": "Please confirm: cancel order #W1 (reason: no longer needed). Yes or no?"}
    look = {"role": "assistant", "content": "<tool_call>...</tool_call>", "tool_calls": call("get_order_details")}
    write = {"role": "assistant", "content": "<tool_call>...</tool_call>", "tool_calls": call("cancel_pending_order")}
    yes, user = {"role": "user", "content": "Yes."}, {"role": "user", "content": "Cancel #W1, please."}
    asked = lambda *msgs, domain="retail": ev.asked_before_writing(SimpleNamespace(domain=domain, messages=[user, *msgs]))  # noqa: E731
    assert asked(look, ask, yes, write) is True
    assert asked(look, write, ask, yes) is False                   # the request came after the write
    assert asked(look, dict(write, content=ask["content"] + " <tool_call>...</tool_call>")) is False   # same turn: no answer yet
    assert asked(dict(look, content=ask["content"] + " <tool_call>...</tool_call>"), write) is False   # asked, but acted at once
    assert asked(look, ask, yes) is None                           # no write, nothing to count
    assert asked(ask, yes, write, domain="tau2-retail") is None    # no write list for τ²'s tools


class FlakyAgent(rollout.TextAgent):
    """Silent on a task's first `trials` conversations, the oracle on any later one (the re-run)."""

    def __init__(self, tokenizer, trials):
        from sft import OracleAgent
        super().__init__(tokenizer)
        self.oracle, self.trials, self.seen, self.count = OracleAgent(tokenizer), trials, {}, {}

    def respond(self, task, messages):
        if id(messages) not in self.seen:    # a conversation's messages list lives as long as it does
            self.seen[id(messages)] = self.count[task.id] = self.count.get(task.id, 0) + 1
        if self.seen[id(messages)] <= self.trials:
            return "Hello."
        return self.oracle.respond(task, messages)


def test_failures_keep_db_diffs_and_rescued_ones_are_flagged(tasks, tok):
    r = ev.evaluate(FlakyAgent(tok, 2), tok, tasks, trials=2, max_turns=12, recheck=3, progress=False, n_boot=50)
    assert r["overall"]["pass^k"] == {1: 0.0, 2: 0.0}
    assert len(r["failures"]) == 8 and r["rechecked"] == 3 and r["user_sim_suspects"] == 3
    import envs
    by_id = {t.id: t for t in tasks}
    writes = [f for f in r["failures"]
              if any(a.name in envs.WRITE_TOOLS[f["domain"]] for a in by_id[f["task_id"]].gold_actions)]
    assert writes and all(f["diff"] for f in writes)             # the gold write never happened: a diff says so
    flagged = [f for f in r["failures"] if f["user_sim_suspect"]]
    assert len(flagged) == 6 and all(f["rechecked"] for f in flagged)   # 3 tasks x 2 failed trials


def test_report_table_and_plot(tmp_path):
    tau = {"overall": ev.summarize({"a": [1, 0], "b": [1, 1]}, 20), "rechecked": 1, "user_sim_suspects": 0,
           "per_domain": {"retail": ev.summarize({"a": [1, 0], "b": [1, 1]}, 20)},
           "per_tier": {"easy": ev.summarize({"a": [1, 0]}, 20), "medium": ev.summarize({"b": [1, 1]}, 20)},
           "per_scenario": {"cancel_order": ev.summarize({"a": [1, 0]}, 20), "return_item": ev.summarize({"b": [1, 1]}, 20)},
           "calls": {"turns": 40, "ok": 10, "err": 6, "malformed": 2}, "writes": {"episodes": 3, "asked_first": 2}}
    bfcl = {"accuracy": 0.25, "n": 4, "per_category": dict(zip(ev.BFCL_CATEGORIES, [0.0, 1.0, 0.0, 0.0]))}
    results = {"base": {"tau": tau}, "rl": {"tau": tau, "bfcl": bfcl}}
    pairs = {"rl - base": ev.paired_difference({"a": [1, 0], "b": [1, 1]}, {"a": [0, 0], "b": [1, 1]}, 100)}
    table = ev.markdown(results, pairs)
    assert "| rl - base | +0.250 | [" in table and "| 1 | 0 | 1.0000 |" in table
    assert "| base | 0.750 [" in table and "| 0.000 / 1.000 / 0.000 / 0.000: 0.250 (4 entries) |" in table and "| return_item | 1 | 1.000 | 1.000 |" in table
    assert "| 25 / 15 / 5 (40 turns) | 2 of 3 episodes | 0 of 1 rechecked |" in table
    assert "| easy pass^1 | medium pass^1 |" in table and "(retail: 2, easy: 1, medium: 1)" in table
    ev.plot(results, str(tmp_path / "p.png"), pairs)
    assert (tmp_path / "p.png").stat().st_size > 10_000


def test_pairs_per_domain_keep_each_domains_tasks_together():
    """rl gains 2 airline tasks and loses 2 retail ones: 0 overall, +1 and -1 per domain."""
    domain_of = {"a1": "airline", "a2": "airline", "r1": "retail", "r2": "retail"}
    results = {"sft": {"tau": {"rewards": {"a1": [0], "a2": [0], "r1": [1], "r2": [1]}}},
               "rl": {"tau": {"rewards": {"a1": [1], "a2": [1], "r1": [0], "r2": [0]}}}}
    pairs, per_domain = ev.pair_up(results, domain_of)
    assert pairs["rl - sft"]["diff"] == 0 and pairs["rl - sft"]["only_a"] == 2 == pairs["rl - sft"]["only_b"]
    assert per_domain["rl - sft (airline)"]["diff"] == 1 and per_domain["rl - sft (airline)"]["n_tasks"] == 2
    assert per_domain["rl - sft (retail)"]["diff"] == -1 and per_domain["rl - sft (retail)"]["only_b"] == 2
    assert ev.pair_up(results, dict.fromkeys(domain_of, "retail"))[1] == {}     # one domain: no split


def test_smoke_run_writes_everything(tmp_path):
    out = ev.main(["--smoke", "--agents", "base,sft", "--sft-adapter", str(tmp_path / "none"), "--domains", "airline",
                   "--out", str(tmp_path)])
    assert list(out) == ["base"]                                 # the missing SFT adapter is skipped
    saved = json.loads((tmp_path / "results.json").read_text())
    o = saved["agents"]["base"]["tau"]["overall"]
    assert o["n_tasks"] == 1 and o["trials"] == 2 and 0.0 <= o["pass^k"]["1"] <= 1.0
    for name in ("args.json", "results.md", "eval.png", "failures_base.jsonl", "episodes_base.jsonl"):
        assert (tmp_path / name).exists(), name
    fails = [json.loads(l) for l in (tmp_path / "failures_base.jsonl").read_text().splitlines()]
    assert len(fails) == saved["agents"]["base"]["tau"]["n_failed"] and all("diff" in f for f in fails)


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
        r = ev.evaluate(agent, tok, tasks[:1], trials=1, max_turns=2, progress=False, n_boot=10)
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
        r = ev.evaluate(Reporter(tok), tok, tasks, trials=1, user="openai:m", progress=False, n_boot=20,
                        base_url=srv.url, user_workers=1)
    assert r["sim_failures"] == 1 and r["tasks_lost"] == 1
    assert r["overall"]["n_tasks"] == len(tasks) - 1 and len(r["rewards"]) == len(tasks) - 1
    assert tasks[1].id not in r["rewards"]          # the second opening asked is the one that failed
    assert all(v == [0.0] for v in r["rewards"].values())    # refusing solves none: the lost task is not among them
