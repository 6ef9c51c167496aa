"""GRPO: online RL with reward functions (training.type: grpo)."""
