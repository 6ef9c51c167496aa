"""The training engine: a small library the torchrun worker drives.

Doors lead in, one per caller. `engine.worker` is the torchrun entry point: it reads the job
file (`engine.process.job`: the config and the explicit paths the train stage hands over) and
runs the trainer type the config names (`engine.recipe.trainers`). `engine.preflight` is the
validate and train stages' door: the checks before launch and the resume's seed;
`engine.prepare` the data stages', `engine.evaluate` the evaluate stage's, `engine.export` the
export stage's. Behind them the engine is grouped in rooms by concern, each importing only the
rooms below it: `recipe` (the loop: `TrainingRun`), `state` (checkpoints, the resume rule),
`strategies` (how work is split across ranks), `rollout` (generation and rewards),
`evaluation`, `kinds` (what differs by model family), `objective` (loss, optimizer),
`datapath` (rows into micro-batches), `modeling` (the model, loaded and transformed),
`reporting` (progress, callbacks, reporters) and `process` (one rank's process). The engine never sees the pipeline's folder layout.
docs/architecture.md lists every module; tests/test_layering.py holds the order.
"""
