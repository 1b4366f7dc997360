"""dpprobe's jobs (extract, probe, tune, finetune, account, audit, verify, info, demo, predict,
export)
as a Python API, and the CLI.

Each job is one module with its frozen config: `run_probe(ProbeConfig(...))`, or the config's
fields as keywords, `run_probe(store, epsilons=[1, 8], delta=1e-5)`.
"""

from dpprobe.pipelines.account_job import AccountConfig, account
from dpprobe.pipelines.audit_job import AuditConfig, run_audit
from dpprobe.pipelines.demo_job import DemoConfig, run_demo
from dpprobe.pipelines.export_job import ExportConfig, run_export
from dpprobe.pipelines.extract_job import ExtractConfig, run_extract, run_extract_ray
from dpprobe.pipelines.finetune_job import FinetuneConfig, run_finetune
from dpprobe.pipelines.predict_job import PredictConfig, run_predict
from dpprobe.pipelines.probe_job import ProbeConfig, probe_table, run_probe
from dpprobe.pipelines.store_jobs import InfoConfig, VerifyConfig, store_info, verify
from dpprobe.pipelines.tune_job import TuneConfig, linear_scaling_search, run_tune, tune_report

__all__ = [
    "AccountConfig", "AuditConfig", "DemoConfig", "ExportConfig", "ExtractConfig",
    "FinetuneConfig", "InfoConfig", "PredictConfig", "ProbeConfig", "TuneConfig",
    "VerifyConfig", "account", "linear_scaling_search", "probe_table", "run_audit", "run_demo",
    "run_export", "run_extract", "run_extract_ray", "run_finetune", "run_predict", "run_probe",
    "run_tune", "store_info", "tune_report", "verify",
]
