"""drmoo report: recognises what each command wrote, embeds the tables, links the PNGs relative to the report."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import drmoo
from drmoo.cli import main

BENCH_RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
TINY = ["--input-size", "16", "--train-size", "48", "--test-size", "16", "--batch-size", "16", "--quiet"]
LINK = re.compile(r"(!?)\[[^\]]*\]\(<?([^)>]+)>?\)")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Real outputs of synthetic, compare, ablate and bench-iter, made once with tiny settings."""
    root = tmp_path_factory.mktemp("results")
    assert main(["synthetic", "--problem", "linear", "--methods", "double-clip", "--steps", "4",
                 "--out", str(root / "synthetic"), "--quiet"]) == 0
    assert main(["compare", "--methods", "double-clip", "--max-steps", "1", "--eps", "0,0.03",
                 "--cache-dir", str(root / "cache"), "--out", str(root / "compare"), *TINY]) == 0
    assert main(["ablate", "--what", "inner", "--experiment", "linear", "--grid", "5", "--steps", "2",
                 "--out", str(root / "nested" / "ablation"), "--quiet"]) == 0
    assert main(["bench-iter", "--methods", "mgda", "--batch-size", "2", "--input-size", "16", "--repeats", "1",
                 "--warmup", "0", "--device", "cpu", "--out", str(root / "wallclock"), "--quiet"]) == 0
    (root / "nested" / "notes").mkdir()
    (root / "nested" / "notes" / "todo.txt").write_text("nothing here\n")
    return root


def _links(report: Path) -> list[tuple[bool, Path]]:
    """(is an image, resolved target) of every markdown link in the report."""
    return [(bang == "!", (report.parent / target).resolve()) for bang, target in LINK.findall(report.read_text())]


