"""Tests for rollout.py: token-exact formatting, tool-call parsing, users, the batched agent and run_episodes.

Formatting tests use the real (cached) SmolLM2 tokenizer; generation tests use a tiny random Llama with
the same vocabulary, so everything runs in well under a minute on CPU.
"""
import copy
import json

import pytest
import torch

import envs
from envs import ours
import rollout
import users
from rollout import AgentTurn, ChatFormat, TextAgent, parse_tool_calls, run_episodes
from sampler import ModelAgent
from users import STOP, WORDS, NoUser, ScriptedUser


def tasks_by_scenario(domain, n=14):
    seen = {}
    for t in ours.make_tasks(domain, "train", n):
        seen.setdefault(t.scenario, t)
    return list(seen.values())


def expected_text(fmt, messages):
    """What the token sequence must decode to: the rendered messages that carry tokens
    (a final ###STOP### user message carries none), ending where the sequence ends."""
    msgs = messages[:-1] if messages[-1]["role"] == "user" and STOP in messages[-1]["content"] else messages
    text = fmt.render(msgs)
    return text[:-1] if msgs[-1]["role"] == "assistant" else text + "<|im_start|>assistant\n"


class Recorder:
    """Wraps an agent and remembers what it returned, per conversation, in order."""

    def __init__(self, agent):
        self.agent, self.sampled = agent, {}
        self.max_new_tokens = getattr(agent, "max_new_tokens", 0)

    def act(self, batch):
        outs = self.agent.act(batch)
        for turn, (ids, _) in zip(batch, outs):
            self.sampled.setdefault(id(turn.messages), []).extend(ids)
        return outs


# ----------------------------------------------------------------------------- formatting

def test_own_template_used_for_smollm2(tok):
    fmt = ChatFormat(tok)
    assert not fmt.native                            # SmolLM2's template ignores tools=
    assert fmt.end_of_turn_id == 2 == tok.eos_token_id == tok.pad_token_id


def test_deltas_concatenate_to_rendered_conversation(tok):
    fmt = ChatFormat(tok)
    msgs = [{"role": "system", "content": "Policy.\n# Tools"}, {"role": "user", "content": "Hi, cancel #W1."},
            {"role": "assistant", "content": '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'},
            {"role": "tool", "content": '{"status": "pending"}'},
            {"role": "assistant", "content": "Shall I cancel #W1? (yes/no)"},
            {"role": "user", "content": "Yes."}]
    ids = fmt.prompt_ids(msgs[0]["content"], msgs[1]["content"])
    for m in msgs[2:]:
        if m["role"] == "assistant":
            ids += tok(m["content"], add_special_tokens=False).input_ids + [fmt.end_of_turn_id]
        else:
            ids += fmt.delta_ids(m["role"], m["content"])
    assert tok.decode(ids) == fmt.render(msgs) + "<|im_start|>assistant\n"
    assert "<|im_start|>user\n<tool_response>\n{\"status\": \"pending\"}\n</tool_response><|im_end|>" in tok.decode(ids)
    assert ids.count(1) == 7 and ids.count(2) == 6   # <|im_start|> per turn + next header; <|im_end|> per turn


QWEN_LIKE = ("{%- for m in messages %}{%- if m.role == 'system' and tools %}"
             "{{ '<|im_start|>system\\n' + m.content + '\\n# Tools: ' + (tools | map(attribute='function.name') | join(',')) + '<|im_end|>\\n' }}"
             "{%- elif m.role == 'tool' %}{{ '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
             "{%- else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
             "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")


