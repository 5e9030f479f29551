"""users.py: the simulated users the agent talks to, the world side of the loop (as envs/ours.py is).

A user gets its task (instruction, opening, hidden facts) and the agent's visible text, never the tools,
the policy or the DB. One interface, User.first_message() / User.reply(messages), four implementations:
  ScriptedUser  rule-based and seeded, the CPU default (a 135M model cannot play a user); its conduct is a row of
                values on named axes (Behaviour, AXES: how it opens, gives facts, meets a request to confirm, words
                things, errs), each value split like tasks: training values, and held-out ones no stage trains on.
                The named personas are rows (--user scripted:NAME, PERSONAS); scripted:population draws a row of
                training values per conversation
  OpenAIUser    any OpenAI-compatible chat endpoint (GPT-4o as in the paper, vLLM, llama.cpp server)
  LocalUser     a Hugging Face model in this process (given the policy, its adapter switched off)
  NoUser        ablation: the whole instruction up front, no user turns
USER_KINDS is the table of --user kinds (make_user builds each, common.check_args validates with it).
rollout.run_episodes asks them for replies (ask_users: many LLM users at once) and checks an LLM user's (check_turn:
a stop before the needed write, a fact the task does not hold, the agent's voice, nothing). Imports nothing of ours.
"""
import contextlib
import functools
import itertools
import os
import random
import re
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

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
PATIENCE = 10   # a user's replies before it gives up (ScriptedUser); the check lets any user stop after them


class User:
    """A user sees its task (instruction, facts) and the conversation, never the tools or the DB.
    reply() gets the agent's view of the conversation without the system message; a reply holding
    ###STOP### ends the episode. ends_on_text: the episode ends at the agent's first text-only turn."""
    ends_on_text = False
    concurrent = False     # may reply from several threads at once (run_episodes then asks a round's users together)
    check_retries = None   # re-asks of a message the check flags (LLM users of ours); None: never checked

    def __init__(self, task):
        self.task, self.usage = task, {"prompt_tokens": 0, "completion_tokens": 0}

    @classmethod
    def build(cls, task, seed: int, arg: str, **kw) -> "User":
        """How USER_KINDS makes one: the task, the conversation's seed, what followed "KIND:", a kind's settings."""
        return cls(task, **kw)

    def first_message(self) -> str:
        """The user's opening message."""
        raise NotImplementedError

    def reply(self, messages: list[dict]) -> str:
        """The user's next message, given the conversation as the user sees it (the agent's view, system prompt
        left out); ###STOP### in it ends the episode."""
        raise NotImplementedError

    def describe(self) -> dict:
        """Who this user is, kept in each trajectory's stats for the metrics by user (rl.py's by_user): nothing,
        but for a scripted user."""
        return {}


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


# ---- the scripted user: one set of rules, its conduct a row of values on named axes (Behaviour). A named persona is
# a row (PERSONAS); a training population draws rows of training values (scripted:population); a held-out persona
# keeps at least one value that no training row can draw (UserVille's split), so it tests whole unseen behaviours.

class Value(NamedTuple):
    """One value of an axis: who may draw it, and its rule in words (docs/personas.md shows them)."""
    split: str       # "train": training stages and the population may use it; "held-out": only evaluation
    says: str


AXES = {
    "opens": {
        "ids": Value("train", "with the task's own opening"),
        "request": Value("held-out", "with the request alone, none of the ids an easy task's opening gives"),
    },
    "gives": {
        "asked": Value("train", "every fact asked for, each when the agent uses a word for it"),
        "all_at_first": Value("train", "all its facts at once, at the first question; later, the facts asked"),
        "one_first": Value("train", "one fact a reply: the first asked that it has not given yet"),
        "one_last": Value("held-out", "one fact a reply: the last asked that it has not given yet"),
        "by_name": Value("held-out", "only a fact asked by its own name (\"order id\", not \"which order\")"),
    },
    "confirms": {
        "decides": Value("train", "yes only to a request naming every value of the change (none wrong); else no "
                                  "and the right values"),
        "asks_back": Value("train", "a question back first; asked again, it decides"),
        "bare_no": Value("held-out", "yes only to a request naming every value; else a bare no, no hint"),
    },
    "words": {
        "plain": Value("train", "plain"),
        "terse": Value("train", "terse: no greeting, bare values, one-word answers"),
        "chatty": Value("train", "chatty: an irrelevant detail in every message"),
        "casual": Value("train", "casual: lower case, slang"),
        "formal": Value("held-out", "formal"),
        "other": Value("held-out", "other words for everything"),
    },
    "mistakes": {
        "none": Value("train", "none"),
        "one_digit": Value("train", "the first fact with a digit comes with one digit wrong, corrected in its next "
                                    "message"),
    },
}