def test_report_embeds_tables_and_links_images_relative_to_itself(results: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    report = results / "reports" / "deep" / "report.md"  # not beside the results: links must climb
    runs = [results / "synthetic", results / "compare", BENCH_RESULTS, results / "nested", results / "wallclock",
            results / "missing"]
    assert main(["report", "--runs", *map(str, runs), "--out", str(report)]) == 0
    assert "section(s)" in capsys.readouterr().out
    text = report.read_text()

    # Each kind is recognised, its table embedded (headings demoted below the report's own).
    assert "Synthetic comparison: linear" in text and "| double-clip | " in text
    assert "Robustness comparison: compare" in text
    # ours beside the paper's Table 1 (rank in brackets), the samples each run drew, Kendall's tau per eps
    assert "| method | Clean (ours) | 0.03 (ours) | Clean (paper) | 0.03 (paper) | iterations | samples seen |" in text
    assert "95.66 (1)" in text and "| τ_b | n/a | n/a | n/a |" in text  # one method: no ordering to compare
    assert "- **paper agreement**: Kendall's τ_b" in text and "- **FGSM eps**: pixel units" in text
    assert "Kernel benchmarks: " in text and "| dual_step | B=256 m=2 |" in text
    assert "Ablation on inner (linear)" in text and "| 5 | double-loop | ok |" in text
    assert "Wall-clock time per iteration" in text and "| mgda |" in text
    assert "\n#### linear: balanced gradient norm" in text and "\n### " not in text

    # Provenance: machine and backend as each directory records them.
    # the first kernel-benchmark table (the report reads only those: the first line names them)
    bench_md = next(first for path in sorted(BENCH_RESULTS.glob("*.md"))
                    if (first := path.read_text().splitlines()[0]).startswith("# drmoo kernel benchmarks"))
    assert f"- **machine**: {bench_md.split(':', 1)[1].strip()}" in text
    manifest = json.loads((results / "nested" / "ablation" / "ablation-inner.json").read_text())
    assert f"- **machine**: {manifest['machine']}" in text and f"- **backend**: {manifest['backend']}" in text
    # compare's runs record where each trained (environment.json): torch, threads, CPU and its vector ISA
    assert f"- **environment**: drmoo {drmoo.__version__}, torch {torch.__version__}, " in text
    assert "hyperparameters of double-clip" in text and "lam=" in text

    # Every link resolves from the report's own directory, and every PNG written is shown.
    links = _links(report)
    assert links and all(target.exists() for _, target in links), [t for _, t in links if not t.exists()]
    images = {target for is_image, target in links if is_image}
    for png in ("synthetic/convergence.png", "compare/robustness.png", "nested/ablation/ablation-inner.png",
                "wallclock/wallclock.png"):
        assert (results / png).resolve() in images, png
    assert "](/" not in text  # relative, never absolute

    # Unknown and missing directories are listed with the reason; recognised ones are not descended into.
    skipped = text.split("## Skipped", 1)[1]
    assert "nested/notes" in skipped and "no recognised results" in skipped and "todo.txt" in skipped
    assert "missing" in skipped and "does not exist" in skipped
    assert "Training run" not in text  # compare's run directories belong to the comparison


def test_a_single_training_run_shows_its_metrics_and_fgsm_table(results: Path) -> None:
    report = results / "run-report.md"
    assert main(["report", "--runs", str(results / "compare" / "double-clip-seed0"), "--out", str(report)]) == 0
    text = report.read_text()
    assert "Training run: multimnist2, double-clip, seed 0" in text
    assert "`metrics.csv`" in text and "| eps | task 1 | task 2 | mean |" in text
    assert "- **backend**: automatic" in text and "input_size=16" in text
    assert all(target.exists() for _, target in _links(report))


def test_nothing_recognised_and_bad_out(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "empty").mkdir()
    report = tmp_path / "r.md"
    assert main(["report", "--runs", str(tmp_path / "empty"), "--out", str(report)]) == 0
    text = report.read_text()
    assert "No recognised results were found." in text and "empty" in text.split("## Skipped", 1)[1]
    assert main(["report", "--runs", str(tmp_path / "empty"), "--out", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_a_comparison_without_the_paper_block_gets_it_from_table_csv(tmp_path: Path) -> None:
    """CelebA's compare writes Table 2 without the paper's numbers: the report rebuilds them beside ours."""
    directory = tmp_path / "celeba-compare"
    for method in ("double-clip", "mgda", "moco"):
        (directory / f"{method}-seed0").mkdir(parents=True)
        (directory / f"{method}-seed0" / "config.json").write_text(json.dumps(
            {"experiment": "celeba", "method": method, "seed": 0, "preset": "quick"}))
    (directory / "table.md").write_text("### CelebA\n\n| method | Averaged Accuracy |\n")
    rows = ["method,seeds,mean_accuracy,std_accuracy,mean_balanced_accuracy,std_balanced_accuracy,mean_auc,std_auc",
            "double-clip,1,80.0,0,70.0,0,75.0,0", "mgda,1,85.0,0,60.0,0,76.0,0", "moco,1,90.0,0,65.0,0,74.0,0"]
    (directory / "table.csv").write_text("\n".join(rows) + "\n")
    (directory / "dr-table.csv").write_text("method,column,mean,std,seeds\n")  # compare's robustness columns
    report = tmp_path / "report.md"
    assert main(["report", "--runs", str(directory), "--out", str(report)]) == 0
    text = report.read_text()
    assert (directory / "dr-table.csv").resolve() in [target for _, target in _links(report)]
    assert "Beside the paper (rebuilt by `drmoo report` from table.csv" in text
    assert "| double-clip | 80.00 (3) | 70.00 (1) | 75.00 (2) | 88.41 (1) | 89.55 (1) | 94.63 (1) |" in text
    # accuracy: paper dc > moco > mgda, ours moco > mgda > dc -> tau -1/3; balanced: ours dc > moco > mgda = paper: +1
    # AUC: paper dc > moco > mgda, ours mgda > dc > moco -> -1/3
    assert "| τ_b | -0.33 | +1.00 | -0.33 | +0.11 |" in text
    assert "- **paper agreement**: Kendall's τ_b between the paper's ordering of the methods and ours: mean +0.11" \
        in text
