"""scripts/viewer.py: the page parsed back holds exactly each trajectory's tokens (count, mask, the log-prob of each sampled
token on its own token), the advantages and filtered groups as rl.py recorded them, and escapes what a model wrote.
Slow: rl.py --smoke and eval.py --smoke, then their pages opened in headless Chromium (no console error, not blank)."""
import json
import math
import os
import random
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from html.parser import HTMLParser
from types import SimpleNamespace

import pytest
import torch

import common
import eval as ev
import rl
import rollout
from scripts import viewer
import envs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = "<script>alert(1)</script>"
# a made-up vocabulary: ChatML markup, words, and the three pieces of a script tag
VOCAB = ["<|im_start|>", "<|im_end|>", "\n", "system", "user", "assistant", " policy", " hello", "<script>",
         "alert(1)", "</script>", " done", "tool", " ok"]
IM_START, IM_END, NL = 0, 1, 2
FAKE = viewer.Vocab(VOCAB.__getitem__, turn_start=IM_START)


class Page(HTMLParser):
    """The page parsed back: each folded episode (details.ep) with its summary line, the system prompt it links to
    and its tokens in order, (class m0/m1, title, text); each system prompt shown once (details.prompt) with its
    tokens; every summary line; every script element's text."""

    def __init__(self, text):
        super().__init__()
        self.episodes, self.prompts, self.summaries, self.scripts = [], {}, [], []
        self.stack, self.open, self.token = [], [], None      # open tags; open episodes and prompts; a token
        self.feed(text)
        assert not self.stack and not self.open, self.stack

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "meta":                                 # the one void element the viewer writes
            return
        classes = (a.get("class") or "").split()
        kind = "box" if tag == "details" and ("ep" in classes or "prompt" in classes) else \
            "ep-summary" if tag == "summary" and self.open and self.stack[-1][1] == "box" else None
        self.stack.append((tag, kind))
        if kind == "box":
            self.open.append(dict(classes=classes, tokens=[], summary="", prompt=None))
            if "ep" in classes:
                self.episodes.append(self.open[-1])
            else:
                self.prompts[a["id"]] = self.open[-1]
        if tag == "a" and self.open and a.get("href", "").startswith("#prompt-"):
            self.open[-1]["prompt"] = a["href"][1:]
        if tag == "script":
            self.scripts.append("")
        if tag == "summary":
            self.summaries.append("")
        if tag == "span" and classes in (["m0"], ["m1"]) and self.open:     # a token (not the legend)
            self.token = [classes[0], a["title"], ""]

    def handle_endtag(self, tag):
        top, kind = self.stack.pop()
        assert top == tag, (top, tag)
        if kind == "box":
            self.open.pop()
        if tag == "span" and self.token:
            self.open[-1]["tokens"].append(tuple(self.token))
            self.token = None

    def handle_data(self, data):
        if self.token:
            self.token[2] += data
        if any(t == "script" for t, _ in self.stack):
            self.scripts[-1] += data
        if any(t == "summary" for t, _ in self.stack):
            self.summaries[-1] += data
        if any(k == "ep-summary" for _, k in self.stack):
            self.open[-1]["summary"] += data

    def tokens(self, ep) -> list:
        """All of an episode's tokens: the system prompt it links to, then its own."""
        return (self.prompts[ep["prompt"]]["tokens"] if ep["prompt"] else []) + ep["tokens"]


