"""envs/oracle.py: the gold agent of our domains (retail, airline): the task's gold actions replayed as a
conversation, in one fixed style: ask for what is missing, look up, ask to confirm naming every value, act on a
yes, report. sft.py's cold-start data is its conversations (kept at reward 1); tests use it as the agent that
solves every task. envs/__init__.py names it as our world's oracle_reply, beside τ²'s and ACEBench's own.
"""
import json
import re

from envs import ours
import users

# How the oracle asks for each fact; every phrase holds a word of users.FACT_KEYWORDS[key], which is
# what the scripted user listens for before it reveals that fact.
QUESTIONS = {"email": "your email address", "name": "your full name", "zip": "your zip code",
             "user_id": "your user id", "order_id": "the order id", "reservation_id": "the reservation id",
             "address": "the new address", "payment_method": "the payment method to use",
             "item": "which item it is", "option": "which option you want (size, color)",
             "reason": "the reason", "flight": "which flight you prefer", "insurance": "whether you want insurance",
             "bags": "how many checked bags you need", "passenger": "the passenger names and dates of birth"}
IDENTITY_ALTERNATIVES = {"name", "zip"}      # retail: name + zip would also identify; the oracle uses email


def _flat(value) -> list[str]:
    """All leaf values of tool-call arguments, as lowercase strings."""
    if isinstance(value, dict):
        return [s for v in value.values() for s in _flat(v)]
    if isinstance(value, list):
        return [s for v in value for s in _flat(v)]
    return [str(value).lower()]


def _uses(fact: str, action) -> bool:
    """Does this call need this fact? (the fact's value and an argument contain one another)"""
    v = str(fact).lower()
    return any(a == v or (len(a) >= 4 and a in v) or (len(v) >= 4 and v in a) for a in _flat(action.arguments))


def describe(action, task) -> str:
    """'cancel pending order (order id #W1234567, reason no longer needed)': names every argument, so a
    confirmation request states ids, new values and the payment method, as the policies ask. A new bag
    total shows its sum ("total baggages 1 + 2 = 3"): the current count is in the reservation the
    agent looked up, the added count in the user's request."""
    def show(k, v):
        if isinstance(v, bool):
            return "yes" if v else "no"
        if isinstance(v, dict):
            return " ".join(show(k, x) for x in v.values())
        if isinstance(v, list):
            return ", ".join(show(k, x) for x in v)
        more = re.fullmatch(r"(\d+) more", task.hidden_facts.get("bags", ""))
        return f"{v - int(more[1])} + {more[1]} = {v}" if k == "total_baggages" and more else str(v)
    args = "; ".join(f"{k.replace('_', ' ')} {show(k, v)}" for k, v in action.arguments.items())
    return f"{action.name.replace('_', ' ')} ({args})"


def _heard(value: str, heard: str) -> bool:
    """Did the user say this fact? Its value, or for a cancel reason the user's own words for it."""
    return str(value).lower() in heard or ours.REASONS.get(value, "\0").lower() in heard


def plan(task, action) -> str:
    """A write said in words, every argument named. A bag update first says the request back in the user's
    words ("add 2 more checked bags to reservation ..."): the 135M student did not fetch the number from the
    opening, two tool results back, for the sum "0 + 2 = 2", but it copies the number after the same words it
    followed there, and the sum can then use it."""
    more = re.fullmatch(r"(\d+) more", task.hidden_facts.get("bags", ""))
    if action.name == "update_reservation_baggages" and more:
        k, rid = int(more[1]), action.arguments["reservation_id"]
        return f"add {k} more checked bag{'s' * (k > 1)} to reservation {rid}, {describe(action, task)}"
    return describe(action, task)


def confirmation(task, action) -> str:
    """'Please confirm: <the write's plan>. Yes or no?'"""
    return f"Please confirm: {plan(task, action)}. Yes or no?"


def withheld(task, heard: str) -> list[str]:
    """The hidden facts the task needs that `heard` (what the user said, lowercase) does not give: what an agent
    has to ask for. Needed: a gold call uses it, or the task writes (a careful agent asks about insurance or
    bags before it books); never name and zip, since the email identifies a retail user."""
    writes = any(a.name in ours.WRITE_TOOLS[task.domain] for a in task.gold_actions)
    return [k for k, v in task.hidden_facts.items() if k not in IDENTITY_ALTERNATIVES and not _heard(v, heard)
            and (writes or any(_uses(v, a) for a in task.gold_actions))]