def test_native_template_deltas_match_the_tokenizer_template(tok):
    """A tokenizer whose template renders tools= (Qwen-style) is used as is; deltas are cut from it."""
    qtok = copy.deepcopy(tok)
    qtok.chat_template = QWEN_LIKE
    fmt = ChatFormat(qtok)
    assert fmt.native and fmt.end_of_turn_id == 2
    msgs = [{"role": "system", "content": "Policy."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "<tool_call>{}</tool_call>"}, {"role": "tool", "content": "Error: x"},
            {"role": "assistant", "content": "Your email?"}, {"role": "user", "content": "a@b.c"}]
    ids = fmt.prompt_ids("Policy.", "Hi")
    for m in msgs[2:]:
        ids += (qtok(m["content"], add_special_tokens=False).input_ids + [2] if m["role"] == "assistant"
                else fmt.delta_ids(m["role"], m["content"]))
    assert qtok.decode(ids) == qtok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert qtok.decode(ids) == ChatFormat(tok).render(msgs) + "<|im_start|>assistant\n"   # same format as ours
    tools = ours.tool_schemas("retail")[:2]
    with_tools = qtok.decode(fmt.prompt_ids("Policy.", "Hi", tools))
    assert "# Tools: " + ",".join(t["function"]["name"] for t in tools) in with_tools       # template's own rendering
    assert tok.decode(ChatFormat(tok).prompt_ids("Policy.", "Hi", tools)).count('{"type": "function"') == 2   # ours


def test_system_prompt_lists_every_tool(tok):
    env = ours.Env(ours.make_tasks("retail", "train", 1)[0])
    sp = rollout.system_prompt(env.policy, env.tools)
    inside = sp.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(line)["function"]["name"] for line in inside] == [t["function"]["name"] for t in env.tools]
    assert sp.startswith(env.policy) and "<tool_call>" in sp
    assert len(ChatFormat(tok).prompt_ids(sp, "hi")) < 2500     # fits the 8192 context with room to talk


@pytest.mark.parametrize("text, n_calls, error", [
    ("Let me check.", 0, None),
    ('<tool_call>\n{"name": "get_order_details", "arguments": {"order_id": "#W1"}}\n</tool_call>', 1, None),
    ('<tool_call>{"name": "a", "arguments": {}}</tool_call> and <tool_call>{"name": "b", "arguments": {}}</tool_call>',
     2, None),
    ('<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>', 1, None),   # arguments as a JSON string
    ('<tool_call>{"name": "a"}</tool_call>', 1, None),                                 # no arguments -> {}
    ('<tool_call>{"name": "a", "arguments": {"x": 1}</tool_call>', 0, "not valid JSON"),
    ('<tool_call>{"name": "a", "arguments": {}}', 0, "unclosed"),
    ('<tool_call>["a", {}]</tool_call>', 0, '"name"'),
    ('<tool_call>{"name": "a", "arguments": [1]}</tool_call>', 0, '"arguments"'),
    ('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{oops</tool_call>', 1, "not valid JSON"),
])
def test_parse_tool_calls(text, n_calls, error):
    calls, err = parse_tool_calls(text)
    assert len(calls) == n_calls
    assert (err is None) if error is None else (error in err)
    if calls:
        assert calls[0]["name"] in ("get_order_details", "a") and isinstance(calls[0]["arguments"], dict)
    if "arguments\": \"{" in text:
        assert calls[0]["arguments"] == {"x": 1}


# ----------------------------------------------------------------------------- users

def say(text):
    return [{"role": "assistant", "content": text}]


