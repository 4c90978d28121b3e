"""Compare FGSM accuracy curves under both eps conventions with the paper's Table 1 curve shape.

Usage: python shape.py pixel.json normalized.json [experiment] > shape.md

Each JSON is the eval.json of ``drmoo eval --eps-space pixel|normalized`` on the same checkpoint.
The shape is the retention acc(eps) / acc(0): it factors out the clean accuracy, which our short
CPU training cannot match, and leaves how fast the attack erodes it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from drmoo.experiments.paper_reference import reference_for


def retention(report: dict) -> tuple[dict[float, float], dict[float, float]]:
    """(acc(eps) / acc(0), acc(eps) in %) per eps."""
    results = {round(r["eps"], 6): 100 * r["mean_acc"] for r in report["results"]}
    clean = results[0.0]
    return {eps: acc / clean for eps, acc in results.items()}, results


def main() -> None:
    pixel, normalized = (json.loads(Path(p).read_text()) for p in sys.argv[1:3])
    experiment = sys.argv[3] if len(sys.argv) > 3 else pixel["experiment"]
    method = pixel["method"]
    reference = reference_for(experiment)
    paper_eps = [e for e in reference.columns if e > 0]
    paper_rows = {m: dict(zip(reference.columns, values)) for m, values in reference.values.items()}
    paper_retention = {m: {e: row[e] / row[0.0] for e in paper_eps} for m, row in paper_rows.items()}
    curves = {"pixel": retention(pixel), "normalized": retention(normalized)}
    print(f"### FGSM retention acc(eps)/acc(0): {experiment}, {method}, seed {pixel['seed']}, "
          f"{pixel['test_samples']} test composites\n")
    print("| eps | paper " + method + " | paper, range over 8 methods | ours, pixel | ours, normalized |")
    print("|---|---:|---:|---:|---:|")
    for eps in paper_eps:
        spread = [paper_retention[m][eps] for m in paper_retention]
        cells = [f"{paper_retention[method][eps]:.3f}", f"{min(spread):.3f}-{max(spread):.3f}"]
        for name in ("pixel", "normalized"):
            ratio, acc = curves[name]
            cells.append(f"{ratio[eps]:.3f} ({acc[eps]:.2f} %)" if eps in ratio else "n/a")
        print(f"| {eps:g} | " + " | ".join(cells) + " |")
    print("\nMean absolute difference of the retention from the paper's " + method + " row:\n")
    for name in ("pixel", "normalized"):
        ratio, acc = curves[name]
        gaps = [abs(ratio[e] - paper_retention[method][e]) for e in paper_eps if e in ratio]
        print(f"- {name}: {sum(gaps) / len(gaps):.3f} (clean {acc[0.0]:.2f} %)")


if __name__ == "__main__":
    main()
