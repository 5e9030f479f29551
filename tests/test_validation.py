"""Bad input gets one clear line before any work: each class of bad flag exits with status 2 and one line on
stderr that names the flag. Every case goes through the script's own argument parsing (in-process, fast); one
case per script also runs as a user types it, where the model cache points at an empty dir: a script that got
as far as loading the default model would convert the bundled GGUF there, so an empty cache afterwards means
no model was loaded, and no --out dir may be left behind."""
import importlib
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CASES = [   # script, bad flags, the flag the line must name
    ("rl.py", ["--domains", "nope"], "--domains"),
    ("rl.py", ["--domains", "airline,tau2-nope"], "--domains"),
    ("rl.py", ["--lr", "nan"], "--lr"),
    ("rl.py", ["--lr", "-1e-4"], "--lr"),
    ("rl.py", ["--lr", "abc"], "--lr"),
    ("rl.py", ["--group-size", "1"], "--group-size"),
    ("rl.py", ["--screen", "8"], "--screen"),
    ("rl.py", ["--steps", "-1"], "--steps"),
    ("rl.py", ["--steps", "0"], "--steps"),
    ("rl.py", ["--temperature", "0"], "--temperature"),
    ("rl.py", ["--user", "gpt4"], "--user"),
    ("rl.py", ["--user", "openai:"], "--user"),
    ("rl.py", ["--user", "scripted:nope"], "--user"),
    ("rl.py", ["--user", "scripted,none"], "--user"),
    ("rl.py", ["--user", "scripted:curious"], "--user"),           # a held-out persona: training on it voids eval
    ("rl.py", ["--user", "scripted:heldout"], "--user"),
    ("rl.py", ["--user", "scripted:terse+literal"], "--user"),
    ("rl.py", ["--user", "none:x"], "--user"),
    ("rl.py", ["--init", "no/such/adapter"], "--init"),
    ("rl.py", ["--tiers", "easiest"], "--tiers"),
    ("rl.py", ["--max-context", "64", "--max-new-tokens", "80"], "--max-context"),
    ("rl.py", ["--kl-coef", "inf"], "--kl-coef"),
    ("rl.py", ["--no-such-flag"], "--no-such-flag"),
    ("rl.py", ["--user-price", "2.5"], "--user-price"),
    ("rl.py", ["--user-retries-on-check", "-1"], "--user-retries-on-check"),
    ("rl.py", ["--max-sim-failures", "nan"], "--max-sim-failures"),
    ("rl.py", ["--report-to", "mlflow"], "--report-to"),
    ("eval.py", ["--domains", "tau2-nope"], "--domains"),
    ("eval.py", ["--n-tasks", "0"], "--n-tasks"),
    ("eval.py", ["--trials", "-2"], "--trials"),
    ("eval.py", ["--agents", "base,no/such/adapter"], "--agents"),
    ("eval.py", ["--user", "robot"], "--user"),
    ("eval.py", ["--user", "scripted:nope"], "--user"),
    ("eval.py", ["--user", "scripted,none,scripted:nope"], "--user"),
    ("eval.py", ["--paired-metric", "pass1,pass2"], "--paired-metric"),
    ("eval.py", ["--temperature", "-1"], "--temperature"),
    ("eval.py", ["--user-price", "1,-2"], "--user-price"),
    ("eval.py", ["--max-sim-failures", "-0.5"], "--max-sim-failures"),
    ("eval.py", ["--user-check", "maybe"], "--user-check"),
    ("eval.py", ["--user-timeout", "0"], "--user-timeout"),
    ("sft.py", ["--domains", "retail,nope"], "--domains"),
    ("sft.py", ["--lr", "0"], "--lr"),
    ("sft.py", ["--batch-size", "3", "--micro-batch-size", "2"], "--batch-size"),
    ("sft.py", ["--tasks-per-scenario", "0"], "--tasks-per-scenario"),
    ("sft.py", ["--user", "none", "--domains", "retail,tau2-retail"], "--user"),
    ("sft.py", ["--user", "local"], "--user"),
    ("sft.py", ["--user", "scripted:literal"], "--user"),
    ("sft.py", ["--user", "scripted:nope"], "--user"),
    ("scripts/rl_trl.py", ["--group-size", "1"], "--group-size"),
    ("scripts/rl_trl.py", ["--domains", "nope"], "--domains"),
    ("scripts/rl_trl.py", ["--tasks", "3", "--group-size", "4", "--micro-batch", "5"], "--micro-batch"),
    ("scripts/rl_trl.py", ["--vllm", "colocate"], "--vllm"),
    ("scripts/rl_trl.py", ["--user", "scripted:curious"], "--user"),
    ("sampler/bench.py", ["--domain", "nope"], "--domain"),
    ("sampler/bench.py", ["--tasks", "0"], "--tasks"),
    ("sampler/bench.py", ["--bench", "--rows", "8,x"], "--rows"),
]


@pytest.mark.parametrize("script, flags, flag", CASES, ids=[f"{s} {' '.join(f)}" for s, f, _ in CASES])
def test_each_bad_flag_is_one_line_naming_it_and_exit_2(capsys, monkeypatch, script, flags, flag):
    module = importlib.import_module(script[:-3].replace("/", "."))
    monkeypatch.setattr(sys, "argv", [script, *flags])
    with pytest.raises(SystemExit) as e:
        module.parse_args(flags) if script != "sampler/bench.py" else module.main()
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and flag in err[0], err


FIRST_OF_EACH_SCRIPT = [c for i, c in enumerate(CASES) if c[0] not in {s for s, _, _ in CASES[:i]}]


@pytest.mark.parametrize("script, flags, flag", FIRST_OF_EACH_SCRIPT, ids=[s for s, _, _ in FIRST_OF_EACH_SCRIPT])
def test_from_the_command_line_no_model_loads_and_no_out_dir_is_left(tmp_path, script, flags, flag):
    cache, out = tmp_path / "cache", tmp_path / "out"
    cache.mkdir()
    argv = [sys.executable, script, *flags, "--out", str(out)] if script != "sampler/bench.py" else \
        [sys.executable, "-m", "sampler.bench", *flags]
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "MUA_RL_CACHE": str(cache)})
    lines = r.stderr.strip().splitlines()
    print(r.stderr.strip())
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert len(lines) == 1 and flag in lines[0], lines
    assert r.stdout == ""                        # not even the arguments: nothing ran
    assert not out.exists() and not os.listdir(cache)


@pytest.mark.parametrize("script, preset, flag, number", [("rl.py", "cpu", "--tasks", "8"), ("rl.py", "gpu", "--tasks", "32"),
                                                          ("sft.py", "cpu", "--lr", "0.001"),
                                                          ("eval.py", "gpu", "--trials", "4")])
def test_help_shows_the_presets_numbers(capsys, monkeypatch, script, preset, flag, number):
    """--help names each flag's default in use, the preset's number where a preset sets it."""
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as e:
        importlib.import_module(script[:-3]).parse_args(["--preset", preset, "--help"])
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.strip().startswith(flag + " "))
    print(line)
    assert e.value.code == 0 and line.endswith(f"(default: {number})")
    assert f"the {preset!r} preset" in out
