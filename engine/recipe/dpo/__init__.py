"""`training.type: dpo`, one room: the run (`run`), its loss (`loss`), its batches
(`batches`) and its held-out metrics (`heldout`). The trainer registry imports
`engine.recipe.dpo.run:DPORun` when a run names dpo."""
