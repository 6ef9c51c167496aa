"""What a checkpoint holds and which run it belongs to: DCP checkpoints, the trainer state
beside the weights and the one resume rule, the run fingerprint, and `RunView`, the surface
that state code may read on a run.
"""
