"""Batches for one rank: a seeded permutation per epoch, cut into global batches, sharded.

Global batch k is `perm[k*B : (k+1)*B]` with B = micro-batch x world size, and rank r takes the
r-th contiguous slice. So 2 ranks x batch b see exactly the examples 1 rank x batch 2b sees,
which is what makes DDP vs single runs comparable bit for bit. The permutation does not depend
on the world size, so the position in an epoch is a global sample count (batches consumed x
B): a checkpoint resumes exactly on another world size with the same examples per optimizer
step (group_by_length sorts within mega-batches of whole optimizer steps for the same
reason). An epoch holds whole optimizer steps (micro x world x accumulation examples each);
the remainder is dropped, so no step straddles two epochs and batch b x accumulation k sees
exactly what batch k*b sees (or, with drop_last false, the last step is filled with examples
from the start of the epoch).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from finetune.datatypes.encoding import IGNORE_INDEX
from finetune.errors import PipelineError
from finetune.imports import load_object


@dataclass(frozen=True)
class ShardedBatches:
    num_examples: int
    micro_batch_size: int
    rank: int
    world_size: int
    seed: int
    accumulation: int = 1
    #: per-example token counts (a sequence or numpy array); set = group_by_length (similar
    #: lengths share a batch)
    lengths: "Sequence[int] | np.ndarray | None" = None
    #: False: fill the last optimizer step with examples from the epoch's start (the padding
    #: torch's DistributedSampler does) instead of dropping the remainder
    drop_last: bool = True

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.world_size

    def __len__(self) -> int:
        """Micro-batches per epoch on each rank (whole optimizer steps only)."""
        per_step = self.global_batch * self.accumulation
        steps = (self.num_examples // per_step if self.drop_last
                 else -(-self.num_examples // per_step))
        return steps * self.accumulation

    def epoch(self, epoch: int) -> np.ndarray:
        """This rank's micro-batches of the epoch: row k holds micro-batch k's example indices
        (int64, [len(self), micro_batch_size]). Numpy, not Python lists: 8 bytes an example
        in each DataLoader worker instead of ~56, however large the split."""
        g = torch.Generator().manual_seed(self.seed + epoch)
        perm = torch.randperm(self.num_examples, generator=g).numpy()
        if self.lengths is not None:
            perm = self._grouped(perm)
        short = len(self) * self.global_batch - len(perm)
        if short > 0:  # drop_last false: the last step filled from the epoch's start, cycling
            perm = np.concatenate([perm, np.resize(perm, short)])
        steps = perm[:len(self) * self.global_batch].reshape(
            len(self), self.world_size, self.micro_batch_size)
        return np.ascontiguousarray(steps[:, self.rank])

    def _grouped(self, perm: np.ndarray) -> np.ndarray:
        """HF's LengthGroupedSampler idea, per global batch: the shuffled order is cut into
        mega-batches of 50 optimizer steps' examples (the same for any split of the global
        batch), each sorted longest first, ties in shuffled order (a stable sort), so a batch
        (and each rank's share of it) holds similar lengths and pads little. Still seeded per
        epoch."""
        mega = self.global_batch * self.accumulation * MEGABATCH_MULT
        lengths = np.asarray(self.lengths, dtype=np.int64)[perm]
        chunk = np.arange(len(perm)) // mega
        return perm[np.lexsort((-lengths, chunk))]  # by chunk, then longest first; stable


MEGABATCH_MULT = 50
#: what a language-model run reads of a tokenized split; a trainer type declares its own
#: (engine.recipe.run.TrainingRun.columns), e.g. DPO adds the rejected side
MODEL_COLUMNS = ("input_ids", "labels")


def load_tokenized(path, columns: tuple[str, ...] = MODEL_COLUMNS):
    """A tokenized split with only the `columns` a run reads (those the split has: a trainer
    type's optional columns may be absent)."""
    import datasets

    ds = datasets.load_from_disk(str(path))
    return ds.select_columns([c for c in columns if c in ds.column_names])


def take_rows(dataset, indices) -> list[dict]:
    """Rows at `indices` in one Arrow take (not one lookup per row)."""
    cols = dataset[list(indices)]
    return [dict(zip(cols, values)) for values in zip(*cols.values())]


def round_up(n: int, multiple: int | None) -> int:
    """`n` up to a multiple of `multiple` (pad_to_multiple_of; None: `n`)."""
    return n if not multiple else -(-n // multiple) * multiple


def collate(rows: list[dict], pad_id: int, multiple: int | None = None
            ) -> dict[str, torch.Tensor]:
    """Dynamic padding: pad to the longest row of this batch (right side), rounded up to
    `multiple` (HF's pad_to_multiple_of: a few shapes instead of one per length, so compiled
    graphs and the attention kernels' per-shape plans are reused)."""
    longest = round_up(max(len(r["input_ids"]) for r in rows), multiple)
    ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), longest), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n] = torch.as_tensor(r["input_ids"])
        labels[i, :n] = torch.as_tensor(r["labels"])
        mask[i, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def user_collate(ref: str) -> Callable[[list[dict]], dict]:
    """data.collate_fn: the user's collator, given each example's input_ids and labels."""
    fn = load_object(ref, "data.collate_fn")
    if not callable(fn):
        raise PipelineError(f"data.collate_fn: '{ref}' is not a function")

    def collate_user(rows: list[dict]) -> dict[str, torch.Tensor]:
        return fn([{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows])

    return collate_user


def check_collate(collate_fn: Callable[[list[dict]], dict], rows: list[dict], ref: str) -> None:
    """A user collator's batch of `rows` has the shape the loop reads, else one line."""
    try:
        batch = collate_fn(rows)
    except Exception as exc:  # the user's code: any failure is the one line
        raise PipelineError(f"data.collate_fn: '{ref}' failed on two train rows: "
                            f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(batch, Mapping) or not {"input_ids", "labels"} <= set(batch):
        got = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
        raise PipelineError(f"data.collate_fn: '{ref}' must return a mapping with input_ids "
                            f"and labels (tensors), got {got}")
    shapes = {k: tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
              for k, v in batch.items() if k in ("input_ids", "labels", "attention_mask")}
    if len(set(shapes.values())) != 1 or shapes["input_ids"][:1] != (len(rows),):
        raise PipelineError(f"data.collate_fn: '{ref}' must return [batch, length] tensors of "
                            f"one shape for input_ids, labels (and attention_mask); got "
                            f"{shapes} for {len(rows)} rows")


def label_shift(batch: dict) -> int:
    """How far a batch's labels sit from the logits that predict them: 1 for a decoder-only
    model (position t predicts token t+1), 0 for a batch that holds a key a model kind
    registered as unshifting (an encoder-decoder's decoder_input_ids: its labels are the
    decoder's own positions; engine.kinds.seq2seq_lm)."""
    return 0 if any(k in batch for k in UNSHIFTING_INPUTS) else 1


def count_targets(batch: dict[str, torch.Tensor]) -> int:
    """Tokens that contribute to the loss (after the causal shift, where there is one)."""
    return int((batch["labels"][:, label_shift(batch):] != IGNORE_INDEX).sum())


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor, shift: int = 1) -> torch.Tensor:
    """Summed next-token cross entropy (`shift` 0: of an encoder-decoder's own positions);
    callers divide by the step's token count."""
    shift_logits = logits[:, :logits.shape[1] - shift, :].float()
    shift_labels = labels[:, shift:]
    return torch.nn.functional.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)),
        shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def pack_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: indices grouped into rows of at most `capacity` tokens.
    Deterministic (ties keep input order), so a resumed run packs exactly as before."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = lengths[i]
        slot = next((b for b, free in enumerate(room) if free >= n), None)
        if slot is None:
            bins.append([i])
            room.append(capacity - n)
        else:
            bins[slot].append(i)
            room[slot] -= n
    return bins


