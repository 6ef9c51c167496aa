"""Resume on another world size, the parts that need no process: the global data order and
the fingerprint's global batch. The runs themselves (DDP 2 -> 1 and 1 -> 2, FSDP2 2 -> 1,
the refusals) are in tests/test_strategies.py, which holds the reference runs they share."""

from __future__ import annotations

import random

import pytest

from engine.datapath.data import ShardedBatches
from engine.state.fingerprint import differences, global_batch_refusal

#: (micro-batch, world size, accumulation): three splits of a global batch of 8
SPLITS = [(4, 2, 1), (4, 1, 2), (2, 2, 2), (8, 1, 1)]


def examples_per_step(micro: int, world: int, accum: int, lengths=None, epoch: int = 0,
                      n: int = 1000) -> list[set[int]]:
    """Each optimizer step's examples, all ranks together."""
    per_rank = [ShardedBatches(n, micro, rank, world, seed=3, accumulation=accum,
                               lengths=lengths).epoch(epoch) for rank in range(world)]
    steps = len(per_rank[0]) // accum
    return [set().union(*(batch for batches in per_rank
                          for batch in batches[s * accum:(s + 1) * accum]))
            for s in range(steps)]


@pytest.mark.parametrize("grouped", [False, True], ids=["shuffled", "group_by_length"])
def test_each_step_sees_the_same_examples_however_the_global_batch_is_split(grouped):
    """The order is one permutation per epoch cut into global steps, so a resume on another
    world size (same global batch) continues with the same examples per step; with
    group_by_length the mega-batches are whole optimizer steps, not world-size batches."""
    rng = random.Random(0)
    lengths = tuple(rng.randrange(1, 500) for _ in range(1000)) if grouped else None
    reference = examples_per_step(*SPLITS[0], lengths=lengths)
    assert len(reference) == 125 and all(len(step) == 8 for step in reference)
    for split in SPLITS[1:]:
        assert examples_per_step(*split, lengths=lengths) == reference, split


def fingerprint(micro: int, accum: int, world: int, strategy: str = "single|ddp|fsdp2") -> dict:
    return {"config": {"training.global_batch_size": micro * accum * world,
                       "distributed.strategy": strategy, "optimizer.learning_rate": 0.1},
            "batch": {"per_device_train_batch_size": micro, "gradient_accumulation_steps": accum,
                      "world_size": world},
            "train_data": "d", "base_model": "m"}


def test_the_global_batch_counts_and_its_split_does_not():
    assert differences(fingerprint(4, 1, 2), fingerprint(2, 4, 1)) == {}
    assert differences(fingerprint(4, 1, 2), fingerprint(4, 1, 1)) == {
        "training.global_batch_size": "8 -> 4"}
    assert global_batch_refusal("ckpt", fingerprint(4, 1, 2), fingerprint(2, 4, 1)) is None
    split = "(per_device_train_batch_size {} x gradient_accumulation_steps {} x world size {})"
    for now, fix in (((4, 1, 1), "set training.gradient_accumulation_steps 2"),
                     ((4, 1, 4), "set training.per_device_train_batch_size 2"),
                     ((3, 1, 1), "set training.per_device_train_batch_size 8"),
                     ((3, 3, 3), "resume on a number of processes that divides 8")):
        assert global_batch_refusal("ckpt", fingerprint(4, 1, 2), fingerprint(*now)) == (
            f"checkpoint ckpt has global batch 8 {split.format(4, 1, 2)}; this run's is "
            f"{now[0] * now[1] * now[2]} {split.format(*now)}: {fix} to resume")


