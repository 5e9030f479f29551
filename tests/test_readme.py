"""The README and the docs pages say only what the code does: every `file.py:name` they point to exists, every
chain `a.py:f` -> `b.py:g` the README draws is a call in the code, every script they tell a reader to run exists,
and every behaviour they promise names a test that checks it."""
import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md")).read()
PAGES = {name: open(os.path.join(ROOT, "docs", name)).read() for name in os.listdir(os.path.join(ROOT, "docs"))
         if name.endswith(".md")}
ALL = "\n".join([README, *PAGES.values()])

# A promise the README or a docs page makes (its words, verbatim) -> the test that keeps it: (test file, function).
PROMISES = {
    "history is never decoded and re-tokenized": ("test_rollout.py", "test_run_episodes_token_exact_with_tiny_model"),
    "Malformed tool calls become an\n`Error: ...` tool observation": ("test_rollout.py",
                                                                     "test_malformed_outputs_become_error_observations"),
    "a trajectory printed token by token with its mask": ("test_rollout.py", "test_print_one_trajectory_token_by_token"),
    "`sampler/fast.py` is the same tokens, faster, tested equal": (
        "test_sampler.py", "test_fast_sampler_equals_the_plain_one_greedy"),
    "`--sampler plain` runs it": ("test_rl.py", "test_the_plain_sampler_runs_rl_and_eval_with_the_fast_ones_tokens"),
    "resume from their newest good checkpoint when rerun after a kill": (
        "test_rl.py", "test_sigkill_then_restart_resumes_from_last_checkpoint"),
    "damaged one is skipped with one line": ("test_rl.py", "test_a_damaged_newest_checkpoint_falls_back_to_the_one_before"),
    "A bad flag is one line and exit status 2 before any model loads": (
        "test_validation.py", "test_each_bad_flag_is_one_line_naming_it_and_exit_2"),
    "`--help` shows every default in use": ("test_validation.py", "test_help_shows_the_presets_numbers"),
    "fails on any import circle, lazy imports included": (
        "test_layout.py", "test_no_module_imports_another_in_a_circle_lazy_imports_included"),
    "`tests/test_layout.py` holds it to this": ("test_layout.py", "test_the_top_level_is_the_design_cards"),
    "The gold oracle scores 1 on all 278 base tasks": (
        "test_tau2.py", "test_gold_oracle_scores_one_and_doing_nothing_only_on_the_no_change_tasks"),
    "Replaying the gold paths scores 41 of 50": (
        "test_acebench.py", "test_gold_path_through_run_episodes_scores_one_except_the_flawed_paths"),
    "its four multi-turn\ncategories are four domains, run through the same loop": (
        "test_bfcl.py", "test_gold_agent_passes_all_four_categories_through_run_episodes"),
    "Tests on CPU check\nthe rows token for token against the Trajectory": (
        "test_rl_trl.py", "test_trl_trains_on_the_trajectory_ids_and_masks_token_for_token"),
    "two gloo ranks under `torchrun` ending with identical LoRA\nweights": (
        "test_rl_trl.py", "test_torchrun_two_processes_hold_whole_groups_and_end_with_identical_lora"),
}
POINTER = r"`([\w/]+\.py):([\w.]+)`"


def node(path: str, dotted: str):
    """The function or class `dotted` (a name, or Class.method) defined at the top of the Python file at path."""
    scope = ast.parse(open(os.path.join(ROOT, path)).read()).body
    found = None
    for part in dotted.split("."):
        found = next((n for n in scope if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part), None)
        if found is None:
            return None
        scope = found.body
    return found


def defined(path: str, dotted: str) -> bool:
    return node(path, dotted) is not None


def calls(path: str, dotted: str) -> set:
    """The names a function calls: f(...) and x.f(...) both give f."""
    return {c.func.id if isinstance(c.func, ast.Name) else c.func.attr for c in ast.walk(node(path, dotted))
            if isinstance(c, ast.Call) and isinstance(c.func, (ast.Name, ast.Attribute))}


def test_every_file_function_the_pages_name_exists():
    pointers = sorted(set(re.findall(POINTER, ALL)))
    print(pointers)
    assert len(pointers) >= 8                                   # the "where to read each piece" table
    missing = [f"{f}:{name}" for f, name in pointers if not os.path.isfile(os.path.join(ROOT, f)) or not defined(f, name)]
    assert not missing, missing


def test_every_call_chain_the_readme_draws_is_the_code_s():
    """`a.py:f` -> `b.py:g` in the README means f calls g: the chain a reader follows is the one that runs."""
    links = []
    for line in README.splitlines():
        hops = [m for m in re.finditer(POINTER + r"( -> )?", line)]
        links += [(a.group(1), a.group(2), b.group(1), b.group(2)) for a, b in zip(hops, hops[1:]) if a.group(3)]
    print("\n".join(f"{a}:{f} -> {b}:{g}" for a, f, b, g in links))
    assert len(links) >= 6
    broken = [f"{a}:{f} -> {b}:{g}" for a, f, b, g in links if g.split(".")[-1] not in calls(a, f)]
    assert not broken, broken


def test_every_script_the_pages_run_exists_or_the_history_holds_it():
    """A script the pages run is in the tree, or it is a finished experiment's, which results.md's table of recipes
    names with the commit that runs it (the tree holds what runs at its commit)."""
    scripts = sorted(set(re.findall(r"python (?:-m )?([\w/]+\.py)", ALL)))
    assert "sft.py" in scripts and "rl.py" in scripts
    results = PAGES["results.md"]
    table = results[results.index("## The finished experiments' recipes, in the history"):]
    table = table[:table.index("\n## ")]
    in_history = set(re.findall(r"scripts/\w+\.(?:py|sh)|\b\w+_report\.py", table))
    gone = [s for s in scripts if not os.path.isfile(os.path.join(ROOT, s))]
    print("in the history:", gone)
    assert [s for s in gone if s not in in_history and os.path.basename(s) not in in_history] == []


def test_every_docs_page_is_linked_from_the_readme_once():
    for name in PAGES:
        assert README.count(f"](docs/{name})") == 1, name


def test_the_readme_reads_in_ten_minutes():
    """Ten minutes at about 230 words a minute (adults read non-fiction silently at ~238, Brysbaert 2019). Words,
    not lines: a line cap is met by reflowing, a word count only by saying less."""
    assert len(README.split()) <= 2300


@pytest.mark.parametrize("promise", list(PROMISES))
def test_every_promise_names_a_test_that_exists(promise):
    words = " ".join(promise.split())                   # a promise may wrap anywhere: compare the words
    assert words in " ".join(ALL.split()), f"the README and docs no longer say {promise!r}: update PROMISES"
    file, name = PROMISES[promise]
    assert defined(os.path.join("tests", file), name), f"{file}::{name} is gone; the README still promises it"
