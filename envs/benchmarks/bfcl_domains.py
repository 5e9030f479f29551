"""envs/benchmarks/bfcl_domains.py: BFCL-v3 multi-turn (PyPI bfcl-eval: its data, API classes and checker) behind
the Env interface, so its entries run through rollout.run_episodes like any other world.

The paper's "BFCL-V3 Multi Turn" is four categories; each is a domain here: bfcl-base, bfcl-miss-func,
bfcl-miss-param, bfcl-long-context. An entry is a task whose user is BFCL's own questions: the first opens the
conversation, and each text answer of the agent ends a turn and brings the next (miss_func: the functions held
back until that turn arrive with it, in BFCL's prompt for them); after the last, the user stops. The env executes
the agent's calls on BFCL's API classes and records them per turn; the reward is BFCL's multi-turn checker on
those (state and execution results after every turn), 0 for an episode cut short (τ²'s rule) or a turn of more
than MAX_STEPS calls (BFCL force-terminates such an entry).

Differences from BFCL's runner, both our loop's rules: one call a turn runs (BFCL runs every call of a step, so
a parallel step takes several agent turns here), and a malformed call is an error observation the agent can
correct (BFCL ends the turn). Tools are OpenAI-style schemas without BFCL's "response" field. Evaluation only.
"""
import ast
import itertools
import json
import os
from dataclasses import dataclass

from envs import ours
import users

CATEGORIES = {"bfcl-base": "multi_turn_base", "bfcl-miss-func": "multi_turn_miss_func",
              "bfcl-miss-param": "multi_turn_miss_param", "bfcl-long-context": "multi_turn_long_context"}
DOMAINS = tuple(CATEGORIES)
POLICY = "You are a helpful assistant. Complete the user's requests by calling the provided functions."
MAX_STEPS = 20          # BFCL: more calls than this in one turn force-terminates the entry
PAPER = {"Qwen3-8B": 11.8, "MUA-RL-8B": 14.6}
_RUN_IDS = itertools.count()


def _bfcl():
    """bfcl-eval's pieces we use (importing it makes result/score dirs: they go in our cache, or BFCL_PROJECT_ROOT)."""
    cache = os.environ.get("MUA_RL_CACHE") or os.path.expanduser("~/.cache/mua-rl")     # rollout.CACHE_DIR
    os.environ.setdefault("BFCL_PROJECT_ROOT", os.path.join(cache, "bfcl"))
    try:
        from bfcl_eval.constants.default_prompts import DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING
        from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI
        from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils
        from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker
        from bfcl_eval.utils import load_dataset_entry, load_ground_truth_entry
    except ImportError as e:
        raise SystemExit(f"BFCL needs bfcl-eval ({e}): pip install --no-deps bfcl-eval==2026.3.23")
    return (GORILLA_TO_OPENAPI, multi_turn_utils, multi_turn_checker, load_dataset_entry, load_ground_truth_entry,
            DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING)


@dataclass
class BfclTask:
    id: str
    domain: str
    entry: dict                                   # BFCL's: question (per turn), function, initial_config, ...
    truth: list                                   # per turn, the ground truth's python calls
    scenario: str = ""
    tier: str = "multi-turn"


def make_tasks(domain: str, split: str, n: int, tiers=None, seed: int = 0) -> list[BfclTask]:
    """The first n entries of a category in BFCL's order. BFCL is a test set: split "test" only."""
    if split != "test":
        raise SystemExit("BFCL has no train split (it is evaluation only): train on our domains or τ²'s")
    *_, load_dataset_entry, load_ground_truth_entry, _ = _bfcl()
    category = CATEGORIES[domain]
    entries, truth = load_dataset_entry(category)[:n], load_ground_truth_entry(category)[:n]
    assert [e["id"] for e in entries] == [g["id"] for g in truth]
    return [BfclTask(e["id"], domain, e, g["ground_truth"], scenario=category) for e, g in zip(entries, truth)]


def tool_schemas(functions: list[dict]) -> list[dict]:
    """BFCL's function docs as OpenAI tool schemas (BFCL's Gorilla types mapped as its own converter does)."""
    to_openai, *_ = _bfcl()

    def cast(schema):
        schema = dict(schema)
        schema["type"] = to_openai.get(schema.get("type", "string"), "string")
        if "properties" in schema:
            schema["properties"] = {k: cast(v) for k, v in schema["properties"].items()}
        if "items" in schema:
            schema["items"] = cast(schema["items"])
        return schema
    return [{"type": "function", "function": {"name": f["name"], "description": f["description"],
                                              "parameters": cast(f["parameters"])}} for f in functions]


def to_python_call(name, arguments, allowed: set[str]) -> str | None:
    """Hermes {"name", "arguments"} -> BFCL's python-call string `cd(folder='x')` (as BFCL's
    convert_to_function_call writes it), or None for a name/argument that is not a plain identifier
    of this entry's functions: BFCL's executor eval()s the string, so nothing else may get through."""
    if name not in allowed or not isinstance(arguments, dict) or not all(str(k).isidentifier() for k in arguments):
        return None
    return f"{name}({','.join(f'{k}={v!r}' for k, v in arguments.items())})"


def _forget(name: str):
    """Drop the API instances BFCL's executor keeps in its module globals as `{name}_{entry id}_{class}_instance`."""
    _, utils, *_ = _bfcl()
    for key in [k for k in vars(utils) if k.startswith(name + "_")]:
        delattr(utils, key)


