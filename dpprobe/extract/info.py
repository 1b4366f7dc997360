"""A feature store's provenance, for people (`dpprobe info`): backbone, weights,
preprocessing, dataset fingerprint, shapes and completion of every split."""

from __future__ import annotations

__all__ = ["format_store_info"]


def format_store_info(store, summary: dict) -> str:
    """The provenance of a store, for people.

    Args:
      store: the store's path (named in the first line).
      summary: its `extract.store_summary`.

    Returns:
      A header line, then one block of lines per split.
    """
    lines = [f"{store}: {summary['root'].get('format')} v{summary['root'].get('format_version')}"]
    for name, attrs in summary["splits"].items():
        backbone, dataset = attrs.get("backbone", {}), attrs.get("dataset", {})
        pre = attrs.get("preprocessing", {})
        lines += [
            f"[{name}] {attrs.get('num_examples')} examples x {attrs.get('feature_shape')} "
            f"{attrs.get('dtype')}, {attrs['chunks_done']}/{attrs['num_chunks']} chunks of "
            f"{attrs.get('rows_per_chunk')} rows, complete={attrs.get('complete')}",
            f"  backbone: {backbone.get('name')} (weights: {backbone.get('weights_source')}"
            + (f", seed {backbone['seed']}" if backbone.get("seed") is not None else "")
            + (f", file {backbone['weights_file']}" if backbone.get("weights_file") else "")
            + (f", sha256 {backbone['weights_sha256']}" if backbone.get("weights_sha256")
               else "")
            + (f", tag {backbone['tag']}" if backbone.get("tag") else "") + ")"
            + "".join(f", {k} {backbone[k]}" for k in ("timm_version", "kymatio_version",
                                                      "torch_version") if backbone.get(k)),
            "  preprocessing: " + ", ".join(f"{k}={v}" for k, v in pre.items()
                                              if k != "transform" and v not in (None, [], ())),
            f"  dataset: {dataset.get('name')} ({dataset.get('spec')}), "
            f"{dataset.get('num_classes')} classes, fingerprint {dataset.get('fingerprint')}",
            "  classes: " + ", ".join(str(c) for c in (attrs.get("class_names")
                                                        or dataset.get("class_names") or [])),
            f"  created {attrs.get('created')}, completed {attrs.get('completed', '-')}",
        ]
    return "\n".join(lines)
