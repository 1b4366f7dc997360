"""`benchmarks/gpu.py` runs and the docs render what it writes (`docs/hooks/gpu_results.py`).

The script's figures need a GPU; here it runs at toy shapes (`--smoke`) on the CPU, which
checks the plumbing (every section's public calls, the file it writes, the table the docs
make of it), not a speed. The finetune section is left out: its calls are
`benchmarks/finetune.py`'s own (ViT-tiny with Opacus costs minutes on this CPU).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _hook():
    spec = importlib.util.spec_from_file_location("gpu_results",
                                                  ROOT / "docs" / "hooks" / "gpu_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_smoke_run_writes_a_card_file_the_docs_render(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--smoke",
         "--sections", "probe_step,float64,sweep", "--out-dir", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    path = tmp_path / "cpu-smoke.json"
    assert f"wrote {path}" in done.stdout
    report = json.loads(path.read_text())
    sections = report["sections"]
    assert set(sections) == {"probe_step", "float64", "sweep"}
    assert not [s["error"] for s in sections.values() if "error" in s]
    step = sections["probe_step"]
    # the roofline: the features (4096 x 64 float16) read twice at the measured bandwidth
    assert abs(step["roofline_seconds"] * step["bandwidth_gb_s"] * 1e9 - 2 * 4096 * 64 * 2) < 1
    assert sections["sweep"]["runs"] == 8  # 8 epsilons x the smoke's one seed
    assert sections["sweep"]["speedup_vs_opacus_hooks"] > 0

    hook = _hook()
    # a smoke file times nothing: the docs leave it out
    assert hook.read_results(tmp_path) == []
    (tmp_path / "cpu.json").write_text(path.read_text())
    table = hook.gpu_markdown(hook.read_results(tmp_path))
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table.splitlines()}
    assert f"{step['over_roofline']:.2f}" in rows["step / roofline (target <= 2)"]
    assert "not run" in rows["ViT-B/16 224 px DP-SGD (img/s)"]
    assert report["environment"]["jax"] in rows["jax"]


def test_failed_sections_and_no_files_are_said(tmp_path):
    hook = _hook()
    assert "No GPU results are recorded yet" in hook.gpu_markdown([])
    report = {"environment": {"card": "H100", "date": "d", "jax": "j", "torch": "t"},
              "sections": {"sweep": {"error": "RuntimeError: out of memory"},
                           "probe_step": {"seconds_per_step": 0.01, "roofline_seconds": 0.004,
                                          "over_roofline": 2.5, "bandwidth_gb_s": 3000}}}
    table = hook.gpu_markdown([report])
    assert "| step / roofline (target <= 2) | 2.50 |" in table
    assert "| 40-run sweep, 50k x 768, one program (s) | failed |" in table
    assert "H100, sweep: RuntimeError: out of memory" in table
