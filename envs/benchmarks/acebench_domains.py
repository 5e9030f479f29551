"""envs/benchmarks/acebench_domains.py: ACEBench's agent category (the paper's third benchmark) behind ours.Env's
interface.

What: the 50 English agent cases of ACEBench (github.com/chenchen0103/ACEBench, MIT; Chen et al. 2025) as two
domains next to ours, evaluation only (ACEBench has no train split):
  acebench-multi-turn  30 cases: a simulated user holds the task (ACEBench's own user prompt); phone or travel
  acebench-multi-step  20 cases: no user; the whole task is the first message and the agent works alone
ACEBench's own code does the work, imported at run time from $ACEBENCH_DIR (default ../shared/acebench):
its sandbox classes (MessageApi, ReminderApi, FoodPlatform, Travel, ...) run the agent's calls, and its
model_eval/checker.py::agent_checker scores the final sandbox state against the case's ground_truth.
  AceEnv     fresh sandbox instances per rollout, loaded from the case's initial_config as ACEBench's execution
             role loads them; score(): reward = ACEBench's end-to-end accuracy for the case, extras["process"] = its
             process accuracy (the fraction of the gold mile_stone path the agent's calls made, in order)
  AceUser    our OpenAI-compatible LLM user with ACEBench's English user prompt; it ends on "finish conversation"
  oracle     the gold agent replays the case's mile_stone path, one call a turn; the oracle user answers with
             the whole question, says yes when asked to confirm, and ends on any other agent text

Simplifications versus ACEBench's runner: the agent speaks Hermes tool calls, not "[f(a=1)]" text, so the
process score compares parsed calls (name, arguments), not strings; a gold step of k parallel calls is made
by k consecutive calls (our loop runs one call a turn). As ACEBench's execution role does, a call may name any
public method of the sandbox and runs on every instance that has it (turn_on_wifi reaches each phone app); its
runner records the state from the first call that runs without raising (none: no state, which its eval fails
as "wrong number of class"). Upstream data flaws, handled here and counted by data_flaws(): mile_stone strings
that are not Python (an unescaped apostrophe: 'Domino's') are read with apostrophes between letters escaped;
misspelt ground_truth class names ("Reminderpi", "BaseAPI") are matched to the closest involved class (ACEBench's
eval leaves such a class unchecked). 9 gold paths do not reach their own ground_truth (tests/test_acebench.py
lists them and why); they are left as they are: they matter only to the oracle.
"""
import ast
import copy
import difflib
import functools
import importlib
import inspect
import json
import os
import re
import sys
from dataclasses import dataclass, field

import users
from envs import llm_users
from envs.ours import Score, cut_short

DOMAINS = ("acebench-multi-turn", "acebench-multi-step")
PAPER = {"Qwen3-8B": 39.2, "MUA-RL-8B": 53.3}   # the paper's ACEBench "Agent" column for the 8B models
FINISH = "finish conversation"                  # how ACEBench's user (or agent) ends a conversation
GREETING = "Is there anything you need help with today?"   # the agent's opening in ACEBench's user chat
# the attributes ACEBench's runner saves from each sandbox class as the case's end state (SAVED_CLASS upstream)
SAVED = {"BaseApi": ["wifi", "logged_in"], "MessageApi": ["inbox"], "ReminderApi": ["reminder_list"],
         "FoodPlatform": ["users", "logged_in_users", "orders"], "Travel": ["users", "reservations"]}
MODULES = {"BaseApi": "phone_platform.base_api", "MessageApi": "phone_platform.message",
           "ReminderApi": "phone_platform.reminder", "FoodPlatform": "phone_platform.food_services",
           "Travel": "travel"}
TYPES = {"dict": "object", "float": "number", "list": "array", "tuple": "array", "int": "integer", "bool": "boolean"}