def test_scripted_user_reveals_only_what_is_asked_and_yes_needs_the_reason():
    """cancel_order: a confirmation naming the order but the wrong reason, no reason, or both reasons gets
    a no and the right reason; naming the order and the right reason alone gets a yes; the user then
    waits for the report and only then stops."""
    task = next(t for t in tasks_by_scenario("retail") if t.scenario == "cancel_order")
    oid, reason = task.confirm_terms[0]["order_id"], task.confirm_terms[0]["reason"]
    wrong = next(r for r in ours.REASONS if r != reason)
    u = ScriptedUser(task, seed=3)
    assert task.opening in u.first_message()
    r = u.reply(say("Could you give me your email?"))
    assert task.hidden_facts["email"] in r and oid not in r
    r = u.reply(say(f"Please confirm: cancel order {oid}, reason {wrong}. Yes or no?"))   # the wrong reason
    assert r.startswith("No") and f"reason is {reason}" in r and STOP not in r, r
    r = u.reply(say(f"Please confirm: cancel order {oid}. Yes or no?"))                   # no reason at all
    assert r.startswith("No") and reason in r and STOP not in r
    r = u.reply(say(f"Please confirm: cancel order {oid}; reason {reason}; reason {wrong}. Yes or no?"))  # both
    assert r.startswith("No") and f"reason is {reason}" in r and STOP not in r, r
    r = u.reply(say(f"Please confirm: cancel order {oid}, reason {reason}. Yes or no?"))
    assert r.lower().startswith(("yes", "correct")) and STOP not in r
    for _ in range(2):                                   # confirmed, but the change is not reported yet
        r = u.reply(say("Let me check one more thing."))
        assert STOP not in r and r in WORDS["plain"].wait
    assert STOP in u.reply(say(f"Done: order {oid} is cancelled."))


def test_scripted_user_bag_count_must_be_the_new_total_and_patience_ends_a_wait():
    task = next(t for t in tasks_by_scenario("airline") if t.scenario == "add_bags")
    terms = task.confirm_terms[0]
    rid, total, card = terms["reservation_id"], terms["bags"], terms["payment_method"]
    u = ScriptedUser(task, seed=1, patience=5)
    r = u.reply(say(f"Please confirm: add bags to {rid}, total {int(total) + 1}{total}, paid with {card}. Proceed?"))
    assert r.startswith("No") and task.hidden_facts["bags"] in r          # "23" does not name "3"
    other = task.rivals["payment_method"][0]                               # the user's other card
    r = u.reply(say(f"Please confirm: reservation {rid}, total baggages {total}, payment {card} or {other}. Proceed?"))
    assert r.startswith("No") and f"payment method is {card}" in r
    r = u.reply(say(f"Please confirm: reservation {rid}, total baggages {total}, payment {card}. Proceed?"))
    assert r.lower().startswith(("yes", "correct"))
    assert [STOP in u.reply(say("One moment.")) for _ in range(3)] == [False, False, True]   # patience: 5 replies


def test_scripted_user_lookup_task_stops_when_outputs_said_and_patience_runs_out():
    task = next(t for t in tasks_by_scenario("retail") if t.scenario == "order_status_total")
    u = ScriptedUser(task, seed=0)
    assert STOP not in u.reply([{"role": "assistant", "content": "Your order is on its way."}])
    said = "Your order is " + " and the total is ".join(task.required_outputs) + "."
    assert STOP in u.reply([{"role": "assistant", "content": said}])
    u = ScriptedUser(task, seed=0, patience=3)
    replies = [u.reply([{"role": "assistant", "content": "Hmm."}]) for _ in range(4)]
    assert [STOP in r for r in replies] == [False, False, False, True]


def test_scripted_user_is_seeded_and_varied():
    task = tasks_by_scenario("retail")[1]
    conv = [{"role": "assistant", "content": "How can I help?"}]
    run = lambda seed: [ScriptedUser(task, seed).first_message()] + [ScriptedUser(task, seed).reply(conv)]
    assert run(5) == run(5)
    assert len({tuple(run(s)) for s in range(10)}) > 2


def test_no_user_gives_everything_up_front():
    task = tasks_by_scenario("airline")[1]
    first = envs.make_user("none", task, 0).first_message()
    assert task.instruction in first and all(v in first for v in task.hidden_facts.values())
    assert isinstance(envs.make_user("none", task, 0), NoUser) and envs.make_user("none", task, 0).ends_on_text
    with pytest.raises(SystemExit):
        envs.make_user("telepathic", task, 0)


