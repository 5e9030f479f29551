"""envs/benchmarks/: the benchmarks' adapters, each a world behind the same five functions as our domains
(envs/__init__.py lists them): τ²-bench (tau2_domains.py), ACEBench's agent category (acebench_domains.py), BFCL-v3
multi-turn (bfcl_domains.py). Each scores with the benchmark's own evaluator. Our world (envs/ours.py, users.py)
never imports them; they use it (its cut-short rule, its users)."""