# ----------------------------------------------------------------------------- ACEBench's files
def data_dir() -> str:
    """$ACEBENCH_DIR, else ../shared/acebench beside this repo; a clear exit when neither holds the data."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # envs/benchmarks/
    root = os.path.abspath(os.environ.get("ACEBENCH_DIR") or os.path.join(repo, "..", "shared", "acebench"))
    if not os.path.isfile(os.path.join(root, "data_all", "data_en", "data_agent_multi_turn.json")):
        raise SystemExit(f"ACEBench not found at {root}: git clone https://github.com/chenchen0103/ACEBench "
                         "and set ACEBENCH_DIR to that directory")
    return root


def upstream(module: str):
    """Import one of ACEBench's modules (its sandboxes import each other by package path, so its root joins
    sys.path, at the end: it never shadows ours)."""
    root = data_dir()
    if root not in sys.path:
        sys.path.append(root)
    return importlib.import_module(module)


@functools.lru_cache(maxsize=None)
def constants(relpath: str) -> dict:
    """The module-level string constants of one of ACEBench's files, read without running it (its prompts)."""
    tree = ast.parse(open(os.path.join(data_dir(), relpath), encoding="utf-8").read())
    return {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
            for t in n.targets if isinstance(t, ast.Name) and isinstance(n.value.value, str)}


# ----------------------------------------------------------------------------- tasks
@dataclass
class AceTask:
    id: str                        # "acebench-multi-turn-agent_multi_turn_0"
    domain: str
    split: str                     # "test" (all cases; "base" is the same)
    case: dict = field(repr=False)   # ACEBench's case: question, initial_config, involved_classes, function
    ground_truth: list = field(repr=False, default_factory=list)   # [{class: saved attributes}], names repaired
    gold_paths: list = field(repr=False, default_factory=list)     # alternatives, each [[(name, args), ...] a step]
    scenario: str = ""             # the sandbox classes, e.g. "BaseApi+MessageApi"
    tier: str = ""                 # "multi-turn" | "multi-step"
    instruction: str = ""          # the case's question: the user's brief (multi-turn) or the task (multi-step)

    def oracle_reply(self, messages: list[dict]) -> str:
        return oracle_reply(self, messages)