def made(task, group, trial, reward, turns, failed=""):
    """A Trajectory built by hand, laid out as run_episodes lays it out: the prompt (system, the user's opening,
    the assistant header: mask 0), each agent turn (its tokens and <|im_end|>: mask 1, log-prob -(position+1)/100)
    followed by a user reply delta (mask 0), and the user's closing ###STOP### (no tokens)."""
    t = rollout.Trajectory(task, "airline", "add_bags", "easy", group, trial, [], [], [],
                           [{"role": "system", "content": "policy"}, {"role": "user", "content": "hello"}],
                           reward=reward, turns=len(turns), stop_reason="user_stop", failed=failed,
                           diff="" if reward else f"missing required output: {SCRIPT}")

    def add(ids, sampled):
        for i in ids:
            t.token_ids.append(i)
            t.loss_mask.append(int(sampled))
            t.logprobs.append(-len(t.token_ids) / 100 if sampled else 0.0)
    add([IM_START, 3, NL, 6, 6, IM_END, NL, IM_START, 4, NL, 7, IM_END, NL, IM_START, 5, NL], False)
    for k, ids in enumerate(turns):
        add(ids + [IM_END], True)
        t.messages.append({"role": "assistant", "content": "".join(VOCAB[i] for i in ids), "tool_calls": []})
        if k < len(turns) - 1:
            add([NL, IM_START, 4, NL, 7, IM_END, NL, IM_START, 5, NL], False)
            t.messages.append({"role": "user", "content": "hello"})
    t.messages.append({"role": "user", "content": f"{SCRIPT} ###STOP###"})
    return t


def check_tokens(page, ep, t, decode=VOCAB.__getitem__):
    """The page's tokens of an episode (its system prompt's, then its own) are exactly the trajectory's: each id's
    text, its mask, its id in the hover, and for a sampled token the log-prob sampled at that very position."""
    tokens = page.tokens(ep)
    assert len(tokens) == len(t.token_ids)
    assert sum(c == "m1" for c, _, _ in tokens) == sum(t.loss_mask)
    for (cls, title, text), i, m, lp in zip(tokens, t.token_ids, t.loss_mask, t.logprobs):
        assert cls == f"m{m}" and text == decode(i)
        assert title == (f"id {i}, logp {lp:.3f} (p {math.exp(lp):.2f})" if m else f"id {i}")


def write_step(out, drawn_files, drawn, kept, left):
    """What rl.py writes for one step: each draw's rollouts as rl.sample_draw saves them, its args.json (--tasks, the
    number of groups kept) and the metrics line of rl.step_metrics."""
    for d, trajs in enumerate(drawn_files):
        rollout.save_trajectories(str(out / "rollouts" / f"step-000001-draw-{d}.jsonl"), trajs)
    m = rl.step_metrics(0, rl.Step(drawn, kept, left, None, 1.0, 0.0), price=[0, 0])
    with open(out / "metrics.jsonl", "w") as f:
        f.write(json.dumps(m) + "\n")
    json.dump({"group_size": 4, "tasks": len(kept)}, open(out / "args.json", "w"))
    return m


def records(out) -> list:
    """(task, record) of each group of step 1, as the viewer recomputes them from the saved rollouts."""
    return [(g["rollouts"][0].task_id, g["record"]) for g in viewer.read_rl(str(out))[1][0][2]]


