"""The training engine: a small library the torchrun worker drives.

Two doors lead in. `engine.worker` is the torchrun entry point: it reads the job file
(`engine.process.job`: the config and the explicit paths the train stage hands over) and runs
the trainer type the config names (`engine.recipe.trainers`). `engine.preflight` is the train
stage's door: the checks before launch and the resume's seed. Behind them the engine is grouped
in rooms by concern, each importing only the rooms below it: `recipe` (the loop:
`TrainingRun`), `state` (checkpoints, the resume rule), `strategies` (how work is split across
ranks), `evaluation`, `objective` (loss, optimizer), `datapath` (rows into micro-batches),
`modeling` (the model, loaded and transformed), `reporting` (progress, callbacks, reporters)
and `process` (one rank's process). The engine never sees the pipeline's folder layout.
docs/architecture.md lists every module; tests/test_layering.py holds the order.
"""