def parse_calls(text: str):
    """"[f(a=1), g()]" -> [("f", {"a": 1}), ("g", {})], or None if it is not a list of calls of literals."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
        calls = node.elts if isinstance(node, (ast.List, ast.Tuple)) else [node]
        return [(c.func.id, {k.arg: ast.literal_eval(k.value) for k in c.keywords}) for c in calls]
    except (SyntaxError, ValueError, AttributeError):
        return None


@functools.lru_cache(maxsize=None)
def load_cases(domain: str) -> tuple:
    """(case, possible_answer) pairs of a domain in file order, checked to pair up by id."""
    if domain not in DOMAINS:
        raise SystemExit(f"unknown ACEBench domain {domain!r}: use one of {', '.join(DOMAINS)}")
    name = "data_agent_" + domain.split("-", 1)[1].replace("-", "_") + ".json"
    cases, answers = ([json.loads(line) for line in open(os.path.join(data_dir(), "data_all", "data_en", *sub, name),
                                                          encoding="utf-8") if line.strip()]
                      for sub in ((), ("possible_answer",)))
    assert [c["id"] for c in cases] == [a["id"] for a in answers], f"{name}: cases and answers do not pair up"
    return tuple(zip(cases, answers))


def _gold_steps(path: list, flaws: dict) -> list:
    """A mile_stone path as steps of parsed calls. A string that is not Python (an apostrophe inside '...', as
    in 'Domino's') is read again with the apostrophes between letters escaped; one still unreadable is dropped."""
    steps = []
    for text in path:
        calls = parse_calls(text)
        if calls is None:
            calls = parse_calls(re.sub(r"(?<=[A-Za-z])'(?=[A-Za-z])", r"\\'", text))
            flaws["mile_stone not Python"] += 1
            flaws["mile_stone repaired"] += calls is not None
        steps += [calls] if calls else []
    return steps


def _class_names(truth: list, involved: list, flaws: dict) -> list:
    """ground_truth with each class named as in involved_classes: a misspelt one ("Reminderpi", "BaseAPI") is
    the closest involved name (ACEBench's eval, matching names exactly, leaves such a class unchecked)."""
    low, out = {c.lower(): c for c in involved}, []
    for entry in truth:
        (name, state), = entry.items()
        if name not in involved:
            flaws["ground_truth class misspelt"] += 1
            name = low.get((difflib.get_close_matches(name.lower(), list(low), n=1, cutoff=0.6) or [""])[0], name)
        out.append({name: state})
    return out


def _tasks(domain: str, split: str = "test") -> tuple[list, dict]:
    flaws = dict.fromkeys(("mile_stone not Python", "mile_stone repaired", "ground_truth class misspelt"), 0)
    tasks = []
    for case, answer in load_cases(domain):
        stones = answer["mile_stone"]
        paths = stones if stones and isinstance(stones[0], list) else [stones]   # alternatives, or one path
        tasks.append(AceTask(f"{domain}-{case['id']}", domain, split, case,
                             _class_names(answer["ground_truth"], case["involved_classes"], flaws),
                             [_gold_steps(p, flaws) for p in paths], "+".join(case["involved_classes"]),
                             domain.split("-", 1)[1], case["question"]))
    return tasks, flaws


def data_flaws(domain: str) -> dict:
    """What loading a domain works around: mile_stone strings that are not Python, how many of them the
    apostrophe repair made readable, and ground_truth class names matched to an involved class."""
    return _tasks(domain)[1]


def make_tasks(domain: str, split: str, n: int, tiers=None, seed: int = 0) -> list[AceTask]:
    """The first n cases of a domain in ACEBench's file order. Only "test" ("base" is the same): ACEBench is a
    test set. tiers and seed are unused (one tier a domain; no sampling)."""
    if split == "train":
        raise SystemExit("ACEBench has no train split (it is evaluation only): train on our domains or τ²'s")
    if split not in ("test", "base"):
        raise SystemExit(f"ACEBench's split is test (or base, the same cases), not {split!r}")
    return _tasks(domain, split)[0][:n]


# ----------------------------------------------------------------------------- the environment
def policy(task: AceTask) -> str:
    """ACEBench's agent system prompt without its call-format text (ours is Hermes, added by the loop).
    Multi-turn: its phone or travel rules (prompt_en.py) after the multi-turn agent's rule on missing
    information. Multi-step: its multi-step agent's rules, in brief (that prompt is not in the shared copy)."""
    if task.tier == "multi-step":
        return ("You are an AI system that completes the user's task with the API calls given below. When a task "
                "takes several steps that depend on each other, do them one at a time and decide each next step "
                "from the results of the last. Use the user's own words for parameter values when no format is "
                "given. No one will answer questions: use what the task and the results tell you. When the task "
                "is complete, say so in a plain message.")
    prompts = constants("model_inference/prompt_en.py")
    rules = "\n\n".join(prompts[k].split("Function Calls:")[0].strip()   # not its "[ApiName(...)]" format section
                          for k, c in (("TRAVEL_PROMPT_EN", "Travel"), ("BASE_PROMPT_EN", "BaseApi"))
                          if c in task.case["involved_classes"])
    rules = re.sub(r",? in the format \[ApiName\(.*?\)\]", "", rules)
    return ("If the information you received is incomplete, ask the user for the missing details; never answer "
            f"for the user.\n\n{rules.strip()}\n\nWhen you believe the current task is completed, respond with "
            f'"{FINISH}" to end the dialogue.')


def tool_schema(function: dict) -> dict:
    """An ACEBench function as an OpenAI tool: its type names mapped to JSON Schema's ("dict" -> "object")."""
    def fix(p):
        if isinstance(p, list):
            return [fix(v) for v in p]
        if not isinstance(p, dict):
            return p
        out = {k: fix(v) for k, v in p.items()}
        if isinstance(p.get("type"), str):      # a parameter named "type" is a dict, and left alone
            out["type"] = TYPES.get(p["type"], p["type"])
        return out
    return {"type": "function", "function": {"name": function["name"], "description": function.get("description", ""),
                                             "parameters": fix(function.get("parameters", {"type": "dict"}))}}


def new_sandbox(task: AceTask) -> dict:
    """{class name: instance}, each loaded with its own initial_config and then BaseApi's, as ACEBench's
    execution role does (every phone app inherits BaseApi's wifi and login)."""
    package = f"model_inference.{task.tier.replace('-', '_')}.scenariosen."
    config, out = task.case["initial_config"], {}
    for name in task.case["involved_classes"]:
        inst = getattr(upstream(package + MODULES[name]), name)()
        inst._load_scenario(copy.deepcopy(config.get(name, {})), long_context=False)
        inst._load_scenario(copy.deepcopy(config.get("BaseApi", {})), long_context=False)
        out[name] = inst
    return out


def _plain(x):
    """x as ACEBench's result file holds it: a JSON round trip (int keys become strings, tuples lists)."""
    return json.loads(json.dumps(x, ensure_ascii=False, default=str))


class AceEnv:
    """One rollout's sandbox. step() -> the call's result as text; score() -> ACEBench's end-to-end check."""

    def __init__(self, task: AceTask, shaped: bool = False):
        self.task, self.shaped = task, shaped
        self.policy, self.tools = policy(task), [tool_schema(f) for f in task.case["function"]]
        self.sandbox = new_sandbox(task)
        self.calls, self.ran = [], False   # every call made, as (name, arguments); did one run without raising

    def step(self, name, arguments) -> str:
        """Run one call on every sandbox instance that has that public method. Never raises."""
        arguments = arguments if isinstance(arguments, dict) else {}
        self.calls.append((str(name), _plain(arguments)))
        targets = [getattr(i, name) for i in self.sandbox.values() if isinstance(name, str)
                   and not name.startswith("_") and inspect.ismethod(getattr(i, name, None))]
        if not targets:
            return f"Error: unknown tool {name!r}"
        try:
            for method in targets:
                out = method(**arguments)
        except Exception as e:                  # a bad argument, a missing one, a sandbox bug: the agent reads it
            return f"Error: {type(e).__name__}: {e}"
        self.ran = True
        return out if isinstance(out, str) else json.dumps(out, ensure_ascii=False, default=str)

    def state(self) -> list[dict]:
        """The end state as ACEBench's runner records it: each class's saved attributes (none until a call ran)."""
        return [{n: _plain({a: v for a, v in vars(i).items() if a in SAVED[n]})} for n, i in self.sandbox.items()] \
            if self.ran else []

    def score(self, assistant_texts=None, stop_reason: str | None = None) -> Score:
        """Reward 1.0 iff ACEBench's end-to-end check passes and the episode ended itself (τ²'s rule: cut short
        scores 0). The agent's texts are not read: ACEBench checks the state only. shaped: the process score
        instead. extras: ACEBench's process score; wrong: the checker's errors."""
        checks = self.state_errors()
        process = 1.0 if not checks else process_score(self.calls, self.task.gold_paths)   # as ACEBench
        reward = correct = float(not checks)
        if why := cut_short(stop_reason):
            checks.insert(0, why)
            reward = 0.0
        if len(checks) > 12:
            checks = checks[:12] + [f"... and {len(checks) - 12} more"]
        return Score(process if reward < 1.0 and self.shaped else reward, bool(correct), "\n".join(checks),
                     {"process": process})

    def state_errors(self) -> list[str]:
        """ACEBench's agent eval of one case: as many recorded classes as ground_truth's, matched by name, then
        each class's state through its agent_checker (which checks ground_truth's keys of a dict attribute)."""
        result, gold = {next(iter(r)): r for r in self.state()}, self.task.ground_truth
        if len(result) != len(gold):
            return [f"wrong number of class: {len(result)} recorded, {len(gold)} in ground_truth"
                    + " (no call ran)" * (not result)]
        errors = []
        for g in gold:
            name = next(iter(g))
            verdict = upstream("model_eval.checker").agent_checker(result[name], g) if name in result else \
                {"valid": False, "error": [f"class {name} not in the sandbox"]}
            errors += [] if verdict["valid"] else verdict["error"]
        return errors


def process_score(calls: list, paths: list) -> float:
    """ACEBench's process accuracy for one case: walk the agent's calls once, in order, finding each gold step
    (k consecutive calls equal to it) after the last one found; found / steps, the best over alternative paths."""
    best = 0.0
    for steps in paths:
        i, found = 0, 0
        for step in steps:
            step = [(n, _plain(a)) for n, a in step]
            while i < len(calls) and calls[i:i + len(step)] != step:
                i += 1
            if i < len(calls):
                found, i = found + 1, i + len(step)
        best = max(best, found / len(steps) if steps else 1.0)
    return best


def make_env(task: AceTask, shaped: bool = False) -> AceEnv:
    return AceEnv(task, shaped)


# ----------------------------------------------------------------------------- the gold agent and the users
def oracle_reply(task: AceTask, messages: list[dict]) -> str:
    """The gold agent's next message: the first gold path's calls, one a turn (a parallel step takes several
    turns), counted off the conversation; then a plain closing message."""
    made = sum(bool(m.get("tool_calls")) for m in messages if m["role"] == "assistant")
    calls = [c for step in (task.gold_paths[0] if task.gold_paths else []) for c in step]
    if made < len(calls):
        name, args = calls[made]
        return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) + "\n</tool_call>"
    return "All done: every step of your request has been completed."


