"""scripts/gpu_check.py's bad input: one line on stderr naming the flag or the missing package, exit 2, before
anything loads. The check's CPU rehearsal itself (`python scripts/gpu_check.py --cpu`) runs in .ci/run, after
the fast suite: it takes minutes."""
import importlib.util

import pytest
import torch

from scripts import gpu_check

CASES = [   # bad flags, what the line must name
    (["--cpu", "--parts", "kernel,nope"], "--parts"),
    (["--cpu", "--update-seqs", "1"], "--update-seqs"),
    (["--cpu", "--kv-budget", "nan"], "--kv-budget"),
    (["--cpu", "--rep", "0"], "--rep"),
]


@pytest.mark.parametrize("flags, name", CASES, ids=[" ".join(f) for f, _ in CASES])
def test_each_bad_flag_is_one_line_naming_it_and_exit_2(capsys, flags, name):
    with pytest.raises(SystemExit) as e:
        gpu_check.parse_args(flags)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and name in err[0], err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_without_cuda_the_gpu_command_says_so_and_points_at_the_rehearsal(capsys):
    with pytest.raises(SystemExit) as e:
        gpu_check.parse_args([])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "no CUDA device" in err[0] and "--cpu" in err[0], err


def test_a_package_the_kit_carries_missing_is_named_with_the_kit_script(capsys, monkeypatch):
    monkeypatch.setattr(gpu_check, "KIT", gpu_check.KIT + ("no_such_carried_package",))
    with pytest.raises(SystemExit) as e:
        gpu_check.parse_args(["--cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert "no_such_carried_package" in err[0] and "scripts/gpu_kit.sh" in err[0], err


def test_the_stages_flags_parse_as_they_would_on_a_gpu_without_vllm(monkeypatch):
    """A GPU picks the stages' GPU presets, whose scripts/rl_trl.py colocates vLLM, which the GPU test machine lacks: the
    flags the check passes each stage must parse there too (the CPU rehearsal never takes that preset)."""
    from types import SimpleNamespace
    import rl
    from scripts import rl_trl
    from scripts import bench_trl
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    ns = SimpleNamespace(model="a-model-dir", tasks=2, group_size=4, max_turns=2, max_new_tokens=16, max_context=3072,
                         micro_batch=2)
    for stage, module in (("rl", rl), ("rl_trl", rl_trl)):
        args = module.parse_args(bench_trl.stage_argv(stage, ns, "out") + gpu_check.STAGE_FLAGS)
        assert args.load_in_4bit and args.grad_checkpointing == "on" and args.steps == 1
    assert args.vllm == "off"


def test_the_stages_part_runs_alone_and_the_check_ends_with_its_table(monkeypatch, tmp_path, capsys):
    """--parts stages uses no 8B model: main must not look for the last part that does (it raised IndexError). The
    stages themselves (two subprocesses, minutes) are stood in for by a part that passes one check."""
    ran = []
    monkeypatch.setattr(gpu_check, "part_stages", lambda args, ctx, part: ran.append(ctx.model)
                        or gpu_check.check(part, "stood in", True, "-"))
    assert gpu_check.main(["--cpu", "--parts", "stages", "--out", str(tmp_path)]) == 0
    assert ran == [None] and "| stages: stood in | - | OK |" in capsys.readouterr().out
    assert (tmp_path / "gpu_check.json").exists()
