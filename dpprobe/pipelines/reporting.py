"""What the commands print for people: mean +- std summaries, the tables and reports."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from dpprobe.messages import format_epsilon

__all__ = [
    "account_line",
    "audit_report",
    "demo_report",
    "format_store_info",
    "format_table",
    "probe_table",
    "summarize_runs",
    "tune_report",
    "warning_lines",
]


def summarize_runs(runs: Sequence[dict], group_keys: Sequence[str], metrics: Sequence[str]):
    """Mean and std (over seeds) of `metrics` for runs grouped by `group_keys`, in order."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for run in runs:
        groups[tuple(run[k] for k in group_keys)].append(run)
    summary = []
    for key, members in groups.items():
        row = dict(zip(group_keys, key, strict=True)) | {"num_seeds": len(members)}
        for metric in metrics:
            values = np.array([m[metric] for m in members if m.get(metric) is not None], float)
            row[f"{metric}_mean"] = float(values.mean()) if values.size else None
            row[f"{metric}_std"] = float(values.std(ddof=1)) if values.size > 1 else 0.0
        for shared in ("noise_multiplier", "epsilon_spent"):
            if shared in members[0]:
                row[shared] = members[0][shared]
        summary.append(row)
    return summary


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isinf(value):
            return "inf"
        if value == 0:
            return "0"
        if abs(value) >= 1e4 or abs(value) < 1e-3:
            return f"{value:.3g}"
        return f"{value:.4g}"
    return str(value)