def test_rl_page_holds_every_token_and_each_groups_advantages_or_why_it_was_filtered(tmp_path):
    S, D = [8, 9, 10], [11]                              # a script tag the model wrote; " done"
    a = [made("A", 0, g, r, [S, D] if r else [S]) for g, r in enumerate([1.0, 0.0, 0.0, 1.0])]   # trained
    b = [made("B", 1, g, 1.0, [D, D, D]) for g in range(4)]                                     # no variance
    c = [made("C", 2, g, 0.0, [D], failed="user") for g in range(4)]                            # all lost
    d = [made("D", 0, g, r, [D]) for g, r in enumerate([1.0, 0.0, 1.0, 0.0])]                  # over the cap
    d[0].failed = "user"                                 # left out of its group, which still has variance
    drawn = [a, b, [], [x for x in d if not x.failed]]
    write_step(tmp_path, [a + b + c, d], drawn, [a], left=c + d[:1])
    rec = dict(records(tmp_path))
    assert [rec[k]["filtered"] for k in "ABD"] == ["", "no variance", "over --tasks cap"] and rec["C"] is None
    assert rec["A"]["advantages"] == pytest.approx([1, -1, -1, 1], abs=1e-3) and rec["D"]["trials"] == [1, 2, 3]
    html, n = viewer.build(str(tmp_path), FAKE)
    page = Page(html)
    assert n == 16 and len(page.episodes) == 16 and page.scripts == []
    for ep, t in zip(page.episodes, a + b + c + d):     # the page's order: steps, draws, groups, trials
        check_tokens(page, ep, t)
        assert SCRIPT in "".join(x[2] for x in ep["tokens"]) or S[0] not in t.token_ids
    assert len(page.prompts) == 1 and all(ep["prompt"] == "prompt-1" for ep in page.episodes)   # shown once
    for ep, x in zip(page.episodes[:4], rec["A"]["advantages"]):    # as recorded, shaded by sign
        assert f"advantage {x:+.3f}" in ep["summary"] and ("pos" if x > 0 else "neg") in ep["classes"]
    assert all("advantage" not in ep["summary"] for ep in page.episodes[4:])
    groups = [s for s in page.summaries if re.match(r"[A-D] ", s)]
    assert [g.split(" rewards")[0] for g in groups] == [
        "A airline · add_bags · easy trained", "B airline · add_bags · easy filtered: no variance",
        "C airline · add_bags · easy filtered: simulator failure (every rollout lost its simulator)",
        "D airline · add_bags · easy filtered: over --tasks cap"]
    assert "advantages +1.00 -1.00 -1.00 +1.00" in groups[0]
    assert all("left out: its user simulator failed" in ep["summary"] for ep in page.episodes[8:12])
    assert "left out: its user simulator failed" in page.episodes[12]["summary"]
    assert [("off" in ep["classes"]) for ep in page.episodes[8:]] == [bool(t.failed) for t in c + d]   # grey
    assert html.count(SCRIPT) == 0 and html.count("&lt;script&gt;alert(1)&lt;/script&gt;") >= 16   # STOP, diffs


class Mixed(rollout.TextAgent):
    """Per task, in the order tasks are first seen: the first two solved by the oracle on every other conversation
    (a script tag on the rest), the third never solved. Groups with variance, and one without."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.oracle, self.order, self.seen, self.count = rollout.OracleAgent(tokenizer), {}, {}, {}

    def respond(self, task, messages):
        self.order.setdefault(task.id, len(self.order))
        if id(messages) not in self.seen:                # a conversation's messages list lives as long as it does
            self.seen[id(messages)] = self.count[task.id] = self.count.get(task.id, 0) + 1
        solve = self.order[task.id] < 2 and self.seen[id(messages)] % 2 == 0
        return self.oracle.respond(task, messages) if solve else SCRIPT


def sample_step(out, tok, tasks: int, screen: int):
    """rl.py's own sample_groups / sample_draw on 3 airline tasks x 4 rollouts with the Mixed agent (scripted user, real
    env, no model), saved under out with args.json and the step's metrics line, as rl.py writes them.
    -> (drawn groups, kept groups, their advantages, the metrics line)."""
    args = SimpleNamespace(seed=0, group_size=4, draw=3, max_draws=1, tasks=tasks, max_sim_failures=0.25, rollouts=None,
                           user="scripted", max_turns=12, max_context=8192, reward="binary", out=str(out),
                           screen=screen, user_workers=1)
    json.dump(vars(args), open(out / "args.json", "w"))
    pools = {"airline": envs.make_tasks("airline", "train", 40, ["easy"], 0)}
    drawn, lost = rl.sample_groups(rl.Sampling(Mixed(tok), tok, envs.UserFactory("scripted")), pools, 0, args)
    kept = [g for g in drawn if rl.has_signal(g)][:args.tasks]                 # as rl.grpo_step keeps them
    adv = torch.cat([rl.group_advantages(torch.tensor([t.reward for t in g])) for g in kept])
    m = rl.step_metrics(0, rl.Step(drawn, kept, lost, None, 1.0, 0.0), price=[0, 0])
    with open(out / "metrics.jsonl", "w") as f:
        f.write(json.dumps(m) + "\n")
    return drawn, kept, adv, m


def test_rl_sample_groups_to_page_with_the_real_tokenizer(tmp_path, tok):
    """rl.py's own sample_groups / sample_draw save a step's real conversations (scripted user, real env, an oracle
    agent: no model); the page shows each group as rl.py filtered it, every token of
    every rollout, and the agent's script tag as text."""
    drawn, kept, adv, m = sample_step(tmp_path, tok, tasks=1, screen=0)
    assert [(r["rewards"], r["filtered"]) for _, r in records(tmp_path)] == [
        ([0.0, 1.0, 0.0, 1.0], ""), ([0.0, 1.0, 0.0, 1.0], "over --tasks cap"), ([0.0] * 4, "no variance")]
    vocab = viewer.load_vocab(rollout.DEFAULT_MODEL)
    html, n = viewer.build(str(tmp_path), vocab)
    assert "group size 4 · reward binary" in html    # --screen 0 (off) is left out of the settings
    page, trajs = Page(html), [t for g in drawn for t in g]
    assert n == 12 == len(page.episodes) and page.scripts == []
    for ep, t in zip(page.episodes, trajs):
        check_tokens(page, ep, t, lambda i: tok.decode([i]))
    assert SCRIPT in "".join(x[2] for x in page.episodes[0]["tokens"]) and SCRIPT not in html
    assert [f"advantage {x:+.3f}" in ep["summary"] for ep, x in zip(page.episodes, adv.tolist())] == [True] * 4


