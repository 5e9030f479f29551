"""envs/llm_users.py: the users an LLM plays, the check on what they say, and what they cost; a battery beside
users.py, which holds the interface (users.User) and the scripted users. USER_KINDS (envs/__init__.py) names the
builders at the end of the "users an LLM plays" part; rollout.run_episodes knows nothing of this file.

  OpenAIUser    any OpenAI-compatible chat endpoint (GPT-4o as in the paper, vLLM, llama.cpp server)
  LocalUser     a Hugging Face model in this process (given the policy, its adapter switched off)
  CheckedUser   either of them on our domains, checked: each message against what the world knows (check_turn: a stop
                before the needed write, a fact the task does not hold, the agent's voice, nothing), asked again with
                a correction (ask_again), and given up with UserBroke, a UserSimulatorError, which the loop records
                as a left-out rollout like any failed simulator (docs/reference.md, "The LLM user")
  user_report, user_line, stop_if_many_left_out    what the users of a step or an evaluation did and cost
  check_episode the check run afterwards on a finished episode (tests, scripts/user_check.py)
They play the customer from task.instruction alone (no tools, policy or DB), in the agent's conversation with roles
flipped: its visible text as "user" turns, their own messages as "assistant" turns.
"""
import contextlib
import functools
import os
import re
import threading
from collections import Counter

from envs import ours
from users import PATIENCE, REFUSES, REPORTS_DONE, STOP, User, UserSimulatorError, asks_confirmation, visible_text


# ----------------------------------------------------------------------------- the users an LLM plays

USER_SIM_PROMPT = """You are playing a customer who writes to a customer-service agent. Stay in character.

Your instruction:
{instruction}

Rules:
- Write one short message at a time, the way a person types in a chat.
- Give only the information the agent needs for the current step; reveal the facts above only when asked.
- Never invent facts that are not in your instruction. If asked for something you do not know, say so.
- Say yes to an action only if it is exactly what your instruction wants.
- When your goal is reached (or cannot be reached), reply with ###STOP### and nothing else."""
AGENT_GREETING = "Hi! How can I help you today?"   # opens the simulator's chat, so it starts with a "user" turn


def user_sim_messages(task, messages: list[dict]) -> list[dict]:
    """The simulator's chat for `messages` (the agent's view): its system prompt, then roles flipped."""
    chat = [{"role": "system", "content": USER_SIM_PROMPT.format(instruction=task.instruction)},
            {"role": "user", "content": AGENT_GREETING}]
    for m in messages:
        if m["role"] == "user":
            role, text = "assistant", m["content"]
        elif m["role"] == "assistant":
            role, text = "user", visible_text(m.get("content"))
        else:
            continue   # system and tool turns: the simulator never sees them
        if not text:
            continue   # an agent turn that was only a tool call
        if chat[-1]["role"] == role:   # agent text, tool call, agent text: one turn for the simulator
            chat[-1] = {"role": role, "content": chat[-1]["content"] + "\n" + text}
        else:
            chat.append({"role": role, "content": text})
    return chat


class LLMUser(User):
    """A user simulator that writes each message with an LLM: _complete(the agent's view) -> text. usage: what it
    cost (prompt and completion tokens; an OpenAIUser's requests and retries too), kept in its trajectory's stats."""

    def __init__(self, task):
        super().__init__(task)
        self.usage = {"prompt_tokens": 0, "completion_tokens": 0}

    def record(self) -> dict:
        return {"user_usage": dict(self.usage)}

    def first_message(self) -> str:
        return self._complete([])

    def reply(self, messages: list[dict]) -> str:
        return self._complete(messages)

    def ask_again(self, messages: list[dict], said: str, reason: str, attempt: int) -> str:
        """The message again (attempt 1, 2, ...), after the check flagged `said` for `reason` (check_turn)."""
        return self._complete(messages, again=(said, reason, attempt))


_sending = threading.local()   # .usage: the counters of the user whose request this thread is sending


def _count_request(request):
    """The HTTP client's request hook: it runs for every request the openai client sends, each of its retries
    included, in the thread that asked; the client is shared, so the thread says whose request it is."""
    usage = getattr(_sending, "usage", None)
    if usage is not None:
        usage["requests"] += 1


