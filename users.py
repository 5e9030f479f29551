"""users.py: the simulated users the agent talks to, the world side of the loop (as envs/ours.py is).

A user gets its task (instruction, opening, hidden facts) and the agent's visible text, never the tools,
the policy or the DB. One interface, User.first_message() / User.reply(messages), four implementations:
  ScriptedUser  rule-based and seeded, the CPU default (a 135M model cannot play a user); its personas
                (--user scripted:NAME, PERSONAS) speak and reveal differently, and no training uses them
  OpenAIUser    any OpenAI-compatible chat endpoint (GPT-4o as in the paper, vLLM, llama.cpp server)
  LocalUser     a Hugging Face model in this process (given the policy, its adapter switched off)
  NoUser        ablation: the whole instruction up front, no user turns
rollout.run_episodes asks them for replies (ask_users: many LLM users at once); imports nothing of ours.
"""
import contextlib
import functools
import os
import random
import re
import threading
from concurrent.futures import ThreadPoolExecutor

# fact key -> lowercase words an agent would use to ask for it (the scripted user matches these)
FACT_KEYWORDS = {
    "email": ("email",), "name": ("name",), "zip": ("zip", "postal"), "address": ("address",),
    "user_id": ("user id", "user_id", "account id", "member id", "customer id"),
    "order_id": ("order id", "order number", "which order", "order_id"),
    "reservation_id": ("reservation id", "reservation number", "which reservation", "reservation_id", "booking"),
    "payment_method": ("payment", "pay", "card", "refund to", "charge"),
    "item": ("which item", "which product", "item"), "option": ("size", "color", "option", "variant"),
    "flight": ("which flight", "flight number", "time", "prefer"), "reason": ("reason", "why"),
    "insurance": ("insurance",), "bags": ("bag", "luggage"), "passenger": ("passenger", "date of birth"),
}

STOP = "###STOP###"


class User:
    """A user sees its task (instruction, facts) and the conversation, never the tools or the DB.
    reply() gets the agent's view of the conversation without the system message; a reply holding
    ###STOP### ends the episode. ends_on_text: the episode ends at the agent's first text-only turn."""
    ends_on_text = False
    concurrent = False     # may reply from several threads at once (run_episodes then asks a round's users together)

    def __init__(self, task):
        self.task, self.usage = task, {"prompt_tokens": 0, "completion_tokens": 0}

    def first_message(self) -> str: raise NotImplementedError               # noqa: E704
    def reply(self, messages: list[dict]) -> str: raise NotImplementedError  # noqa: E301, E704


_ASKS_CONFIRM = re.compile(r"\b(confirm|proceed|shall i|should i|go ahead|yes or no|is that correct|"
                           r"is this correct|do you want|would you like me|ok to|okay to)\b", re.I)
_REFUSES = re.compile(r"\b(cannot|can't|can not|unable|not able|not possible|not allowed|not eligible|"
                      r"against (our|the) policy)\b", re.I)
_REPORTS_DONE = re.compile(r"\b(done|complete|completed|all set|has been|have been|successfully|cancelled|canceled|"
                           r"updated|added|changed|booked|processed|submitted)\b", re.I)


def asks_confirmation(text: str) -> bool:
    """Does this agent message ask the user to confirm or approve something? (what the scripted user reads
    as a confirmation request; eval.py counts writes made after one)"""
    return bool(_ASKS_CONFIRM.search(text))


def asked_for(key: str, text: str) -> bool:
    """Does this (lowercase) agent text ask for fact `key`? It uses a word of FACT_KEYWORDS[key], the scripted
    user's own test before it reveals that fact (eval.py counts the facts asked for with it)."""
    return any(re.search(r"\b" + re.escape(w), text) for w in FACT_KEYWORDS[key])


def names(text: str, term) -> bool:
    """Does text name term (a value, or a list of alternatives), as a whole word? ("3" is not in "13")"""
    alts = term if isinstance(term, list) else [term]
    return any(re.search(r"(?<![\w.])" + re.escape(str(a).lower()) + r"(?!\w)", text.lower()) for a in alts)