def test_a_fingerprint_from_before_the_global_batch_resumes_in_todays_terms():
    """Checkpoints recorded the split and the world size, and the strategy that ran."""
    old = {"config": {"training.per_device_train_batch_size": 4,
                      "training.gradient_accumulation_steps": 1, "distributed.world_size": 2,
                      "distributed.strategy": "ddp", "optimizer.learning_rate": 0.1},
           "train_data": "d", "base_model": "m"}
    assert differences(old, fingerprint(8, 1, 1)) == {}
    assert differences(old, fingerprint(4, 1, 1)) == {"training.global_batch_size": "8 -> 4"}
    assert global_batch_refusal("ckpt", old, fingerprint(4, 1, 1)).startswith(
        "checkpoint ckpt has global batch 8; this run's is 4 (")


def test_a_key_added_since_the_checkpoint_resumes_at_its_default_only():
    """A checkpoint from before a key existed (the rloo section, grpo.dynamic_sampling) was
    trained as that key's default behaves: at the default it resumes, set otherwise it is a
    change named like any other."""
    now = fingerprint(8, 1, 1)
    at_default = {"config": {**now["config"], "rloo.num_generations": 2,
                             "grpo.dynamic_sampling": False}}
    assert differences(fingerprint(8, 1, 1), {**now, **at_default}) == {}
    changed = {"config": {**now["config"], "grpo.dynamic_sampling": True}}
    assert differences(fingerprint(8, 1, 1), {**now, **changed}) == {
        "grpo.dynamic_sampling": '"<unset>" -> true'}


def test_a_rank_the_checkpoint_has_no_rng_file_for_gets_a_state_of_its_own():
    """Derived from (seed, rank, step): the same on every resume, different per rank, and
    deriving it leaves the process's current RNG as it was."""
    import torch

    from engine.state.checkpoint import derived_rng_state

    before = torch.get_rng_state()
    one, again = derived_rng_state(42, 1, 3), derived_rng_state(42, 1, 3)
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(one["torch"], again["torch"]) and one["python"] == again["python"]
    others = [derived_rng_state(42, 2, 3), derived_rng_state(42, 1, 4), derived_rng_state(7, 1, 3)]
    assert all(not torch.equal(one["torch"], other["torch"]) for other in others)


def list_epoch(b: ShardedBatches, epoch: int) -> list[list[int]]:
    """The order as Python lists, the way it was built before it was numpy: the reference
    the numpy order must equal exactly (a resumed run and the default run's adapter depend
    on it)."""
    import torch

    perm = torch.randperm(b.num_examples,
                          generator=torch.Generator().manual_seed(b.seed + epoch)).tolist()
    if b.lengths is not None:
        mega = b.global_batch * b.accumulation * 50
        perm = [i for start in range(0, len(perm), mega)
                for i in sorted(perm[start:start + mega], key=lambda i: -b.lengths[i])]
    short = len(b) * b.global_batch - len(perm)
    if short > 0:
        perm = perm + (perm * (short // len(perm) + 1))[:short]
    return [perm[k * b.global_batch + b.rank * b.micro_batch_size:][:b.micro_batch_size]
            for k in range(len(b))]


@pytest.mark.parametrize("n, micro, world, accum, drop_last, grouped", [
    (1000, 4, 2, 1, True, False), (1003, 2, 2, 2, True, True), (13, 4, 2, 1, False, False),
    (5, 4, 2, 2, False, True), (2600, 3, 1, 2, True, True)])
def test_the_numpy_order_is_the_list_order(n, micro, world, accum, drop_last, grouped):
    """8 bytes an example in numpy, exactly the order the Python lists gave: every rank,
    epochs 0 and 1, shuffled and group_by_length (lengths with many ties: a stable sort),
    with the remainder dropped or filled (cycling when a step is larger than the split)."""
    rng = random.Random(n)
    lengths = [rng.randrange(1, 20) for _ in range(n)] if grouped else None
    for rank in range(world):
        b = ShardedBatches(n, micro, rank, world, seed=5, accumulation=accum, lengths=lengths,
                           drop_last=drop_last)
        for epoch in (0, 1):
            order = b.epoch(epoch)
            assert order.dtype == "int64" and order.shape == (len(b), micro)
            assert order.tolist() == list_epoch(b, epoch), (rank, epoch)