class Behaviour(NamedTuple):
    """A scripted user's conduct: one value of each of AXES."""
    opens: str
    gives: str
    confirms: str
    words: str
    mistakes: str


class Words(NamedTuple):
    """How a scripted user words things; its rng draws each phrase from its tuple."""
    greet: tuple
    yes: tuple       # every one a yes to the gold agent (oracle._is_yes); no other phrase is
    no: tuple
    thanks: tuple
    nudge: tuple     # asked nothing it can answer
    wait: tuple      # every write approved but not yet reported done
    back: tuple      # its question back before deciding (confirms "asks_back")
    fact: str        # a fact given, with {key} and {value}
    asides: tuple = ()   # a detail that has nothing to do with the request, after every message but the last


BACK = ("Before I answer: will this cost me anything extra?", "Wait, can that be undone later if I change my mind?",
        "Hmm, how long will that take to go through?")
WORDS = {
    "plain": Words(
        greet=("", "Hi! ", "Hello. ", "Hey there, ", "Good morning. "),
        yes=("Yes, please go ahead.", "Yes, that's right, please proceed.", "Correct, go ahead.", "Yes."),
        no=("No, that's not right.", "No, that's not what I want.", "No, please don't do that."),
        thanks=("Great, thank you, that's all.", "Perfect, thanks for your help!", "Thanks, that's everything."),
        nudge=("Can you help me with that?", "What do you need from me?", "Could you take care of it?"),
        wait=("Okay, please go ahead and make the change.", "Please do it now.", "Go ahead, please."),
        back=BACK, fact="My {key} is {value}."),
    "terse": Words(
        greet=("",), yes=("Yes.", "Yep.", "Yes, do it."), no=("No.", "Nope."),
        thanks=("Thanks. Bye.", "Ok, thanks.", "Fine, thanks."), nudge=("Well?", "And?", "So?"),
        wait=("Do it.", "Go on.", "Make the change."), back=BACK, fact="{key} {value}."),
    "chatty": Words(
        greet=("Hi hi! ", "Hello there, hope your day is going well! ", "Oh hello! "),
        yes=("Yes, please go ahead with that.", "Yes! That's exactly it, go ahead.", "Yes, that's the one, thanks."),
        no=("No no, that's not it.", "No, hold on, that's not what I meant."),
        thanks=("Wonderful, thank you so much, have a lovely day!", "Brilliant, thanks, that's everything from me!"),
        nudge=("So, can we get this sorted today?", "What would you need from me for that?"),
        wait=("Lovely, please go ahead and make the change then.", "Great, please do it now."),
        back=("Oh, quick question first: will I get an email about this?",
              "Before that: is this handled by you or a different team?",
              "One thing first: will it show up on my account right away?"),
        fact="My {key} is {value}.",
        # never a word the gold agent reads as a yes (yes, sure, correct, proceed, go ahead), nor a fact's value
        asides=("My cat just walked across the keyboard, sorry.", "I'm typing this on the bus, so bear with me.",
                "It's been raining here all week.", "My neighbour is drilling again, it's so loud.",
                "I had the best coffee this morning.", "My sister says hi, she's reading over my shoulder.")),
    "casual": Words(
        greet=("", "hey, ", "hiya ", "ok so "),
        yes=("yep, go for it", "yeah that's it, do it", "yup, go ahead"),
        no=("nah, that's not it", "nope, not what i meant"),
        thanks=("cool, thanks!", "awesome, cheers, that's it", "nice one, thx"),
        nudge=("so can u sort it?", "what do u need from me?", "ok what now?"),
        wait=("k, go ahead and change it", "pls just do it", "go on then"),
        back=("hmm wait, does that cost extra?", "hang on, can i undo that later?", "wait how long does that take?"),
        fact="my {key}'s {value}"),
    "formal": Words(
        greet=("Good afternoon. ", "Good day. ", "Hello. "),
        yes=("Yes. Please proceed.", "Yes, that is what I requested.", "Yes, you may go ahead."),
        no=("No. That is not what I requested.", "No. Please state the change exactly."),
        thanks=("Thank you for your assistance.", "Thank you. That concludes my request."),
        nudge=("Please tell me exactly which details you require.", "Which details do you require?"),
        wait=("Please carry out the change now.", "Kindly make the change."),
        back=BACK, fact="My {key} is {value}."),
    "other": Words(
        greet=("", "Hello! ", "Hi there. ", "Evening. "),
        yes=("Sure, do it.", "Yep, that's what I want, go ahead.", "That is correct.", "Sure."),
        no=("Nope, that's wrong.", "No, not like that.", "Nope, please don't."),
        thanks=("Lovely, thanks a lot, bye!", "Got it, thanks, that's all I needed.", "Cheers, all good now."),
        nudge=("So, can you sort it out?", "What happens next?", "Anything you need from me?"),
        wait=("Alright, please make the change now.", "Okay, I'm waiting for it to be done.", "Please carry on."),
        back=BACK, fact="The {key}: {value}."),
}
REQUESTS = {"cancel_order": "Could you cancel one of my orders for me?",     # opens "request": openings without ids
            "add_bags": "I need extra checked luggage on one of my bookings."}