# ----------------------------------------------------------------------------- agents and the loop

def test_model_agent_logprobs_are_the_sampling_distribution(tok, tiny):
    """Conversations of different lengths advanced over several rounds, as run_episodes does: every stored
    log-prob equals a teacher-forced recomputation of log_softmax(logits / T) on the unpadded row, rows are
    cut at end-of-turn, and the model is fed only what is new (the shared prefix once, then each row's
    appended turn). After a weight update the remembered keys/values are dropped and it stays exact."""
    model = copy.deepcopy(tiny)
    agent = ModelAgent(model, tok, temperature=1.3, max_new_tokens=12)
    fed = []                                           # real (not padding) tokens per forward call

    def count(module, args, kw):
        ids, mask = kw["input_ids"], kw.get("attention_mask")
        fed.append(ids.numel() if mask is None else int(mask[:, -ids.shape[1]:].sum()))
    model.model.register_forward_pre_hook(count, with_kwargs=True)
    common = tok("<|im_start|>system\nYou are a helpful agent.<|im_end|>\n", add_special_tokens=False).input_ids
    convs = [common + tok(x).input_ids for x in ("Hello there, how are you today?", "Hi", "Cancel #W1 now")]
    ranks, deltas = [], []                             # deltas: the user turns the last round appended
    for k in range(4):
        if k == 3:                                     # an optimizer step changes the weights in place
            with torch.no_grad():
                model.model.layers[0].self_attn.v_proj.weight.mul_(10.0)
        torch.manual_seed(k)
        fed.clear()
        outs = agent.act([AgentTurn(None, [], p) for p in convs])
        prefill = sum(fed[:len(fed) - max(len(ids) for ids, _ in outs) + 1])   # the calls before decoding
        assert len(outs) == len(convs)
        for p, (ids, lps) in zip(convs, outs):
            assert len(ids) == len(lps) and 0 < len(ids) <= 12
            assert 2 not in ids[:-1] and (ids[-1] == 2 or len(ids) == 12)
            with torch.no_grad():
                logits = model(torch.tensor([p + ids])).logits[0, len(p) - 1:-1]
            ref = torch.log_softmax(logits / 1.3, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
            print(f"round {k}: max |stored - recomputed| log-prob {(ref - torch.tensor(lps)).abs().max().item():.2e}")
            assert torch.allclose(ref, torch.tensor(lps), atol=1e-5)
            ranks += [(logits[t] > logits[t, i]).sum().item() for t, i in enumerate(ids) if i != 2]
        if k in (0, 3):   # nothing reusable: the common prefix once, then each row's own rest
            assert prefill == len(common) + sum(len(p) - len(common) for p in convs)
        else:             # each row's history is cached except its last sampled token and the new turn
            assert prefill == sum(1 + len(delta) for delta in deltas)
        deltas = [tok(f"<|im_end|>\n<|im_start|>user\nturn {k} of {j}{' and more' * 3 * j}<|im_end|>\n",
                      add_special_tokens=False).input_ids for j in range(len(convs))]   # new turns of 3 lengths
        convs = [p + ids + d for p, (ids, _), d in zip(convs, outs, deltas)]
    # generate's default top_k=50 is not in play: on a near-uniform random model most samples rank far beyond 50
    assert max(ranks) > 1000, ranks


def test_plan_waves_by_hand():
    """4 rows of 10/50/30/20 own tokens after a 100-token prefix, room 5. One wave with copies kept costs
    2 x 100 + 50 + 2 x 4 x 55 = 690; without copies a wave led by the 50-token row costs 250 + 55 b."""
    from sampler.attention import plan_waves
    own = [10, 50, 30, 20]
    assert plan_waves(own, 100, 5, None) == ([[0, 1, 2, 3]], True)
    assert plan_waves(own, 100, 5, 690) == ([[0, 1, 2, 3]], True)
    assert plan_waves(own, 100, 5, 689) == ([[1, 2, 3, 0]], False)               # fits, but not twice: no copies
    assert plan_waves(own, 100, 5, 400) == ([[1, 2], [3, 0]], False)             # 250 + 110; then 220 + 50
    assert plan_waves(own, 100, 5, 100) == ([[1], [2], [3], [0]], False)         # nothing fits: a row a wave


def test_waves_give_the_same_trajectories_as_one_batch(tok, tiny):
    """Greedy decoding in waves that fit a small KV budget gives exactly the conversations one big batch
    gives; a round that needs several waves keeps no row's keys/values for the next, only the shared prefix."""
    from sampler.attention import kv_bytes_per_token, sampler_scratch
    tasks = ours.make_tasks("retail", "train", 4)
    env = ours.Env(tasks[0])
    P = len(ChatFormat(tok).prompt_ids(env.policy, "", env.tools))             # about the prefix rows share
    per_row, per_token, once = sampler_scratch(tiny.config, torch.float32, P + 400, 400, packed=True)
    budget = (2 * P + 400) * kv_bytes_per_token(tiny.config, torch.float32) + 3 * per_row + P * per_token + once
    runs = {}
    for name, budget in (("one batch", None), ("waves", budget)):               # waves: a few rows' worth
        agent, rounds = ModelAgent(tiny, tok, temperature=0.0, max_new_tokens=8, kv_budget=budget), []
        act = agent.act

        def recorded(batch):                              # per round: wave sizes, rows kept, the shortest row, memo
            out = act(batch)
            rounds.append(([len(w) for w in agent.waves], agent.keeps_rows, min(len(turn.token_ids) for turn in batch),
                           [len(m[0]) for m in agent.memo]))
            return out
        agent.act = recorded
        runs[name] = run_episodes(agent, tok, tasks, group_size=2, max_turns=4, progress=False, seed=3,
                                  max_context=8192), rounds
    (one, one_rounds), (waves, wave_rounds) = runs["one batch"], runs["waves"]
    print("waves per round:", [w for w, *_ in wave_rounds])
    assert all(len(w) == 1 and keep for w, keep, *_ in one_rounds)
    assert all(len(w) > 1 and not keep for w, keep, *_ in wave_rounds)
    assert max(max(w) for w, *_ in wave_rounds) > 1                            # some waves batch several rows
    for *_, shortest_row, memo in wave_rounds:
        assert all(n < shortest_row for n in memo)                             # only the shared prefix is kept
    for a, b in zip(one, waves):
        assert (a.token_ids, a.loss_mask, a.messages, a.stop_reason) == (b.token_ids, b.loss_mask, b.messages, b.stop_reason)
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
    assert len({tuple(t.token_ids) for t in one}) == len(one)                  # 8 different conversations
    assert sum(t.stats["truncated_turns"] for t in one) < sum(t.turns for t in one)   # and rows end at different steps


def test_merged_lora_samples_as_the_adapter_does_and_gives_the_weights_back(tok, tiny):
    """ModelAgent samples with the LoRA delta folded into the weights (sampler.attention.lora_merged): greedy turns are
    the unmerged adapter's, every weight is bit for bit what it was, and each row's keys/values are still
    reused from one round to the next (the merge's own writes are not a weight change)."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer
    model = get_peft_model(copy.deepcopy(tiny), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, generator=torch.Generator().manual_seed(p.numel()), std=0.5)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    tasks, runs = ours.make_tasks("retail", "train", 2), {}
    for merge in (False, True):
        agent, seen = ModelAgent(model, tok, temperature=0.0, max_new_tokens=8, merge_lora=merge), []
        prefill = agent._prefill_wave

        def spy(rows, P, gid, agent=agent, prefill=prefill, seen=seen):   # per round: merged?, least own KV cached
            seen.append((any(m.merged for m in model.modules() if isinstance(m, LoraLayer)),
                         min(agent._cached(r)[0] - p for r, p in zip(rows, P))))
            return prefill(rows, P, gid)
        agent._prefill_wave = spy
        runs[merge] = run_episodes(agent, tok, tasks, group_size=2, max_turns=4, progress=False, seed=3,
                                   max_context=8192), seen
    (plain, plain_seen), (merged, merged_seen) = runs[False], runs[True]
    print("per round (merged, own tokens cached):", merged_seen)
    assert not any(m for m, _ in plain_seen) and all(m for m, _ in merged_seen)
    assert len(merged_seen) > 1 and all(c > 0 for _, c in merged_seen[1:])       # rows continue their cache
    for a, b in zip(plain, merged):
        assert (a.token_ids, a.messages, a.stop_reason) == (b.token_ids, b.messages, b.stop_reason)
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert not any(m.merged for m in model.modules() if isinstance(m, LoraLayer))


def test_two_system_prompts_decode_together_as_each_would_alone(tok, tiny):
    """Retail and airline rows in one batch: each group attends its own shared system prompt (prefilled once
    per group), decoding steps are shared, and every conversation equals the one its domain gives alone."""
    tasks = {d: ours.make_tasks(d, "train", 2) for d in ours.DOMAINS}
    agent = ModelAgent(tiny, tok, temperature=0.0, max_new_tokens=8)
    prefill = []
    hook = tiny.model.register_forward_pre_hook(lambda m, a, kw: prefill.append(kw["input_ids"].shape), with_kwargs=True)
    mixed = run_episodes(agent, tok, tasks["retail"] + tasks["airline"], group_size=2, max_turns=3, progress=False,
                         max_context=8192)
    hook.remove()
    prompts = sorted(shape[1] for shape in prefill if shape[0] == 1 and shape[1] > 500)   # the two system prompts
    alone = [t for d in ours.DOMAINS for t in run_episodes(ModelAgent(tiny, tok, temperature=0.0, max_new_tokens=8),
                                                           tok, tasks[d], group_size=2, max_turns=3, progress=False,
                                                           max_context=8192)]
    assert len(prompts) == 2                                                   # once each, in the first round
    for a, b in zip(mixed, alone):
        assert (a.task_id, a.token_ids, a.loss_mask, a.messages) == (b.task_id, b.token_ids, b.loss_mask, b.messages)
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
    assert len({tuple(t.token_ids) for t in mixed}) == len(mixed)


def test_run_episodes_token_exact_with_tiny_model(tok, tiny):
    tasks = tasks_by_scenario("retail")[:2] + tasks_by_scenario("airline")[:1]
    rec = Recorder(ModelAgent(tiny, tok, temperature=1.0, max_new_tokens=6))
    torch.manual_seed(0)
    trajs = run_episodes(rec, tok, tasks, group_size=2, max_turns=4, progress=False, seed=1, max_context=8192)
    fmt = ChatFormat(tok)
    assert [t.task_id for t in trajs] == [t.id for t in tasks for _ in range(2)]   # task-major
    assert [t.group for t in trajs] == [0, 0, 1, 1, 2, 2]
    for t in trajs:
        n = len(t.token_ids)
        assert len(t.loss_mask) == n == len(t.logprobs)
        assert [i for i, m in zip(t.token_ids, t.loss_mask) if m] == rec.sampled[id(t.messages)]
        assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.loss_mask) if not m)
        assert all(lp < 0.0 for lp, m in zip(t.logprobs, t.loss_mask) if m)
        assert tok.decode(t.token_ids) == expected_text(fmt, t.messages)
        assert t.stop_reason in ("user_stop", "max_turns") and 1 <= t.turns <= 4
        assert t.stats["sampled_tokens"] == sum(t.loss_mask)
        assert t.stats["truncated_turns"] == sum(1 for m in t.messages if m.get("truncated"))
        assert t.reward == 0.0 and t.diff != ""          # write tasks; a random model writes nothing right
    assert sum(t.stats["truncated_turns"] for t in trajs) > 0       # the 6-token cap was hit somewhere


class ScriptAgent(TextAgent):
    """Returns scripted text turn by turn (the i-th assistant turn gets script[i])."""

    def __init__(self, tokenizer, script):
        super().__init__(tokenizer)
        self.script = script

    def respond(self, task, messages):
        return self.script[sum(m["role"] == "assistant" for m in messages)]


def test_malformed_outputs_become_error_observations(tok):
    task = next(t for t in tasks_by_scenario("retail") if t.scenario == "order_status_total")
    call = lambda name, args: f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'
    script = ['<tool_call>{"name": "get_order_details", "arguments": {"order_id": </tool_call>',   # bad JSON
              "Let me look. <tool_call>" + json.dumps({"name": "get_order_details"}),             # unclosed
              call("delete_everything", {}),                                                      # unknown tool
              call("get_order_details", {}),                                                      # missing args
              call("find_user_id_by_email", {"email": task.hidden_facts["email"]})
              + call("get_order_details", {"order_id": task.hidden_facts["order_id"]}),           # two calls
              "Which order id?"]
    trajs = run_episodes(ScriptAgent(tok, script), tok, [task], max_turns=6, progress=False, max_context=8192)
    t = trajs[0]
    tool_obs = [m["content"] for m in t.messages if m["role"] == "tool"]
    assert len(tool_obs) == 5 and all(o.startswith("Error") for o in tool_obs[:4])
    assert tool_obs[4] == ours.Env(task).step("find_user_id_by_email", {"email": task.hidden_facts["email"]})
    s = t.stats
    assert (s["malformed_calls"], s["tool_errors"], s["tool_calls"], s["extra_calls_ignored"]) == (2, 2, 3, 1)
    assert t.stop_reason == "max_turns" and t.turns == 6 and t.reward == 0.0
    assert tok.decode(t.token_ids) == expected_text(ChatFormat(tok), t.messages)


def oracle_script(task):
    """The gold conversation as text: ask for the facts, confirm each write with its terms, act, report."""
    script = []
    if task.hidden_facts:
        script.append("Could you tell me your " + ", ".join(users.FACT_KEYWORDS[k][0] for k in task.hidden_facts) + "?")
    writes = iter(task.confirm_terms)
    for a in task.gold_actions:
        if a.name in ours.WRITE_TOOLS[task.domain]:
            terms = [t if isinstance(t, str) else t[0] for t in next(writes).values()]
            script.append(f"I will run {a.name} for {' '.join(terms)}. Shall I proceed?")
        script.append(f'<tool_call>\n{json.dumps({"name": a.name, "arguments": a.arguments})}\n</tool_call>')
    script.append("All done. I cannot do anything else here. " + " ".join(task.required_outputs))
    return script


@pytest.mark.parametrize("domain", ours.DOMAINS)
def test_oracle_script_gets_reward_one_with_scripted_user(tok, domain):
    """End to end with the real env: an agent that asks, confirms and acts like the gold trajectory
    is rewarded 1.0 and the scripted user ends the episode (or the agent transfers)."""
    tasks = tasks_by_scenario(domain)
    trajs = []
    for task in tasks:
        trajs += run_episodes(ScriptAgent(tok, oracle_script(task)), tok, [task], max_turns=20, progress=False,
                              max_context=8192)
    for task, t in zip(tasks, trajs):
        assert (t.reward, t.stop_reason) in ((1.0, "user_stop"), (1.0, "transfer")), (task.scenario, t.diff,
                                                                                        t.messages[-3:])
        assert t.diff == "" and t.stats["tool_errors"] == 0 and t.turns == len(oracle_script(task))
        # TextAgent turns are mask 1 with log-prob 0.0 (for SFT); every other token is mask 0
        assert sum(t.loss_mask) == t.stats["sampled_tokens"] and not any(t.logprobs)


def test_no_user_ends_at_first_text_turn_and_context_limit(tok):
    task = tasks_by_scenario("retail")[0]
    t = run_episodes(ScriptAgent(tok, ["Hello!"] * 3), tok, [task], user=envs.UserFactory("none"), progress=False,
                     max_turns=30, max_context=8192)[0]
    assert (t.stop_reason, t.turns) == ("agent_stop", 1)
    t = run_episodes(ScriptAgent(tok, ["Hello!"] * 3), tok, [task], max_context=500, progress=False, max_turns=30)[0]
    assert (t.stop_reason, t.turns) == ("context_limit", 0)       # the system prompt alone is ~1800 tokens


def test_the_system_prompt_length_the_docs_state(tok):
    """docs/personas.md and common.CPU_LIMITS' comment say how long a domain's system prompt (policy and tools) is
    in the default model's tokens: retail 1,759, airline 1,581."""
    said = {}
    for domain in ours.DOMAINS:
        env = ours.make_env(ours.make_tasks(domain, "train", 1)[0])
        said[domain] = len(tok(rollout.system_prompt(env.policy, env.tools), add_special_tokens=False).input_ids)
    print(said)
    assert said == {"retail": 1759, "airline": 1581}


def test_print_one_trajectory_token_by_token(tok):
    """STYLE rule 7: show exactly what gets trained (mask 1) and what is context (mask 0)."""
    task = next(t for t in tasks_by_scenario("retail") if t.scenario == "cancel_order")
    script = ["Sure. What is your email?",
              f'<tool_call>\n{json.dumps({"name": "find_user_id_by_email", "arguments": {"email": task.hidden_facts["email"]}})}\n</tool_call>']
    t = run_episodes(ScriptAgent(tok, script), tok, [task], max_turns=2, progress=False, max_context=8192)[0]
    start = [i for i, x in enumerate(t.token_ids) if x == 1][1]    # skip the system prompt
    print(f"\n{t.task_id}: {len(t.token_ids)} tokens, {sum(t.loss_mask)} trained; the tail from token {start}:")
    for i in range(start, len(t.token_ids)):
        print(f"{i:5d} {t.token_ids[i]:6d} mask={t.loss_mask[i]} {tok.decode([t.token_ids[i]])!r}")
    first_trained = t.loss_mask.index(1)
    assert tok.decode(t.token_ids[first_trained - 4:first_trained]) == "<|im_start|>assistant\n"
    assert tok.decode([i for i, m in zip(t.token_ids, t.loss_mask) if m]) == \
        "Sure. What is your email?<|im_end|>" + script[1] + "<|im_end|>"


def test_user_seeds_pair_episodes_across_batches(tok):
    """A (task, trial) meets the same simulated user whatever else is in the batch, so two agents evaluated
    in different batches are compared on the same users (eval.paired_difference relies on it)."""
    tasks = [t for t in ours.make_tasks("retail", "test", 14) if t.confirm_terms][:6]
    together = run_episodes(ScriptAgent(tok, ["Hi, what is the reason?"] * 2), tok, tasks, group_size=2,
                            max_turns=2, seed=5, progress=False, max_context=8192)
    alone = [tr for t in reversed(tasks) for tr in run_episodes(ScriptAgent(tok, ["Hi, what is the reason?"] * 2),
                                                                   tok, [t], group_size=2, max_turns=2, seed=5,
                                                                   progress=False, max_context=8192)]
    key = lambda tr: (tr.task_id, tr.trial)                          # noqa: E731
    users_of = lambda trs: {key(tr): [m["content"] for m in tr.messages if m["role"] == "user"] for tr in trs}  # noqa: E731
    assert users_of(together) == users_of(alone)
    assert len({tuple(v) for v in users_of(together).values()}) > 3   # and the users do differ between episodes
