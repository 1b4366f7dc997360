"""dpprobe's jobs (extract, probe, tune, account, verify, demo) as a Python API, and the CLI."""

from pipelines.jobs import (
    account,
    probe_table,
    run_demo,
    run_extract,
    run_extract_ray,
    run_probe,
    run_tune,
    store_info,
    tune_report,
    verify,
)
from pipelines.search import linear_scaling_search

__all__ = [
    "account",
    "linear_scaling_search",
    "probe_table",
    "run_demo",
    "run_extract",
    "run_extract_ray",
    "run_probe",
    "run_tune",
    "store_info",
    "tune_report",
    "verify",
]
