"""users.py: the simulated users the agent talks to, the world side of the loop (as envs/ours.py is).

A user gets its task (instruction, opening, hidden facts) and the agent's visible text, never the tools,
the policy or the DB. One interface, User.first_message() / User.reply(messages); here:
  ScriptedUser  rule-based and seeded, the CPU default (a 135M model cannot play a user); its conduct is a row of
                values on named axes (Behaviour, AXES: how it opens, gives facts, meets a request to confirm, words
                things, errs), each value split like tasks: training values, and held-out ones no stage trains on.
                The named personas are rows (--user scripted:NAME, PERSONAS); scripted:population draws a row of
                training values per conversation, scripted:heldout-population a row with at least one held-out
                value (the users no stage met; the held-out personas are some of its rows)
  NoUser        ablation: the whole instruction up front, no user turns
The users an LLM plays (OpenAIUser, LocalUser) and the check on what they say are a battery: envs/llm_users.py.
envs.USER_KINDS is the table of --user kinds (scripted_user and no_user build ours; check_scripted validates a
scripted spec). rollout.run_episodes asks users for messages, many at once (ask_users). Imports nothing of ours.
"""
import itertools
import random
import re
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
REPEATS_TO_LEAVE = 3   # patience "remembers": the question asked again for a fact it gave that makes it leave


class User:
    """A user sees its task (instruction, facts) and the conversation, never the tools or the DB.
    reply() gets the agent's view of the conversation without the system message; a reply holding
    ###STOP### ends the episode. ends_on_text: the episode ends at the agent's first text-only turn.
    A user that cannot write a message raises UserSimulatorError (an LLM user's server, its check): the loop leaves
    that rollout out. Anything else it raises is a bug, and stops the run."""
    ends_on_text = False
    concurrent = False     # may reply from several threads at once (run_episodes then asks a round's users together)

    def __init__(self, task):
        self.task = task

    def first_message(self) -> str:
        """The user's opening message."""
        raise NotImplementedError

    def reply(self, messages: list[dict]) -> str:
        """The user's next message, given the conversation as the user sees it (the agent's view, system prompt
        left out); ###STOP### in it ends the episode."""
        raise NotImplementedError

    def record(self) -> dict:
        """What this user leaves in its trajectory's stats when the episode ends: who it is (a scripted user's label
        and behaviour: rl.py's metrics by user), what it cost and what its check flagged (an LLM user)."""
        return {}


_ASKS_CONFIRM = re.compile(r"\b(confirm|proceed|shall i|should i|go ahead|yes or no|is that correct|"
                           r"is this correct|do you want|would you like me|ok to|okay to)\b", re.I)
REFUSES = re.compile(r"\b(cannot|can't|can not|unable|not able|not possible|not allowed|not eligible|"
                      r"against (our|the) policy)\b", re.I)
REPORTS_DONE = re.compile(r"\b(done|complete|completed|all set|has been|have been|successfully|cancelled|canceled|"
                           r"updated|added|changed|booked|processed|submitted)\b", re.I)


def asks_confirmation(text: str) -> bool:
    """Does this agent message ask for a confirmation?"""
    return bool(_ASKS_CONFIRM.search(text))


def mentions(key: str, text: str) -> bool:
    """Does this agent text use a word for fact `key`, asked or not (a request: asks_for)?"""
    return any(re.search(r"\b" + re.escape(w), text.lower()) for w in FACT_KEYWORDS[key])


def mentioned_facts(task, text: str) -> list[str]:
    """The facts of task this agent text mentions, in FACT_KEYWORDS' order."""
    return [k for k in FACT_KEYWORDS if k in task.hidden_facts and mentions(k, text)]


def names(text: str, term) -> bool:
    """Does text name term (a value, or a list of alternatives), as a whole word? ("3" is not in "13")"""
    alts = term if isinstance(term, list) else [term]
    return any(re.search(r"(?<![\w.])" + re.escape(str(a).lower()) + r"(?!\w)", text.lower()) for a in alts)


_REQUESTS = re.compile(r"\?|\b(please|provide|give|tell|share|need|let me know|could you|can you|may i)\b", re.I)


