"""dpprobe's public Python API: `import dpprobe`.

The jobs (as the CLI runs them), the private hyperparameter search, the feature store's
readers, and released models:

    import dpprobe

    dpprobe.run_extract(backbone="scatternet", data="digits", out="digits.zarr")
    dpprobe.run_probe("digits.zarr", epsilons=[1, 8], save_model="models")
    model = dpprobe.load_model("models/eps8.safetensors")
    model.predict(images), model.predict_proba(features), model.privacy, model.to_torch()

Everything here is re-exported from the packages that implement it (`pipelines`, `extract`,
`dpmodel`), which remain importable; this is the name that does not collide with a user's own
modules.
"""

from dpmodel import Model, ModelFileError, Privacy, load_model
from extract import iter_split_chunks, load_split, open_split, store_summary, verify_store
from pipelines import (
    AccountConfig,
    AuditConfig,
    DemoConfig,
    ExportConfig,
    ExtractConfig,
    FinetuneConfig,
    InfoConfig,
    PredictConfig,
    ProbeConfig,
    TuneConfig,
    VerifyConfig,
    account,
    linear_scaling_search,
    run_audit,
    run_demo,
    run_export,
    run_extract,
    run_extract_ray,
    run_finetune,
    run_predict,
    run_probe,
    run_tune,
    store_info,
    verify,
)
from pipelines.records import VERSION as __version__

__all__ = [
    "AccountConfig",
    "AuditConfig",
    "DemoConfig",
    "ExportConfig",
    "ExtractConfig",
    "FinetuneConfig",
    "InfoConfig",
    "Model",
    "ModelFileError",
    "PredictConfig",
    "Privacy",
    "ProbeConfig",
    "TuneConfig",
    "VerifyConfig",
    "__version__",
    "account",
    "iter_split_chunks",
    "linear_scaling_search",
    "load_model",
    "load_split",
    "open_split",
    "run_audit",
    "run_demo",
    "run_export",
    "run_extract",
    "run_extract_ray",
    "run_finetune",
    "run_predict",
    "run_probe",
    "run_tune",
    "store_info",
    "store_summary",
    "verify",
    "verify_store",
]