# THE named personas (--user scripted:NAME; plain "scripted" is "default"): rows of AXES' values. Their split follows
# from their values: a row with a held-out value is held out. docs/personas.md shows this table (persona_table()).
PERSONAS = {
    "default": Behaviour(opens="ids", gives="asked", confirms="decides", words="plain", mistakes="none"),
    "terse": Behaviour(opens="ids", gives="all_at_first", confirms="decides", words="terse", mistakes="none"),
    "chatty": Behaviour(opens="ids", gives="one_first", confirms="asks_back", words="chatty", mistakes="none"),
    "careless": Behaviour(opens="ids", gives="asked", confirms="decides", words="plain", mistakes="one_digit"),
    "curious": Behaviour(opens="request", gives="one_last", confirms="asks_back", words="other", mistakes="none"),
    "literal": Behaviour(opens="ids", gives="by_name", confirms="bare_no", words="formal", mistakes="none"),
}
MIXES = {"train": "train", "heldout": "held-out"}   # scripted:train / scripted:heldout: a named persona of that split


def held_out_values(b: Behaviour) -> list[str]:
    """The values of b that no training row can draw, as "axis=value"."""
    return [f"{axis}={v}" for axis, v in b._asdict().items() if AXES[axis][v].split != "train"]


def split_of(b: Behaviour) -> str:
    return "held-out" if held_out_values(b) else "train"


def population() -> list[Behaviour]:
    """Every row of training values: what scripted:population draws from, one row per conversation."""
    values = [[v for v, val in AXES[axis].items() if val.split == "train"] for axis in Behaviour._fields]
    return [Behaviour(*row) for row in itertools.product(*values)]