def asks_for(task, text: str) -> list[str]:
    """The facts an agent message mentions, if it makes a request that is not a confirmation ("Done: order id #W1
    cancelled." asks for nothing)."""
    if asks_confirmation(text) or not _REQUESTS.search(text):
        return []
    return mentioned_facts(task, text)


def given(task, messages: list[dict]) -> set[str]:
    """The facts of task the user has given in messages: one of its messages names the value (a value of three
    characters or fewer, "yes", counts only beside a word for its fact: "Yes." to a confirmation gives no insurance)."""
    said = [m["content"] for m in messages if m["role"] == "user"]
    return {k for k, v in task.hidden_facts.items()
            if any(names(s, v) and (len(str(v)) > 3 or mentions(k, s)) for s in said)}


def repeated_questions(task, messages: list[dict]) -> list[int] | None:
    """Where the agent asked again for a fact the user had already given: the indices of its messages that ask for
    (asks_for) a fact an earlier user message gave (given). A person counts these; the scripted user whose patience
    "remembers" leaves at the REPEATS_TO_LEAVE-th. None in a world without hidden facts (τ²'s tasks)."""
    if not hasattr(task, "hidden_facts"):
        return None
    told, at = set(), []
    for i, m in enumerate(messages):
        if m["role"] == "user":
            told |= given(task, [m])
        elif m["role"] == "assistant" and set(asks_for(task, visible_text(m["content"]))) & told:
            at.append(i)
    return at


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
        "one_random": Value("train", "one fact a reply: one drawn at random from those asked that it has not given "
                                     "yet"),
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
    "patience": {
        "replies": Value("train", f"it gives up after {PATIENCE} replies, whatever the agent asks"),
        "remembers": Value("held-out", "asked again for a fact it already gave, it says so and gives it again; the "
                                       f"question that does so for the {REPEATS_TO_LEAVE}rd time, it leaves (and it "
                                       f"gives up after {PATIENCE} replies)"),
    },
}


class Behaviour(NamedTuple):
    """A scripted user's conduct: one value of each of AXES (patience: a row that does not name it has today's)."""
    opens: str
    gives: str
    confirms: str
    words: str
    mistakes: str
    patience: str = "replies"


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


TOLD = ("I already told you that.", "As I said before:", "I gave you that already.")   # patience remembers
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
    "mindful": Behaviour(opens="ids", gives="asked", confirms="decides", words="plain", mistakes="none",
                         patience="remembers"),
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


def heldout_population() -> list[Behaviour]:
    """Every row with at least one held-out value: what scripted:heldout-population draws from, one row per
    conversation. These are the users no stage trained with; each held-out persona is one of them."""
    rows = itertools.product(*(list(AXES[axis]) for axis in Behaviour._fields))
    return [b for b in map(Behaviour._make, rows) if held_out_values(b)]


# the populations a scripted spec draws a row from, one per conversation (--user scripted:NAME)
POPULATIONS = {"population": population, "heldout-population": heldout_population}


def one_up(value: str) -> str:
    """value with its last digit one up (9 -> 0): a mistyped fact, never the right one."""
    i = max(i for i, c in enumerate(value) if c.isdigit())
    return value[:i] + str((int(value[i]) + 1) % 10) + value[i + 1:]


