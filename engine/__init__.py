"""The training engine: a small library the torchrun worker drives.

`engine.worker` is the torchrun entry point: it reads the job file (`engine.job`: the config and
the explicit paths the train stage hands over) and runs the trainer type the config names
(`engine.trainers`). The recipe is `engine.run.TrainingRun`: it owns the loop and one progress
record (`engine.progress`), and the pieces are components it composes: the model and its setup
(`model`, `model_setup`, `construction`), the data path (`data`, `loader`, `stream`, `prefetch`,
`packing`, `attention`), the loss and optimizer (`loss`, `optim`, `optim_in_backward`), the
parallelism (`strategies/`, `distributed`, `comm`), the state a checkpoint holds (`checkpoint`,
`trainer_state`, `fingerprint`), and reporting (`callbacks`, `reporters`, `readback`). The
engine never sees the pipeline's folder layout. docs/architecture.md lists every module.
"""
