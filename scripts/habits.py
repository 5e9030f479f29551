"""scripts/habits.py: what an agent does, read from its conversations, step by step: to name the habit a run learned
and the first step whose rollouts show it (issue 99: a run that ends below its cold start gets its own lines).

One row per step of an rl.py run (its rollouts/step-*.jsonl), or per agent of an eval.py run (episodes_<agent>.jsonl):
    convs        conversations read
    solved       the mean reward
    asks         the agent's requests for facts a conversation (users.asks_for: a request naming a fact, not a
                 confirmation)
    asks_once    of the conversations where it asks at all, the share where it asks only in its first message
    made_up      tool calls a conversation with an id or an email that no user or tool message had shown it
                 (an argument named *_id, *_ids or email): a placeholder such as "order_id", or a guess
    tool_errors  tool calls a conversation that the tool answered with an error
    malformed    agent messages a conversation with a tool call that would not parse (not valid JSON, say)
    says_done    of the unsolved conversations, the share whose last agent message starts with "Done"

Run:
    python scripts/habits.py runs/rl                   # an rl.py run: a row a step
    python scripts/habits.py runs/eval                 # an eval.py run: a row an agent
Reads JSON only: no model, no tokenizer.
"""
import collections
import glob
import json
import os
import re
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repo root
import users  # noqa: E402

ANY_FACT = types.SimpleNamespace(hidden_facts=dict.fromkeys(users.FACT_KEYWORDS))   # asks_for: a request for any fact
COLUMNS = ("convs", "solved", "asks", "asks_once", "made_up", "tool_errors", "malformed", "says_done")


def conversations(run_dir: str) -> dict:
    """{row label: [conversation record]}: a step's rollouts ("step 3") or an agent's episodes ("sft")."""
    rows = collections.defaultdict(list)
    for path in sorted(glob.glob(os.path.join(run_dir, "rollouts", "step-*.jsonl"))):
        step = int(re.search(r"step-(\d+)", os.path.basename(path)).group(1))
        rows[f"step {step}"] += map(json.loads, open(path))
    for path in sorted(glob.glob(os.path.join(run_dir, "episodes_*.jsonl"))):
        rows[os.path.basename(path)[len("episodes_"):-len(".jsonl")]] += map(json.loads, open(path))
    return rows


def made_up_calls(messages: list[dict]) -> int:
    """Tool calls with an id or email argument whose value no earlier user or tool message contains."""
    shown, n = "", 0
    for m in messages:
        if m["role"] in ("user", "tool"):
            shown += "\n" + m["content"].lower()
        for call in m.get("tool_calls") or []:
            args = call.get("arguments") if isinstance(call.get("arguments"), dict) else {}
            values = [v for k, v in args.items() if re.search(r"(_ids?|^email)$", k)]
            values = [str(x).lower() for v in values for x in (v if isinstance(v, list) else [v])]
            n += any(x not in shown for x in values)
    return n


def habits(convs: list[dict]) -> dict:
    """The row's numbers (COLUMNS) over its conversations."""
    asks, once, made_up, done, unsolved = [], [], [], 0, 0
    for c in convs:
        said = [users.visible_text(m["content"]) for m in c["messages"] if m["role"] == "assistant"]
        requests = [i for i, text in enumerate(said) if users.asks_for(ANY_FACT, text)]
        asks.append(len(requests))
        if requests:
            once.append(requests == [0])
        made_up.append(made_up_calls(c["messages"]))
        if c["reward"] < 1:
            unsolved += 1
            last = [text for text in said if text]
            done += bool(last) and last[-1].lower().startswith("done")
    n = len(convs)
    mean = (lambda xs: sum(xs) / len(xs) if xs else float("nan"))
    return {"convs": n, "solved": mean([c["reward"] for c in convs]), "asks": mean(asks), "asks_once": mean(once),
            "made_up": mean(made_up), "tool_errors": mean([c["stats"].get("tool_errors", 0) for c in convs]),
            "malformed": mean([c["stats"].get("malformed_calls", 0) for c in convs]),
            "says_done": done / unsolved if unsolved else float("nan")}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    rows = conversations(argv[0]) if len(argv) == 1 else {}
    if not rows:
        print("habits.py: give one folder with rollouts/step-*.jsonl (an rl.py run's --out) or episodes_*.jsonl "
              "(an eval.py run's)", file=sys.stderr)
        sys.exit(2)
    print("\t".join(("row",) + COLUMNS))
    for label, convs in rows.items():
        h = habits(convs)
        print("\t".join([label, str(h["convs"])] + [f"{h[k]:.3f}" for k in COLUMNS[1:]]))


if __name__ == "__main__":
    main()
