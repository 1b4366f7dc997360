"""dpprobe's public Python API: `import dpprobe`.

The jobs by their command-line names (`dpprobe.jobs`), the probe as a scikit-learn estimator
on arrays (`DPLinearProbe`), the data sources and the feature store's readers, and released
models:

    import dpprobe

    dpprobe.extract(backbone="scatternet", data="digits", out="digits.zarr")
    result = dpprobe.probe("digits.zarr", epsilons=[1, 8], save_model="models")
    print(result.table)
    model = dpprobe.load_model("models/eps8.safetensors")
    model.predict(images), model.predict_proba(features), model.privacy, model.to_torch()

    probe = dpprobe.DPLinearProbe(epsilon=3, num_classes=10).fit(X, y)

`dpprobe.extract`, `dpprobe.probe` and `dpprobe.finetune` are also the packages of those
stages: calling one runs its job (`jobs.make_callable`), and `dpprobe.probe.train_probe` is
still the trainer. Everything here is re-exported from the packages that implement it
(`pipelines`, `extract`, `dpmodel`, `probe`), which remain importable; this is the name that
does not collide with a user's own modules. The `run_*` functions, their configs and the report
tables are `pipelines`' public names (its `__all__`), listed once there. Importing dpprobe loads
neither JAX nor torch (nor scikit-learn: `DPLinearProbe` is imported on first use).
"""

from dpprobe import extract, finetune, jobs, pipelines, probe
from dpprobe.accounting.records import VERSION as __version__
from dpprobe.extract import (
    iter_split_chunks,
    load_split,
    open_source,
    open_split,
    store_summary,
    verify_store,
)
from dpprobe.jobs import JobResult, audit, predict, tune
from dpprobe.model import Model, ModelFileError, Privacy, load_model
from dpprobe.pipelines import *  # noqa: F403 - the jobs and their configs (`pipelines.__all__`)

# The packages `extract`, `probe`, `finetune` run their jobs when called.
jobs.make_callable(extract, jobs.extract)
jobs.make_callable(probe, jobs.probe)
jobs.make_callable(finetune, jobs.finetune)


def __getattr__(name):
    if name == "DPLinearProbe":  # on first use: it imports scikit-learn
        from dpprobe.probe.estimator import DPLinearProbe

        globals()[name] = DPLinearProbe
        return DPLinearProbe
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DPLinearProbe",  # noqa: F405 - imported on first use (`__getattr__`)
    "JobResult",
    "Model",
    "ModelFileError",
    "Privacy",
    "__version__",
    "audit",
    "extract",
    "finetune",
    "iter_split_chunks",
    "load_model",
    "load_split",
    "open_source",
    "open_split",
    "predict",
    "probe",
    "store_summary",
    "tune",
    "verify_store",
]
__all__ += pipelines.__all__
