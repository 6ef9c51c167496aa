"""`training.type: rloo`: REINFORCE Leave-One-Out (engine.recipe.rloo.run)."""