def user_prompt(task: AceTask) -> str:
    """ACEBench's English user system prompt (its phone or travel version) with the case's question."""
    prompts = constants("model_inference/multi_turn/APIModel_user.py")
    key = "SYSTEM_PROMPT_BASE_EN" if "BaseApi" in task.case["involved_classes"] else "SYSTEM_PROMPT_TRAVEL_EN"
    return prompts[key].format(instruction=task.instruction)


def _ended(text: str) -> str:
    return f"{text} {users.STOP}" if FINISH in text.lower() and users.STOP not in text else text


class AceUser(llm_users.OpenAIUser):
    """ACEBench's user through an OpenAI-compatible endpoint: its prompt, the agent's greeting, then the agent's
    visible text as "user" turns and its own as "assistant" turns. "finish conversation" from either side ends
    the episode, as in ACEBench's runner."""

    def _complete(self, messages: list[dict]) -> str:
        said = [users.visible_text(m.get("content")) for m in messages if m["role"] == "assistant"]
        if said and FINISH in said[-1].lower():
            return f"{FINISH} {users.STOP}"
        chat = llm_users.user_sim_messages(self.task, messages)
        chat[:2] = [{"role": "system", "content": user_prompt(self.task)}, {"role": "user", "content": GREETING}]
        return _ended((self._request(chat).content or "").strip())


