"""The loop and how a run is put together: `TrainingRun` (the recipe that owns the loop), the
trainer registry (`training.type`) and model setup in one fixed order. The top room: only the
doors (`engine.preflight`, `engine.worker`) import it.
"""