def collate_packed(rows: list[dict], pad_id: int, capacity: int,
                   block_mask: torch.dtype | None = None,
                   varlen: bool = False, multiple: int | None = None) -> dict[str, torch.Tensor]:
    """Packing: the micro-batch's examples share rows of up to `capacity` tokens.

    position_ids restart at 0 for every example; models that build their attention mask from
    position_ids (transformers' packed-sequence detection, or varlen flash attention) then keep
    examples apart. `block_mask` (a float dtype) adds an explicit block-diagonal causal mask for
    models that do not; `varlen` adds the boundaries of every example (and of each row's padding
    tail) over the flattened rows, for a varlen attention kernel (engine.datapath.attention). Rows
    are as wide as the fullest one, rounded up to `multiple` (pad_to_multiple_of = the capacity
    gives every batch one shape: what compile and CUDA graphs want). Each example's first label
    is ignored: in the unpacked batch nothing predicts it either, so packed and unpacked runs
    optimise exactly the same targets.
    """
    bins = pack_rows([len(r["input_ids"]) for r in rows], capacity)
    width = round_up(max(sum(len(rows[i]["input_ids"]) for i in b) for b in bins), multiple)
    ids = torch.full((len(bins), width), pad_id, dtype=torch.long)
    labels = torch.full((len(bins), width), IGNORE_INDEX, dtype=torch.long)
    positions = torch.zeros((len(bins), width), dtype=torch.long)
    segments = torch.full((len(bins), width), -1, dtype=torch.long)
    for r, members in enumerate(bins):
        at = 0
        for seg, i in enumerate(members):
            n = len(rows[i]["input_ids"])
            ids[r, at : at + n] = torch.as_tensor(rows[i]["input_ids"])
            labels[r, at : at + n] = torch.as_tensor(rows[i]["labels"])
            labels[r, at] = IGNORE_INDEX
            positions[r, at : at + n] = torch.arange(n)
            segments[r, at : at + n] = seg
            at += n
        positions[r, at:] = torch.arange(width - at)  # padding: its own (ignored) sequence
        segments[r, at:] = len(members)
    batch = {"input_ids": ids, "labels": labels, "position_ids": positions}
    if varlen:
        pieces = []
        for members in bins:
            sizes = [len(rows[i]["input_ids"]) for i in members]
            pieces += sizes + ([width - sum(sizes)] if width > sum(sizes) else [])
        batch.update(varlen_boundaries(pieces))
    if block_mask is not None:
        causal = torch.tril(torch.ones(width, width, dtype=torch.bool))
        allowed = (segments[:, :, None] == segments[:, None, :]) & causal
        mask = torch.zeros((len(bins), 1, width, width), dtype=block_mask)
        batch["attention_mask"] = mask.masked_fill(~allowed[:, None], torch.finfo(block_mask).min)
    return batch