def test_screened_groups_are_finished_in_a_second_file_and_shown_whole(tmp_path, tok):
    """rl.py --screen 2 with the same agent: trials 0-1 of the three tasks first (the first two tasks solved on
    trial 1, the third never), then trials 2-3 only of the two tasks whose rewards differ. The step's groups are
    those two whole groups and a group of 2 that teaches nothing; the page shows each group's rollouts together,
    in trial order, from the two files."""
    drawn, kept, adv, m = sample_step(tmp_path, tok, tasks=3, screen=2)
    files = sorted(os.listdir(tmp_path / "rollouts"))
    assert files == ["step-000001-draw-0-trials-0-2.jsonl", "step-000001-draw-0-trials-2-4.jsonl"]
    saved = [[json.loads(line)["trial"] for line in open(tmp_path / "rollouts" / f)] for f in files]
    assert saved == [[0, 1] * 3, [2, 3] * 2]
    assert [[t.trial for t in g] for g in drawn] == [[0, 1, 2, 3], [0, 1, 2, 3], [0, 1]]
    assert [[t.reward for t in g] for g in drawn] == [[0.0, 1.0, 0.0, 1.0]] * 2 + [[0.0, 0.0]] and kept == drawn[:2]
    tokens = [sum(sum(t.loss_mask) for t in g) for g in drawn]
    assert m["signal_token_share"] == pytest.approx(sum(tokens[:2]) / sum(tokens)) and 0 < tokens[2]
    html, n = viewer.build(str(tmp_path), viewer.load_vocab(rollout.DEFAULT_MODEL))
    assert "· screen 2 ·" in html                 # the run's settings name --screen when it is on
    page = Page(html)
    assert n == 10 == len(page.episodes)
    for ep, t in zip(page.episodes, [t for g in drawn for t in g]):
        check_tokens(page, ep, t, lambda i: tok.decode([i]))