class ScriptedUser(User):
    """Deterministic (given seed) rule-based user, the CPU default, its conduct set by a Behaviour. It opens with
    task.opening (or, opens "request", REQUESTS' opening without ids); it reveals hidden_facts[key] only when the
    agent's last message mentions it, asked or not (how many at once, and which: gives). Asked to confirm a
    change, it says yes only if the message names every value that makes the next write right (task.confirm_terms:
    the ids, and the reason, bag count, flight, item, option or payment method that apply) and none of the values
    that would make it wrong (task.rivals: a second reason, another card); otherwise it says no and corrects the
    values that were missing, wrong or ambiguous (confirms "bare_no": no alone; "asks_back": a question first).
    Once every write is confirmed it waits until the agent reports the change done (nudging it to go ahead), then
    thanks and stops. Tasks without writes: it stops once every required output was said or the agent refused.
    patience: at most this many replies, then it gives up (patience "remembers": also once it has been asked
    REPEATS_TO_LEAVE times for a fact it had given). label: the persona's name, or the population it was drawn from."""

    def __init__(self, task, seed: int = 0, behaviour: Behaviour = PERSONAS["default"], label: str = "default",
                 patience: int = PATIENCE):
        super().__init__(task)
        self.behaviour, self.words, self.label = behaviour, WORDS[behaviour.words], label
        self.rng, self.patience, self.replies = random.Random(seed), patience, 0
        self.confirmed = [False] * len(task.confirm_terms)
        self.opening = REQUESTS.get(task.scenario, task.opening) if behaviour.opens == "request" else task.opening
        self.given = set()            # gives one_first / one_random / one_last: the facts it has given
        self.told_all = False         # gives all_at_first: it has given everything once
        self.asked_back = False       # confirms asks_back: it has asked its question back
        self.mistyped, self.correction = False, ""   # mistakes one_digit: done, and the correction still owed
        self.repeats = 0              # patience remembers: the questions for a fact it had given

    def record(self) -> dict:
        """Its label (a persona's name, "population", a row written out) and its value on each axis."""
        return {"user": self.label, "behaviour": self.behaviour._asdict()}

    def first_message(self) -> str:
        greet = self.rng.choice(self.words.greet)          # openings that already greet get no second hello
        said = self.opening if re.match(r"(hi|hello|hey)\b", self.opening, re.I) else greet + self.opening
        return self._aside(said)

    def reply(self, messages: list[dict]) -> str:
        owed, self.correction = self.correction, ""     # a mistyped fact given in the reply before this one
        text = self._decide(messages)
        if STOP in text:
            return text
        return self._aside(f"{text} {owed}" if owed else text)

    def _decide(self, messages: list[dict]) -> str:
        """The reply's substance: the first rule below that applies. mentioned: the facts the agent's last message
        has a word for (it gives those, asked or not); again: those it asks for that this user had given."""
        said = [visible_text(m["content"]) for m in messages if m["role"] == "assistant"]
        last = said[-1] if said else ""
        mentioned = mentioned_facts(self.task, last)
        again = self._asked_again_for(messages, last)
        self.replies += 1
        if self._asks_back(last):
            self.asked_back = True
            return self.rng.choice(self.words.back)
        if self.replies > self.patience:
            return f"This is taking too long, I'll try again later. {STOP}"
        if again:                                       # asked for a fact it gave (patience remembers)
            return self._told_you(again, mentioned, last)
        if self._approved_all() and REPORTS_DONE.search(last) and not asks_confirmation(last):
            return self._thanks()
        if self._approved_all():                        # not reported done yet: it urges the agent on
            return self.rng.choice(self.words.wait)
        if self._lookup_over(said, mentioned):
            return self._thanks()
        if self._asked_to_confirm(last):                # it answers the request, nothing more
            return self._confirm(last)
        if keys := self._answer(mentioned, last):
            return " ".join(self._say(keys, self._mistype(keys)))
        return self._nudge()

    # ---- the rules' tests, in the order _decide asks them

    def _asked_again_for(self, messages: list[dict], last: str) -> list[str]:
        """patience remembers: the facts the last message asks for that it had already given (else none)."""
        if self.behaviour.patience != "remembers":
            return []
        told = given(self.task, messages)
        return [k for k in asks_for(self.task, last) if k in told]

    def _asks_back(self, last: str) -> bool:
        """confirms asks_back: its first request to confirm gets a question back; asked again, it decides."""
        return self.behaviour.confirms == "asks_back" and not self.asked_back and self._asked_to_confirm(last)

    def _approved_all(self) -> bool:
        """It has said yes to every write of its task (a task with writes)."""
        return bool(self.confirmed) and all(self.confirmed)

    def _lookup_over(self, said: list[str], mentioned: list[str]) -> bool:
        """A task without writes is over once the agent has said every required output or refused, unless its last
        message mentions a fact."""
        if self.task.confirm_terms or mentioned:
            return False
        outs = self.task.required_outputs
        all_said = bool(outs) and all(any(o in x for x in said) for o in outs)
        return all_said or bool(REFUSES.search(said[-1] if said else ""))

    def _asked_to_confirm(self, last: str) -> bool:
        """Is it asked to approve a write not yet approved?"""
        return asks_confirmation(last) and not all(self.confirmed)

    # ---- the rules' actions

    def _told_you(self, again: list[str], mentioned: list[str], last: str) -> str:
        """patience remembers: it says it told them already and gives them again, with the other facts mentioned; the
        REPEATS_TO_LEAVE-th time, it leaves."""
        self.repeats += 1
        if self.repeats >= REPEATS_TO_LEAVE:
            return f"You keep asking me for things I already told you. I'll go elsewhere. {STOP}"
        keys = again + self._answer([k for k in mentioned if k not in again], last)
        return " ".join([self.rng.choice(TOLD), *self._say(keys, self._mistype(keys))])

    def _confirm(self, text: str) -> str:
        """Answer a confirmation request: yes to the first unconfirmed write whose values it all names, else no
        and the right values of the write it got closest to (confirms "bare_no": the no alone)."""
        pending = [i for i, ok in enumerate(self.confirmed) if not ok]
        rivals = self.task.rivals                       # a value named beside a rival of its kind is not named
        named = {i: [k for k, term in self.task.confirm_terms[i].items()
                     if names(text, term) and not names(text, rivals.get(k, []))] for i in pending}
        done = next((i for i in pending if len(named[i]) == len(self.task.confirm_terms[i])), None)
        if done is not None:
            self.confirmed[done] = True
            return self.rng.choice(self.words.yes)
        no = self.rng.choice(self.words.no)
        if self.behaviour.confirms == "bare_no":
            return no
        closest = max(pending, key=lambda i: len(named[i]))
        wrong = [k for k in self.task.confirm_terms[closest] if k not in named[closest]]
        fixes = [k for k in wrong if k in self.task.hidden_facts]
        said = [no, *self._say(fixes, self._mistype(fixes))]
        if len(fixes) < len(wrong):                     # a value it holds no fact for: its request again
            said.append(self.opening)
        return " ".join(said)

    def _answer(self, mentioned: list[str], last: str) -> list[str]:
        """The facts it gives for these mentioned (FACT_KEYWORDS' order), as its gives value says; it records what
        it gave where its next answer depends on it."""
        gives = self.behaviour.gives
        if gives == "all_at_first" and mentioned and not self.told_all:
            self.told_all = True
            return list(self.task.hidden_facts)
        if gives in ("one_first", "one_random", "one_last"):
            if not mentioned:
                return []
            fresh = [k for k in mentioned if k not in self.given] or mentioned   # only given ones: that one again
            key = fresh[0] if gives == "one_first" else fresh[-1] if gives == "one_last" else self.rng.choice(fresh)
            self.given.add(key)
            return [key]
        if gives == "by_name":                          # "order id", not "which order"
            return [k for k in mentioned if re.search(r"\b" + k.replace("_", " "), last.lower())]
        return mentioned

    def _mistype(self, keys: list[str]) -> int | None:
        """mistakes one_digit: of the facts it is about to give, the one it gets wrong, once in a conversation (the
        first with a digit), recording the correction it owes its next message. -> its place in keys, or None."""
        if self.behaviour.mistakes != "one_digit" or self.mistyped:
            return None
        at = next((i for i, k in enumerate(keys) if any(c.isdigit() for c in str(self.task.hidden_facts[k]))), None)
        if at is not None:
            right = str(self.task.hidden_facts[keys[at]])
            self.mistyped = True
            self.correction = f"Sorry, I mistyped my {keys[at].replace('_', ' ')}: it is {right}, not {one_up(right)}."
        return at

    # ---- its words

    def _say(self, keys: list[str], typo: int | None = None) -> list[str]:
        """These facts in its words; typo: the place of the one it says with a digit wrong (_mistype)."""
        said = []
        for i, key in enumerate(keys):
            value = str(self.task.hidden_facts[key])
            said.append(self.words.fact.format(key=key.replace("_", " "), value=one_up(value) if i == typo else value))
        return said

    def _thanks(self) -> str:
        return f"{self.rng.choice(self.words.thanks)} {STOP}"

    def _nudge(self) -> str:
        """Asked nothing it can answer: a nudge, half the time with its request again."""
        nudge = self.rng.choice(self.words.nudge)
        return f"{nudge} {self.opening}" if self.rng.random() < 0.5 else nudge

    def _aside(self, said: str) -> str:
        return f"{said} {self.rng.choice(self.words.asides)}" if self.words.asides else said


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