class OracleUser(users.User):
    """The gold user (tests, cold-start data): opens with the whole question, says yes to a confirmation
    request, and ends on any other agent text (the oracle agent speaks only when it is done)."""

    def first_message(self) -> str:
        return self.task.instruction

    def reply(self, messages: list[dict]) -> str:
        last = users.visible_text(messages[-1]["content"]) if messages else ""
        if users.asks_confirmation(last) and sum(m["role"] == "user" for m in messages) < 10:
            return "Yes, please go ahead."
        return f"Thanks, {FINISH}. {users.STOP}"


class StepUser(users.NoUser):
    """Multi-step's absent user: the whole question first, then nothing; the agent's first text ends it."""

    def first_message(self) -> str:
        return self.task.instruction


def make_user(spec: str, task: AceTask, seed: int = 0, env=None, **kw) -> users.User:
    """Multi-step: no user, whatever spec. Multi-turn: "openai:MODEL" (ACEBench's user) or "oracle"."""
    if task.tier == "multi-step":
        return StepUser(task)
    if spec.startswith("openai:"):                   # unchecked (no check_retries), as τ²'s user
        return AceUser(task, spec.split(":", 1)[1], **{k: v for k, v in kw.items() if k != "check_retries"})
    if spec == "oracle":
        return OracleUser(task)
    raise SystemExit(f"user {spec!r} cannot play an ACEBench case: use --user openai:MODEL (ACEBench's own user "
                     "prompt; --user-base-url for a local server) or --user oracle with the oracle agent")


# ----------------------------------------------------------------------------- the comparison with the paper
def report(scores: dict) -> str:
    """Markdown for one agent: scores maps domain -> {"pass1" (fraction), "n_tasks", "extras": {"process"}}.
    ACEBench's Agent score is the unweighted mean of multi-turn's and multi-step's end-to-end accuracies
    (model_eval/evaluation_helper.py, generate_result_csv: agent_summary)."""
    lines = ["\n### ACEBench agent (end-to-end accuracy; process accuracy beside it)\n",
             "| domain | tasks | end-to-end | process |", "|---|---|---|---|"]
    for d in DOMAINS:
        if d in scores:
            s = scores[d]
            lines.append(f"| {d} | {s['n_tasks']} | {100 * s['pass1']:.1f} | "
                         f"{100 * s.get('extras', {}).get('process', float('nan')):.1f} |")
    paper = f"paper: Qwen3-8B {PAPER['Qwen3-8B']} -> MUA-RL-8B {PAPER['MUA-RL-8B']}"
    if all(d in scores for d in DOMAINS):
        agent = 100 * sum(scores[d]["pass1"] for d in DOMAINS) / 2
        lines.append(f"\nAgent (mean of the two, as ACEBench's summary): {agent:.1f}; {paper}")
    else:
        lines.append(f"\nAgent: needs both domains (ACEBench averages them); {paper}")
    return "\n".join(lines) + "\n"