def test_eval_page_pairs_the_episodes_where_agents_differ(tmp_path):
    S, D = [8, 9, 10], [11]
    sft = [made("T1", 0, 0, 0.0, [S]), made("T1", 0, 1, 1.0, [D]), made("T2", 1, 0, 1.0, [D]),
           made("T2", 1, 1, 0.0, [D], failed="user")]
    rlx = [made("T1", 0, 0, 1.0, [D, D]), made("T1", 0, 1, 1.0, [D]), made("T2", 1, 0, 0.0, [S]),
           made("T2", 1, 1, 1.0, [D])]
    ev.save_episodes(str(tmp_path / "episodes_runs_rl.jsonl"), "runs/rl", rlx)
    ev.save_episodes(str(tmp_path / "episodes_sft.jsonl"), "sft", sft)
    json.dump({"agents": "sft,runs/rl"}, open(tmp_path / "args.json", "w"))
    html, n = viewer.build(str(tmp_path), FAKE)
    page = Page(html)
    assert n == 8 and page.scripts == [] and SCRIPT not in html
    assert "sft vs runs/rl: 1 solved only by sft, 1 only by runs/rl" in html   # T2 trial 1: sft lost its user
    differ, every = page.episodes[:4], page.episodes[4:]
    pairs = [(sft[0], rlx[0]), (sft[2], rlx[2])]         # side by side: sft's, then runs/rl's
    for ep, t in zip(differ, [t for p in pairs for t in p]):
        check_tokens(page, ep, t)
    assert [ep["summary"].split(" · ")[0] for ep in differ] == ["sft", "runs/rl"] * 2
    order = [sft[1], rlx[1], sft[3], rlx[3]]          # per task, a column per agent; those above link there
    assert len(every) == 4 and html.count("shown above (where agents differ)") == 4
    for ep, t in zip(every, order):
        check_tokens(page, ep, t)
    assert "left out: its user simulator failed" in every[2]["summary"]
    assert "sft</td><td>4</td><td>2 of 3 (0.667)</td><td>1</td>" in html


def test_a_flagged_user_message_and_a_user_that_broke_the_check_are_marked_with_their_reasons(tmp_path):
    """The tries the check flagged (a CheckedUser's stats["user_checks"]) stand before the message that passed, each
    with its reason; an episode whose user broke the check ends on its tries, marked left out. The tokens are still
    exactly the trajectory's, and what the user wrote is escaped."""
    D = [11]
    mended, broke = made("T1", 0, 0, 1.0, [D, D]), made("T1", 0, 1, 0.0, [D], failed="user_broke")
    mended.stats = {"user_flags": {"wrong_fact": 1}, "user_asked_again": 1, "user_checks": [
        {"at": 3, "flagged": [{"said": f"{SCRIPT} my id is #W0000001", "reason": "wrong_fact"}]}]}
    broke.messages.pop()                                  # the reply that broke never reached the conversation
    broke.stop_reason, broke.stats = "error", {"user_flags": {"early_stop": 3}, "user_broke": "early_stop",
                                               "error": "UserBroke: the user broke the check (early_stop) 3 time(s)",
                                               "user_checks": [{"at": 3, "broke": "early_stop", "flagged": [
                                                   {"said": f"Yes {SCRIPT} ###STOP###", "reason": "early_stop"}] * 3}]}
    ev.save_episodes(str(tmp_path / "episodes_sft.jsonl"), "sft", [mended, broke])
    json.dump({"agents": "sft"}, open(tmp_path / "args.json", "w"))
    html, n = viewer.build(str(tmp_path), FAKE)
    page = Page(html)
    assert n == 2 and page.scripts == [] and SCRIPT not in html
    for ep, t in zip(page.episodes, (mended, broke)):
        check_tokens(page, ep, t)
    assert "user messages flagged by the check: wrong_fact 1" in page.episodes[0]["summary"]
    assert "left out: its user broke the check (early_stop)" in page.episodes[1]["summary"]
    first, second = html.split('<details class="ep ')[1:]            # the two episodes, in order
    turns = re.findall(r'<div class="turn ([a-z ]+)"><b>[^<]*</b>(?:<span class=note>([^<]*)</span>)?', first)
    assert turns == [("system", ""), ("user", "the opening"), ("assistant", ""),
                     ("user flagged", "flagged by the check: wrong_fact; asked again"), ("user", ""),
                     ("assistant", ""), ("user", "no tokens: the episode ends")]
    assert "&lt;script&gt;alert(1)&lt;/script&gt; my id is #W0000001" in first
    notes = re.findall(r'<div class="turn user flagged"><b>[^<]*</b><span class=note>([^<]*)</span>', second)
    assert notes == ["flagged by the check: early_stop; asked again"] * 2 + [
        "flagged by the check: early_stop; no re-ask left: the user broke, the episode is left out"]
    assert "no tokens: the episode ends" not in second                # nothing it said reached the agent


