"""Error messages echo long values shortened: a refused list of 20,000 seeds is not a 109,000-character line."""

from __future__ import annotations

import pytest

from drmoo._echo import MAX_ECHOED_CHARS, echo, echo_items, first_repeat
from drmoo.experiments.synthetic import SyntheticConfig

from .conftest import assert_one_line_refusal, run_cli

SEEDS = ",".join(map(str, range(20_000)))
MAX_LINE = 400  # the message's own words and the shortened value, far below the 109,000 characters echoed before


@pytest.mark.parametrize(("seeds", "named"), [
    (SEEDS + ",0", "repeats a seed: 0"),  # compare's own check
    (SEEDS + ",x", "got 'x' in '0,1,2,3,4,...' (20001 comma-separated values)"),
    (SEEDS + ",-1", "got '-1' in '0,1,2,3,4,...' (20001 comma-separated values)"),
])
def test_a_refused_seed_list_is_shown_by_its_first_seeds_and_its_length(
        seeds: str, named: str, tmp_path: object, capsys: pytest.CaptureFixture) -> None:
    code, err = run_cli(["compare", "--experiment", "multimnist2", "--methods", "mgda", "--seeds", seeds,
                         "--out", str(tmp_path)], capsys)
    assert_one_line_refusal(code, err, named)
    assert len(err) < MAX_LINE, len(err)


def test_a_huge_count_is_echoed_shortened(capsys: pytest.CaptureFixture) -> None:
    code, err = run_cli(["train", "--max-steps", "9" * 100_000], capsys)
    assert_one_line_refusal(code, err, "(100000 characters)")
    assert len(err) < MAX_LINE, len(err)


def test_the_synthetic_settings_name_the_repeated_seed_not_all_of_them() -> None:
    with pytest.raises(ValueError, match=r"repeats a seed: 0 \(\[0, 1, 2, 3, 4, \.\.\.\] \(20001 values\)\)") as error:
        SyntheticConfig(problem="linear", seeds=[*range(20_000), 0]).resolved()
    assert len(str(error.value)) < MAX_LINE


def test_echo_keeps_short_values_whole_and_shortens_long_ones() -> None:
    assert echo("0,1,2") == "'0,1,2'" and echo_items([1, 2]) == "[1, 2]"
    assert echo("x" * 1000) == repr("x" * MAX_ECHOED_CHARS + "...") + " (1000 characters)"
    assert echo_items(["y" * 1000]) == "['" + "y" * (MAX_ECHOED_CHARS - 1) + "...]"
    assert first_repeat([3, 1, 2, 1, 3]) == 1 and first_repeat([1, 2]) is None
