"""drmoo report: recognises what each command wrote, embeds the tables, links the PNGs relative to the report."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

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
    assert "Robustness comparison: compare" in text and "| method | Clean | 0.03 |" in text
    assert "Kernel benchmarks: " in text and "| dual_step | B=256 m=2 |" in text
    assert "Ablation on inner (linear)" in text and "| 5 | double-loop | ok |" in text
    assert "Wall-clock time per iteration" in text and "| mgda |" in text
    assert "\n#### linear: balanced gradient norm" in text and "\n### " not in text

    # Provenance: machine and backend as each directory records them.
    bench_md = sorted(BENCH_RESULTS.glob("*.md"))[0].read_text().splitlines()[0]
    assert f"- **machine**: {bench_md.split(':', 1)[1].strip()}" in text
    manifest = json.loads((results / "nested" / "ablation" / "ablation-inner.json").read_text())
    assert f"- **machine**: {manifest['machine']}" in text and f"- **backend**: {manifest['backend']}" in text
    assert "- **machine**: device cpu" in text  # compare records the device, not the machine model
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
