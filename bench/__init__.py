"""Benchmarks: the timed runner (`bench.run`), the history and its check (`bench.history`),
the dashboard (`bench.dashboard`) and the schema of the cited records (`bench.records`).

Not part of the installed distribution: run from the repository root
(`python -m bench.run`, `python -m bench.history`).
"""
