"""spike_course.federated: label-skewed sites and the FedAvg reference."""

import pytest
import torch

from spike_course import federated

LABELS = torch.arange(1000) % 10


def test_split_has_the_sizes_and_no_sample_twice():
    for skew in (0.0, 0.5, 1.0):
        split = federated.label_skew_split(LABELS, [400, 200, 100], skew=skew)
        assert [len(s) for s in split] == [400, 200, 100]
        flat = [i for s in split for i in s]
        assert len(set(flat)) == len(flat)


def test_skew_one_gives_disjoint_classes_and_skew_zero_all_classes():
    skewed = federated.label_skew_split(LABELS, [300, 300], skew=1.0)
    assert set(LABELS[skewed[0]].tolist()) == {0, 2, 4, 6, 8}
    assert set(LABELS[skewed[1]].tolist()) == {1, 3, 5, 7, 9}
    iid = federated.label_skew_split(LABELS, [300, 300], skew=0.0)
    for site in iid:
        counts = torch.bincount(LABELS[site], minlength=10)
        assert counts.min() >= 15  # about 30 of each class, none missing


def test_split_is_the_same_on_every_rank_and_changes_with_the_seed():
    a = federated.label_skew_split(LABELS, [100, 100], skew=0.5, seed=3)
    assert a == federated.label_skew_split(LABELS, [100, 100], skew=0.5, seed=3)
    assert a != federated.label_skew_split(LABELS, [100, 100], skew=0.5, seed=4)


def test_split_refuses_what_it_cannot_give():
    with pytest.raises(ValueError, match="not enough samples of its own classes"):
        federated.label_skew_split(LABELS, [600, 100], skew=1.0)  # site 0 owns only 500
    with pytest.raises(ValueError, match="skew"):
        federated.label_skew_split(LABELS, [10, 10], skew=1.5)


def test_targets_of_a_subset():
    dataset = torch.utils.data.TensorDataset(torch.zeros(6, 1), torch.arange(6))
    dataset.targets = torch.arange(6) * 10
    subset = torch.utils.data.Subset(dataset, [1, 4])
    assert federated.targets_of(subset).tolist() == [10, 40]


def test_reference_is_the_sample_weighted_mean():
    states = [{"w": torch.tensor([4.0])}, {"w": torch.tensor([0.0])}]
    assert federated.fedavg_reference(states, [3, 1])["w"].item() == pytest.approx(3.0)
