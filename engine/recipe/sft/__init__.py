"""`training.type: sft`, the language-model room: the run is the loop itself
(engine.recipe.run.TrainingRun, whose hooks are SFT's), and `heldout` its evaluate-stage
numbers (loss, perplexity, the quantized model's loss, generations scored by the dataset
types)."""
