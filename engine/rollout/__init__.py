"""The rollout: what a model generates from prompts and what scores it, for any method.

GRPO was the first to need it, so it grew in GRPO's room; the next ones (multi-turn tool use,
distillation from a teacher's samples, a vLLM server behind the same seam, the evaluate
stage's greedy generations) need the same pieces without GRPO's objective. This room holds
them and names no method: a caller hands in its own settings and the config key its messages
name (`key="grpo.reward_funcs"`).

- `generator`: the `Generator` seam and the `Completions` it returns; `sampling`: how a
  next token is drawn (Hugging Face generate's processors); `local`: the in-process
  generator (`LocalGenerator`), with `lora_merge` folding LoRA adapters for it;
- `greedy`: the evaluate stage's batched greedy generation (Hugging Face generate);
- `rewards`: reward functions named in the params (built-ins, user code, reward models),
  `scoring`: their scores for a batch of completions, `reward_model`: a trained reward model
  as one of them;
- `environment`: what a multi-turn rollout drives (TRL's `environment_factory` contract): the
  protocol, an environment's tools, the instance pool; `tools`: running a call as TRL does
  (timeout, sandbox, counts); `multi_turn`: the loop (`ToolLoop`, a `Generator` over another
  that runs the calls between turns); `episodes`: prompt rows made into rollouts, plain, with
  tools, or each in its own environment instance, which GRPO's run and its held-out numbers
  use alike.
"""