def scripted_user(task, seed: int, arg: str, *, env=None) -> ScriptedUser:
    """USER_KINDS' scripted: the scripted user of one conversation. ARG is a population (a row drawn by seed), a row
    written out ("axis=value/..."), or persona names (one, or a mix one is drawn from by seed)."""
    if arg in POPULATIONS:
        row = random.Random(f"{arg}|{seed}").choice(POPULATIONS[arg]())
        return ScriptedUser(task, seed, row, label=arg)
    if "=" in arg:
        return ScriptedUser(task, seed, parse_row(arg), label=arg)
    personas = personas_of(arg)
    name = personas[0] if len(personas) == 1 else random.Random(f"persona|{seed}").choice(personas)
    return ScriptedUser(task, seed, PERSONAS[name], label=name)


def check_scripted(arg: str, training: bool) -> str | None:
    """What is wrong with a scripted spec's ARG, in one line, or None (envs.check_user). training (sft.py, rl.py,
    rl_trl.py): a held-out behaviour would void the experiment, and a persona set must keep a training persona."""
    if arg == "population":
        return None                                 # training values only, by construction (population())
    if arg == "heldout-population":
        return "scripted:heldout-population is held out: no stage trains on it (use scripted:population)" \
            if training else None
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
               f"(or {', '.join(MIXES)}, {', '.join(POPULATIONS)}, or a row axis=value/...)"
    held_out = [n for n in names if split_of(PERSONAS[n]) != "train"]
    if training and held_out:
        return f"persona {held_out[0]!r} is held out ({held_out_values(PERSONAS[held_out[0]])[0]} is a behaviour no " \
               f"stage trains on: users.AXES); use scripted:population, scripted:train or one of " \
               f"{', '.join(n for n, b in PERSONAS.items() if split_of(b) == 'train')}"
    if not names:
        return f"'scripted:{arg}' leaves no training persona: users.PERSONAS marks none {MIXES.get(arg, arg)}" \
            if training else f"'scripted:{arg}' names no persona: users.PERSONAS marks none {MIXES.get(arg, arg)}"
    return None


