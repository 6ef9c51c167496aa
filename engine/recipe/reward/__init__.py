"""`training.type: reward`, one room: the run (`run`), its loss (`loss`), its batches
(`batches`) and its held-out metrics (`heldout`). The trainer registry imports
`engine.recipe.reward.run:RewardRun` when a run names reward."""
