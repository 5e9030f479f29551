"""The README says only what the code does: every `file.py:name` it points to exists, every script it tells a
reader to run exists, and every behaviour it promises names a test that checks it."""
import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md")).read()

# A promise the README makes (its words, verbatim) -> the test that keeps it: (test file, test function).
PROMISES = {
    "history is never decoded and re-tokenized": ("test_rollout.py", "test_run_episodes_token_exact_with_tiny_model"),
    "Malformed tool calls become an\n`Error: ...` tool observation": ("test_rollout.py",
                                                                     "test_malformed_outputs_become_error_observations"),
    "a trajectory printed token by token with its mask": ("test_rollout.py", "test_print_one_trajectory_token_by_token"),
    "then `ModelAgent`, tested equal": ("test_sampler.py", "test_fast_sampler_equals_the_plain_one_greedy"),
    "resume from their newest good checkpoint when rerun after a kill": (
        "test_rl.py", "test_sigkill_then_restart_resumes_from_last_checkpoint"),
    "a damaged one is skipped with one line": ("test_rl.py", "test_a_damaged_newest_checkpoint_falls_back_to_the_one_before"),
    "A bad flag is one line and exit status 2 before any model loads": (
        "test_validation.py", "test_each_bad_flag_is_one_line_naming_it_and_exit_2"),
    "fails on any\nimport circle, lazy imports included": (
        "test_layout.py", "test_no_module_imports_another_in_a_circle_lazy_imports_included"),
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


def defined(path: str, dotted: str) -> bool:
    """Is `dotted` (a function, a class, or Class.method) defined at the top of the Python file at path?"""
    scope = ast.parse(open(os.path.join(ROOT, path)).read()).body
    for part in dotted.split("."):
        found = [n for n in scope if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part]
        if not found:
            return False
        scope = getattr(found[0], "body", [])
    return True


def test_every_file_function_the_readme_names_exists():
    pointers = sorted(set(re.findall(r"`([\w/]+\.py):([\w.]+)`", README)))
    print(pointers)
    assert len(pointers) >= 8                                   # the "where to read each piece" table
    missing = [f"{f}:{name}" for f, name in pointers if not os.path.isfile(os.path.join(ROOT, f)) or not defined(f, name)]
    assert not missing, missing


def test_every_script_the_readme_runs_exists():
    scripts = sorted(set(re.findall(r"python (?:-m )?([\w/]+\.py)", README)))
    assert "sft.py" in scripts and "rl.py" in scripts
    assert [s for s in scripts if not os.path.isfile(os.path.join(ROOT, s))] == []


@pytest.mark.parametrize("promise", list(PROMISES))
def test_every_promise_names_a_test_that_exists(promise):
    assert promise in README, f"the README no longer says {promise!r}: update PROMISES"
    file, name = PROMISES[promise]
    assert defined(os.path.join("tests", file), name), f"{file}::{name} is gone; the README still promises it"