def alone(task, messages: list[dict]) -> bool:
    """Is nobody there to answer? users.NoUser (--user none) opens with the task's whole instruction and every
    fact, and the first text the agent sends ends the episode."""
    return next((m["content"] for m in messages if m["role"] == "user"), "").startswith(task.instruction)


def oracle_reply(task, messages: list[dict]) -> str:
    """The gold agent's next message. Follows task.gold_actions in one short, fixed style (a 135M student
    copies a consistent teacher more easily than a varied one). Stateless: where it is in the plan is read
    off the conversation (how many tool calls it has made, which facts it has heard, whether
    the user just said yes to its confirmation request). Plan: ask for the facts the next steps need (all in
    one message; again for any that the answer left out or got wrong), look up (a turn that is only the tool
    call), ask to confirm each write naming every argument (again after any reply but a yes: a question back,
    a no), make the call after a yes, then report what was done (or refuse, saying why). With no user
    (alone) it asks nothing and confirms nothing: it looks up, says each write's plan in the turn that makes
    it (the words its confirmation would use, so both cold starts write the same numbers before a write), and
    its report ends the episode."""
    writes, solo = ours.WRITE_TOOLS[task.domain], alone(task, messages)
    agent = [m for m in messages if m["role"] == "assistant"]
    heard = " ".join(m["content"] for m in messages if m["role"] == "user").lower()
    n_calls = sum(bool(m.get("tool_calls")) for m in agent)
    writes_done = sum(m["tool_calls"][0]["name"] in writes for m in agent if m.get("tool_calls"))
    if n_calls < len(task.gold_actions):
        action = task.gold_actions[n_calls]
        # 1. facts the steps up to the next write need, and (before the first write) facts no call
        #    uses but a careful agent asks anyway (insurance, bags, which item): ask them together
        upcoming = []
        for a in task.gold_actions[n_calls:]:
            upcoming.append(a)
            if a.name in writes:
                break
        first_write = upcoming[-1].name in writes and writes_done == 0
        #    A fact it asked for that no answer gave (a user who gives one fact a reply, or mistyped it) is asked
        #    again, as a careful agent would, rather than guessed: the oracle knows the gold values, an agent not.
        facts = task.hidden_facts
        missing = [k for k in withheld(task, heard)
                   if any(_uses(facts[k], a) for a in upcoming)
                   or (first_write and not any(_uses(facts[k], a) for a in task.gold_actions))]
        if missing and not solo:
            q = [QUESTIONS.get(k, f"your {users.FACT_KEYWORDS[k][0]}") for k in missing]
            return f"Please give me {', '.join(q[:-1]) + ' and ' * (len(q) > 1) + q[-1]}."
        call = "<tool_call>\n" + json.dumps({"name": action.name, "arguments": action.arguments}) + "\n</tool_call>"
        if action.name not in writes:
            return call
        if solo:                            # no one to confirm with: the plan in words, then the call, one turn
            return f"I will {plan(task, action)}.\n{call}"
        # 2. a write: ask to confirm (naming every argument, so every confirm term); act after a yes
        confirm = confirmation(task, action)
        if agent and agent[-1]["content"] == confirm and _is_yes(messages[-1]["content"]):
            return call
        return confirm
    # 3. every gold call made: report what was done, or refuse and say why
    if messages[-1]["role"] == "user":
        return "Is there anything else I can help with?"
    return report(task)


def report(task) -> str:
    facts, out = task.hidden_facts, task.required_outputs
    if task.scenario == "refuse_cancel_delivered":
        return (f"Sorry, I can't cancel order {facts['order_id']}: it is already {out[0]}, "
                "and only pending orders can be cancelled.")
    if task.scenario == "refuse_cancel_uninsured":
        return (f"Sorry, I can't cancel reservation {facts['reservation_id']}: it is in economy without travel "
                f"{out[0]}, and only insured or business-cabin reservations can be cancelled.")
    if task.scenario == "order_status_total":
        return f"Order {facts['order_id']} is {out[0]} and its total is ${out[1]}."
    done = [describe(a, task) for a in task.gold_actions if a.name in ours.WRITE_TOOLS[task.domain]]
    return f"Done: {'; '.join(done)}." + (" " + ", ".join(out) + "." if out else "")


def _is_yes(text: str) -> bool:
    """Did the user approve? Its words for yes, the curt ones too ("Yep.", "Do it."), and not a reply opening with no."""
    t = text.lower()
    return any(w in t for w in ("yes", "correct", "go ahead", "proceed", "sure", "yep", "yeah", "do it")) \
        and not t.startswith("no")
