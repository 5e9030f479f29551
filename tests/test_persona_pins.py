"""The named personas, word for word: every reply each of users.PERSONAS gives in a fixed set of conversations, pinned
in tests/data/persona_pins.json. The file was written before the personas became rows of behaviours (users.Behaviour),
from the classes they were, so every earlier result (the claims grid, attempts 1 and 2) still reproduces: a named
persona must say exactly what it said then, to the character.

Two kinds of conversation a task, for seeds 0 and 1, on every scenario of both domains (test split):
  gold   the gold agent (oracle.oracle_reply) against the persona, as tests/test_personas.py's gold_episode runs it
  probe  a fixed script of agent messages that walks the paths the gold agent avoids: a vague question, many facts
         at once, facts by other words, a confirmation that names nothing, the right one twice, a report, then
         small talk until the user gives up

Regenerate only when a persona is meant to change (say so in the commit): python tests/test_persona_pins.py --write
"""
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import envs  # noqa: E402
from envs import ours, oracle  # noqa: E402
import rollout  # noqa: E402
import users  # noqa: E402

PINS = os.path.join(ROOT, "tests", "data", "persona_pins.json")
NAMED = ("default", "terse", "chatty", "careless", "curious", "literal")   # the six as they stood when pinned
PER_SCENARIO = 2          # tasks of each scenario
SEEDS = (0, 1)


def pinned_tasks():
    """The first PER_SCENARIO test tasks of every scenario, in both domains."""
    tasks = []
    for domain in ours.DOMAINS:
        pool = ours.make_tasks(domain, "test", PER_SCENARIO * len(ours.SCENARIOS[domain]))
        tasks += [t for s in ours.SCENARIOS[domain] for t in [t for t in pool if t.scenario == s][:PER_SCENARIO]]
    return tasks


def gold_conversation(name, task, seed, cap=30):
    """The persona's messages against the gold agent (its tool calls answered by a fresh env), to a stop or cap."""
    env, user = ours.Env(task), envs.make_user(f"scripted:{name}", task, seed)
    messages, said = [{"role": "user", "content": user.first_message()}], []
    said.append(messages[0]["content"])
    for _ in range(cap):
        text = oracle.oracle_reply(task, messages)
        calls, _ = rollout.parse_tool_calls(text)
        messages.append({"role": "assistant", "content": text, "tool_calls": calls})
        if calls:
            messages.append({"role": "tool", "content": env.step(calls[0]["name"], calls[0]["arguments"])})
            continue
        said.append(user.reply(messages))
        messages.append({"role": "user", "content": said[-1]})
        if users.STOP in said[-1]:
            break
    return said


def probe_script(task):
    """Agent messages that reach what the gold agent never does (no, corrections, questions back, impatience)."""
    right = oracle.confirmation(task, task.gold_actions[-1]) if task.confirm_terms else "Is that everything?"
    return ["How can I help you today?",
            "Please give me your email address, user id, order id, reservation id, payment method and the reason.",
            "Which order is it, which booking, and which card should I charge?",
            "Please confirm: I will go ahead with the change now. Yes or no?",
            right, right,
            "Done: the change has been processed successfully.",
            "Is there anything else I can help with?"] + ["Let me check something, one moment."] * 6


def probe_conversation(name, task, seed):
    user = envs.make_user(f"scripted:{name}", task, seed)
    messages = [{"role": "user", "content": user.first_message()}]
    said = [messages[0]["content"]]
    for text in probe_script(task):
        messages.append({"role": "assistant", "content": text})
        said.append(user.reply(messages))
        messages.append({"role": "user", "content": said[-1]})
        if users.STOP in said[-1]:
            break
    return said


def conversations():
    """{persona: {"gold|task id|seed" or "probe|...": [the user's messages]}}"""
    out = {}
    for name in NAMED:
        out[name] = {}
        for task in pinned_tasks():
            for seed in SEEDS:
                out[name][f"gold|{task.id}|{seed}"] = gold_conversation(name, task, seed)
                out[name][f"probe|{task.id}|{seed}"] = probe_conversation(name, task, seed)
    return out


@pytest.fixture(scope="module")
def pins():
    with open(PINS) as f:
        return json.load(f)


@pytest.mark.parametrize("name", NAMED)
def test_each_named_persona_says_what_it_said_when_pinned(name, pins):
    now = {k: v for k, v in conversations()[name].items()}
    assert set(now) == set(pins[name])
    changed = [k for k in pins[name] if now[k] != pins[name][k]]
    assert not changed, (len(changed), changed[0], now[changed[0]], pins[name][changed[0]])


def test_the_pins_cover_every_path_a_persona_has(pins):
    """The pins are worth something only if they reach each persona's rules: a no with corrections, a question back,
    a mistyped digit and its correction, a bare no, a give-up, a stop after thanks."""
    said = {n: " ".join(m for conv in pins[n].values() for m in conv) for n in NAMED}
    assert "This is taking too long" in said["default"] and users.STOP in said["default"]
    assert "Sorry, I mistyped" in said["careless"]
    assert "Before I answer" in said["curious"] or "Wait, can that be undone" in said["curious"]
    assert "quick question first" in said["chatty"] or "Before that" in said["chatty"] or "One thing first" in said["chatty"]
    assert "No. That is not what I requested." in said["literal"] or "No. Please state the change exactly." in said["literal"]
    assert sum(len(c) for c in pins["default"].values()) > 500


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    os.makedirs(os.path.dirname(PINS), exist_ok=True)
    with open(PINS, "w") as f:
        json.dump(conversations(), f, indent=0, sort_keys=True)
    print("wrote", PINS)