class ScriptedUser(User):
    """Deterministic (given seed) rule-based user, the CPU default. Opens with task.opening; reveals
    hidden_facts[key] only when the agent's last message uses a word of FACT_KEYWORDS[key].
    Asked to confirm a change, it says yes only if the message names every value that makes the next
    write right (task.confirm_terms: the ids, and the reason, bag count, flight, item, option or payment
    method that apply) and none of the values that would make it wrong (task.rivals: a second reason,
    another card); otherwise it says no and corrects the values that were missing, wrong or ambiguous.
    Once every write is confirmed it waits until the agent reports the change done (nudging it to go
    ahead), then thanks and stops. Tasks without writes: it stops once every required output was said
    or the agent refused. patience: at most this many replies, then it gives up."""

    GREET = ("", "Hi! ", "Hello. ", "Hey there, ", "Good morning. ")
    YES = ("Yes, please go ahead.", "Yes, that's right, please proceed.", "Correct, go ahead.", "Yes.")
    NO = ("No, that's not right.", "No, that's not what I want.", "No, please don't do that.")
    THANKS = ("Great, thank you, that's all.", "Perfect, thanks for your help!", "Thanks, that's everything.")
    NUDGE = ("Can you help me with that?", "What do you need from me?", "Could you take care of it?")
    WAIT = ("Okay, please go ahead and make the change.", "Please do it now.", "Go ahead, please.")

    def __init__(self, task, seed: int = 0, patience: int = 10):
        super().__init__(task)
        self.rng, self.patience, self.replies = random.Random(seed), patience, 0
        self.confirmed, self.opening = [False] * len(task.confirm_terms), task.opening

    def first_message(self) -> str:
        greet = self.rng.choice(self.GREET)                # openings that already greet get no second hello
        return self.opening if re.match(r"(hi|hello|hey)\b", self.opening, re.I) else greet + self.opening

    def _fact(self, key: str) -> str:
        return f"My {key.replace('_', ' ')} is {self.task.hidden_facts[key]}."

    def _answer(self, asked: list[str]) -> list[str]:
        """The facts it reveals when asked for these (all of them, in FACT_KEYWORDS' order)."""
        return [self._fact(k) for k in asked]

    def _confirm(self, text: str) -> list[str]:
        """Answer a confirmation request: yes to the first unconfirmed write whose values it all names,
        else no and the right values of the write it got closest to."""
        pending = [i for i, ok in enumerate(self.confirmed) if not ok]
        rivals = self.task.rivals                       # a value named beside a rival of its kind is not named
        named = {i: [k for k, term in self.task.confirm_terms[i].items()
                     if names(text, term) and not names(text, rivals.get(k, []))] for i in pending}
        done = next((i for i in pending if len(named[i]) == len(self.task.confirm_terms[i])), None)
        if done is not None:
            self.confirmed[done] = True
            return [self.rng.choice(self.YES)]
        closest = max(pending, key=lambda i: len(named[i]))
        wrong = [k for k in self.task.confirm_terms[closest] if k not in named[closest]]
        fixes = [self._fact(k) for k in wrong if k in self.task.hidden_facts]
        return [self.rng.choice(self.NO)] + fixes + [self.opening] * (len(fixes) < len(wrong))

    def reply(self, messages: list[dict]) -> str:
        self.replies += 1
        said = [visible_text(m["content"]) for m in messages if m["role"] == "assistant"]
        low = (last := said[-1] if said else "").lower()
        if self.replies > self.patience:
            return f"This is taking too long, I'll try again later. {STOP}"
        if self.confirmed and all(self.confirmed):      # every write approved: wait for the report
            if _REPORTS_DONE.search(last) and not asks_confirmation(last):
                return f"{self.rng.choice(self.THANKS)} {STOP}"
            return self.rng.choice(self.WAIT)
        asked = [k for k in FACT_KEYWORDS if k in self.task.hidden_facts and asked_for(k, low)]
        if not self.task.confirm_terms and not asked:    # lookup / refusal tasks
            outs = self.task.required_outputs
            if outs and all(any(o in x for x in said) for o in outs) or _REFUSES.search(last):
                return f"{self.rng.choice(self.THANKS)} {STOP}"
        if asks_confirmation(last) and self.task.confirm_terms:   # answers the request, nothing more
            return " ".join(self._confirm(last))
        facts = self._answer(asked)
        return " ".join(facts or [self.rng.choice(self.NUDGE)] + [self.opening] * (self.rng.random() < 0.5))


