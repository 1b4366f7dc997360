"""dpprobe's jobs as Python functions, named and spelled as the command line names them:
`dpprobe.extract`, `dpprobe.probe`, `dpprobe.tune`, `dpprobe.finetune`, `dpprobe.audit`,
`dpprobe.predict`.

    import dpprobe

    dpprobe.extract(backbone="scatternet", data="digits", out="digits.zarr")
    result = dpprobe.probe("digits.zarr", epsilons=[1, 8], save_model="models")
    print(result.table)            # what `dpprobe probe` prints
    result.models[0].predict(...)  # the models, as `dpprobe.Model` objects

Each takes its command's options as keywords, one spelling each (`dpprobe probe --lr` is
`lr=`, `--normalize` is `normalize=`, `--quiet` is `quiet=True`; `epsilons=` for probe,
`epsilon=` for tune, finetune and audit, as their commands say), builds the job's config
(`ProbeConfig`, ...: its checks, its defaults) and runs the job's `run_*` function, which the
command line runs too. The signatures are generated from the configs' fields, so that they
cannot drift from the command line; `inspect.signature` and `help()` show them.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import types
from typing import Any

from dpprobe import model as dpmodel
from dpprobe import timings
from dpprobe.extract.job import report_line
from dpprobe.finetune.own_model import own_module
from dpprobe.model_files import MODEL_FILE
from dpprobe.pipelines.audit_job import AuditConfig, audit_report, run_audit
from dpprobe.pipelines.extract_job import ExtractConfig, run_extract
from dpprobe.pipelines.finetune_job import (
    FinetuneConfig,
    finetune_audit_line,
    finetune_line,
    run_finetune,
)
from dpprobe.pipelines.predict_job import PredictConfig, predict_line, run_predict
from dpprobe.pipelines.probe_job import ProbeConfig, probe_job, probe_table
from dpprobe.pipelines.tune_job import TuneConfig, run_tune, tune_report

__all__ = ["JobResult", "audit", "extract", "finetune", "make_callable", "predict", "probe",
           "tune"]

# Config fields whose option is spelled otherwise on the command line: the CLI's spelling wins.
RENAMED = {"learning_rates": "lr", "learning_rate": "lr", "normalization": "normalize",
           "num_workers": "workers"}
# `--quiet` sets `progress=False` (extract's config).
INVERTED = {"progress": "quiet"}


@dataclasses.dataclass(frozen=True)
class JobResult:
    """What a job function returns.

    Attributes:
      job: the command's name.
      results: the job's own result: the results dict (results.json's content) of probe,
        tune, finetune and audit; predict's summary dict; extract's per-split reports.
      table: what the command prints at the end (the probe table, the tune report, ...).
      ledger: the privacy ledger (every mechanism that ran, their compositions), or None.
      paths: every file or folder the job wrote, in order.
      model_sources: the models as given: `dpprobe.Model` objects, or the paths of model
        files (read by `models` on first use, so that the command line, which prints the
        table, never reads back the model it wrote).
      models: the job's models (`dpprobe.Model`): probe's one per epsilon (x steps x lr, its
        first seed's run; in memory, named by its file, written only with `save_model`), the
        model file tune and finetune wrote.
    """

    job: str
    results: Any
    table: str
    ledger: dict | None
    paths: tuple[str, ...]
    model_sources: tuple[dpmodel.Model | str, ...] = ()

    @functools.cached_property
    def models(self) -> tuple[dpmodel.Model, ...]:
        """The job's models, each file read once, when first asked for."""
        return tuple(m if isinstance(m, dpmodel.Model) else dpmodel.load_model(m)
                     for m in self.model_sources)

    def __str__(self) -> str:
        return self.table


def _written(*paths) -> tuple[str, ...]:
    """The given paths that exist (an output option not given is None)."""
    return tuple(os.fspath(p) for p in paths if p and os.path.exists(p))


def _timings(config) -> tuple:
    return (timings.timings_path(config.out),) if config.out else ()


def _extract_result(config: ExtractConfig) -> JobResult:
    reports = run_extract(config)
    return JobResult("extract", reports,
                     "\n".join(report_line(config.out, r, config.dtype) for r in reports), None,
                     _written(config.out))


def _probe_result(config: ProbeConfig) -> JobResult:
    results, parts = probe_job(config)
    files = tuple(results.get("model_files", ()))
    # The models in memory, each named by its file (written or, without `save_model`, not).
    paths = files or tuple(name for name, _, _ in parts)
    models = tuple(dpmodel.Model(path, arrays, dpmodel.file_document(arrays, document))
                   for path, (_, arrays, document) in zip(paths, parts, strict=True))
    return JobResult("probe", results, probe_table(results), results["ledger"],
                     _written(config.out, *_timings(config), config.csv, config.plot,
                              config.diagnostics, *files), models)


def _tune_result(config: TuneConfig) -> JobResult:
    results = run_tune(config)
    model = (config.save_model,) if config.save_model else ()
    return JobResult("tune", results, tune_report(results), results["ledger"],
                     _written(config.out, *_timings(config), config.save_model), model)


def _finetune_result(config: FinetuneConfig) -> JobResult:
    results = run_finetune(config)
    lines = [finetune_line(results)]
    if "audit" in results:
        lines.append(finetune_audit_line(results["audit"]))
    model_file = os.path.join(config.out, MODEL_FILE) if config.out else None
    paths = _written(config.out, model_file)
    return JobResult("finetune", results, "\n".join(lines), results.get("ledger"), paths,
                     (_finetuned_model(model_file, config.model),) if model_file in paths
                     else ())


def _finetuned_model(model_file: str, model) -> dpmodel.Model | str:
    """The finetune's model source: the file, read on first use; a run of the caller's own
    NNX module is read now, rebuilt from that module (`load_model(module=...)`)."""
    own = own_module(model)
    return model_file if own is None else dpmodel.load_model(model_file, module=own)


def _audit_result(config: AuditConfig) -> JobResult:
    results = run_audit(config)
    return JobResult("audit", results, audit_report(results), None,
                     _written(config.out, config.plot))


def _predict_result(config: PredictConfig) -> JobResult:
    result = run_predict(config)
    return JobResult("predict", result, predict_line(result), None, _written(config.out))


def _job(name: str, config_class, first: str | None, finish, doc: str):
    """The job function `name`: the config's fields as keywords, by their command-line names
    (`first`, the command's positional argument, may also be given by position)."""
    parameters, fields, inverted = [], {}, set()
    for field in dataclasses.fields(config_class):
        python_name = INVERTED.get(field.name) or RENAMED.get(field.name, field.name)
        default = field.default
        if field.name in INVERTED:
            inverted.add(python_name)
            default = not default
        kind = (inspect.Parameter.POSITIONAL_OR_KEYWORD if field.name == first
                else inspect.Parameter.KEYWORD_ONLY)
        parameters.append(inspect.Parameter(
            python_name, kind, annotation=field.type,
            default=inspect.Parameter.empty if default is dataclasses.MISSING else default))
        fields[python_name] = field.name
    # The positional argument first; then the fields in the config's order.
    parameters.sort(key=lambda p: p.kind != inspect.Parameter.POSITIONAL_OR_KEYWORD)
    signature = inspect.Signature(parameters, return_annotation=JobResult)

    def job(*args, **kwargs) -> JobResult:
        if args and isinstance(args[0], config_class):  # a config made (the command line's)
            if len(args) > 1 or kwargs:
                raise TypeError(f"give a {config_class.__name__} or keyword options, not both")
            return finish(args[0])
        bound = signature.bind(*args, **kwargs)  # an unknown or missing option: TypeError
        options = {fields[k]: (not v if k in inverted else v) for k, v in bound.arguments.items()}
        return finish(config_class(**options))

    job.__name__ = job.__qualname__ = name
    job.__module__ = __name__
    job.__signature__ = signature
    job.__doc__ = doc + (f"\n\nArgs:\n  The options of `dpprobe {name} --help`, by their "
                         f"command-line names\n  (the fields of `{config_class.__name__}`), or "
                         f"one `{config_class.__name__}`\n  (as the command line calls it).\n\n"
                         "Returns:\n  A `JobResult`: the results, the table the command prints, "
                         "the ledger,\n  the paths written and the models.")
    return job


extract = _job("extract", ExtractConfig, None, _extract_result, """\
Extract features into a Zarr store (`dpprobe extract`): data through a frozen backbone, once.

Example:
  dpprobe.extract(backbone="scatternet", data="digits", out="digits.zarr")""")

probe = _job("probe", ProbeConfig, "store", _probe_result, """\
Sweep DP linear probes on a store (`dpprobe probe`): every epsilon x steps x lr x seed.

Example:
  result = dpprobe.probe("digits.zarr", epsilons=[1, 8], save_model="models", quiet=True)
  result.table, result.ledger, result.models""")

tune = _job("tune", TuneConfig, "store", _tune_result, """\
Tune the probe privately and train the final one (`dpprobe tune`); epsilon is the total.

Example:
  result = dpprobe.tune("digits.zarr", epsilon=3, save_model="tuned.safetensors")
  (model,) = result.models""")

finetune = _job("finetune", FinetuneConfig, None, _finetune_result, """\
Fine-tune a network with DP-SGD on images (`dpprobe finetune`).

Example:
  result = dpprobe.finetune("digits", model="cnn", epsilon=3, epochs=5, out="runs/cnn")
  (model,) = result.models""")

audit = _job("audit", AuditConfig, "store", _audit_result, """\
Audit the probe's privacy claim with canaries (`dpprobe audit`): a lower bound on epsilon.

Example:
  result = dpprobe.audit("digits.zarr", epsilon=1, runs=1000)
  print(result.table)""")

predict = _job("predict", PredictConfig, "model", _predict_result, """\
Predict with a model file (`dpprobe predict`): a CSV of predictions (to `out`, else stdout)
and the accuracy when the data has labels. In memory: `dpprobe.load_model(path).predict(...)`.

Example:
  result = dpprobe.predict("models/eps8.safetensors", data=["digits.zarr"], out="pred.csv")
  result.results["accuracy"]""")


# ----------------------------------------------------------------------------------------------
# `dpprobe.extract`, `dpprobe.probe`, `dpprobe.finetune` are packages too: callable ones.
# ----------------------------------------------------------------------------------------------

_CALLS: dict[str, Any] = {}


class _CallableJob(types.ModuleType):
    """A package that is also its job (Python's documented way to customize a module's class:
    set its `__class__` to a `types.ModuleType` subclass): `dpprobe.probe(...)` runs the probe
    job, while `dpprobe.probe.train_probe` and `import dpprobe.probe.step` are the package's."""

    def __call__(self, *args, **kwargs) -> JobResult:
        return _CALLS[self.__name__](*args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(_CALLS[self.__name__])


def make_callable(package: types.ModuleType, job) -> None:
    """Make `package` callable as `job` (done once, by `dpprobe/__init__.py`; the package
    itself never imports its job, which imports `pipelines`)."""
    _CALLS[package.__name__] = job
    package.__class__ = _CallableJob
