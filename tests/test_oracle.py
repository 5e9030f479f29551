"""Our world's gold agent (oracle.py): it solves every scenario through the real loop and scripted user, with only
its own tokens trained, and its confirmations say back what the user asked for."""
import re

import envs
import oracle
import rollout
import users


def test_oracle_solves_tasks_of_every_scenario():
    for key, words in users.FACT_KEYWORDS.items():                 # its questions use the user's keywords
        assert any(w in oracle.QUESTIONS.get(key, words[0]) for w in words), key
    tok = rollout.load_tokenizer()
    agent = rollout.OracleAgent(tok)
    for domain in envs.DOMAINS:
        tasks = envs.make_tasks(domain, "train", 3 * len(envs.SCENARIOS[domain]), seed=5)   # 3 per scenario
        trajs = rollout.run_episodes(agent, tok, tasks, user="scripted", seed=0, progress=False)
        bad = [(t.task_id, t.scenario, t.stop_reason, t.diff[:200]) for t in trajs if t.reward != 1.0]
        print(domain, f"{len(trajs) - len(bad)}/{len(trajs)} solved")
        assert not bad, bad
        for t in trajs:                                           # the agent's tokens, and only them, are trained
            assert len(t.loss_mask) == len(t.token_ids) and 0 < sum(t.loss_mask) < len(t.token_ids)


def test_bag_confirmation_says_the_request_back_before_the_sum():
    """add_bags: the oracle's confirmation repeats the user's own words "add K more checked bag(s) to
    reservation R" and then the sum to the new total; other writes name only the call."""
    seen = set()
    for t in envs.make_tasks("airline", "train", 60, seed=1):
        write = t.gold_actions[-1]
        text = oracle.confirmation(t, write)
        if t.scenario != "add_bags":
            assert "more checked bag" not in text, text
            continue
        request = re.search(r"add (\d) more checked bags? to reservation \w+", t.opening)
        total = write.arguments["total_baggages"]
        assert text.startswith(f"Please confirm: {request[0]}, "), text
        assert f"{total - int(request[1])} + {request[1]} = {total}" in text, text
        seen.add(request[1])
    assert seen == {"1", "2"}                                      # both requests were checked
