"""Benchmarks against peers: `python -m bench [NAME]`; each writes .posttrain/bench/<name>.json."""
