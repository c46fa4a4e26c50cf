"""Counter-based seeds and the per-client seeding of the global generators."""

import random

import numpy as np
import pytest
import torch

from lightning_fl import seeding
from lightning_fl.seeding import derive_seed, seed_everything_quietly


def test_derived_seeds_depend_on_every_part_and_its_order():
    seeds = {derive_seed(0, r, c, 12) for r in range(20) for c in range(50)}
    assert len(seeds) == 1000 and all(0 <= s < 2**64 for s in seeds)
    assert derive_seed(1, 2) != derive_seed(2, 1) and derive_seed(1, 2) == derive_seed(1, 2)


def test_quiet_seeding_draws_what_manual_seed_draws_without_calling_it(monkeypatch):
    seed = derive_seed(3, 4, 5)
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    expected = (torch.rand(5), torch.randn(3, generator=None), random.random(), np.random.rand(2))

    def costly(*args, **kwargs):
        raise AssertionError("torch.manual_seed queues a lazy CUDA seeding with a stack trace on CUDA builds")

    monkeypatch.setattr(seeding.torch, "manual_seed", costly)
    torch.rand(7)  # move the generators on, so the comparison below depends on the reseeding
    seed_everything_quietly(seed)
    got = (torch.rand(5), torch.randn(3), random.random(), np.random.rand(2))
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert got[2] == expected[2] and np.array_equal(got[3], expected[3])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_quiet_seeding_seeds_cuda_once_it_is_initialised():
    torch.zeros(1, device="cuda")
    seed_everything_quietly(11)
    a = torch.rand(4, device="cuda")
    torch.manual_seed(11)
    assert torch.equal(a, torch.rand(4, device="cuda"))


def test_stream_ids_are_defined_in_one_place_and_distinct():
    """Every STREAM_* id lives in lightning_fl.seeding; no two share a value except Poisson sampling and DP-SGD's
    sampling, whose derive_seed tuples differ in length (said where they are defined)."""
    import collections
    import re

    from conftest import REPO

    ids = {k: v for k, v in vars(seeding).items() if k.startswith("STREAM_")}
    counts = collections.Counter(ids.values())
    assert {k for k, v in ids.items() if counts[v] > 1} == {"STREAM_POISSON", "STREAM_DPSGD_SAMPLING"}
    for path in (REPO / "lightning_fl").rglob("*.py"):
        if path.name != "seeding.py":
            assert not re.search(r"^STREAM_\w+\s*[,=]", path.read_text(), re.M), f"{path} defines a stream id"
