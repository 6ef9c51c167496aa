"""The training engine: a small library the torchrun worker drives.

- `model`: loading base models, tokenizers and adapters.
- `data`: deterministic sharded batching and the padding collator.
- `optim`: optimizer and LR schedule from the typed config.
- `checkpoint`: atomic save, validated load, rotation.
- `distributed`: process group, threads, strategy wrapping.
- `loop`: the training recipe (owns the loop; the pieces above are components).
- `worker`: the torchrun entry point.
"""