class ScriptedUser(User):
    """Deterministic (given seed) rule-based user, the CPU default, its conduct set by a Behaviour. It opens with
    task.opening (or, opens "request", REQUESTS' opening without ids); it reveals hidden_facts[key] only when the
    agent's last message uses a word of FACT_KEYWORDS[key] (how many at once, and which: gives). Asked to confirm a
    change, it says yes only if the message names every value that makes the next write right (task.confirm_terms:
    the ids, and the reason, bag count, flight, item, option or payment method that apply) and none of the values
    that would make it wrong (task.rivals: a second reason, another card); otherwise it says no and corrects the
    values that were missing, wrong or ambiguous (confirms "bare_no": no alone; "asks_back": a question first).
    Once every write is confirmed it waits until the agent reports the change done (nudging it to go ahead), then
    thanks and stops. Tasks without writes: it stops once every required output was said or the agent refused.
    patience: at most this many replies, then it gives up. label: the persona's name, or "population"."""

    def __init__(self, task, seed: int = 0, behaviour: Behaviour = PERSONAS["default"], label: str = "default",
                 patience: int = PATIENCE):
        super().__init__(task)
        self.behaviour, self.words, self.label = behaviour, WORDS[behaviour.words], label
        self.rng, self.patience, self.replies = random.Random(seed), patience, 0
        self.confirmed = [False] * len(task.confirm_terms)
        self.opening = REQUESTS.get(task.scenario, task.opening) if behaviour.opens == "request" else task.opening
        self.given = set()            # gives one_first / one_last: the facts it has given
        self.told_all = False         # gives all_at_first: it has given everything once
        self.by_name = []             # gives by_name: the facts the agent's last message named by their own name
        self.asked_back = False       # confirms asks_back: it has asked its question back
        self.mistyped, self.correction = False, ""   # mistakes one_digit: done, and the correction still owed

    def describe(self) -> dict:
        """Its label (a persona's name, "population", a row written out) and its value on each axis."""
        return {"user": self.label, "behaviour": self.behaviour._asdict()}

    def first_message(self) -> str:
        greet = self.rng.choice(self.words.greet)          # openings that already greet get no second hello
        said = self.opening if re.match(r"(hi|hello|hey)\b", self.opening, re.I) else greet + self.opening
        return self._aside(said)

    def _aside(self, said: str) -> str:
        return f"{said} {self.rng.choice(self.words.asides)}" if self.words.asides else said

    def _fact(self, key: str) -> str:
        """A fact in its words; mistakes one_digit: the first with a digit has its last digit one up (so never the
        right value), and the correction is owed to the next message."""
        value, name = str(self.task.hidden_facts[key]), key.replace("_", " ")
        digits = [i for i, c in enumerate(value) if c.isdigit()]
        if self.behaviour.mistakes == "one_digit" and not self.mistyped and digits:
            i, right = digits[-1], value
            value = value[:i] + str((int(value[i]) + 1) % 10) + value[i + 1:]
            self.mistyped, self.correction = True, f"Sorry, I mistyped my {name}: it is {right}, not {value}."
        return self.words.fact.format(key=name, value=value)

    def _answer(self, asked: list[str]) -> list[str]:
        """The facts it reveals when asked for these (asked: FACT_KEYWORDS' order), as its gives value says."""
        gives = self.behaviour.gives
        if gives == "all_at_first" and asked and not self.told_all:
            self.told_all = True
            return [self._fact(k) for k in self.task.hidden_facts]
        if gives in ("one_first", "one_last"):
            if not asked:
                return []
            fresh = [k for k in asked if k not in self.given] or asked    # asked only for given ones: that one again
            key = fresh[0] if gives == "one_first" else fresh[-1]
            self.given.add(key)
            return [self._fact(key)]
        if gives == "by_name":
            return [self._fact(k) for k in asked if k in self.by_name]
        return [self._fact(k) for k in asked]

    def _confirm(self, text: str) -> list[str]:
        """Answer a confirmation request: yes to the first unconfirmed write whose values it all names, else no
        and the right values of the write it got closest to (confirms "bare_no": the no alone)."""
        pending = [i for i, ok in enumerate(self.confirmed) if not ok]
        rivals = self.task.rivals                       # a value named beside a rival of its kind is not named
        named = {i: [k for k, term in self.task.confirm_terms[i].items()
                     if names(text, term) and not names(text, rivals.get(k, []))] for i in pending}
        done = next((i for i in pending if len(named[i]) == len(self.task.confirm_terms[i])), None)
        if done is not None:
            self.confirmed[done] = True
            return [self.rng.choice(self.words.yes)]
        no = [self.rng.choice(self.words.no)]
        if self.behaviour.confirms == "bare_no":
            return no
        closest = max(pending, key=lambda i: len(named[i]))
        wrong = [k for k in self.task.confirm_terms[closest] if k not in named[closest]]
        fixes = [self._fact(k) for k in wrong if k in self.task.hidden_facts]
        if len(fixes) < len(wrong):                     # a value it holds no fact for: its request again
            fixes.append(self.opening)
        return no + fixes

    def reply(self, messages: list[dict]) -> str:
        said = [visible_text(m["content"]) for m in messages if m["role"] == "assistant"]
        last = said[-1] if said else ""
        owed, self.correction = self.correction, ""     # a mistyped fact given in the reply before this one
        if self.behaviour.gives == "by_name":
            self.by_name = [k for k in self.task.hidden_facts if re.search(r"\b" + k.replace("_", " "), last.lower())]
        if (self.behaviour.confirms == "asks_back" and not self.asked_back and asks_confirmation(last)
                and not all(self.confirmed)):
            self.asked_back, self.replies = True, self.replies + 1
            text = self.rng.choice(self.words.back)
        else:
            text = self._decide(said)
        if STOP in text:
            return text
        return self._aside(f"{text} {owed}" if owed else text)

    def _decide(self, said: list[str]) -> str:
        """The reply's substance, given what the agent has said: give up, thank and stop, wait for the report,
        answer a confirmation request (only that), or give the facts asked for (asked nothing: a nudge)."""
        self.replies += 1
        last = said[-1] if said else ""
        if self.replies > self.patience:
            return f"This is taking too long, I'll try again later. {STOP}"
        if self.confirmed and all(self.confirmed):      # every write approved: wait for the report
            if _REPORTS_DONE.search(last) and not asks_confirmation(last):
                return f"{self.rng.choice(self.words.thanks)} {STOP}"
            return self.rng.choice(self.words.wait)
        asked = [k for k in FACT_KEYWORDS if k in self.task.hidden_facts and asked_for(k, last.lower())]
        if not self.task.confirm_terms and not asked:    # lookup / refusal tasks
            outs = self.task.required_outputs
            if outs and all(any(o in x for x in said) for o in outs) or _REFUSES.search(last):
                return f"{self.rng.choice(self.words.thanks)} {STOP}"
        if asks_confirmation(last) and self.task.confirm_terms:   # answers the request, nothing more
            return " ".join(self._confirm(last))
        facts = self._answer(asked)
        if facts:
            return " ".join(facts)
        nudge = [self.rng.choice(self.words.nudge)]
        if self.rng.random() < 0.5:                     # half the time it repeats its request
            nudge.append(self.opening)
        return " ".join(nudge)


