"""`training.type: kto`, one room: the run (`run`), its loss (`loss`), its batches
(`batches`) and its held-out metrics (`heldout`). The trainer registry imports
`engine.recipe.kto.run:KTORun` when a run names kto."""