def score(entry: dict, decoded: list[list[list[str]]], truth: list[list[str]]) -> dict:
    """BFCL's multi-turn checker on one entry. decoded: per turn, per step, the python-call strings."""
    _, _, checker, *_ = _bfcl()
    if len(decoded) != len(truth):         # BFCL: an entry that did not reach its last turn fails unchecked
        return {"valid": False, "error_type": "multi_turn:force_terminated"}
    name = f"mua_{os.getpid()}_{next(_RUN_IDS)}"   # BFCL keeps API instances in globals keyed by this name
    try:
        return checker(decoded, truth, entry, entry["id"].rsplit("_", 1)[0], name)
    finally:
        _forget(name)


class BfclEnv:
    """One entry's API classes (BFCL's, fresh for this rollout) and the calls made on them, turn by turn."""

    def __init__(self, task: BfclTask):
        self.task, self.policy = task, POLICY
        self.tools = tool_schemas(task.entry["function"])
        self.allowed = {f["name"] for f in task.entry["function"]}
        self.decoded, self.steps, self.over = [[]], 0, False
        self.name = f"mua_{os.getpid()}_{next(_RUN_IDS)}"

    def step(self, name, arguments) -> str:
        _, utils, *_ = _bfcl()
        self.steps += 1
        self.over |= self.steps > MAX_STEPS
        call = to_python_call(name, arguments, self.allowed)
        if call is None:
            return f"Error: {name} is not a function of this conversation, or its arguments are not plain names"
        e = self.task.entry
        results, _ = utils.execute_multi_turn_func_call([call], e["initial_config"], e["involved_classes"], self.name,
                                                         e["id"], "long_context" in e["id"])
        self.decoded[-1].append([call])
        return str(results[0])

    def next_turn(self, functions=()):
        """The user's next question starts a turn; miss_func's held-back functions become callable with it."""
        self.decoded.append([])
        self.steps = 0
        self.allowed |= {f["name"] for f in functions}

    def score(self, assistant_texts=None, stop_reason: str | None = None) -> ours.Score:
        """BFCL's checker's verdict on the episode's calls, 0 when the episode was cut short (τ²'s rule) or a turn
        made more than MAX_STEPS calls; wrong: the checker's error type."""
        _forget(self.name)                                 # the episode's calls are done: free its instances
        checked = score(self.task.entry, self.decoded, self.task.truth)
        verdict = ({"valid": False, "error_type": ours.cut_short(stop_reason)} if ours.cut_short(stop_reason)
                   else {"valid": False, "error_type": f"more than {MAX_STEPS} calls in a turn"} if self.over
                   else checked)
        correct = bool(checked["valid"]) and not self.over
        return ours.Score(float(verdict["valid"]), correct,
                          "" if verdict["valid"] else str(verdict.get("error_type", "")))


def make_env(task: BfclTask, shaped: bool = False) -> BfclEnv:
    return BfclEnv(task)


def hermes_call(call: str, entry: dict) -> str:
    """A ground-truth python call `sort('a.txt')` as our Hermes tool-call text (positional arguments named)."""
    node = ast.parse(call, mode="eval").body
    docs = entry["function"] + sum(entry.get("missed_function", {}).values(), [])   # miss_func: held-back ones too
    params = list(next(f for f in docs if f["name"] == node.func.id)["parameters"]["properties"])
    args = {params[i]: ast.literal_eval(a) for i, a in enumerate(node.args)}
    args.update({kw.arg: ast.literal_eval(kw.value) for kw in node.keywords})
    return "<tool_call>\n" + json.dumps({"name": node.func.id, "arguments": args}) + "\n</tool_call>"


def oracle_reply(task: BfclTask, messages: list[dict]) -> str:
    """The gold agent: the ground truth's calls of the current turn, one a message, then a short text answer."""
    turn = sum(m["role"] == "user" for m in messages) - 1
    since = messages[max(i for i, m in enumerate(messages) if m["role"] == "user"):]
    made = sum(bool(m.get("tool_calls")) for m in since if m["role"] == "assistant")
    calls = task.truth[turn]
    return hermes_call(calls[made], task.entry) if made < len(calls) else "Done."


class BfclUser(users.User):
    """BFCL's user: its questions in order, the next one after each text answer; then ###STOP###."""

    def __init__(self, task: BfclTask, env: BfclEnv):
        super().__init__(task)
        self.env, self.turn = env, 0

    def first_message(self) -> str:
        return "\n".join(m["content"] for m in self.task.entry["question"][0])

    def reply(self, messages: list[dict]) -> str:
        self.turn += 1
        questions = self.task.entry["question"]
        if self.turn == len(questions):
            return "Thanks. " + users.STOP
        held = self.task.entry.get("missed_function", {}).get(str(self.turn))
        self.env.next_turn(held or ())
        if held:                           # miss_func: the functions held back until this turn arrive now
            prompt = _bfcl()[-1]
            return prompt.format(functions="\n".join(json.dumps(t) for t in tool_schemas(held)))
        return "\n".join(m["content"] for m in questions[self.turn])


def make_user(spec: str, task: BfclTask, seed: int = 0, env=None, **kw) -> users.User:
    """BFCL's questions are the user, whatever --user says."""
    return BfclUser(task, env)


def report(scores: dict) -> str:
    """Markdown for one agent: accuracy per category and their mean, beside the paper's (all four categories)."""
    lines = ["\n### BFCL-v3 multi-turn (BFCL's checker)\n", "| category | entries | accuracy |", "|---|---|---|"]
    lines += [f"| {d} | {scores[d]['n_tasks']} | {100 * scores[d]['pass1']:.1f} |" for d in DOMAINS if d in scores]
    mine = [scores[d]["pass1"] for d in DOMAINS if d in scores]
    lines.append(f"\nmean of {len(mine)} categories: {100 * sum(mine) / len(mine):.1f}; paper (all four): Qwen3-8B "
                 f"{PAPER['Qwen3-8B']} -> MUA-RL-8B {PAPER['MUA-RL-8B']}\n")
    return "\n".join(lines)