def persona_table() -> str:
    """PERSONAS as the markdown table of docs/personas.md: a row a persona, its value on each axis, held-out values
    in bold."""
    def show(b, axis):
        value = getattr(b, axis)
        return f"**{value}**" if AXES[axis][value].split != "train" else value
    rows = [f"| `{name}` | {split_of(b)} | " + " | ".join(show(b, a) for a in Behaviour._fields) + " |"
            for name, b in PERSONAS.items()]
    return "\n".join(["| persona | split | " + " | ".join(Behaviour._fields) + " |",
                      "|---|---|" + "---|" * len(Behaviour._fields), *rows]) + "\n"


def axes_table() -> str:
    """AXES as the markdown table of docs/personas.md: a row a value, its split and its rule."""
    rows = [f"| {axis} | `{v}` | {val.split} | {val.says} |" for axis, values in AXES.items()
            for v, val in values.items()]
    return "\n".join(["| axis | value | split | the user |", "|---|---|---|---|", *rows]) + "\n"


def personas_of(arg: str) -> list[str]:
    """The persona names a scripted spec's ARG stands for: "" -> default, train / heldout -> that split's
    personas, A+B -> those (an unknown name is kept, for check_user to report)."""
    if arg in MIXES:
        return [n for n, b in PERSONAS.items() if split_of(b) == MIXES[arg]]
    return [n for n in (arg or "default").split("+")]


def persona(arg: str, seed: int) -> str:
    """The persona of one conversation with a scripted spec's ARG: its one name, or one drawn by seed from a mix."""
    names = personas_of(arg)
    return names[0] if len(names) == 1 else random.Random(f"persona|{seed}").choice(names)


def parse_row(arg: str) -> Behaviour | str:
    """A row written out, "axis=value/axis=value" (the axes not named: default's) -> the Behaviour, or what is wrong
    with it in one line."""
    row = PERSONAS["default"]._asdict()
    for pair in arg.split("/"):
        axis, _, value = pair.partition("=")
        if axis not in AXES:
            return f"unknown axis {axis!r} in {arg!r}; axes: {', '.join(AXES)}"
        if value not in AXES[axis]:
            return f"unknown value {value!r} of {axis}; use one of {', '.join(AXES[axis])}"
        row[axis] = value
    return Behaviour(**row)


def scripted_user(task, seed: int, arg: str, **kw) -> ScriptedUser:
    """The scripted user of one conversation: a named persona (ARG names one, or a mix one is drawn from by seed),
    a row written out (ARG "axis=value/..."), or a row drawn by seed from the training population."""
    if arg == "population":
        return ScriptedUser(task, seed, random.Random(f"population|{seed}").choice(population()), "population")
    if "=" in arg:
        return ScriptedUser(task, seed, parse_row(arg), arg)
    name = persona(arg, seed)
    return ScriptedUser(task, seed, PERSONAS[name], name)