def test_a_dir_that_is_no_run_is_one_line_and_exit_2(tmp_path):
    r = subprocess.run([sys.executable, "scripts/viewer.py", str(tmp_path)], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "neither an rl.py run" in r.stderr


# ----------------------------------------------------------------------------- slow: a real browser

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
needs_chromium = pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                    reason="no Chromium here: apt-get install -y chromium (.ci/run installs it)")


def chromium(page, *flags, timeout=300):
    """Headless Chromium on a page from disk: no network, a throwaway profile. -> (CompletedProcess, wall seconds,
    CPU seconds of Chromium's processes, all of them: each is reaped by its parent, so the counts add up here)."""
    with tempfile.TemporaryDirectory() as profile:
        cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}", *flags,
               f"file://{page}"]
        t0, r0 = time.time(), resource.getrusage(resource.RUSAGE_CHILDREN)
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        return r, time.time() - t0, r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime


def open_in_chromium(page):
    """The page loads with no console error, its screenshot is not one colour, and the browser's DOM holds every
    episode the file does."""
    from PIL import Image
    png = page + ".png"
    r, _, _ = chromium(page, "--enable-logging=stderr", "--v=0", f"--screenshot={png}", "--window-size=1280,900")
    assert r.returncode == 0 and os.path.isfile(png), r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if "Uncaught" in line or "ERROR:CONSOLE" in line]
    assert not errors, errors
    colours = Image.open(png).convert("RGB").getcolors(maxcolors=1 << 20)
    assert colours is None or len(colours) > 10, f"blank screenshot: {colours}"
    dom, _, _ = chromium(page, "--dump-dom")
    assert dom.returncode == 0 and dom.stdout.count('<details class="ep') == len(Page(open(page).read()).episodes) > 0