def collate_flat(rows: list[dict], pad_id: int, multiple: int | None = None
                 ) -> dict[str, torch.Tensor]:
    """Padding-free: the micro-batch as one row with no padding at all (see engine.datapath.attention).

    position_ids restart per example and `cu_seq_lens_q/k` mark where each example starts, so
    the varlen attention keeps examples apart; the all-ones attention_mask tells transformers
    no mask is needed (it would otherwise build a row x row block mask from the positions).
    Each example's first label is ignored, as in collate_packed, so the targets equal the
    padded batch's.

    `multiple` (pad_to_multiple_of) buckets the row for torch.compile and CUDA graphs: the row
    is padded up to a multiple of that many tokens with a tail that is always there (at least
    one token: its own sequence, every label ignored), so a micro-batch always has the same
    number of sequences, and the longest-sequence bound is rounded up to a power of two. A run
    then sees a few shapes (one per bucket) instead of one per batch, and the attention result
    of every real token is unchanged (the tail attends only to itself).
    """
    lengths = [len(r["input_ids"]) for r in rows]
    total = sum(lengths)
    width = round_up(total + 1, multiple) if multiple else total
    ids = torch.full((width,), pad_id, dtype=torch.long)
    labels = torch.full((width,), IGNORE_INDEX, dtype=torch.long)
    ids[:total] = torch.as_tensor([t for r in rows for t in r["input_ids"]], dtype=torch.long)
    labels[:total] = torch.as_tensor([t for r in rows for t in r["labels"]], dtype=torch.long)
    starts = torch.as_tensor([0] + lengths[:-1], dtype=torch.long).cumsum(0)
    labels[starts] = IGNORE_INDEX
    pieces = lengths + ([width - total] if width > total else [])
    positions = torch.cat([torch.arange(n) for n in pieces])
    return {"input_ids": ids[None], "labels": labels[None], "position_ids": positions[None],
            "attention_mask": torch.ones(1, width, dtype=torch.long),
            **varlen_boundaries(pieces, bucketed=multiple is not None)}


def varlen_boundaries(lengths: list[int], bucketed: bool = False) -> dict:
    """What a varlen attention kernel needs: cumulative lengths of the sequences laid end to
    end (int32, a host tensor) and the longest one (a Python int), under transformers' keyword
    names. `bucketed`: the longest as the next power of two (an upper bound is all the flash
    kernels need), so a compiled graph that specialises on it sees a few values."""
    starts = torch.as_tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    longest = max(lengths)
    if bucketed:
        longest = min(1 << (longest - 1).bit_length(), sum(lengths))
    return {"cu_seq_lens_q": starts, "cu_seq_lens_k": starts, "max_length_q": longest,
            "max_length_k": longest}


#: what the forward pass takes from a batch: the text inputs and the packed-attention keys,
#: then what a model kind adds (KIND_INPUTS)
TEXT_INPUTS = ("input_ids", "attention_mask", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k",
               "max_length_q", "max_length_k")
#: the keys model kinds added (register_model_inputs: an encoder-decoder's decoder inputs):
#: also what an evaluation forward passes besides the text inputs
KIND_INPUTS: list[str] = []
#: kind keys whose presence means the labels are the model's own positions (label_shift 0)
UNSHIFTING_INPUTS: list[str] = []


def register_model_inputs(keys: tuple[str, ...], unshifting: tuple[str, ...] = ()) -> None:
    """A model kind's batch keys for the forward pass (engine.kinds: declared on the kind,
    registered when its class is defined); `unshifting`: those of them whose presence means
    the labels sit on the model's own positions."""
    KIND_INPUTS.extend(k for k in keys if k not in KIND_INPUTS)
    UNSHIFTING_INPUTS.extend(k for k in unshifting if k not in UNSHIFTING_INPUTS)


#: example boundaries: read on the host by the kernels that slice with Python ints (per-example
#: SDPA, FlexAttention's mask); the flash kernels take them on the device, copied with the batch
#: (engine.datapath.attention.host_keys says which)
BOUNDARY_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k")


def to_device(batch: dict, device: torch.device, host_keys: tuple[str, ...] = BOUNDARY_KEYS
              ) -> dict:
    """The batch's tensors on `device` (non-blocking: from pinned memory the copy overlaps the
    step), but for `host_keys`; plain values (the longest-sequence ints) as they are."""
    return {k: v.to(device, non_blocking=True)
            if isinstance(v, torch.Tensor) and k not in host_keys else v
            for k, v in batch.items()}


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the forward pass takes from a (padded or packed) batch."""
    return {k: batch[k] for keys in (TEXT_INPUTS, KIND_INPUTS) for k in keys if k in batch}