class NoUser(User):
    """Ablation "none": the whole instruction and every fact up front, no user turns after that."""
    ends_on_text = True

    def first_message(self) -> str:
        facts = "; ".join(f"{k.replace('_', ' ')}: {v}" for k, v in self.task.hidden_facts.items())
        return f"{self.task.instruction}\nEverything you may need: {facts}" if facts else self.task.instruction

    def reply(self, messages: list[dict]) -> str:
        return STOP


# ---- LLM users: OpenAIUser, LocalUser play the customer from task.instruction alone (no tools, policy or DB), in the
# agent's conversation with roles flipped: its visible text as "user" turns, their own messages as "assistant" turns.

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

    @classmethod
    def build(cls, task, seed: int, arg: str, **kw) -> "OpenAIUser":
        return cls(task, arg, **kw)                # arg: the server's model

    def __init__(self, task, model, *, base_url=None, api_key=None, timeout=60.0, max_retries=6,
                 temperature=0.0, max_tokens=256, check_retries=None):
        super().__init__(task)   # max_retries 6: the client's waits add up to 18-24 s, a server restart ridden out
        self.model, self.max_retries, self.check_retries = model, max_retries, check_retries
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

    def __init__(self, task, model, tokenizer, max_new_tokens=64, check_retries=None):
        super().__init__(task)
        self.model, self.tokenizer = model, tokenizer
        self.max_new_tokens, self.check_retries = max_new_tokens, check_retries

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


# ---- The check on an LLM user's message, against what the world knows (rollout.check_replies; docs/reference.md)

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
    reported = _REPORTS_DONE.search(last) and not asks_confirmation(last)
    owed = len(env.writes) < len(task.confirm_terms) and not reported or \
        any(o.lower() not in " ".join(agent).lower() for o in task.required_outputs)
    if STOP in said and owed and not _REFUSES.search(last) and len(own) <= PATIENCE:
        return "early_stop"
    # a value the brief and the agent's words do not hold, not even as part of one ("3198000" of "#W3198000") or one
    # digit off (a person's typo, as the careless persona makes it)
    held = stated_values(" ".join([task.instruction, *map(str, task.hidden_facts.values()), *agent]))
    typo = lambda v, h: len(v) == len(h) and [a.isdigit() and b.isdigit() for a, b in zip(v, h) if a != b] == [True]
    return "wrong_fact" if any(not any(v in h or typo(v, h) for h in held) for v in stated_values(text)) else ""


# LLM users asked at once by default: a paper-sized round (32 tasks x 8) all in flight (--user-workers)
USER_WORKERS = 256


def ask_users(calls: list, workers: int) -> list:
    """Call each of calls (a user writing its next message), all at once up to `workers` when workers > 1: an
    LLM user waits on the network, and a round at paper scale asks 256 of them, so the round should wait on its
    slowest user, not on a queue (--user-workers, default 256). workers 1: one after another, in order (a
    scripted user: the same tokens every run). -> the messages in order, a UserSimulatorError in place of a message
    that failed (an LLM user, after the client's retries). Any other exception is a bug of ours (a scripted user's, a
    check's) and stops the run with its traceback: it is never a left-out rollout."""
    def call(fn):
        try:
            return fn()
        except UserSimulatorError as e:                  # the outside world's: handed back, the caller leaves it out
            return e
    if workers <= 1 or len(calls) <= 1:
        return [call(fn) for fn in calls]
    with ThreadPoolExecutor(min(workers, len(calls))) as pool:
        return list(pool.map(call, calls))


class UserKind(NamedTuple):
    """One row of the user table: how make_user builds it, what may follow "KIND:", a line of help."""
    build: object    # (task, seed, arg, **kw) -> User; None: only a benchmark world plays it (its own make_user)
    arg: str         # "": nothing may follow; "MODEL": required; "[...]": optional (scripted's persona or mix)
    help: str


