"""scripts/viewer.py: see what GRPO saw. A run's rollouts, or an evaluation's episodes, as one HTML page.

Every conversation turn by turn, as the tokens the model read and wrote: the agent's sampled tokens (loss_mask 1,
what GRPO trains on) shaded, green where rl.py pushed them up (a positive advantage) and red where it pushed them
down; the system prompt, user and tool tokens (loss_mask 0) plain. Hover a token for its id and the sampler's
log-prob. Per step and group: the task, each rollout's reward and the advantage rl.py trained it with, or why the
group was filtered (no variance, over the --tasks cap, its simulator failed), recomputed from the saved rollouts with
rl.py's own functions (group_records). For eval.py's episodes: each agent's score and, first, where agents differ: the episodes one
agent solved and the other did not, side by side.

Run:
    python scripts/viewer.py runs/rl                    # an rl.py run (rollouts/*.jsonl, metrics.jsonl) -> runs/rl/view.html
    python scripts/viewer.py runs/eval -o eval.html     # an eval.py run (its episodes_<agent>.jsonl)

The page is one file that opens from disk: inline CSS, no script, nothing fetched. Conversations fold (<details>),
so a page of hundreds of them opens at once. Everything a model, a user or a tool wrote is escaped. Tokens are
decoded one at a time by the run's tokenizer (args.json's --model; only the tokenizer loads).
"""
import glob
import html
import itertools
import json
import math
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repo root
import torch  # noqa: E402

import common  # noqa: E402
import rl  # noqa: E402
import rollout  # noqa: E402
from envs import llm_users  # noqa: E402