@functools.lru_cache(maxsize=None)
def openai_client(base_url, api_key, timeout):
    """One client per server for all users of a run (a GRPO step makes 256 users): one pool of open
    connections instead of a new client, certificates and connections per conversation. The client does the
    retrying (as many times as each call's with_options(max_retries=) allows): 408, 409, 429, 5xx, timeouts and
    dropped or refused connections, waiting what the server's Retry-After says (up to 2 min) or else
    0.5 * 2**k s (at most 8 s) less up to 25% jitter. timeout: seconds for each HTTP request."""
    import openai
    http = openai.DefaultHttpx2Client(event_hooks={"request": [_count_request]})   # its default pool: 1000 connections
    return openai.OpenAI(base_url=base_url, api_key=api_key, timeout=timeout, http_client=http)


def chat_message(response):
    """The message of a chat completion -> it, or ValueError for a 200 whose body is not one (no choices, no
    message, neither text nor tool calls): what the openai client does not check."""
    choice = (getattr(response, "choices", None) or [None])[0]   # a body that is not JSON can come back as a str
    message = getattr(choice, "message", None)
    text = getattr(message, "content", None)
    if not (isinstance(text, str) and text.strip()) and not getattr(message, "tool_calls", None):
        raise ValueError(f"no message in the response: {str(response)[:100]!r}")
    return message


class OpenAIUser(LLMUser):
    """User simulator behind any OpenAI-compatible chat endpoint (GPT-4o as in the paper, vLLM, llama.cpp).
    base_url / api_key default to $OPENAI_BASE_URL / $OPENAI_API_KEY. A message may take max_retries + 1 requests:
    the openai client retries what the network and the server get wrong (openai_client), and this class asks again,
    at once and from the same budget, when a 200 carries no message (a body that is not JSON, not a chat
    completion, or empty). Other HTTP errors (401 bad key, 404 unknown model) fail at once. A message that fails
    raises UserSimulatorError. usage also counts requests (every HTTP request sent) and retries (those beyond the
    first of a message)."""
    concurrent = True      # it waits on the network; its client is thread-safe

    def __init__(self, task, model, *, base_url=None, api_key=None, timeout=60.0, max_retries=6,
                 temperature=0.0, max_tokens=256):
        super().__init__(task)   # max_retries 6: the client's waits add up to 18-24 s, a server restart ridden out
        self.model, self.max_retries = model, max_retries
        self.temperature, self.max_tokens = temperature, max_tokens
        self.client = openai_client(base_url or os.environ.get("OPENAI_BASE_URL"),
                                    api_key or os.environ.get("OPENAI_API_KEY") or "none",   # local servers ignore it
                                    timeout)
        self.usage.update(requests=0, retries=0)

    def _complete(self, messages: list[dict], again=None) -> str:
        chat, sampling = user_sim_messages(self.task, messages), {}
        if again:                  # asked again: the correction, and a seeded higher temperature (AGAIN_TEMPERATURE)
            chat, sampling = again_chat(chat, *again[:2]), dict(temperature=AGAIN_TEMPERATURE, seed=again[2])
        return (self._request(chat, **sampling).content or "").strip()

    def _request(self, chat: list[dict], tools: list[dict] | None = None, **sampling):
        """One chat completion -> its message (text, or tool calls when tools are given); sampling: instead of ours."""
        import openai
        first, no_message = self.usage["requests"], (ValueError, openai.APIResponseValidationError)
        while True:
            left = self.max_retries - (self.usage["requests"] - first)   # the client gets what the budget has left
            _sending.usage, error = self.usage, None
            try:
                r = self.client.with_options(max_retries=left).chat.completions.create(
                    model=self.model, messages=chat, max_tokens=self.max_tokens,
                    **{"temperature": self.temperature, **sampling, **({"tools": tools} if tools else {})})
                message = chat_message(r)
            except (ValueError, openai.APIError) as e:   # a 200 without a message (a body that is not JSON:
                error = e                                # JSONDecodeError), the client's retries spent, or a 401/404
            finally:
                _sending.usage = None
            sent = self.usage["requests"] - first
            if not (isinstance(error, no_message) and sent <= self.max_retries):   # only a 200 without one: again
                break
        self.usage["retries"] += max(sent - 1, 0)
        if error is not None:
            raise UserSimulatorError(
                f"user simulator {self.model!r} at {self.client.base_url} failed after {sent} attempt(s): "
                f"{type(error).__name__}: {str(error)[:200].rstrip('.')}. Check that the server is up and serves "
                f"this model (OPENAI_BASE_URL, OPENAI_API_KEY), or use --user scripted.")
        self.usage["prompt_tokens"] += getattr(r.usage, "prompt_tokens", 0) or 0
        self.usage["completion_tokens"] += getattr(r.usage, "completion_tokens", 0) or 0
        return message


