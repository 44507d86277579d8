"""runtime.choose_placement: the one policy for which backend and device a rank uses.

A pure function of the ranks on the node, the GPUs and the NCCL version, so every case a
GPU node can present is tested here on a laptop."""

import pytest

from spike_course.runtime import NCCL_SHARES_GPUS_FROM, Placement, choose_placement

NEW_NCCL, OLD_NCCL = (2, 30, 7), (2, 21, 5)
assert NEW_NCCL >= NCCL_SHARES_GPUS_FROM > OLD_NCCL


def test_no_gpu_means_gloo_on_the_cpu():
    assert choose_placement(4, 0) == Placement("gloo", "cpu", False)


def test_one_rank_per_gpu_means_nccl():
    assert choose_placement(8, 8, nccl_version=NEW_NCCL) == Placement("nccl", "cuda", False)


def test_more_ranks_than_gpus_share_them_with_nccl():
    placement = choose_placement(4, 1, nccl_version=NEW_NCCL)
    assert (placement.backend, placement.device_type, placement.shares_gpu) == ("nccl", "cuda", True)
    assert placement.note == "4 ranks share 1 GPU(s)"


def test_an_nccl_that_cannot_share_falls_back_and_says_why():
    placement = choose_placement(2, 1, nccl_version=OLD_NCCL)
    assert (placement.backend, placement.device_type) == ("gloo", "cpu")
    assert "NCCL 2.21.5 allows one process per GPU" in placement.note
    shared = choose_placement(2, 1, device="cuda", nccl_version=OLD_NCCL)
    assert (shared.backend, shared.device_type, shared.shares_gpu) == ("gloo", "cuda", True)
    with pytest.raises(RuntimeError, match="start fewer ranks, or use backend='gloo'"):
        choose_placement(2, 1, backend="nccl", nccl_version=OLD_NCCL)


def test_what_a_script_asks_for_is_obeyed():
    assert choose_placement(2, 2, device="cpu", nccl_version=NEW_NCCL) == Placement("gloo", "cpu", False)
    assert choose_placement(2, 2, backend="gloo", nccl_version=NEW_NCCL) == Placement("gloo", "cpu", False)
    gloo_on_gpus = choose_placement(2, 2, backend="gloo", device="cuda", nccl_version=NEW_NCCL)
    assert (gloo_on_gpus.backend, gloo_on_gpus.device_type) == ("gloo", "cuda")


@pytest.mark.parametrize("options, message", [
    (dict(device="gpu"), "unknown device 'gpu'"),
    (dict(backend="mpi"), "unknown backend 'mpi'"),
    (dict(backend="nccl", device="cpu"), "moves CUDA tensors only"),
])
def test_impossible_requests_are_refused_with_the_fix(options, message):
    with pytest.raises(ValueError, match=message):
        choose_placement(2, 1, nccl_version=NEW_NCCL, **options)


def test_cuda_without_a_gpu_is_refused():
    with pytest.raises(RuntimeError, match="torch sees no GPU"):
        choose_placement(2, 0, device="cuda")
