"""LLM user simulators: OpenAIUser against real local HTTP servers that misbehave, LocalUser
with a tiny random model, and (slow) OpenAIUser against a real llama.cpp server.

Run:  pytest tests/test_users.py            # fault tests + LocalUser, a few seconds
      pytest tests/test_users.py -m slow    # end-to-end with llama-cpp-python's server (needs llama_cpp)
"""
import json
import socket
import time
import types

import pytest
import torch

import envs
import rollout
import users as U
from envs import llm_users as L
from chat_server import FakeServer

TASK = types.SimpleNamespace(
    id="retail-train-00000", domain="retail",
    instruction="You are Mia Chen. You want to cancel order #W1234 because you no longer need it. "
                "Your email is mia.chen@example.com; give it only when asked.",
    opening="Hi, I'd like to cancel an order.")
# The agent's view of a conversation with a tool call and a tool result in it.
AGENT_VIEW = [
    {"role": "user", "content": "Hi, I'd like to cancel an order."},
    {"role": "assistant", "content": "Sure. What is your email?"},
    {"role": "user", "content": "mia.chen@example.com"},
    {"role": "assistant", "content": '<tool_call>{"name": "find_user_id_by_email", "arguments": '
                                     '{"email": "mia.chen@example.com"}}</tool_call>'},
    {"role": "tool", "name": "find_user_id_by_email", "content": "SECRET_DB_ROW user_id=mia_chen_42"},
    {"role": "assistant", "content": 'Found you. <tool_call>{"name": "get_order_details", "arguments": {}}</tool_call>'},
    {"role": "tool", "name": "get_order_details", "content": "SECRET_DB_ROW status=pending"},
    {"role": "assistant", "content": "Shall I cancel order #W1234? (yes/no)"},
]


