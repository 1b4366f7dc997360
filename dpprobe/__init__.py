"""dpprobe's public Python API: `import dpprobe`.

The jobs (as the CLI runs them), the private hyperparameter search, the data sources and the
feature store's readers, and released models:

    import dpprobe

    dpprobe.run_extract(backbone="scatternet", data="digits", out="digits.zarr")
    dpprobe.run_probe("digits.zarr", epsilons=[1, 8], save_model="models")
    model = dpprobe.load_model("models/eps8.safetensors")
    model.predict(images), model.predict_proba(features), model.privacy, model.to_torch()

Everything here is re-exported from the packages that implement it (`pipelines`, `extract`,
`dpmodel`), which remain importable; this is the name that does not collide with a user's own
modules. The jobs, their configs and the report tables are `pipelines`' public names (its
`__all__`), listed once there.
"""

from dpprobe import pipelines
from dpprobe.accounting.records import VERSION as __version__
from dpprobe.extract import (
    iter_split_chunks,
    load_split,
    open_source,
    open_split,
    store_summary,
    verify_store,
)
from dpprobe.model import Model, ModelFileError, Privacy, load_model
from dpprobe.pipelines import *  # noqa: F403 - the jobs and their configs (`pipelines.__all__`)

__all__ = [
    "Model",
    "ModelFileError",
    "Privacy",
    "__version__",
    "iter_split_chunks",
    "load_model",
    "load_split",
    "open_source",
    "open_split",
    "store_summary",
    "verify_store",
]
__all__ += pipelines.__all__
