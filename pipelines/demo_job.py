"""The demo job: the embedded default data through ScatterNet, then the epsilon sweep."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import extract
from pipelines import config as cfg
from pipelines import preflight
from pipelines.extract_job import run_extract
from pipelines.probe_job import run_probe
from pipelines.reporting import log

__all__ = ["DEMO_DATA", "DEMO_EPSILONS", "DemoConfig", "demo_data", "run_demo"]

DEMO_DATA = ("fashion-mnist", "digits")
DEMO_EPSILONS = (0.5, 1.0, 2.0, 4.0, 8.0, math.inf)


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """Where the demo writes, which data (None: fashion-mnist if installed, else digits), how
    many seeds."""

    out_dir: str = "runs/demo"
    data: str | None = None
    seeds: int = 3
    progress: bool = True

    def __post_init__(self):
        if self.data is not None and self.data not in DEMO_DATA:
            raise cfg.ConfigError("data", f"must be one of {DEMO_DATA}, got {self.data!r}")
        cfg.check_int("seeds", self.seeds)


def demo_data() -> str:
    """Fashion-MNIST when Debian's files are present, scikit-learn digits otherwise."""
    if all((extract.sources.FASHION_MNIST_DIR / f"{stem}.gz").exists()
           for stem in extract.sources.FASHION_MNIST_SHA256):
        return "fashion-mnist"
    return "digits"


def run_demo(config: DemoConfig | str | None = None, /, **options) -> dict:
    """Extract the embedded default data with ScatterNet, sweep epsilons, write results.json.

    Takes a `DemoConfig`, or the output folder and the config's other fields as keywords.
    """
    config = cfg.make_config(DemoConfig, config, "out_dir", **options)
    preflight.check_demo_job(config.out_dir)
    data = config.data or demo_data()
    out = Path(config.out_dir)
    store = str(out / f"{data}-scatternet.zarr")
    quiet = not config.progress
    log(f"demo: {data} -> scatternet (J=2) features -> {store}", quiet)
    run_extract(backbone="scatternet", data=data, out=store, progress=config.progress)
    log("demo: full-batch DP-SGD with momentum 0.9 (Panda et al.), T=20, lr=1, clip 1, zero "
        "init, per-example group normalization (27 groups, Tramer & Boneh)", quiet)
    return run_probe(store, epsilons=DEMO_EPSILONS, delta=1e-5, seeds=config.seeds,
                     optimizer="momentum", steps=(20,), learning_rates=(1.0,),
                     normalization="group", groups=27, out=str(out / "results.json"),
                     quiet=quiet)
