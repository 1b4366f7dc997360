"""dpprobe's jobs (extract, probe, account, demo) as a Python API, and the `dpprobe` CLI."""

from pipelines.jobs import account, probe_table, run_demo, run_extract, run_probe

__all__ = ["account", "probe_table", "run_demo", "run_extract", "run_probe"]