esc = html.escape
CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:1.2em 2em;color:#222;max-width:1500px}
h1{font-size:1.3em;margin:.2em 0}h2{font-size:1.1em;margin:1.2em 0 .3em;border-bottom:1px solid #ccc}
h3{font-size:1em;margin:.8em 0 .2em}summary{cursor:pointer}.meta{color:#555}
details.group{margin:.25em 0;padding:.15em .5em;border:1px solid #ddd;border-radius:4px}
details.group.kept{border-left:4px solid #3a3}details.group.off{border-left:4px solid #bbb;background:#fafafa}
details.ep{margin:.3em 0 .3em .8em}details.ep>summary{font-size:.93em}
.badge{display:inline-block;padding:0 .4em;border-radius:3px;font-size:.85em;background:#eee}
.kept .badge.status{background:#cfc}.off .badge.status{background:#e4e4e4}
.r1{color:#070;font-weight:bold}.r0{color:#a00}.lost{color:#a60}
.turn{border-left:3px solid #ccc;margin:.35em 0;padding:.1em .6em}.turn>b{font-size:.8em;text-transform:uppercase}
.turn.assistant{border-color:#3a3}.turn.user{border-color:#48c}.turn.tool{border-color:#c84}
.turn.flagged{border-color:#d33;background:#fff3f3}.turn.again{border-color:#e90;background:#fff8ec}
.note{color:#666;font-style:italic;font-size:.85em;margin-left:.5em}
.tok{white-space:pre-wrap;word-break:break-word;font:12px/1.55 ui-monospace,Menlo,Consolas,monospace}
.m0{color:#666}.m1{background:#cfe0f7;box-shadow:inset -1px 0 #fff}.text{white-space:pre-wrap}
.pos .m1{background:#b5e8b5}.neg .m1{background:#f5c0c0}.off .m1{background:#e6e6e6}
pre.diff{background:#fff6e6;padding:.4em .6em;white-space:pre-wrap;margin:.3em 0}
.grid{display:grid;grid-template-columns:repeat(var(--cols),minmax(0,1fr));gap:.3em 1em}
table{border-collapse:collapse}td,th{border:1px solid #ddd;padding:.15em .6em;text-align:left}
"""


# ----------------------------------------------------------------------------- reading a run

def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_args(run_dir: str) -> dict:
    path = os.path.join(run_dir, "args.json")
    return json.load(open(path)) if os.path.isfile(path) else {}


def rollouts_dir(run_dir: str) -> str | None:
    """Where an rl.py run's rollouts are: its own rollouts/, or, for a replay (--rollouts DIR), the run it replayed."""
    for d in (os.path.join(run_dir, "rollouts"), run_args(run_dir).get("rollouts")):
        if d and glob.glob(os.path.join(d, "step-*-draw-*.jsonl")):
            return d
    return None


def run_kind(run_dir: str) -> str | None:
    """"rl" (rollouts and metrics.jsonl), "eval" (episodes_<agent>.jsonl), or None."""
    if os.path.isfile(os.path.join(run_dir, "metrics.jsonl")) and rollouts_dir(run_dir):
        return "rl"
    return "eval" if glob.glob(os.path.join(run_dir, "episodes_*.jsonl")) else None


def read_rl(run_dir: str) -> tuple[list, list]:
    """-> (metrics lines, steps): steps = [(step, its metrics line or None, groups)], each group a dict of its
    task's rollouts (every one saved, those that lost their simulator included) and its record (group_records; None
    when every rollout lost its simulator, or the step was never logged)."""
    metrics = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    by_step, cap = {m["step"]: m for m in metrics}, run_args(run_dir).get("tasks") or math.inf
    files = {}
    for path in glob.glob(os.path.join(rollouts_dir(run_dir), "step-*-draw-*.jsonl")):
        s, d = map(int, re.search(r"step-(\d+)-draw-(\d+)(-trials-\d+-\d+)?\.jsonl$", path).groups()[:2])
        files.setdefault(s, []).append((d, path))
    steps = []
    for s in sorted(files):
        tasks = {}                                 # task -> its rollouts (with --screen, from two files), draw order
        for _, path in sorted(files[s]):
            for t in rollout.load_trajectories(path):
                tasks.setdefault(t.task_id, []).append(t)
        groups = [dict(rollouts=sorted(mine, key=lambda t: t.trial)) for mine in tasks.values()]
        for g, rec in zip(groups, group_records([g["rollouts"] for g in groups], cap) if s in by_step
                          else [None] * len(groups)):
            g["record"] = rec
        steps.append((s, by_step.get(s), groups))
    return metrics, steps


def group_records(groups: list, cap) -> list:
    """What rl.py did with a step's groups (in draw order), recomputed from the rollouts as rl.sample_groups and
    rl.grpo_step do it: a group's rollouts that lost their simulator are left out; of the groups whose rewards differ
    (rl.has_signal) the first --tasks are trained, with advantages rl.group_advantages. -> a record a group (its
    trials, rewards, trained, advantages or why it was filtered), None for a group with no rollout left."""
    out, trained = [], 0
    for g in groups:
        ok = [t for t in g if not t.failed]
        signal = bool(ok) and rl.has_signal(ok)
        keep = signal and trained < cap
        trained += keep
        adv = rl.group_advantages(torch.tensor([t.reward for t in ok])).tolist() if keep else None
        out.append(dict(trials=[t.trial for t in ok], rewards=[t.reward for t in ok], trained=keep, advantages=adv,
                        filtered="" if keep else "over --tasks cap" if signal else "no variance") if ok else None)
    return out


def read_eval(run_dir: str) -> dict:
    """{agent: [Trajectory]} from eval.py's episodes_<agent>.jsonl, agents in --agents order."""
    agents = {}
    for path in sorted(glob.glob(os.path.join(run_dir, "episodes_*.jsonl"))):
        for d in read_jsonl(path):
            agents.setdefault(d.pop("agent"), []).append(rollout.Trajectory(**d))
    order = [a.strip() for a in run_args(run_dir).get("agents", "").split(",")]
    return dict(sorted(agents.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)))


# ----------------------------------------------------------------------------- tokens and turns

class Vocab:
    """What one page is written with: each token id's text, decoded alone and escaped once (a page repeats a few
    thousand ids); turn_start, the id that opens a chat turn (<|im_start|>), where the system prompt ends and the
    user's opening begins; and the system prompts, each shown once at the top of the page (every episode of a domain
    starts with the same policy and tools: 1.6k of a CPU episode's ~2.7k tokens)."""

    def __init__(self, decode, turn_start=None):
        self.decode, self.turn_start, self.cache, self.prompts = decode, turn_start, {}, {}

    def text(self, i: int) -> str:
        if i not in self.cache:
            self.cache[i] = esc(self.decode(i))
        return self.cache[i]

    def prompt(self, t, lo: int, hi: int) -> int:
        """The number of the system prompt t.token_ids[lo:hi] on this page, where it is shown once (prompts_html)."""
        key = tuple(t.token_ids[lo:hi])
        if key not in self.prompts:
            self.prompts[key] = (len(self.prompts) + 1, t.domain, spans(t, lo, hi, self))
        return self.prompts[key][0]

    def prompts_html(self) -> str:
        return "".join(f'<details class=prompt id=prompt-{n}><summary><b>system prompt {n}</b> <span class=meta>'
                       f'{esc(domain)}: policy and tools, {len(k)} tokens, loss_mask 0; the episodes that start with '
                       f'it link here</span></summary><div class=tok>{body}</div></details>'
                       for k, (n, domain, body) in self.prompts.items())


def load_vocab(model: str) -> Vocab:
    tok = rollout.load_tokenizer(model)
    return Vocab(lambda i: tok.decode([i]), tok.get_vocab().get("<|im_start|>"))


def spans(t, lo: int, hi: int, vocab: Vocab) -> str:
    """Tokens lo:hi of t, a span each: class m1 where the policy sampled it (loss_mask 1), else m0. The title (a
    hover) gives the id and, for a sampled token, the log-prob the sampler drew it with: logprobs[i] belongs to
    token_ids[i] itself (rollout.agent_turn appends each sampled token with its own log-prob)."""
    out = []
    for i in range(lo, hi):
        tid = t.token_ids[i]
        if t.loss_mask[i]:
            lp = t.logprobs[i]
            out.append(f'<span class=m1 title="id {tid}, logp {lp:.3f} (p {math.exp(lp):.2f})">{vocab.text(tid)}</span>')
        else:
            out.append(f'<span class=m0 title="id {tid}">{vocab.text(tid)}</span>')
    return "".join(out)


def stretches(mask: list[int]) -> list[tuple[int, int, int]]:
    """[(start, end, mask value)]: the runs of equal loss_mask. A run of 1s is one agent turn; a run of 0s is the
    prompt, or what was appended after a turn (a tool result or a user reply, in the chat template's markup)."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((start, i, mask[start]))
            start = i
    return out


def turn(role: str, body: str, note: str = "") -> str:
    label = {"assistant": "agent", "assistant again": "agent, asking again"}.get(role, role)
    return (f'<div class="turn {esc(role)}"><b>{esc(label)}</b>{f"<span class=note>{esc(note)}</span>" if note else ""}'
            f'<div class=tok>{body}</div></div>')


def flagged_turns(check: dict | None) -> str:
    """A user message's tries the check flagged (envs/llm_users.py's CheckedUser: one of the trajectory's
    stats["user_checks"]), each marked with its reason: asked again, or the last try of a user that broke the check
    (its episode left out)."""
    tries = (check or {}).get("flagged", [])
    return "".join(turn("user flagged", f"<span class=text>{esc(f['said'])}</span>", f"flagged by the check: "
                        f"{f['reason']}; " + ("no re-ask left: the user broke, the episode is left out"
                                              if "broke" in check and k == len(tries) - 1 else "asked again"))
                   for k, f in enumerate(tries))


def agent_note(m: dict, repeated: bool = False) -> str:
    """What the turn did: its first tool call, the one that ran (rollout.agent_turn), and what was cut or ignored;
    repeated: it asks again for a fact the user had given (users.repeated_questions)."""
    calls, notes = m.get("tool_calls") or [], ["asks again for a fact the user gave"] if repeated else []
    if calls:
        notes.append(f"called {calls[0]['name']}({json.dumps(calls[0]['arguments'], ensure_ascii=False)})")
    if len(calls) > 1:
        notes.append(f"{len(calls) - 1} more call(s) ignored")
    if m.get("truncated"):
        notes.append("cut at --max-new-tokens")
    return "; ".join(notes)


def conversation(t, vocab: Vocab) -> str:
    """The episode turn by turn, every token once: the prompt (the system prompt, shown once at the top of the page
    and linked, then the user's opening), each agent turn (its sampled tokens), each tool result or user reply (the
    tokens appended for it); a message that has no tokens (the user's closing ###STOP###) as text; before a user
    message, its tries the check flagged."""
    runs, parts, r = stretches(t.loss_mask), [], 0
    checks = {c["at"]: c for c in t.stats.get("user_checks", [])}     # message index -> its flagged tries
    repeated = set(t.stats.get("repeated_at") or [])                   # agent messages that ask again
    if runs and not runs[0][2]:
        lo, hi, _ = runs[0]
        starts = [i for i in range(lo, hi) if t.token_ids[i] == vocab.turn_start]
        cut = starts[-2] if len(starts) >= 3 else hi        # system, user, assistant header: the user's turn opens
        n = vocab.prompt(t, lo, cut)
        parts.append(f'<div class="turn system"><b>system prompt</b><span class=note>{cut - lo} tokens, the same as '
                     f'<a href="#prompt-{n}">system prompt {n}</a> at the top</span></div>')
        parts.append(flagged_turns(checks.get(1)))
        if cut < hi:
            parts.append(turn("user", spans(t, cut, hi, vocab), "the opening"))
        r = 1
    for i, m in enumerate(t.messages[2:], start=2):
        agent = m["role"] == "assistant"
        parts.append(flagged_turns(checks.get(i)))
        if r < len(runs) and runs[r][2] == agent:
            parts.append(turn(m["role"] + " again" * (i in repeated), spans(t, *runs[r][:2], vocab),
                              agent_note(m, i in repeated) if agent else ""))
            r += 1
        else:
            parts.append(turn(m["role"], f"<span class=text>{esc(m['content'])}</span>", "no tokens: the episode ends"))
    if len(t.messages) > 2:           # a user that broke the check: its tries are all it said, nothing reached the agent
        parts.append(flagged_turns(checks.get(len(t.messages))))
    # tokens that no message names: a rollout saved without its messages (rl.py --rollouts accepts those too)
    parts += [turn("assistant" if m else "user or tool", spans(t, lo, hi, vocab)) for lo, hi, m in runs[r:]]
    return "".join(parts)


def reward_html(r: float) -> str:
    return f'<span class="{"r1" if r >= 1 else "r0"}">{r:g}</span>'


def episode(t, vocab: Vocab, label: str = "", adv: float | None = None, anchor: str = "") -> str:
    """One rollout, folded: a summary line (reward, advantage, how it ended, tokens sampled of all), then its
    conversation and the env's diff against the gold state."""
    sign = "off" if t.failed else "" if adv is None else "pos" if adv > 0 else "neg" if adv < 0 else ""
    head = [esc(label) if label else f"trial {t.trial}", f"reward {reward_html(t.reward)}"]
    head += [] if adv is None else [f"advantage <b>{adv:+.3f}</b>"]
    head += [esc(t.stop_reason), f"{t.turns} turns", f"{sum(t.loss_mask)} of {len(t.token_ids)} tokens sampled"]
    if again := t.stats.get("repeated_at"):
        head.append(f"<span class=lost>{len(again)} question(s) asked again for a fact the user gave</span>")
    if flags := t.stats.get("user_flags"):
        head.append("<span class=lost>user messages flagged by the check: " +
                    ", ".join(f"{esc(k)} {v}" for k, v in sorted(flags.items())) + "</span>")
    if t.failed:
        why = f"its user broke the check ({t.stats.get('user_broke')})" if t.failed == "user_broke" else \
            f"its {t.failed} simulator failed"
        head.append(f"<span class=lost>left out: {esc(why)} ({esc(str(t.stats.get('error', '')))})</span>")
    diff = f"<pre class=diff>{esc(t.diff)}</pre>" if t.diff else "<p class=meta>nothing differs from the gold state</p>"
    return (f'<details class="ep {sign}"{f" id={anchor}" if anchor else ""}><summary>{" · ".join(head)}</summary>'
            f"{conversation(t, vocab)}<h3>the env's diff against the gold state (stop reason: {esc(t.stop_reason)})</h3>"
            f"{diff}</details>")


def page(title: str, head: list[str], body: list[str], vocab: Vocab) -> str:
    """The HTML file: the head, then the system prompts the body's episodes start with, then the body."""
    return (f"<!DOCTYPE html><html lang=en><head><meta charset=utf-8><title>{esc(title)}</title><style>{CSS}</style>"
            f"</head><body>{''.join(head)}{vocab.prompts_html()}{''.join(body)}</body></html>\n")


LEGEND = ("<p class=meta>Tokens: <span class=tok><span class=m0>plain</span></span> = loss_mask 0 (system prompt, "
          "user, tool: read, never trained); <span class=tok><span class=m1>shaded</span></span> = loss_mask 1 "
          "(sampled by the policy){}. Hover a token: its id and the log-prob it was sampled with.</p>")


# ----------------------------------------------------------------------------- an rl.py run

def group_status(g: dict) -> tuple[str, str]:
    """(css class, words): trained, or filtered and why, as rl.py recorded it."""
    rec = g["record"]
    if rec is None:
        if all(t.failed for t in g["rollouts"]):
            return "off", "filtered: simulator failure (every rollout lost its simulator)"
        return "off", "not in metrics.jsonl (the run stopped before this step was logged)"
    return ("kept", "trained") if rec["trained"] else ("off", f"filtered: {rec.get('filtered') or 'not trained'}")


def group_html(g: dict, vocab: Vocab) -> str:
    """A group folded: task, status, rewards and advantages in one line; its rollouts inside."""
    rec, ts = g["record"], g["rollouts"]
    adv = dict(zip(rec["trials"], rec["advantages"])) if rec and rec.get("advantages") else {}
    cls, status = group_status(g)
    t = ts[0]
    head = (f"<b>{esc(t.task_id)}</b> <span class=meta>{esc(t.domain)} · {esc(t.scenario)} · {esc(t.tier)}</span> "
            f"<span class='badge status'>{esc(status)}</span> rewards "
            + " ".join(reward_html(x.reward) if not x.failed else "<span class=lost>lost</span>" for x in ts))
    if adv:
        head += " · advantages " + " ".join(f"{adv[x.trial]:+.2f}" for x in ts if x.trial in adv)
    body = "".join(episode(x, vocab, adv=adv.get(x.trial)) for x in ts)
    return f'<details class="group {cls}"><summary>{head}</summary>{body}</details>'


def settings(a: dict, names: str) -> str:
    """The run's model and the named flags it has in args.json, one line."""
    return " · ".join([f"model {esc(str(a.get('model') or rollout.DEFAULT_MODEL))}"] +
                      [f"{k.replace('_', ' ')} {esc(str(a[k]))}" for k in names.split() if a.get(k) is not None])


def step_line(m: dict | None) -> str:
    if m is None:
        return "<p class=meta>no metrics line for this step</p>"
    f = lambda x, spec: "-" if x is None else format(x, spec)                    # noqa: E731
    share = f" ({m['signal_token_share']:.0%} of the tokens)" if "signal_token_share" in m else ""
    held = f" · held-out pass^1 after the step {m['heldout_pass1']:.3f}" if m.get("heldout_pass1") is not None else ""
    held += f" · {esc(llm_users.user_line(m))}" if "user_requests" in m else ""
    return (f"<p class=meta>reward {m['reward']:.3f} · pass rate {m['pass_rate']:.3f} · groups: {m['groups_drawn']} "
            f"drawn, {m['groups_varied']} with reward variance{share}, {m['groups_trained']} trained · kl "
            f"{f(m['kl'], '.5f')} · {m['tokens']} tokens sampled, {m['train_tokens']} trained · simulator failures "
            f"{m['sim_failures']}{held}</p>")


def rl_page(run_dir: str, vocab: Vocab) -> tuple[str, int]:
    metrics, steps = read_rl(run_dir)
    a = run_args(run_dir)
    start = [m for m in metrics if m["step"] == 0 and m.get("heldout_pass1") is not None]
    flags = "init user domains group_size" + (" screen" if a.get("screen") else "") + " temperature reward max_turns"
    head = [f"<h1>rl.py rollouts: {esc(run_dir)}</h1>",
            f"<p class=meta>{settings(a, flags)}"
            + (f" · held-out pass^1 before training {start[0]['heldout_pass1']:.3f}" if start else "") + "</p>",
            LEGEND.format(", green: pushed up (advantage > 0), red: pushed down (< 0), grey: its group was filtered, "
                          "not trained"),
            "<p class=meta>A group is a task's G rollouts. rl.py trains a group only when its rewards differ; each "
            "rollout's advantage (r - mean) / (std + eps) is the one rl.py trained it with.</p>"]
    body, n = [], 0
    for s, m, groups in steps:
        body += [f"<h2>step {s}</h2>", step_line(m)] + [group_html(g, vocab) for g in groups]
        n += sum(len(g["rollouts"]) for g in groups)
    return page(f"rl.py rollouts: {run_dir}", head, body, vocab), n


# ----------------------------------------------------------------------------- an eval.py run

def solved(t) -> bool:
    return t.reward >= 1.0


def eval_page(run_dir: str, vocab: Vocab) -> tuple[str, int]:
    """Each agent's score; where agents differ (for each pair, the episodes with the same task and user seed that
    exactly one solved, side by side); then every task's episodes, a column per agent."""
    agents = read_eval(run_dir)
    names = list(agents)
    by = {a: {(t.task_id, t.trial): t for t in ts} for a, ts in agents.items()}
    rows = ["<tr><th>agent</th><th>episodes</th><th>solved</th><th>left out (the user failed or broke the check)</th>"
            "</tr>"]
    for a, ts in agents.items():
        ok = [t for t in ts if not t.failed]
        rows.append(f"<tr><td>{esc(a)}</td><td>{len(ts)}</td><td>{sum(map(solved, ok))} of {len(ok)} "
                    f"({sum(map(solved, ok)) / max(len(ok), 1):.3f})</td><td>{len(ts) - len(ok)}</td></tr>")
    head = [f"<h1>eval.py episodes: {esc(run_dir)}</h1>",
            f"<p class=meta>{settings(run_args(run_dir), 'user domains tiers trials temperature max_turns')}</p>",
            f"<table>{''.join(rows)}</table>",
            LEGEND.format(" by the agent; nothing is trained in an evaluation")]
    body, shown = ["<h2>Where agents differ</h2><p class=meta>Episodes of the same task and trial (the same "
                   "simulated user) that one agent solved and the other did not.</p>"], {}
    for a, b in itertools.combinations(names, 2):
        keys = [k for k in by[a] if k in by[b] and not by[a][k].failed and not by[b][k].failed
                and solved(by[a][k]) != solved(by[b][k])]
        only_a = sum(solved(by[a][k]) for k in keys)
        body.append(f"<h3>{esc(a)} vs {esc(b)}: {only_a} solved only by {esc(a)}, {len(keys) - only_a} only by "
                    f"{esc(b)}</h3>")
        for k in keys:
            pair = [episode(by[x][k], vocab, x, anchor=shown.setdefault((x, k), f"ep-{len(shown)}")) for x in (a, b)]
            body.append(f"<div class=meta>{esc(k[0])}, trial {k[1]}</div><div class=grid style='--cols:2'>"
                        f"{''.join(pair)}</div>")

    def cell(a, t):                                  # an episode shown above links there: one copy on the page
        label = f"{a}, trial {t.trial}"
        if (a, (t.task_id, t.trial)) not in shown:
            return episode(t, vocab, label)
        return (f"<p class=meta><a href='#{shown[a, (t.task_id, t.trial)]}'>{esc(label)}</a>: reward "
                f"{reward_html(t.reward)}, shown above (where agents differ)</p>")
    body.append("<h2>Every episode</h2>")
    for task in dict.fromkeys(t.task_id for ts in agents.values() for t in ts):
        first = next(t for ts in agents.values() for t in ts if t.task_id == task)
        cells = [[t for t in agents[a] if t.task_id == task] for a in names]
        scores = " · ".join(f"{esc(a)} " + " ".join(reward_html(t.reward) for t in c) for a, c in zip(names, cells))
        cols = "".join("<div>" + "".join(cell(a, t) for t in c) + "</div>" for a, c in zip(names, cells))
        body.append(f'<details class=group><summary><b>{esc(task)}</b> <span class=meta>{esc(first.domain)} · '
                    f'{esc(first.scenario)} · {esc(first.tier)}</span> {scores}</summary>'
                    f"<div class=grid style='--cols:{len(names)}'>{cols}</div></details>")
    return page(f"eval.py episodes: {run_dir}", head, body, vocab), sum(map(len, agents.values()))


# ----------------------------------------------------------------------------- main

def build(run_dir: str, vocab: Vocab) -> tuple[str, int]:
    """The page for an rl.py or an eval.py run, and how many conversations it holds."""
    vocab.prompts = {}                               # a page shows its own system prompts
    return (rl_page if run_kind(run_dir) == "rl" else eval_page)(run_dir, vocab)


def main(argv=None):
    p = common.Parser(description=__doc__.split("\n")[0])
    p.add_argument("run", help="an rl.py --out dir (rollouts/*.jsonl and metrics.jsonl) or an eval.py --out dir "
                   "(episodes_<agent>.jsonl)")
    p.add_argument("-o", "--out", default=None, help="the page to write (default RUN/view.html)")
    p.add_argument("--model", default=None, help="the tokenizer that decodes the tokens (default: the run's "
                   "args.json --model, else the bundled model)")
    args = p.parse_args(argv)
    if run_kind(args.run) is None:                   # bad input: one line, exit 2, before the tokenizer loads
        common.fail("run", f"{args.run} holds neither an rl.py run (rollouts/step-*.jsonl and metrics.jsonl) nor "
                    "an eval.py run (episodes_<agent>.jsonl); pass a stage's --out dir")
    out, model = args.out or os.path.join(args.run, "view.html"), args.model or run_args(args.run).get("model")
    try:
        vocab = load_vocab(model or rollout.DEFAULT_MODEL)
    except OSError as e:
        common.fail("--model", f"cannot load the tokenizer {model!r} ({e.__class__.__name__}): pass --model with a "
                    "local path of that model's tokenizer")
    text, n = build(args.run, vocab)
    with open(out, "w") as f:
        f.write(text)
    print(f"{out}: {n} conversations, {len(text.encode()) / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