def user_for(url, **kw):
    kw = {"timeout": 2.0, "max_retries": 3, **kw}
    return L.OpenAIUser(TASK, "sim-model", base_url=url, api_key="test-key", **kw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- prompt: what the simulator sees

def test_roles_flipped_and_no_tools_in_simulator_chat():
    chat = L.user_sim_messages(TASK, AGENT_VIEW)
    assert chat[0]["role"] == "system" and TASK.instruction in chat[0]["content"]
    assert [m["role"] for m in chat] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert chat[2]["content"] == AGENT_VIEW[0]["content"]             # its own opening is "assistant"
    assert chat[5]["content"] == "Found you.\nShall I cancel order #W1234? (yes/no)"   # tool-only turn dropped, merged
    everything = json.dumps(chat)
    for hidden in ("tool_call", "SECRET_DB_ROW", "find_user_id_by_email", "get_order_details"):
        assert hidden not in everything


def test_request_carries_flipped_chat_no_tools_and_counts_tokens():
    with FakeServer("ok") as srv:
        user = user_for(srv.url)
        assert user.first_message() == "Yes, please cancel it."
        assert user.reply(AGENT_VIEW) == "Yes, please cancel it."
    assert len(srv.requests) == 2 and srv.requests[0]["path"] == "/v1/chat/completions"
    body = srv.requests[1]["body"]
    assert "tools" not in body and body["model"] == "sim-model"
    assert body["messages"] == L.user_sim_messages(TASK, AGENT_VIEW)
    assert [m["role"] for m in srv.requests[0]["body"]["messages"]] == ["system", "user"]
    assert srv.requests[0]["auth"] == "Bearer test-key"
    assert user.usage == {"prompt_tokens": 100, "completion_tokens": 14, "requests": 2, "retries": 0}


def test_make_user_builds_openai_user():
    with FakeServer("ok") as srv:
        user = envs.make_user("openai:sim-model", TASK, seed=0, base_url=srv.url, api_key="k", timeout=2.0)
        assert isinstance(user, L.OpenAIUser) and user.first_message() == "Yes, please cancel it."
    assert srv.requests[0]["body"]["model"] == "sim-model"


def test_base_url_and_key_from_environment(monkeypatch):
    with FakeServer("ok") as srv:
        monkeypatch.setenv("OPENAI_BASE_URL", srv.url)
        monkeypatch.setenv("OPENAI_API_KEY", "env-key")
        assert L.OpenAIUser(TASK, "m", timeout=2.0).first_message() == "Yes, please cancel it."
    assert srv.requests[0]["auth"] == "Bearer env-key"


# ---------------------------------------------------------------- faults: real servers that misbehave

def test_server_down_gives_one_clear_error_after_retries():
    url = f"http://127.0.0.1:{free_port()}/v1"   # nothing listens there any more
    user = user_for(url, max_retries=2)
    t0 = time.time()
    with pytest.raises(U.UserSimulatorError) as err:
        user.first_message()
    msg = str(err.value)
    assert url in msg and "APIConnectionError" in msg and "3 attempt" in msg and "OPENAI_BASE_URL" in msg
    assert user.usage["requests"] == 3 and user.usage["retries"] == 2
    assert time.time() - t0 < 5


def test_slow_server_times_out_then_retry_succeeds():
    with FakeServer("slow", "ok") as srv:
        user = user_for(srv.url, timeout=0.3)
        t0 = time.time()
        assert user.first_message() == "Yes, please cancel it."
        assert 0.3 + 0.375 <= time.time() - t0 < 1.3   # gave up at the timeout, then the client's backoff (0.5 s
                                                      # less up to 25% jitter), not after the slow second
    assert len(srv.requests) == 2 and user.usage["retries"] == 1
    assert user.usage["prompt_tokens"] == 50   # only the answered request counts


def test_always_slow_server_raises_timeout_error():
    with FakeServer("slow") as srv:
        user = user_for(srv.url, timeout=0.2, max_retries=1)
        with pytest.raises(U.UserSimulatorError, match="APITimeoutError"):
            user.first_message()
    assert len(srv.requests) == 2


@pytest.mark.parametrize("fault", ["500", "429", "garbage", "nochoices"])
def test_transient_fault_then_success_is_retried_and_counted(fault):
    with FakeServer(fault, "ok") as srv:
        user = user_for(srv.url)
        assert user.reply(AGENT_VIEW) == "Yes, please cancel it."
    assert len(srv.requests) == 2
    assert user.usage == {"prompt_tokens": 50, "completion_tokens": 7, "requests": 2, "retries": 1}


@pytest.mark.parametrize("fault,name", [("500", "InternalServerError"), ("429", "RateLimitError"),
                                        ("garbage", "JSONDecodeError"), ("nochoices", "ValueError")])
def test_persistent_fault_raises_after_max_retries(fault, name):
    with FakeServer(fault) as srv:
        user = user_for(srv.url, max_retries=1)
        with pytest.raises(U.UserSimulatorError) as err:
            user.first_message()
    assert len(srv.requests) == 2 and user.usage["retries"] == 1   # 1 try + 1 retry, then stop
    assert name in str(err.value) and srv.url in str(err.value)


def test_retries_wait_the_clients_exponential_backoff():
    with FakeServer("500") as srv:
        user = user_for(srv.url, max_retries=2)
        t0 = time.time()
        with pytest.raises(U.UserSimulatorError):
            user.first_message()
        elapsed = time.time() - t0
    gaps = [b["t"] - a["t"] for a, b in zip(srv.requests, srv.requests[1:])]
    print(f"\n3 attempts in {elapsed:.2f} s, gaps {[round(g, 2) for g in gaps]}")
    assert 0.375 <= gaps[0] < 0.7 and 0.75 <= gaps[1] < 1.3   # 0.5 s, then 1 s, each less up to 25% jitter


def test_auth_error_is_not_retried():
    with FakeServer("401") as srv:
        user = user_for(srv.url, max_retries=3)
        with pytest.raises(U.UserSimulatorError, match="AuthenticationError"):
            user.first_message()
    assert len(srv.requests) == 1


# ---------------------------------------------------------------- a round's users asked together (run_episodes)

class AsksHowToHelp(rollout.TextAgent):
    def respond(self, task, messages):
        return "How can I help you?"


def llm_user_episodes(url, tasks, group_size=1, max_turns=1, user_workers=16, **settings):
    """run_episodes with an OpenAIUser per rollout; settings go to the users (timeout, max_retries, ...)."""
    import envs
    tok = rollout.load_tokenizer()
    make_user = envs.UserFactory("openai:sim-model", {"base_url": url, "api_key": "k", "timeout": 5.0,
                                                      "max_retries": 0, **settings})
    return rollout.run_episodes(AsksHowToHelp(tok), tok, tasks, group_size=group_size, user=make_user,
                                max_turns=max_turns, user_workers=user_workers, progress=False, max_context=8192)


def test_a_rounds_sixteen_replies_take_one_slow_reply_not_sixteen():
    from envs import ours
    with FakeServer(*(["ok"] * 16 + ["slow"])) as srv:    # 16 quick openings, then every reply takes 1 s
        trajs = llm_user_episodes(srv.url, ours.make_tasks("retail", "train", 4), group_size=4)
    elapsed = srv.last_answer - srv.requests[16]["t"]       # the round's first reply asked -> its last answered
    print(f"\n16 conversations, one round of 1-s replies: {elapsed:.2f} s, {srv.max_in_flight} requests at once")
    assert len(srv.requests) == 32 and srv.max_in_flight == 16
    assert 1.0 <= elapsed < 2.0                             # one after another: 16 s
    for t in trajs:
        assert [m["role"] for m in t.messages] == ["system", "user", "assistant", "user"] and t.stop_reason == "max_turns"


def test_the_pool_is_bounded_by_user_workers():
    from envs import ours
    with FakeServer("slow") as srv:
        trajs = llm_user_episodes(srv.url, ours.make_tasks("retail", "train", 4), group_size=2, user_workers=4)
    assert srv.max_in_flight == 4 and len(srv.requests) == 16 and all(t.stop_reason == "max_turns" for t in trajs)


def test_a_failing_user_ends_only_its_own_rollout_and_retries_stay_per_conversation():
    from envs import ours
    tasks = ours.make_tasks("retail", "train", 3)
    broken, flaky = tasks[0].instruction, tasks[1].instruction
    assert len({t.instruction for t in tasks}) == 3
    flaky_replies = []

    def route(body):                                        # by whose conversation the request is
        system = body["messages"][0]["content"]
        if len(body["messages"]) == 2:                      # an opening: [system prompt, the agent's greeting]
            return "ok"
        if broken in system:
            return "500"
        if flaky in system:
            flaky_replies.append(body)
            return "429" if len(flaky_replies) == 1 else "ok"
        return "ok"
    with FakeServer(route) as srv:
        a, b, c = llm_user_episodes(srv.url, tasks, max_turns=2, max_retries=2)
    print(f"\nbroken: {a.stop_reason} {a.stats['error'][:90]!r}")
    assert a.stop_reason == "error" and a.turns == 1
    assert "UserSimulatorError" in a.stats["error"] and "InternalServerError" in a.stats["error"]
    assert a.stats["user_usage"]["requests"] == 1 + 3        # its opening, then 1 try + 2 retries of its reply
    assert (b.stop_reason, b.turns, c.stop_reason, c.turns) == ("max_turns", 2, "max_turns", 2)
    assert b.stats["user_usage"]["retries"] == 1 and c.stats["user_usage"]["retries"] == 0
    assert [m["role"] for m in b.messages][-2:] == ["assistant", "user"]


# ---------------------------------------------------------------- LocalUser: a tiny random model

def tiny_random_llama(tok):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=4096)).eval()