class CuriousUser(ScriptedUser):
    """Persona "curious" (--user scripted:curious), for evaluation only: does an agent trained with ScriptedUser
    overfit it? Other words for everything; an opening that names the request but none of the ids an easy task's
    opening gives (so the agent has to ask); asked for several facts, it gives one, the last asked; and it answers
    the first request to confirm with a question of its own, deciding only when asked again. The confirmation
    rule (every value of the write named, no rival) is ScriptedUser's."""

    GREET = ("", "Hello! ", "Hi there. ", "Evening. ")
    YES = ("Sure, do it.", "Yep, that's what I want, go ahead.", "That is correct.", "Sure.")
    NO = ("Nope, that's wrong.", "No, not like that.", "Nope, please don't.")
    THANKS = ("Lovely, thanks a lot, bye!", "Got it, thanks, that's all I needed.", "Cheers, all good now.")
    NUDGE = ("So, can you sort it out?", "What happens next?", "Anything you need from me?")
    WAIT = ("Alright, please make the change now.", "Okay, I'm waiting for it to be done.", "Please carry on.")
    BACK = ("Before I answer: will this cost me anything extra?", "Wait, can that be undone later if I change my mind?",
            "Hmm, how long will that take to go through?")
    REQUESTS = {"cancel_order": "Could you cancel one of my orders for me?",     # openings without their ids
                "add_bags": "I need extra checked luggage on one of my bookings."}

    def __init__(self, task, seed: int = 0, patience: int = 10):
        super().__init__(task, seed, patience)
        self.opening, self.asked_back = self.REQUESTS.get(task.scenario, task.opening), False

    def _fact(self, key: str) -> str:
        return f"The {key.replace('_', ' ')}: {self.task.hidden_facts[key]}."

    def _answer(self, asked: list[str]) -> list[str]:
        return [self._fact(asked[-1])] if asked else []

    def reply(self, messages: list[dict]) -> str:
        said = [visible_text(m["content"]) for m in messages if m["role"] == "assistant"]
        if not self.asked_back and said and asks_confirmation(said[-1]) and not all(self.confirmed):
            self.asked_back, self.replies = True, self.replies + 1
            return self.rng.choice(self.BACK)
        return super().reply(messages)


PERSONAS = {"curious": CuriousUser}      # --user scripted:NAME; plain "scripted" is ScriptedUser


class NoUser(User):
    """Ablation "none": the whole instruction and every fact up front, no user turns after that."""
    ends_on_text = True

    def first_message(self) -> str:
        facts = "; ".join(f"{k.replace('_', ' ')}: {v}" for k, v in self.task.hidden_facts.items())
        return f"{self.task.instruction}\nEverything you may need: {facts}" if facts else self.task.instruction

    def reply(self, messages: list[dict]) -> str:
        return STOP


# ---- LLM users: OpenAIUser, LocalUser. Both play the customer from task.instruction alone, never
# seeing the tools, the policy or the DB.
# Their chat is the agent's conversation with roles flipped: the agent's visible text (tool-call
# tags and tool turns removed) becomes "user" turns, the simulator's own messages "assistant" turns.

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


def without_think(text: str) -> str:
    """An agent message without its <think>...</think> reasoning (closed or not): what it says and calls."""
    return re.sub(r"<think>.*?(</think>|\Z)", "", text or "", flags=re.S)


def visible_text(text: str) -> str:
    """What a user sees of an agent message: the text without reasoning and <tool_call>...</tool_call> (closed or not)."""
    return re.sub(r"<tool_call>.*?(</tool_call>|\Z)", "", without_think(text), flags=re.S).strip()


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


class UserSimulatorError(RuntimeError):
    """The LLM user simulator gave no usable reply, even after retries."""