class LocalUser(LLMUser):
    """User simulator played by a Hugging Face causal LM in this process (greedy, short replies).
    Given the policy itself (a peft model), the base model plays the user: the LoRA adapter is switched off."""

    def __init__(self, task, model, tokenizer, max_new_tokens=64):
        super().__init__(task)
        self.model, self.tokenizer, self.max_new_tokens = model, tokenizer, max_new_tokens

    def _complete(self, messages: list[dict], again=None) -> str:
        """Greedy; asked again, with the correction only (sampling would draw from torch's RNG, the policy's)."""
        import torch
        tok, chat = self.tokenizer, user_sim_messages(self.task, messages)
        text = tok.apply_chat_template(again_chat(chat, *again[:2]) if again else chat, add_generation_prompt=True,
                                       tokenize=False)
        ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]], device=self.model.device)  # (1, T)
        with torch.no_grad(), getattr(self.model, "disable_adapter", contextlib.nullcontext)():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=self.max_new_tokens, pad_token_id=tok.eos_token_id)
        self.usage["prompt_tokens"] += ids.shape[1]
        self.usage["completion_tokens"] += out.shape[1] - ids.shape[1]
        return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


def checked(user, env, check_retries):
    """user, checked on each message (CheckedUser) when check_retries is set (--user-check on)."""
    return user if check_retries is None else CheckedUser(user, env, check_retries)


def openai_user(task, seed: int, arg: str, *, env=None, check_retries=None, **kw):
    """USER_KINDS' openai:MODEL: an OpenAIUser of the server's model `arg`; kw: its settings (base_url, timeout)."""
    return checked(OpenAIUser(task, arg, **kw), env, check_retries)


def local_user(task, seed: int, arg: str, *, env=None, check_retries=None, **kw):
    """USER_KINDS' local: a LocalUser of the model and tokenizer in kw (the policy's, its adapter off)."""
    return checked(LocalUser(task, **kw), env, check_retries)


# ----------------------------------------------------------------------------- the check on each message

CORRECTIONS = {   # the check's reasons, each with the line a re-ask adds to the simulator's chat (again_chat)
    "empty": "Your message was empty: write the customer's next message.",
    "agent_voice": "You are the customer, not the agent: write only the customer's next message, in plain words.",
    "early_stop": "Your request is not done yet, so do not write ###STOP###: answer the agent's last message.",
    "wrong_fact": "Use only the facts in your instruction, exactly as written; never make up an id, email or number.",
}
AGAIN_TEMPERATURE = 0.7   # a re-ask's temperature (seeded by its attempt): at the user's own 0 it would say the same
_SYNTAX = re.compile(r"<\|[^|>]*\|>|</?(tool_call|tool_response|tools|think)>|\[/?INST]|\"arguments\"\s*:|"
                     r"^\W*(system|assistant|user|agent|customer|human|ai|bot)\s*:", re.I | re.M)
_AGENT_SAYS = re.compile("|".join((   # the agent's words: help offered, leave asked, its role, "your" facts, acts
    r"\bhow (can|may) i (help|assist)", r"\bwhat can i do for you", r"\b(happy|glad) to (help|assist)\b",
    r"\banything else (i|we) can\b", r"\b(would you like|do you want) me to\b", r"\bshall i\b", r"\bas an ai\b",
    r"\b(i('m| am) (\w+,? ){0,2}(a|an|your)|as (a|an|your|the)) (\w+[- ]){0,3}(agent|representative|assistant)\b",
    r"\blanguage model\b",
    r"\byour (email|user id|order (id|number)|reservation (id|number)|zip|payment method|date of birth)\b",
    r"\bi('ve| have) (successfully )?(cancell?ed|updated|changed|processed|booked|added|modified) (your|the)\b")), re.I)
