"""What is measured on held-out rows: the token-weighted loss over all ranks (`heldout`) and
the bootstrap standard errors of the evaluate stage's metrics (`bootstrap`). The evaluate
stage's greedy generation is the rollout room's (engine.rollout.greedy).
"""