# THE table of user kinds (--user KIND or KIND:ARG): make_user builds from it, and common.check_args and --help read
# it, so a user added here is a valid --user everywhere.
USER_KINDS = {
    "scripted": UserKind(scripted_user, "[PERSONA|train|heldout|A+B|population|axis=value/...]",
                         "rule-based and seeded (PERSONAS, AXES; plain: default; train: a training persona drawn per "
                         "conversation; population: a row of training values drawn per conversation)"),
    "none": UserKind(NoUser.build, "", "no user: the whole instruction up front"),
    "local": UserKind(LocalUser.build, "", "the policy's base model plays it"),
    "openai": UserKind(OpenAIUser.build, "MODEL", "an OpenAI-compatible server's model"),
    "oracle": UserKind(None, "", "a benchmark's gold user (τ², ACEBench), for the oracle agent"),
}


def user_help() -> str:
    """The --user choices, as --help and error lines show them."""
    show = lambda a: f"[:{a[1:-1]}]" if a.startswith("[") else f":{a}" if a else ""   # noqa: E731; [..] optional
    return " | ".join(k + show(u.arg) for k, u in USER_KINDS.items())


def check_user(spec: str, training: bool = False) -> str | None:
    """What is wrong with a --user spec, in one line, or None. training (sft.py, rl.py, rl_trl.py): a held-out
    persona would void the experiment, and a persona set must keep a training persona."""
    kind, colon, arg = spec.partition(":")
    if kind not in USER_KINDS:
        return f"unknown user simulator {spec!r}; use {user_help()}"
    takes = USER_KINDS[kind].arg
    if (colon and not takes) or (takes and not takes.startswith("[") and not arg):
        return f"{spec!r} is not a user spec; use {kind}" + (f":{takes}" if takes else "")
    if kind != "scripted":
        return None
    if arg == "population":
        return None                                 # training values only, by construction (population())
    if "=" in arg:
        row = parse_row(arg)
        if isinstance(row, str):
            return row
        if training and held_out_values(row):
            return f"{held_out_values(row)[0]} is a held-out behaviour: no stage trains on it (users.AXES)"
        return None
    names = personas_of(arg)
    unknown = [n for n in names if n not in PERSONAS]
    if unknown:
        return f"unknown persona {unknown[0]!r}; use scripted:NAME with NAME one of {', '.join(PERSONAS)} " \
               f"(or {', '.join(MIXES)}, population, or a row axis=value/...)"
    held_out = [n for n in names if split_of(PERSONAS[n]) != "train"]
    if training and held_out:
        return f"persona {held_out[0]!r} is held out ({held_out_values(PERSONAS[held_out[0]])[0]} is a behaviour no " \
               f"stage trains on: users.AXES); use scripted:population, scripted:train or one of " \
               f"{', '.join(n for n, b in PERSONAS.items() if split_of(b) == 'train')}"
    if not names:
        return f"{spec!r} leaves no training persona: users.PERSONAS marks none {MIXES.get(arg, arg)}" if training \
            else f"{spec!r} names no persona: users.PERSONAS marks none {MIXES.get(arg, arg)}"
    return None


def make_user(spec: str, task, seed: int = 0, env=None, **kw) -> User:
    """envs.make_user for our domains: USER_KINDS[KIND].build(task, seed, ARG, **kw) for spec "KIND" or "KIND:ARG"
    (user_help()); kw: what an LLM user takes (an openai: user's server, a local one's model; check_retries). env
    unused."""
    kind, _, arg = spec.partition(":")
    if (error := check_user(spec)) or USER_KINDS[kind].build is None:
        raise SystemExit(error or f"user {spec!r} plays only a benchmark's tasks; use {user_help()}")
    return USER_KINDS[kind].build(task, seed, arg, **kw)


# ----------------------------------------------------------------------------- what the users did and cost

def user_report(trajs, wall_s=None, price=(0.0, 0.0)) -> dict:
    """What the simulated users of these rollouts cost and where the check stepped in: a step's numbers (rl.py's
    metrics.jsonl and log line, the tracker) and an evaluation's (eval.py's results). requests: every HTTP request
    sent; retries: the client's; asked_again: the check's re-asks; prompt and completion tokens; dollars at price
    (USD per million prompt and completion tokens, --user-price); seconds waited on users (each rollout holds its
    share of each round's wait, so they add up to wall time) and their share of wall_s; flags: the check's, per
    reason; left_out: the rollouts left out, per reason (a check reason: the user broke it; user_failed: its
    simulator failed)."""
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
