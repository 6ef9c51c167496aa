"""`training.type: distill`: knowledge distillation, TRL GKD's loss (engine.recipe.distill.run)."""
