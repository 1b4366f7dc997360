"""The performance page's GPU table, generated from `benchmarks/results/<card>.json`.

`benchmarks/gpu.py` writes one file per card; `gpu_markdown()` renders every such file (not
the `-smoke` ones, which time nothing) as one table, a column per card, and the MkDocs hook
`on_page_markdown` below puts it where `performance.md` holds the marker
`<!-- gpu-results -->`, so the page shows what the files say and nothing retyped.
`tests/test_gpu_benchmark.py` renders the script's own output through the same function.
"""

from __future__ import annotations

import json
from pathlib import Path

MARKER = "<!-- gpu-results -->"
PAGE = "performance.md"
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"

# (section, key, row label, format): the rows of the table, in order
ROWS = (
    ("probe_step", "seconds_per_step", "probe DP step, 1.28M x 1280 float16, 1000 classes (s)",
     "{:.4f}"),
    ("probe_step", "roofline_seconds", "its memory roofline: X read twice at the copy bandwidth"
     " (s)", "{:.4f}"),
    ("probe_step", "over_roofline", "step / roofline (target <= 2)", "{:.2f}"),
    ("probe_step", "bandwidth_gb_s", "copy bandwidth measured (GB/s)", "{:.0f}"),
    ("float64", "float64_over_float32", "X^T R in float64 / float32 (the float64 sums' price)",
     "{:.2f}"),
    ("float64", "dp_over_non_private", "probe DP step / non-private step", "{:.2f}"),
    ("sweep", "dpprobe_seconds", "40-run sweep, 50k x 768, one program (s)", "{:.2f}"),
    ("sweep", "speedup_vs_opacus_hooks", "ours vs Opacus per-sample, same card (x)", "{:.0f}"),
    ("sweep", "speedup_vs_opacus_ghost", "ours vs Opacus ghost clipping, same card (x)",
     "{:.0f}"),
    ("finetune", "dp_images_per_second", "ViT-B/16 224 px DP-SGD (img/s)", "{:.0f}"),
    ("finetune", "non_private_images_per_second", "ViT-B/16 non-private (img/s)", "{:.0f}"),
    ("finetune", "dp_over_non_private", "DP / non-private (target >= 0.9)", "{:.2f}"),
    ("finetune", "opacus_images_per_second", "Opacus, its fastest mode (img/s)", "{:.0f}"),
    ("finetune", "ours_over_opacus", "ours / Opacus", "{:.2f}"),
)


def read_results(directory: Path = RESULTS) -> list[dict]:
    """Every card's results file in `directory` (smoke runs left out), by card name."""
    files = sorted(p for p in directory.glob("*.json") if not p.stem.endswith("-smoke"))
    return [json.loads(p.read_text()) for p in files]


def _cell(section: dict | None, key: str, fmt: str) -> str:
    if section is None:
        return "not run"
    if "error" in section:
        return "failed"
    value = section.get(key)
    return "-" if value is None else fmt.format(value)


def gpu_markdown(results: list[dict]) -> str:
    """The table of `results` (`read_results`' list), or a line saying there is none yet."""
    if not results:
        return ("No GPU results are recorded yet: run `python benchmarks/gpu.py` on a GPU and "
                "commit the `benchmarks/results/<card>.json` it writes.")
    cards = [r["environment"]["card"] for r in results]
    lines = ["| measure | " + " | ".join(cards) + " |",
             "| --- | " + " | ".join("---:" for _ in cards) + " |"]
    for section, key, label, fmt in ROWS:
        cells = [_cell(r["sections"].get(section), key, fmt) for r in results]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    modes = [(r["sections"].get("finetune") or {}).get("opacus_mode", "-") for r in results]
    lines.append("| Opacus's mode | " + " | ".join(modes) + " |")
    for key in ("date", "jax", "torch"):
        lines.append(f"| {key} | " + " | ".join(str(r["environment"][key]) for r in results)
                     + " |")
    failures = [f"{r['environment']['card']}, {name}: {section['error']}" for r in results
                for name, section in r["sections"].items() if "error" in section]
    if failures:
        lines += ["", "Sections that failed: " + "; ".join(failures) + "."]
    return "\n".join(lines)


def on_page_markdown(markdown: str, page, **_kwargs) -> str:
    """MkDocs hook: the marker on the performance page becomes the table."""
    if page.file.src_uri != PAGE or MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, gpu_markdown(read_results()))