def stage(cmd, out):
    """python <stage> --smoke --out OUT, then python scripts/viewer.py OUT -> the page."""
    r = subprocess.run([sys.executable, *cmd, "--smoke", "--out", str(out)], cwd=REPO, capture_output=True,
                       text=True, timeout=3600, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    v = subprocess.run([sys.executable, "scripts/viewer.py", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert v.returncode == 0 and "view.html: " in v.stdout, v.stderr[-3000:]
    return str(out / "view.html")


@pytest.mark.slow
@needs_chromium
def test_smoke_runs_pages_open_in_chromium(tmp_path):
    """As on a fresh clone: python rl.py --smoke and python eval.py --smoke, then python scripts/viewer.py on each."""
    rl_page = stage(["rl.py", "--init", "base"], tmp_path / "rl")
    eval_page = stage(["eval.py", "--agents", "base"], tmp_path / "eval")
    assert len(Page(open(rl_page).read()).episodes) == 4      # 2 steps x 1 task x 2 rollouts
    with open(tmp_path / "eval" / "episodes_base.jsonl") as f:
        ran = sum(1 for _ in f)
    assert ran == 4                                            # 2 domains x 1 task x 2 trials
    assert len(Page(open(eval_page).read()).episodes) == ran   # one agent: no pair differs, each shown once
    for page in (rl_page, eval_page):
        open_in_chromium(page)


REPLY = "Could you add two checked bags to my reservation, please? I pay with my credit card."


def long_episode(fmt, prompt, rng, task, group, trial):
    """As long as the CPU presets let an episode run (common.CPU_LIMITS): agent turns of the most sampled tokens a
    turn, each answered by the user, until the next would pass the context limit or the turn cap. The agent's tokens
    are drawn from the system prompt's (words, not noise); the reward is a coin."""
    limits = common.CPU_LIMITS
    reward = float(rng.random() < 0.5)
    t = rollout.Trajectory(task, "airline", "add_bags", "easy", group, trial, list(prompt), [0] * len(prompt),
                           [0.0] * len(prompt), [{"role": "system", "content": "policy"}, {"role": "user", "content": "Hi"}],
                           reward=reward, turns=0, stop_reason="context_limit",
                           diff="" if reward else "reservations.X32449.total_baggages: 0 (gold: 2)")
    while t.turns < limits["max_turns"] and len(t.token_ids) + 2 * limits["max_new_tokens"] <= limits["max_context"]:
        t.turns += 1
        ids = rng.choices(prompt[200:1500], k=limits["max_new_tokens"] - 1) + [fmt.end_of_turn_id]
        reply = fmt.delta_ids("user", REPLY)
        t.token_ids += ids + reply
        t.loss_mask += [1] * len(ids) + [0] * len(reply)
        t.logprobs += [-rng.random() for _ in ids] + [0.0] * len(reply)
        t.messages += [{"role": "assistant", "content": fmt.tok.decode(ids[:-1]), "tool_calls": []},
                       {"role": "user", "content": REPLY}]
    return t


@pytest.mark.slow
@needs_chromium
def test_a_48_rollout_step_and_a_192_episode_eval_open_in_under_2_s(tmp_path, tok):
    """The CPU presets' sizes at their longest: rl.py's step of 8 tasks x 6 rollouts, eval.py's 48 tasks x 2
    agents x 2 users (the training personas, the held-out ones), every episode run to the context limit. Chromium
    loads, lays out and screenshots each page in under 2 s more than an empty page, counted in CPU seconds (all its
    processes, best of 3): a page that needs less than 2 s of CPU opens in less than 2 s on one free core, and the
    count does not grow when other jobs share the machine, as the wall time does (both are printed)."""
    fmt, rng = rollout.ChatFormat(tok), random.Random(0)
    env = envs.make_env(envs.make_tasks("airline", "test", 40, ["easy"], 0)[0])
    prompt = fmt.prompt_ids(env.policy, "Hi, I want to add bags to my reservation.", env.tools)
    trajs = [long_episode(fmt, prompt, rng, f"airline-train-{g}", g, k) for g in range(8) for k in range(6)]
    groups = [trajs[g * 6:(g + 1) * 6] for g in range(8)]
    write_step(tmp_path / "rl", [trajs], groups, [g for g in groups if len({t.reward for t in g}) > 1], [])
    os.makedirs(tmp_path / "eval")
    for a in ("sft", "rl"):
        ev.save_episodes(str(tmp_path / "eval" / f"episodes_{a}.jsonl"), a,
                         [long_episode(fmt, prompt, rng, f"airline-test-{i}", i, 0) for i in range(96)])
    json.dump({"agents": "sft,rl"}, open(tmp_path / "eval" / "args.json", "w"))
    vocab, pages = viewer.load_vocab(rollout.DEFAULT_MODEL), {"empty": str(tmp_path / "empty.html")}
    open(pages["empty"], "w").write("<!DOCTYPE html><html><body>empty</body></html>")
    for kind in ("rl", "eval"):
        html, n = viewer.build(str(tmp_path / kind), vocab)
        assert n == {"rl": 48, "eval": 192}[kind]
        pages[kind] = str(tmp_path / f"{kind}.html")
        open(pages[kind], "w").write(html)
        open_in_chromium(pages[kind])
    runs = {k: [chromium(p, f"--screenshot={p}.png", "--window-size=1280,900")[1:] for _ in range(3)]
            for k, p in pages.items()}
    wall, cpu = ({k: min(r[i] for r in v) for k, v in runs.items()} for i in (0, 1))
    print("wall", {k: f"{v:.2f} s" for k, v in wall.items()}, "CPU", {k: f"{v:.2f} s" for k, v in cpu.items()},
          {k: f"{os.path.getsize(p) / 2**20:.1f} MiB" for k, p in pages.items()})
    assert cpu["rl"] - cpu["empty"] < 2 and cpu["eval"] - cpu["empty"] < 2, cpu