def test_local_user_returns_text_and_never_sees_tools():
    tok = rollout.load_tokenizer()
    model = tiny_random_llama(tok)
    seen, generate = [], model.generate
    model.generate = lambda ids, **kw: seen.append(ids) or generate(ids, **kw)   # record the prompt
    user = L.LocalUser(TASK, model, tok, max_new_tokens=8)
    first, second = user.first_message(), user.reply(AGENT_VIEW)
    assert isinstance(first, str) and isinstance(second, str)
    prompt = tok.decode(seen[1][0])
    assert TASK.instruction in prompt and "Shall I cancel order #W1234?" in prompt
    for hidden in ("tool_call", "SECRET_DB_ROW", "find_user_id_by_email"):
        assert hidden not in prompt
    assert user.usage["prompt_tokens"] == seen[0].shape[1] + seen[1].shape[1]
    assert 0 < user.usage["completion_tokens"] <= 16


def test_local_user_plays_whole_episodes_in_run_episodes():
    """rl.py / eval.py --user local give the user its own model= and tokenizer= through the stage's one user factory
    (common.user_factory), which run_episodes calls for each conversation."""
    import common
    from envs import ours
    tok = rollout.load_tokenizer()
    task = ours.make_tasks("retail", "test", 1)[0]
    make_user = common.user_factory(types.SimpleNamespace(user="local", user_check="on", user_retries_on_check=2),
                                    tiny_random_llama(tok), tok)
    trajs = rollout.run_episodes(rollout.OracleAgent(tok), tok, [task], group_size=2, user=make_user, max_turns=2,
                                 progress=False, max_context=8192)
    assert all(t.stop_reason != "error" and t.turns >= 1 for t in trajs)
    assert all(t.stats["user_usage"]["completion_tokens"] > 0 for t in trajs)


# ---------------------------------------------------------------- end to end: a real llama.cpp server

@pytest.mark.slow
def test_openai_user_against_llama_cpp_server(llama_server):
    user = L.OpenAIUser(TASK, "smollm2", base_url=llama_server, api_key="none",
                        timeout=120.0, max_retries=1, max_tokens=48)
    first = user.first_message()
    messages = [{"role": "user", "content": first},
                {"role": "assistant", "content": "Sure. What is your email address?"}]
    second = user.reply(messages)
    print(f"\nfirst: {first!r}\nsecond: {second!r}\nusage: {user.usage}")
    assert first.strip() and second.strip()
    for said in (first, second):     # what reaches the agent is a user's plain text: no template, role or tool syntax
        assert not any(t in said for t in ("<|im_start|>", "<|im_end|>", "<tool_call>", "<think>")), said
        assert not said.lower().lstrip().startswith(("assistant:", "user:", "system:")), said
    assert first.strip() != L.AGENT_GREETING and U.STOP not in first     # the user opens; it does not echo or end
    assert second != first                                               # it answered the agent's new question
    assert user.usage["requests"] == 2 and user.usage["retries"] == 0
    assert user.usage["prompt_tokens"] > 100 and 0 < user.usage["completion_tokens"] <= 96