_VALUE = re.compile(r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+|\$ ?\d[\d,]*(?:\.\d+)?|\b\d+\.\d\d\b|[#\w-]*\d[#\w-]*")


def again_chat(chat: list[dict], said: str, reason: str) -> list[dict]:
    """The simulator's chat to ask again: the message it wrote, then the correction for its reason as a system line."""
    return chat + [{"role": "assistant", "content": said or "(nothing)"},
                   {"role": "system", "content": CORRECTIONS[reason]}]


def stated_values(text: str) -> set[str]:
    """The values a message states: emails; amounts ("$1,054.2" -> "1054.20"); codes of 5 or more letters, digits, _
    and - with a digit among them (ids, zips, dates; lowercase, no #), not a number-word compound ("30-day")."""
    out = set()
    for v in _VALUE.findall(text):
        if "@" in v:
            out.add(v.lower())
        elif v[0] == "$" or re.fullmatch(r"\d+\.\d\d", v):
            out.add(f"{float(v.strip('$ ').replace(',', '')):.2f}")
        elif len(v := v.strip("#_-").lower()) >= 5 and not re.fullmatch(r"\d+(-[a-z]+)+", v):
            out.add(v)
    return out


def check_turn(task, env, messages: list[dict], said: str) -> str:
    """The check on one message `said` of an LLM user of our domains -> "" when it passes, else the first reason of
    CORRECTIONS that flags it. messages: the agent's view before it (the user's opening first; [] for the opening);
    env: the rollout's, with the writes made so far."""
    agent, own = ([visible_text(m["content"]) for m in messages if m["role"] == r] for r in ("assistant", "user"))
    last, text = (agent or [""])[-1], said.replace(STOP, " ")
    words = lambda x: " ".join(re.findall(r"\w+", x.lower()))                   # noqa: E731
    if STOP not in said and not re.search(r"[^\W_]", said):          # no letter or digit, and no stop
        return "empty"
    # template, role or tool-call syntax; the agent's words; its last message said back (4+ words the user had not said)
    echo = len(words(text).split()) >= 4 and words(text) == words(last) not in words(" ".join(own + [task.instruction]))
    if _SYNTAX.search(said) or _AGENT_SAYS.search(text) or echo:
        return "agent_voice"
    # a stop while a write has not happened nor been reported done, or an answer is owed, unless the agent refused or
    # the user has replied PATIENCE times (then it may give up, as the scripted user does)
    reported = REPORTS_DONE.search(last) and not asks_confirmation(last)
    owed = len(env.writes) < len(task.confirm_terms) and not reported or \
        any(o.lower() not in " ".join(agent).lower() for o in task.required_outputs)
    if STOP in said and owed and not REFUSES.search(last) and len(own) <= PATIENCE:
        return "early_stop"
    # a value the brief and the agent's words do not hold, not even as part of one ("3198000" of "#W3198000") or one
    # digit off (a person's typo, as the careless persona makes it)
    held = stated_values(" ".join([task.instruction, *map(str, task.hidden_facts.values()), *agent]))
    typo = lambda v, h: len(v) == len(h) and [a.isdigit() and b.isdigit() for a, b in zip(v, h) if a != b] == [True]
    return "wrong_fact" if any(not any(v in h or typo(v, h) for h in held) for v in stated_values(text)) else ""


class UserBroke(UserSimulatorError):
    """A message the check still flagged after its user's re-asks: the rollout is left out as the user's."""
    failed = "user_broke"

    def __init__(self, said: str, reason: str, tries: int):
        super().__init__(f"the user broke the check ({reason}) {tries} time(s) in a row; its last try: {said[:120]!r}")
        self.reason = reason


class CheckedUser(User):
    """A user whose every message passes the check (check_turn) before the agent reads it. A flagged message is asked
    again (ask_again: the message and its reason's correction) up to `retries` times; still flagged, the user broke
    (UserBroke). env: the rollout's, with the writes made so far. checks: each flagged message's tries, kept in the
    trajectory's stats (record) for the viewer, the report and scripts/user_check.py:
    {"at": its index in the trajectory's messages, "flagged": [{"said", "reason"}, ...], "broke": reason if it did}."""

    def __init__(self, user, env, retries: int):
        super().__init__(user.task)
        self.user, self.env, self.retries, self.checks = user, env, retries, []
        self.concurrent = user.concurrent

    def first_message(self) -> str:
        return self._checked([], self.user.first_message())

    def reply(self, messages: list[dict]) -> str:
        return self._checked(messages, self.user.reply(messages))

    def _checked(self, messages: list[dict], said: str) -> str:
        tries = []
        while reason := check_turn(self.task, self.env, messages, said):
            if not tries:                                # its index in the trajectory: the view lacks the system's
                self.checks.append({"at": len(messages) + 1, "flagged": tries})
            tries.append({"said": said, "reason": reason})
            if len(tries) > self.retries:                # out of re-asks: the user broke
                self.checks[-1]["broke"] = reason
                raise UserBroke(said, reason, len(tries))
            said = self.user.ask_again(messages, said, reason, len(tries))
        return said

    def record(self) -> dict:
        flags = Counter(f["reason"] for c in self.checks for f in c["flagged"])
        broke = [c["broke"] for c in self.checks if "broke" in c]
        return self.user.record() | {"user_flags": dict(flags), "user_asked_again": flags.total() - len(broke),
                                     "user_checks": self.checks} | ({"user_broke": broke[0]} if broke else {})


def check_episode(task, traj) -> list[tuple[int, str]]:
    """The check run afterwards on each user message of a finished episode of ours, as a CheckedUser runs it: the
    agent's tool calls replayed on a fresh env up to each message. -> [(message index, reason)] of the messages it
    flags (tests: no scripted persona trips it; scripts/user_check.py: the run without the check)."""
    env, flags = ours.make_env(task), []
    for i, m in enumerate(traj.messages[1:], start=1):
        if m["role"] == "assistant" and m.get("tool_calls"):          # the executed call: the first (agent_turn)
            env.step(m["tool_calls"][0]["name"], m["tool_calls"][0]["arguments"])
        elif m["role"] == "user" and (reason := check_turn(task, env, traj.messages[1:i], m["content"])):
            flags.append((i, reason))
    return flags


# ----------------------------------------------------------------------------- what the users did and cost

def user_report(trajs, wall_s=None, price=(0.0, 0.0)) -> dict:
    """What the simulated users of these rollouts cost and where the check stepped in: a step's numbers (rl.py's
    metrics.jsonl and log line, the tracker) and an evaluation's (eval.py's results). requests: every HTTP request
    sent; retries: the client's; asked_again: the check's re-asks; prompt and completion tokens; dollars at price
    (USD per million prompt and completion tokens, --user-price); seconds waited on users (each rollout holds its
    share of each round's wait, so they add up to wall time) and their share of wall_s; flags: the check's, per
    reason; left_out: the rollouts left out, per reason (a check reason: the user broke it; user_failed: its
    simulator failed). {} when no LLM user played any of them: a scripted user costs nothing and is never checked."""
    if not any("user_usage" in t.stats or t.failed for t in trajs):
        return {}
    usage, flags = Counter(), Counter()
    for t in trajs:
        usage.update(t.stats.get("user_usage", {}))
        flags.update(t.stats.get("user_flags", {}))
    wait = sum(t.stats.get("user_wait_s", 0.0) for t in trajs)
    return dict(user_requests=usage["requests"], user_retries=usage["retries"],
                user_asked_again=sum(t.stats.get("user_asked_again", 0) for t in trajs),
                user_prompt_tokens=usage["prompt_tokens"], user_completion_tokens=usage["completion_tokens"],
                user_dollars=(usage["prompt_tokens"] * price[0] + usage["completion_tokens"] * price[1]) / 1e6,
                user_wait_s=wait, user_wait_share=wait / wall_s if wall_s else None, user_flags=dict(flags),
                left_out=dict(Counter(t.stats.get("user_broke") or f"{t.failed}_failed" for t in trajs if t.failed)))


def user_line(r: dict) -> str:
    """A user_report in one line, for a step's or an evaluation's log."""
    counts = lambda d: ", ".join(f"{k} {v}" for k, v in sorted(d.items())) or "none"   # noqa: E731
    share = "" if r["user_wait_share"] is None else f" ({r['user_wait_share']:.0%})"
    return (f"users {r['user_requests']} req ({r['user_retries']} retried, {r['user_asked_again']} asked again), "
            f"{r['user_prompt_tokens'] / 1e3:.1f}k+{r['user_completion_tokens'] / 1e3:.1f}k tok, "
            f"${r['user_dollars']:.2f}, waited {r['user_wait_s']:.0f} s{share} | flagged {counts(r['user_flags'])} | "
            f"left out {counts(r['left_out'])}")


def stop_if_many_left_out(trajs, limit: float, where: str):
    """Stop with one line when more than `limit` (--max-sim-failures) of trajs were left out: their user simulator
    failed or broke the check. So many 0s would be the infrastructure's, not the agent's."""
    left = [t for t in trajs if t.failed]
    if len(left) > limit * len(trajs):
        raise SystemExit(f"{where}: {len(left)} of {len(trajs)} rollouts left out (their user simulator failed or "
                         f"broke the check), more than --max-sim-failures {limit}: "
                         f"{left[0].stats.get('error')}")
