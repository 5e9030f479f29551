"""The house rules a reader relies on: imports run one way (world <- loop <- stages), with no circle even
through an import inside a function; the world side never imports a benchmark module or the model side; the
stages never import each other; no file outgrows a sitting; and bitsandbytes' probe of our kernels/ package
logs no false error, while a real one still prints (a whole run's log: tests/test_rl.py's smoke test)."""
import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULES = sorted(p[:-3] for p in os.listdir(ROOT) if p.endswith(".py")) + ["kernels", "scripts"]
STAGES = {"sft", "rl", "rl_trl", "eval"}
WORLD_SIDE = {"databases", "envs", "users", "oracle"}        # ours; a benchmark module sits between it and worlds


def imports_of(name: str) -> set:
    """Our modules that `name` imports anywhere in its source, inside functions included, plus (for worlds.py)
    the modules its table names, which it imports by name."""
    path = os.path.join(ROOT, name if name in ("kernels", "scripts") else f"{name}.py")
    files = [os.path.join(path, f) for f in os.listdir(path) if f.endswith(".py")] if os.path.isdir(path) else [path]
    names = set()
    for f in files:
        tree = ast.parse(open(f).read())
        names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and not n.level}
    if name == "worlds":
        import worlds
        names |= {m for _, *modules in worlds.WORLDS.values() for m in modules}
    return {n.split(".")[0] for n in names} & set(MODULES) - {name}


def test_no_module_imports_another_in_a_circle_lazy_imports_included():
    graph = {m: imports_of(m) for m in MODULES}
    print({m: sorted(v) for m, v in graph.items()})
    state = {}

    def visit(m, path):
        if state.get(m) == "open":
            raise AssertionError("import circle: " + " -> ".join(path[path.index(m):] + [m]))
        if state.get(m) != "done":
            state[m] = "open"
            for n in sorted(graph[m]):
                visit(n, path + [m])
            state[m] = "done"
    for m in MODULES:
        visit(m, [])


def test_the_world_side_imports_no_benchmark_and_nothing_of_the_model_side():
    import worlds
    benchmarks = {m for _, *modules in worlds.WORLDS.values() for m in modules} - WORLD_SIDE
    for m in WORLD_SIDE:
        assert imports_of(m) <= WORLD_SIDE, (m, imports_of(m))
    for m in benchmarks & set(MODULES):       # a benchmark module uses the world side, never the model side
        assert imports_of(m) <= WORLD_SIDE, (m, imports_of(m))
    assert imports_of("worlds") - benchmarks <= WORLD_SIDE
    assert imports_of("rollout") == {"users", "worlds"}


def test_stages_do_not_import_each_other_and_nothing_imports_a_stage_or_a_script():
    for m in set(MODULES) - {"scripts"}:               # scripts/ run the stages: benchmarks, the GPU check
        assert not imports_of(m) & STAGES, f"{m} imports the stage(s) {imports_of(m) & STAGES}"
        assert "scripts" not in imports_of(m), f"{m} imports scripts/, which only the stages' users run"


def test_kernels_holds_kernels_and_their_own_benchmark_only():
    """Benchmarks of whole stages live in scripts/: kernels/ imports nothing of the loop or the stages."""
    assert imports_of("kernels") == set(), imports_of("kernels")


def test_no_file_is_over_700_lines():
    for path in [p for p in os.listdir(ROOT) if p.endswith(".py")] + [f"{d}/{p}" for d in ("kernels", "scripts")
                                                                       for p in os.listdir(os.path.join(ROOT, d)) if p.endswith(".py")]:
        n = sum(1 for _ in open(os.path.join(ROOT, path)))
        assert n <= 700, f"{path} has {n} lines"


PROBE = """
import importlib, sys
import bitsandbytes, bitsandbytes.functional as F
F.has_avx512bf16 = lambda: True          # take the AVX512-BF16 branch whatever this CPU has
import bitsandbytes.backends.cpu.ops as ops
importlib.reload(ops)                    # re-runs bitsandbytes' probe: `from kernels import get_kernel`
ops.logger.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s.", RuntimeError("a real one"))
"""


def test_bitsandbytes_probe_of_our_kernels_package_is_silenced_and_real_errors_are_not():
    """bitsandbytes looks for the hub package `kernels`, finds ours and logs a false error. The filter in
    kernels/__init__.py drops exactly that record; a record about any other failure still prints."""
    err = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True).stderr
    lines = [l for l in err.splitlines() if "kernels-community" in l]
    print("\n".join(lines))
    assert lines == ["Failed to load CPU gemm_4bit_forward from kernels-community: a real one."]


def test_wrapping_a_model_in_lora_prints_no_future_warning():
    """peft reads a property transformers deprecates; rollout.add_lora / load_adapter keep that one warning out of
    every run's log (and only that one)."""
    code = ("import warnings, torch, rollout; from transformers import LlamaConfig, LlamaForCausalLM\n"
            "m = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,"
            " num_attention_heads=2, num_key_value_heads=1))\n"
            "rollout.add_lora(m, r=2, alpha=4)\nwarnings.warn('a later FutureWarning still shows', FutureWarning)\n")
    err = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True).stderr
    assert "is_gradient_checkpointing" not in err and "a later FutureWarning still shows" in err