class NoUser(User):
    """Ablation "none": the whole instruction and every fact up front, no user turns after that."""
    ends_on_text = True

    def first_message(self) -> str:
        facts = "; ".join(f"{k.replace('_', ' ')}: {v}" for k, v in self.task.hidden_facts.items())
        return f"{self.task.instruction}\nEverything you may need: {facts}" if facts else self.task.instruction

    def reply(self, messages: list[dict]) -> str:
        return STOP


def no_user(task, seed: int, arg: str, *, env=None) -> NoUser:
    """USER_KINDS' none."""
    return NoUser(task)


# ----------------------------------------------------------------------------- what any user is asked

def without_think(text: str) -> str:
    """An agent message without its <think>...</think> reasoning (closed or not): what it says and calls."""
    return re.sub(r"<think>.*?(</think>|\Z)", "", text or "", flags=re.S)


def visible_text(text: str) -> str:
    """What a user sees of an agent message: the text without reasoning and <tool_call>...</tool_call> (closed or not)."""
    return re.sub(r"<tool_call>.*?(</tool_call>|\Z)", "", without_think(text), flags=re.S).strip()


class UserSimulatorError(RuntimeError):
    """The LLM user simulator gave no usable reply, even after retries (or broke the check: envs/llm_users.py)."""
    failed = "user"        # the left-out rollout's Trajectory.failed


# LLM users asked at once by default: a paper-sized round (32 tasks x 8) all in flight (--user-workers)
USER_WORKERS = 256


def ask_users(calls: list, workers: int) -> list:
    """A round's users write their messages: up to `workers` at once (LLM users wait on the network), or in order
    when workers is 1. -> the messages in order; a UserSimulatorError stands in for a failed one, any other
    exception is our bug and stops the run."""
    def call(fn):
        try:
            return fn()
        except UserSimulatorError as e:                  # the outside world's: handed back, the caller leaves it out
            return e
    if workers <= 1 or len(calls) <= 1:
        return [call(fn) for fn in calls]
    with ThreadPoolExecutor(min(workers, len(calls))) as pool:
        return list(pool.map(call, calls))