def format_table(rows: Sequence[dict], columns: Sequence[tuple[str, str]]) -> str:
    """A fixed-width text table; `columns` are (header, key) pairs; values pre-formatted ok."""
    cells = [[header for header, _ in columns]]
    for row in rows:
        cells.append([row[key] if isinstance(row.get(key), str) else _fmt(row.get(key))
                      for _, key in columns])
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cells[0], widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    for row in cells[1:]:
        lines.append("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
    return "\n".join(lines)


def pm(mean: float | None, std: float | None, scale: float = 100.0, digits: int = 2) -> str:
    """'87.31 ± 0.12' (percent by default)."""
    if mean is None:
        return "-"
    return f"{mean * scale:.{digits}f} ± {(std or 0.0) * scale:.{digits}f}"


def probe_table(results: dict) -> str:
    """The printed table: epsilon per run and of the row (its seeds composed), noise
    multiplier, steps, lr, accuracy mean ± std; the non-private reference labelled as such."""
    rows = []
    for row in results["summary"]:
        private = math.isfinite(row["epsilon"])
        rows.append(
            row
            | {
                "epsilon": row["epsilon"] if private else "inf: non-private, no guarantee",
                "acc": pm(row["test_accuracy_mean"], row["test_accuracy_std"]),
                "top5": pm(row["test_top5_accuracy_mean"], row["test_top5_accuracy_std"]),
            }
        )
    columns = [
        ("epsilon per run", "epsilon"),
        ("eps spent", "epsilon_spent"),
        ("eps of row (seeds composed)", "epsilon_row"),
        ("noise mult", "noise_multiplier"),
        ("steps", "steps"),
        ("lr", "learning_rate"),
        ("seeds", "num_seeds"),
        ("test acc % (mean ± std)", "acc"),
        ("top-5 %", "top5"),
    ]
    if (results.get("probe") or {}).get("num_classes", 6) <= 5:
        columns.pop()  # top-5 of at most 5 classes is always 100%: not shown
    if all(_same_epsilon(row["epsilon"], row.get("epsilon_spent")) for row in results["summary"]):
        columns.remove(("eps spent", "epsilon_spent"))  # it would repeat the first column
    if all(row.get("num_seeds") == 1 for row in results["summary"]):
        columns.remove(("eps of row (seeds composed)", "epsilon_row"))  # so would this one
    privacy = results["privacy"]
    header = (
        f"delta={privacy['delta']:g}, accountant={privacy['accountant'].upper()}, "
        f"{privacy['neighboring_relation_text']}, {privacy['sampling']}; "
        f"N_train={results['num_train']}, N_test={results['num_test']}"
    )
    ledger = results["ledger"]
    private = sum(1 for e in ledger["entries"] if e["role"] == "private")
    footer = (f"all {private} private runs together (e.g. picking the best): epsilon = "
              f"{format_epsilon(ledger['epsilon_by_role'].get('private', 0.0))} at "
              f"delta={privacy['delta']:g}")
    if private < ledger["num_mechanisms"]:
        footer += "; the non-private reference has no guarantee"
    return "\n".join([header, format_table(rows, columns), footer, *warning_lines(results)])


def _same_epsilon(asked: float, spent: float | None) -> bool:
    """Whether a run spent its target epsilon, as printed (4 significant digits)."""
    return spent is None or not math.isfinite(asked) or f"{asked:.4g}" == f"{spent:.4g}"


def tune_report(results: dict) -> str:
    """The recipe, trials, the fitted line, the final run and the ledger, for the terminal."""
    spec, standardization = results["probe"], results.get("standardization")
    normalization = spec["normalization"] + (
        f" ({spec['groups']} groups)" if spec["normalization"] == "group" else "")
    standardization = standardization or {}
    lines = [f"recipe: per-example normalization {normalization}, "
             + ("no standardization" if "epsilon" not in standardization else
                f"private feature standardization (epsilon {standardization['epsilon']:.4g})")
             + f", {spec['optimizer']}"
             + (f"; standardization {standardization['decision']}"
                if standardization.get("decision") else "")]
    for stage in results["stages"]:
        lines.append(f"stage {stage['stage']}: epsilon {stage['epsilon_stage']:.4g} for the "
                     f"stage ({stage['epsilon_per_trial']:.4g} per trial), best r = "
                     f"{stage['best_r']:.4g}")
        rows = [t | {"score": f"{100 * t['score']:.2f}"} for t in stage["trials"]]
        lines.append(format_table(rows, [
            ("r", "r"), ("lr", "learning_rate"), ("steps", "steps"),
            ("noise mult", "noise_multiplier"), ("score % (DP)", "score")]))
    line, chosen, final = results["line"], results["chosen"], results["final"]
    lines.insert(1, results["search"].get("decision") or "")
    if results["stages"]:
        lines.append(_line_report(line, results["privacy"]["epsilon_final_alone"]))
    else:
        lines.append(f"default recipe: r = {line['r_star']:.4g} (the linear scaling rule "
                     f"r = 0.011 x mu x N at the final run's epsilon "
                     f"{results['privacy']['epsilon_final_alone']:.4g})")
    lines.append(f"final run: lr = {chosen['learning_rate']:.4g}, T = {chosen['steps']}, "
                 f"noise multiplier = {chosen['noise_multiplier']:.4g} -> test accuracy "
                 f"{100 * final['test_accuracy']:.2f}%"
                 + (f" (top-5 {100 * final['test_top5_accuracy']:.2f}%)"
                    if results["probe"]["num_classes"] > 5 else ""))
    privacy = results["privacy"]
    lines.append(f"selection: {results['selection']['scoring']}")
    lines.append(f"total epsilon (tuning and selection included) = "
                 f"{privacy['epsilon_total']:.4f} <= requested {privacy['epsilon_requested']:g}, "
                 f"delta = {privacy['delta']:g}, {privacy['neighboring_relation_text']}; covers "
                 f"{privacy['covers']}")
    ledger = results["ledger"]
    lines.append(f"privacy ledger: {ledger['num_mechanisms']} mechanisms, PLD composition "
                 f"epsilon = {ledger['epsilon']:.4f}; Gaussian DP mu = {ledger['gdp_mu']:.4g} "
                 f"(epsilon {ledger['gdp_epsilon']:.4f}); basic composition epsilon = "
                 f"{ledger['basic_composition_epsilon']:.4f}")
    return "\n".join(lines + warning_lines(results))


def warning_lines(results: dict) -> list[str]:
    """The job's warnings (`records.warnings`), one line each, for the end of its report."""
    return [f"warning: {warning}" for warning in results.get("warnings") or ()]


def _line_report(line: dict, epsilon_final: float) -> str:
    """The fitted line and r*, and, when r* was clipped, what that means and what to do."""
    kind = line.get("extrapolation", "linear")
    fit = (f"r = {line['alpha']:.4g} * epsilon + {line['b']:.4g}" if kind != "log"
           else f"r = r1 (epsilon / eps1)^{line['exponent']:.3g}")
    text = (f"linear scaling ({kind}): {fit} -> r* = {line['r_star']:.4g} at the final run's "
            f"epsilon {epsilon_final:.4g}"
            + (" (fit not positive: kept stage 1's best r)" if line["fallback_used"] else ""))
    if line.get("clipped"):
        low, high = line["searched"]
        above = (line.get("r_line") or line["r_star"]) > line["r_star"]
        text += (f"\n  the line gave r = {line.get('r_line', float('nan')):.4g}, "
                 f"{'above' if above else 'below'} the r the search tried "
                 f"([{low:.3g}, {high:.3g}]), so the final run uses {line['r_star']:.4g}, the "
                 "nearest r it tried: an r the search never scored would be a guess. If the "
                 f"trials' best r sat at that edge, rerun with --r-{'max' if above else 'min'} "
                 f"{(high * 3) if above else (low / 3):.3g} to search further, or "
                 "--extrapolation linear to follow the line")
    return text


def format_store_info(store, summary: dict) -> str:
    """The provenance of a store (`extract.store_summary`), for people."""
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


def account_line(result: dict) -> str:
    """What `dpprobe account` prints: the noise multiplier, the steps and the epsilon."""
    q = result["sampling_probability"]
    sampling = "full batch" if q == 1 else f"Poisson q={q:g}"
    return "\n".join([
        f"noise multiplier {result['noise_multiplier']:.6g}, {result['steps']} step(s), "
        f"{sampling} -> epsilon {result['epsilon']:.6g} at delta {result['delta']:g} "
        f"({result['accountant'].upper()}, zero-out neighbours)", *warning_lines(result)])


def audit_report(results: dict) -> str:
    """What `dpprobe audit` prints: the claim, the lower bounds with their confidence and
    ratios to the claim, the attack's statistics, the verdict and what it means."""
    claim, audit, bounds = results["claim"], results["audit"], results["bounds"]
    confidence = f"{100 * bounds['confidence']:g}%"
    tpr = ", ".join(f"{100 * v:.2f}% at FPR {100 * float(f):g}%"
                    for f, v in bounds["tpr_at_fpr"].items())
    lines = [
        f"audit: {audit['runs_per_side']} probes with the canary and {audit['runs_per_side']} "
        f"without ({audit['optimizer']}, T={claim['steps']}, {audit['num_rows']} rows + the "
        f"canary, full batch); {claim['neighboring_relation_text']}",
        f"claimed: epsilon = {claim['epsilon']:.4f} at delta = {claim['delta']:g} (PLD ledger), "
        f"i.e. mu = {claim['gdp_mu']:.4f} Gaussian DP (noise multiplier "
        f"{claim['noise_multiplier']:.4g})",
        f"lower bounds at {confidence} confidence, delta = {claim['delta']:g}:",
        f"  Gaussian-DP fit: mu >= {bounds['gdp_mu_lower']:.4f} (estimate "
        f"{bounds['gdp_mu_estimate']:.4f}, {bounds['gdp_mu_estimate_over_claim']:.3f} x the "
        f"claimed mu), epsilon >= {bounds['gdp_epsilon_lower']:.4f} "
        f"({100 * bounds['gdp_epsilon_lower_over_claim']:.1f}% of the claim)",
        f"  Clopper-Pearson: epsilon >= {bounds['cp_epsilon_lower']:.4f} "
        f"({100 * bounds['cp_epsilon_lower_over_claim']:.1f}% of the claim)",
        f"attack: AUROC {bounds['auroc']:.4f}; TPR {tpr}",
        ("CLAIM REFUTED: a lower bound exceeds the claimed privacy"
         if results["claim_refuted"] else "consistent with the claim: no lower bound exceeds it"),
        results["note"],
    ]
    return "\n".join(lines + warning_lines(results))


def finetune_line(results: dict) -> str:
    """One line: the model, its test accuracy (and its EMA's) and the guarantee; no duration
    or speed (they depend on the records: the owner's timing file, `dpprobe.timings`)."""
    privacy = results["privacy"]
    ema = results.get("test_accuracy_ema")
    ema_text = f", EMA {100 * ema:.2f}%" if ema is not None else ""
    claim = ("NOT PRIVATE (--non-private: no clipping, no noise; epsilon inf)"
             if "claim" in privacy else
             f"(epsilon {privacy['epsilon']:.3g}, delta {privacy['delta']:g}), "
             f"{privacy['accountant']}, {privacy['neighboring_relation_text']}")
    return "\n".join([
        f"{results['model']['name']} on {results['data']['spec']}: test accuracy "
        f"{100 * results['test_accuracy']:.2f}%{ema_text} at {claim}",
        *warning_lines(results)])


def finetune_audit_line(audit: dict) -> str:
    """One line: the one-run lower bound (and estimate) against the claim
    (`finetune.canaries`)."""
    if audit.get("kind") == "gradient":
        verdict = ("CLAIM REFUTED" if audit["refuted"] else
                   "consistent with the claim (a lower bound, not a proof of privacy)")
        return (f"audit (white box, {audit['canaries']} gradient canaries, {audit['included']} "
                f"in): epsilon >= {audit['epsilon_lower']:.3f} at "
                f"{100 * audit['confidence']:g}% confidence (rigorous), estimate "
                f"{audit['epsilon_estimate']:.3f} (not a bound), delta {audit['delta']:g}; "
                f"claimed {audit['claimed_epsilon']:.3f}; {verdict}; the model is an audit "
                "artefact (the canaries moved its weights)")
    verdict = ("CLAIM REFUTED" if audit["refuted"] else
               "consistent with the claim (a weak one-run lower bound, not a proof of privacy)")
    return (f"audit (one run, {audit['canaries']} canaries, {audit['included']} in): epsilon >= "
            f"{audit['epsilon_lower']:.3f} at {100 * audit['confidence']:g}% confidence, delta "
            f"{audit['delta']:g}; claimed {audit['claimed_epsilon']:.3f} (ratio "
            f"{audit['ratio']:.3f}); AUROC {audit['auroc']:.3f}; {verdict}; the model is an "
            "audit model (trained with the canaries)")


def demo_report(results: dict) -> str:
    """What `dpprobe demo` prints: the trade-off table, the tuned run beside the published
    reference, the files it wrote and how long it took."""
    tune, privacy = results["tune"], results["tune"]["privacy"]
    lines = [probe_table(results["sweep"]), "",
             f"tuned privately: {100 * tune['final']['test_accuracy']:.2f}% test accuracy at "
             f"total epsilon {privacy['epsilon_total']:.4f} (delta {privacy['delta']:g}), every "
             f"cost paid ({tune['ledger']['num_mechanisms']} mechanisms in its ledger); "
             + tune["search"]["decision"]]
    published = results.get("published")
    if published is not None:
        lines.append(f"published reference: {published.label.replace(chr(10), ' ')}")
    predictions = results.get("predictions") or []
    if predictions:
        lines.append(f"the tuned model on {len(predictions)} test images: " + ", ".join(
            f"{p['prediction']} ({100 * p['probability']:.0f}%"
            + (")" if p["prediction"] == p["label"] else f"; it is {p['label']})")
            for p in predictions))
    lines += [f"wrote {path}" for path in results["files"].values()]
    features = ("reused the features extracted by an earlier run" if results["reused_features"]
                else "features extracted")
    lines.append(f"demo finished in {results['wall_seconds']:.0f} s ({features}: "
                 f"{results['store']})")
    lines.append(f"next: dpprobe finetune --data {results['data']} --epsilon 3 --out ft (DP-SGD "
                 "on a whole network; the default for small images is a ScatterNet + CNN), "
                 f"dpprobe export --model {results['files']['model']} --format onnx "
                 "model.onnx (README: \"Use your model\")")
    return "\n".join(lines)
