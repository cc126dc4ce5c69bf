"""Reference backends for `scripts/bench_targets.py`: transformers generate and ModelRunner in-process."""
