"""The side-by-side tables: ranks, Kendall's tau-b (against scipy), the paper's numbers, fabricated comparisons."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import scipy.stats
from hypothesis import given, settings
from hypothesis import strategies as st

from drmoo.experiments.paper_reference import PAPER_NAMES, REFERENCES, reference_for
from drmoo.experiments.summaries import (
    agreement_markdown,
    fgsm_comparison,
    kendall_tau_b,
    ranks,
    side_by_side,
    training_progress,
)

# Verbatim from the paper's LaTeX (Table 1 rows, then Table 2 rows), copied with sed, not retyped; the two
# bold rows are wrapped at an '&' to fit the line length.
TABLE_ONE_LATEX = r"""
Double-Clip MGDA
& $\boldsymbol{95.66}\%$ & $\boldsymbol{83.48}\%$ & $\boldsymbol{65.95}\%$ & $\boldsymbol{60.40}\%$
& $\boldsymbol{57.13}\%$
& $\boldsymbol{98.76\%}$ & $\boldsymbol{97.59\%}$ & $\boldsymbol{94.40\%}$ & $\boldsymbol{91.05\%}$
& $\boldsymbol{86.65\%}$ \\
Double-loop MGDA
& 92.80\% & 72.81\% & 57.71\% & 54.49\% & $51.63\%$
& 97.49\% & 95.38\% & 89.99\% & 85.25\% & 79.88\% \\
MoCo~\citep{MOCO}
& 94.49\% & 77.69\% & 61.74\% & 58.63\% & 56.43\%
& 98.27\% & 96.62\% & 92.75\% & 88.75\% & 83.43\% \\
NashMTL~\citep{nashMTL}
& 91.21\% & 62.58\% & 51.67\% & 49.54\% & 47.09\%
& 96.17\% & 92.31\% & 84.53\% & 78.91\% & 73.48\% \\
FAMO~\citep{FAMO}
& 89.05\% & 61.04\% & 50.82\% & 48.66\% & 46.48\%
& 95.90\% & 91.86\% & 84.29\% & 78.94\% & 73.52\% \\
SDMGrad~\citep{SDMkaiyiJi}
& 89.59\% & 64.02\% & 52.00\% & 49.91\% & 47.31\%
& 96.46\% & 92.89\% & 85.06\% & 79.37\% & 73.50\% \\
MoDo~\citep{MODO}
& 91.10\% & 64.08\% & 51.95\% & 49.73\% & 47.49\%
& 96.50\% & 93.15\% & 86.03\% & 80.56\% & 74.81\% \\
MGDA~\citep{MGDA1stwork,qimgda}
& 89.44\% & 62.61\% & 52.19\% & 50.81\% & 48.30\%
& 96.34\% & 92.85\% & 85.42\% & 80.26\% & 75.18\% \\
"""
TABLE_TWO_LATEX = r"""
Double-Clip MGDA & $\boldsymbol{88.41}$\% & $\boldsymbol{89.55}$\% & $\boldsymbol{94.63}$\% \\
Double-loop MGDA & 86.61\% & 87.97\% & 93.28\% \\
MoCo~\citep{MOCO} & 87.27\% & 88.50\% & 93.31\% \\
NashMTL~\citep{nashMTL} & 85.58\% & 87.00\% & 92.41\% \\
FAMO~\citep{FAMO} & 85.32\% & 86.03\% & 91.41\% \\
SDMGrad~\citep{SDMkaiyiJi} & 85.89\% & 87.06\% & 92.45\% \\
MoDo~\citep{MODO} & 85.66\% & 87.08\% & 92.42\% \\
MGDA~\citep{MGDA1stwork,qimgda} & 85.53\% & 86.87\% & 92.58\% \\
"""
EPS = [0.0, 0.01, 0.03, 0.05, 0.08]


def _numbers(text: str) -> list[float]:
    return [float(v) for v in re.findall(r"(\d+\.\d+)", text)]


def test_the_reference_numbers_are_the_papers() -> None:
    rows = re.split(r"\\\\", TABLE_ONE_LATEX)
    parsed = {}
    for row in rows:
        for method, name in PAPER_NAMES.items():
            if row.strip().startswith(name + "\n") or row.strip().startswith(name + "~"):
                parsed[method] = _numbers(row)
    assert set(parsed) == set(PAPER_NAMES)
    for method, values in parsed.items():
        assert len(values) == 10
        assert REFERENCES["multimnist2"].values[method] == tuple(values[:5]), method
        assert REFERENCES["multimnist3"].values[method] == tuple(values[5:]), method
    for line in TABLE_TWO_LATEX.strip().splitlines():
        method = next(m for m, name in PAPER_NAMES.items() if line.startswith((name + " ", name + "~")))
        assert REFERENCES["celeba"].values[method] == tuple(_numbers(line)), method
    for reference in REFERENCES.values():
        assert reference.source and reference.title and len(reference.columns) == len(reference.labels)
    assert reference_for("linear") is None
    assert REFERENCES["multimnist2"].value("double-clip", 0.05) == 60.40
    assert REFERENCES["multimnist2"].value("double-clip", 0.04) is None
    assert REFERENCES["celeba"].value("moco", "mean_auc") == 93.31


@pytest.mark.parametrize(("x", "y"), [
    ([1, 2, 3, 4], [1, 2, 3, 4]),
    ([1, 2, 3, 4], [4, 3, 2, 1]),
    ([1, 2, 2, 3, 5], [2, 1, 3, 3, 4]),  # ties in both
    ([3, 1, 2], [1, 1, 2]),
    ([95.66, 92.8, 94.49, 91.21, 89.05, 89.59, 91.1, 89.44], [65.3, 62.85, 70.75, 60.0, 61.0, 58.2, 61.0, 63.15]),
])
def test_kendall_tau_b_matches_scipy(x: list[float], y: list[float]) -> None:
    expected = scipy.stats.kendalltau(x, y, variant="b").statistic
    assert kendall_tau_b(x, y) == pytest.approx(expected, abs=1e-12)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 4)), min_size=2, max_size=12))
def test_kendall_tau_b_matches_scipy_with_many_ties(pairs: list[tuple[int, int]]) -> None:
    x, y = [p[0] for p in pairs], [p[1] for p in pairs]
    expected = scipy.stats.kendalltau(x, y, variant="b").statistic
    ours = kendall_tau_b(x, y)
    assert (math.isnan(ours) and math.isnan(expected)) or ours == pytest.approx(expected, abs=1e-12)


def test_kendall_tau_b_undefined_and_bad_input() -> None:
    assert math.isnan(kendall_tau_b([1.0], [2.0]))
    assert math.isnan(kendall_tau_b([1, 1, 1], [1, 2, 3]))  # no ordering in x
    with pytest.raises(ValueError, match="one length"):
        kendall_tau_b([1, 2], [1, 2, 3])


def test_ranks_best_first_ties_share_the_mean_rank() -> None:
    assert ranks({"a": 50.0, "b": 70.0, "c": 60.0}) == {"b": 1.0, "a": 3.0, "c": 2.0}
    assert ranks({"a": 5.0, "b": 5.0, "c": 9.0, "d": 1.0}) == {"c": 1.0, "a": 2.5, "b": 2.5, "d": 4.0}
    assert ranks({"a": math.nan, "b": 1.0}) == {"b": 1.0}


def _report(method: str, seed: int, accuracies: list[float], iterations: int, samples: int) -> dict:
    return {"method": method, "seed": seed, "experiment": "multimnist2", "test_samples": 100,
            "results": [{"eps": e, "mean_acc": a / 100, "task_acc": [a / 100] * 2} for e, a in zip(EPS, accuracies)],
            "iterations": iterations, "samples_seen": samples}


def test_fgsm_comparison_from_fabricated_runs() -> None:
    # Ours: moco best everywhere, then double-clip, then mgda - except at 0.08 where mgda beats double-clip.
    reports = [
        _report("double-clip", 0, [66.0, 15.0, 10.0, 9.0, 7.0], 100, 51200),
        _report("double-clip", 1, [64.0, 13.0, 8.0, 7.0, 5.0], 100, 51200),
        _report("mgda", 0, [60.0, 12.0, 7.0, 6.0, 6.5], 100, 25600),
        _report("mgda", 1, [62.0, 12.0, 7.0, 6.0, 6.5], 100, 25600),
        _report("moco", 0, [70.0, 23.0, 16.0, 15.0, 14.0], 100, 25600),
        _report("moco", 1, [72.0, 25.0, 18.0, 17.0, 16.0], 100, 25600),
    ]
    table, rows, agreement = fgsm_comparison(reports, EPS, "### fabricated", "multimnist2")
    # mean ± std over seeds and our rank, then the paper's value and its rank among these three methods
    line = next(x for x in table.splitlines() if x.startswith("| double-clip |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[1] == "65.00 ± 1.41 (2)" and cells[5] == "6.00 ± 1.41 (3)"
    assert cells[6] == "95.66 (1)" and cells[10] == "57.13 (1)"
    assert cells[11] == "100" and cells[12] == "51,200"  # iterations, samples seen
    moco = [c.strip() for c in next(x for x in table.splitlines() if x.startswith("| moco |")).strip("|").split("|")]
    assert moco[1] == "71.00 ± 1.41 (1)" and moco[6] == "94.49 (2)" and moco[12] == "25,600"
    assert "Clean (ours)" in table and "0.08 (paper)" in table and "samples seen" in table
    # paper order (dc, moco, mgda) vs ours (moco, dc, mgda): one discordant pair of three -> tau = 1/3;
    # at 0.08 ours is (moco, mgda, dc): two discordant -> -1/3
    taus = {row["column"]: row["tau_b"] for row in agreement["per_column"]}
    assert taus["Clean"] == pytest.approx(1 / 3) and taus["0.08"] == pytest.approx(-1 / 3)
    assert agreement["mean_tau_b"] == pytest.approx((4 * (1 / 3) - 1 / 3) / 5)
    assert all(row["methods"] == 3 for row in agreement["per_column"])
    assert "| τ_b | +0.33 | +0.33 | +0.33 | +0.33 | -0.33 | +0.20 |" in table
    by_key = {(r["method"], r["eps"]): r for r in rows}
    assert by_key[("mgda", 0.08)]["rank"] == 2.0 and by_key[("mgda", 0.08)]["paper_rank"] == 3.0
    assert by_key[("moco", 0.0)]["mean_acc"] == 71.0 and by_key[("moco", 0.0)]["seeds"] == 2
    assert by_key[("double-clip", 0.0)]["samples_seen"] == 51200


def test_columns_the_paper_lacks_and_experiments_it_lacks() -> None:
    per_seed = {"moco": {0.0: [70.0], 0.02: [30.0]}, "mgda": {0.0: [60.0], 0.02: [35.0]}}
    table, _, agreement = side_by_side("multimnist2", [(0.0, "Clean"), (0.02, "0.02")], per_seed, "### x")
    assert "0.02 (ours)" in table and "0.02 (paper)" not in table and "Clean (paper)" in table
    assert [row["column"] for row in agreement["per_column"]] == ["Clean"]
    assert "70.00 (1)" in table  # a single seed: no spread
    table, _, agreement = side_by_side("linear", [(0.0, "Clean")], per_seed, "### x")
    assert "paper reports no numbers for linear" in table and agreement["per_column"] == []
    assert "no agreement to measure" in agreement_markdown(agreement)
    # one method alone has no ordering: tau is n/a
    _, _, agreement = side_by_side("multimnist3", [(0.0, "Clean")], {"moco": {0.0: [90.0]}}, "### x")
    assert math.isnan(agreement["per_column"][0]["tau_b"]) and "n/a" in agreement_markdown(agreement)


def test_training_progress_reads_the_last_epoch(tmp_path: Path) -> None:
    assert training_progress(tmp_path) == {}
    (tmp_path / "metrics.json").write_text("not json")
    assert training_progress(tmp_path) == {}
    (tmp_path / "metrics.json").write_text(json.dumps([{"step": 16, "samples": 8192}, {"step": 32, "samples": 16384}]))
    assert training_progress(tmp_path) == {"iterations": 32, "samples_seen": 16384}