class LLMUser(User):
    """A user simulator that writes each message with an LLM: _complete(the agent's view) -> text."""

    def first_message(self) -> str:
        return self._complete([])

    def reply(self, messages: list[dict]) -> str:
        return self._complete(messages)


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

    def __init__(self, task, model, base_url=None, api_key=None, timeout=60.0, max_retries=6,
                 temperature=0.0, max_tokens=256):
        super().__init__(task)   # max_retries 6: the client's waits add up to 18-24 s, a server restart ridden out
        self.model, self.max_retries = model, max_retries
        self.temperature, self.max_tokens = temperature, max_tokens
        self.client = openai_client(base_url or os.environ.get("OPENAI_BASE_URL"),
                                    api_key or os.environ.get("OPENAI_API_KEY") or "none",   # local servers ignore it
                                    timeout)
        self.usage.update(requests=0, retries=0)

    def _complete(self, messages: list[dict]) -> str:
        return (self._request(user_sim_messages(self.task, messages)).content or "").strip()

    def _request(self, chat: list[dict], tools: list[dict] | None = None):
        """One chat completion -> its message (with text, or tool calls when tools are given)."""
        import openai
        first, no_message = self.usage["requests"], (ValueError, openai.APIResponseValidationError)
        while True:
            left = self.max_retries - (self.usage["requests"] - first)   # the client gets what the budget has left
            _sending.usage, error = self.usage, None
            try:
                r = self.client.with_options(max_retries=left).chat.completions.create(
                    model=self.model, messages=chat, temperature=self.temperature, max_tokens=self.max_tokens,
                    **({"tools": tools} if tools else {}))
                message = chat_message(r)
            except no_message as e:               # a 200 without a message (a body that is not JSON: JSONDecodeError)
                error = e
            except openai.APIError as e:          # the client's retries are spent, or retrying cannot help (401, 404)
                error = e
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

    def _complete(self, messages: list[dict]) -> str:
        import torch
        tok = self.tokenizer
        text = tok.apply_chat_template(user_sim_messages(self.task, messages), add_generation_prompt=True, tokenize=False)
        ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]], device=self.model.device)  # (1, T)
        with torch.no_grad(), getattr(self.model, "disable_adapter", contextlib.nullcontext)():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=self.max_new_tokens, pad_token_id=tok.eos_token_id)
        self.usage["prompt_tokens"] += ids.shape[1]
        self.usage["completion_tokens"] += out.shape[1] - ids.shape[1]
        return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


def ask_users(calls: list, workers: int) -> list:
    """Call each of calls (a user writing its next message), all at once up to `workers` when workers > 1: an
    LLM user waits on the network, and a round at paper scale asks 256 of them, so the round should wait on its
    slowest user, not on a queue (--user-workers, default 256). workers 1: one after another, in order (a
    scripted user: the same tokens every run). -> the messages in order, an exception in place of a message that
    failed (after the client's retries)."""
    def call(fn):
        try:
            return fn()
        except Exception as e:                           # handed back: the caller decides what it ends
            return e
    if workers <= 1 or len(calls) <= 1:
        return [call(fn) for fn in calls]
    with ThreadPoolExecutor(min(workers, len(calls))) as pool:
        return list(pool.map(call, calls))


def make_user(spec: str, task, seed: int = 0, env=None, **kw) -> User:
    """envs.make_user for our domains. spec: "scripted" | "scripted:PERSONA" | "none" | "local" | "openai:MODEL";
    env unused."""
    if spec == "scripted":
        return ScriptedUser(task, seed)
    if spec.startswith("scripted:") and spec[9:] in PERSONAS:
        return PERSONAS[spec[9:]](task, seed)
    if spec == "none":
        return NoUser(task)
    if spec == "local":
        return LocalUser(task, **kw)
    if spec.startswith("openai:"):
        return OpenAIUser(task, spec.split(":", 1)[1], **kw)
    raise SystemExit(f"unknown user simulator {spec!r}: use scripted, scripted:PERSONA ({', '.join(PERSONAS)}), none, "
                     "local or openai:MODEL")
