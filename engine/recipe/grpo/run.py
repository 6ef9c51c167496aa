"""`training.type: grpo`: online RL with reward functions (TRL's GRPOTrainer), through the
SFT run's hooks only (the loop, the strategies and the checkpoints are the SFT run's):

- `columns`: a prompt split's token ids and its rows' other columns (`reward_inputs`, JSON);
- batches: the loader's micro-batches hold prompts, left-padded (engine.recipe.grpo.batches);
- `prepare_step`: the rollout. Each rank generates `num_generations` completions per prompt
  of its share with the current weights (engine.rollout.local; with `use_vllm` on a vLLM
  server sent the adapter first, engine.rollout.vllm_server, and the loss then takes TRL's
  importance-sampling correction: `sync_server`, engine.recipe.grpo.loss), the reward
  functions score them (engine.rollout.rewards, engine.rollout.scoring), advantages are
  normalised per group (engine.recipe.grpo.advantages), and with `num_iterations` > 1 or `beta` > 0 the
  log-probabilities at generation and of the reference are taken before the first update;
  with `grpo.tools` or `grpo.environment_factory` each completion is a tool-calling episode
  (engine.rollout.episodes, engine.recipe.grpo.rollouts: the tool results are in it, not
  trained on; an environment per rollout, reset with its row), and TRL's tool statistics are
  logged;
- `count_targets`: what `grpo.loss_type` averages over (completions, micro-batches or tokens);
- `micro_step`: the clipped objective plus the KL term (engine.recipe.grpo.loss);
- `window_metrics`: TRL's logged statistics, and the step's generation and scoring times;
- `open_train_data`: with `num_iterations` k, every optimizer step's prompts come k times
  (TRL's RepeatSampler), and the completions generated at the first are trained on k times;
- `heldout_metrics`: rewards and pass rates of base and fine-tuned on held-out prompts
  (engine.recipe.grpo.heldout).

Sampling is seeded per prompt, by (seed, step, the prompt's position in the step's global
batch): the completions of a step are a function of the weights and of the step, so a run
resumed from a checkpoint samples exactly what the uninterrupted run sampled, with no generator
state to carry; and a prompt's completions do not depend on how the step's prompts are spread
over ranks and micro-batches (2 ranks x batch b sample what 1 rank x batch 2b samples).
"""

from __future__ import annotations

import functools
import json
import shutil
import time

import torch

from engine.modeling.runtime import activation_offloading
from engine.recipe.grpo.advantages import group_advantages
from engine.recipe.grpo.batches import PROMPT_COLUMNS, collate_prompts, repeat_steps
from engine.recipe.grpo.heldout import load_rewards, reward_metrics, rewards_key
from engine.recipe.grpo.loss import (SAMPLING_STATS, STAT_SLOTS, TOKEN_SLOTS, Objective,
                                     SamplingCorrection, TokenLosses, averaged_over,
                                     completion_logps, entropy_token_mask,
                                     importance_sampling_ratio, reduce, sampling_stats,
                                     stat_means, token_losses, token_stat_sums)
from engine.recipe.grpo.rollouts import load_grpo_environments, make_episodes, reward_weights
from engine.recipe.reference import Reference
from engine.recipe.run import TrainingRun
from engine.rollout.local import LocalGenerator, eos_ids
from engine.rollout.sampling import sampling_params
from engine.rollout.scoring import score_completions
from finetune.config.rollout import rollout_section
from finetune.datatypes.encoding import IGNORE_INDEX
from finetune.errors import PipelineError

#: per-step statistics, each step's value weighted by its targets in the logging window
TIMES = ("time/generation", "time/scoring")
#: per-step statistics of a run with grpo.tools (TRL's names: calls per completion, failed
#: calls per call)
TOOL_STATS = ("tools/call_frequency", "tools/failure_frequency")
#: per-step statistics of a run with dynamic_sampling: the share of the step's groups that
#: were replaced (all ranks)
DYNAMIC = ("dynamic_sampling/refilled_ratio",)
#: the window's sum of its rollout steps' targets (GRPORun.window_metrics)
ROLLOUT_TARGETS = "_sum/rollout_targets"
#: where a run writes its sample table (prompt, completion, rewards) at every logging step
SAMPLES_FILE = "train_samples.jsonl"


def completion_columns(done) -> torch.Tensor:
    """[N, 2] each completion's length and whether it was clipped, then, for episodes with
    tools, [N, 4] with its tool calls and failed calls: what `GRPORun.advantages` gathers for
    the length and tool statistics. The length is TRL's: the tokens the model wrote, so an
    episode's tool results and the template's text around them do not count."""
    written = done.mask if done.trained is None else done.mask * done.trained
    columns = [written.sum(-1), done.clipped.long()]
    if done.tool_calls is not None:
        columns += [done.tool_calls, done.tool_failures]
    return torch.stack(columns, 1)


def prompt_seeds(seed: int, step: int, first: int, count: int) -> list[int]:
    """The sampling seeds of `count` prompts at positions first, first + 1, ... of step
    `step`'s global batch (engine.datapath.data: rank r's micro-batch i holds positions
    (i * world_size + r) * batch ...): distinct per step and position, whatever the world size
    and the accumulation."""
    return [((seed * 1_000_003 + step) * 1_000_033 + first + j) % (2**63 - 1)
            for j in range(count)]


class GRPORun(TrainingRun):
    """An online RL run: see the module docstring."""

    columns = PROMPT_COLUMNS
    #: the config section this run class reads (finetune.config.rollout.rollout_section
    #: reads it off a project's `module:Class` subclass)
    section = "grpo"

    @functools.cached_property
    def g(self):
        """The rollout section this run reads (`grpo`; `rloo` for its subclass)."""
        return rollout_section(self.cfg)

    # -- building --------------------------------------------------------------------------
    def prepare_model(self) -> None:
        super().prepare_model()
        g = self.g
        self.collate_fn = collate_prompts(self.tokenizer.pad_token_id)
        self.check_positions()
        if g.uses_reference and not self.cfg.peft.use_peft:
            self.log(f"[train] {g.SCOPE}.beta > 0 with peft.use_peft false: the reference is a "
                     "frozen copy of the base model, a second model's memory on every rank")
        self.reference = Reference.of(self) if g.uses_reference else None
        #: vLLM's importance-sampling correction (None: off, or no vLLM server)
        self.correction = SamplingCorrection.of(g)
        generator = self.make_generator()
        # multi-turn with grpo.tools or grpo.environment_factory: the completions are episodes
        # of turns and tool results (engine.recipe.grpo.rollouts)
        environments = load_grpo_environments(self.cfg)
        self.episodes = make_episodes(self.cfg, self.tokenizer, generator,
                                      self.paths.project_root, environments)
        self.rewards = load_rewards(self.cfg, self.paths.project_root, self.dist.device,
                                    environments)
        t = self.cfg.training
        #: a prompt's completions share its forward (loss.completion_logps `group`): where
        #: the strategy allows it (one process holding the whole model), without activation
        #: checkpointing or compile, and without environments (reset's text makes each
        #: rollout's prompt its own)
        self.prompt_group = g.num_generations if (
            self.strategy.shares_prompt_forward() and not t.gradient_checkpointing
            and not t.torch_compile and environments is None) else 1
        self.weights = torch.tensor(reward_weights(self.cfg, len(self.rewards)),
                                    dtype=torch.float32)
        self.step_names = ("reward", "reward_std", "frac_reward_zero_std",
                           *(f"rewards/{f.name}/{s}" for f in self.rewards
                             for s in ("mean", "std")),
                           "completions/mean_length", "completions/clipped_ratio",
                           *(TOOL_STATS if self.episodes.counts_tools else ()),
                           *self.rollout_stats(), *(DYNAMIC if g.dynamic_sampling else ()),
                           *(SAMPLING_STATS if self.correction else ()), *TIMES)
        device = self.dist.device
        self.step_sums = torch.zeros(len(self.step_names), dtype=torch.float64, device=device)
        #: the targets of the window's rollout steps: what the step values are averaged over
        #: (a step that trains on an earlier rollout, num_iterations > 1, adds none, as TRL
        #: logs them at generation steps only)
        self.rollout_targets = torch.zeros((), dtype=torch.float64, device=device)
        self.token_sums = torch.zeros(STAT_SLOTS, dtype=torch.float64, device=device)
        self.objective = self.make_objective()
        self.buffer: list[dict] | None = None
        self.samples: list[dict] = []
        self.prompt_rows = None  # the train split's prompts, read when dynamic sampling draws
        self.samples_started = False  # SAMPLES_FILE not written by this run yet
        self.scored_at: float | None = None

    def make_generator(self):
        """What the rollout generates with: the policy in this process (LocalGenerator), or
        with use_vllm a vLLM server (engine.rollout.vllm_server), waited for up to
        vllm_server_timeout seconds and sent the adapter before each rollout that follows
        an optimizer step (`sync_server`)."""
        g, module = self.g, self.strategy.module
        eos, pad = eos_ids(self.tokenizer, module), self.tokenizer.pad_token_id
        self.server = None
        if not g.use_vllm:
            return LocalGenerator(module, sampling_params(g), eos, pad,
                                  all_finished=self.strategy.generation_done)
        from engine.rollout.vllm_server import ADAPTER_PREFIX, VLLMServerGenerator

        self.server = VLLMServerGenerator(g.vllm_server_base_url, sampling_params(g), eos, pad,
                                          key=f"{g.SCOPE}.vllm_server_base_url",
                                          timeout=g.vllm_server_timeout)
        #: the step whose weights the server has (None: none of this run's yet)
        self.synced_step: int | None = None
        # adapter names are unique to this run (vLLM keeps an adapter by name): rank 0's
        # start time, the same on every rank
        tag = [f"{ADAPTER_PREFIX}-{time.time_ns() % 10**12:012d}"]
        if self.dist.world_size > 1:
            torch.distributed.broadcast_object_list(tag, src=0)
        self.adapter_tag = tag[0]
        logs = self.paths.timings_file.parent if self.paths.timings_file else \
            self.paths.trained.parent
        self.adapter_root = logs / "vllm-adapters"
        self.log(f"[train] rollouts on the vLLM server at {g.vllm_server_base_url} (model "
                 f"'{self.server.base_model}'); the adapter is sent to it from "
                 f"{self.adapter_root}")
        return self.server

    def sync_server(self) -> None:
        """With use_vllm, before a rollout: the current adapter saved (rank 0, peft's
        save_pretrained) and loaded on the server under a new name, which every rank's
        requests then name; once per optimizer step, at the first rollout after it (and at
        the run's first rollout, so a resumed run's server has its weights)."""
        step = self.progress.step
        if self.server is None or self.synced_step == step:
            return
        name = f"{self.adapter_tag}-step{step}"
        folder = self.adapter_root / name
        if self.dist.is_main:
            self.strategy.module.save_pretrained(str(folder))
            self.server.load_adapter(name, folder.resolve())
            for old in self.adapter_root.iterdir():  # the server holds what it loaded
                if old.name != name and old.name.startswith(self.adapter_tag):
                    shutil.rmtree(old, ignore_errors=True)
        if self.dist.world_size > 1:
            torch.distributed.barrier()
            self.server.model = name
        self.synced_step = step

    # -- what a rollout method replaces (engine.recipe.rloo.run) -----------------------
    def make_objective(self) -> Objective:
        """The surrogate's settings; also how the logged token statistics are named."""
        return Objective.of(self.g)

    def rollout_stats(self) -> tuple[str, ...]:
        """Names of the step statistics `advantages` adds to its stats beyond the rewards,
        lengths and tool counts (logged per step, weighted by its targets)."""
        return ()

    def averaged_over(self, mask: torch.Tensor) -> torch.Tensor:
        """What the step averages a micro-batch's loss sum over (loss.averaged_over)."""
        return averaged_over(self.g.loss_type, mask)

    def policy_loss(self, logps: torch.Tensor, entropy: torch.Tensor, batch: dict
                    ) -> tuple[TokenLosses, torch.Tensor]:
        """(the micro-batch's token losses, its loss sum): loss_type's surrogate plus the
        KL term, reduced as loss_type averages."""
        g, mask = self.g, batch["completion_mask"]
        losses = token_losses(logps, batch.get("old_logps"), batch.get("ref_logps"),
                              batch["advantages"], mask, self.objective,
                              entropy_token_mask(entropy, mask, self.objective),
                              batch.get("is_ratio"), batch.get("sampling_logps"))
        return losses, reduce(g.loss_type, losses.per_token, mask, g.max_completion_length)[0]

    def check_positions(self) -> None:
        """A prompt plus its completion must fit the model's positions: one line if not."""
        from engine.modeling.model import max_positions

        limit = max_positions(self.cfg.model, self.paths.project_root)
        g = self.g
        need = self.cfg.data.max_seq_length + g.max_completion_length
        if limit and need > limit:
            raise PipelineError(
                f"{g.SCOPE}.max_completion_length {g.max_completion_length} + "
                f"data.max_seq_length {self.cfg.data.max_seq_length} = {need} exceeds the "
                f"model's {limit} positions; lower one of them")

    def open_train_data(self):
        opened, per_epoch, epoch_len = super().open_train_data()
        k = self.g.num_iterations
        if k == 1:
            return opened, per_epoch, epoch_len
        accum = self.cfg.training.gradient_accumulation_steps
        return ((lambda epoch, start: repeat_steps(opened, epoch, start, accum, k)),
                None if per_epoch is None else per_epoch * k, epoch_len * k)

    # -- the rollout -----------------------------------------------------------------------
    def prepare_step(self, micro: list[dict]) -> list[dict]:
        """Generate and score at the first step of a generation batch; reuse it for the next
        num_iterations - 1 steps."""
        k = self.g.num_iterations
        first = self.progress.step % k == 0
        if not first and self.buffer is None:
            self.log(f"[train] step {self.progress.step + 1}: resumed inside a generation "
                     f"batch ({self.g.SCOPE}.num_iterations); generating it again with the current "
                     "weights")
        if first or self.buffer is None:
            self.buffer = self.rollout(micro)
        return [dict(b) for b in self.buffer]

    @torch.no_grad()
    def rollout(self, micro: list[dict]) -> list[dict]:
        g, t, d = self.g, self.cfg.training, self.dist
        device, module = d.device, self.strategy.module
        started = time.perf_counter()
        generated, self.samples = [], []
        size = t.per_device_train_batch_size
        self.sync_server()
        for i, batch in enumerate(micro):
            seeds = prompt_seeds(t.seed, self.progress.step, (i * d.world_size + d.rank) * size,
                                 batch["input_ids"].shape[0])
            generated.append((batch, *self.generate(batch, seeds)))
        generated_at = time.perf_counter()
        scored = [self.score(batch, rolled) for batch, _, _, rolled in generated]
        per_func = torch.cat([rewards for rewards, _ in scored])
        self.samples = [row for _, rows in scored for row in rows]
        batches = [self.completion_batch(p_ids, p_mask, rolled.done)
                   for _, p_ids, p_mask, rolled in generated]
        columns = torch.cat([completion_columns(rolled.done) for *_, rolled in generated])
        if g.dynamic_sampling:
            batches, per_func, columns = self.resample(batches, per_func, columns)
        for batch in batches:
            self.add_logps(module, batch)
        corrected = () if self.correction is None else tuple(sampling_stats(
            [b["old_logps"] for b in batches], [b["sampling_logps"] for b in batches],
            [b["is_ratio"] for b in batches], [b["completion_mask"] for b in batches],
            self.correction.per_sequence).to(device).unbind(0))
        advantages, stats = self.advantages(per_func, columns, batches)
        for batch, adv in zip(batches, advantages.split([len(b["input_ids"]) for b in batches])):
            batch["advantages"] = adv
        counts = torch.stack([self.averaged_over(b["completion_mask"])
                              for b in batches]).tolist()  # one host sync per rollout
        for batch, count in zip(batches, counts):
            batch["targets"] = count
        scored_at = time.perf_counter()
        step_targets = sum(counts)
        host = torch.tensor([generated_at - started, scored_at - generated_at],
                            dtype=torch.float64, device=device)
        values = torch.cat([torch.stack([*self.reward_stats(stats),
                                         stats["completions/mean_length"],
                                         stats["completions/clipped_ratio"],
                                         *(stats[n] for n in TOOL_STATS
                                           if self.episodes.counts_tools),
                                         *(stats[n] for n in self.rollout_stats()),
                                         *(stats[n] for n in DYNAMIC if g.dynamic_sampling),
                                         *corrected]),
                            host])
        self.step_sums += values * step_targets
        self.rollout_targets += step_targets
        return batches

    def generate(self, batch: dict, seeds: list[int]):
        """(each rollout's prompt ids and mask, [B * G, P], and the rollouts) of a batch of
        prompts, `num_generations` each, sampled with one seed per prompt."""
        device, group = self.dist.device, self.g.num_generations
        ids = batch["input_ids"].to(device)
        mask = batch["attention_mask"].to(device)
        with torch.autocast(device.type, dtype=self.amp, enabled=self.amp is not None):
            rolled = self.episodes.generate(ids, mask, batch["reward_inputs"], group, seeds)
        return (*rolled.forward_prompts(ids, mask, group), rolled)

    def reward_stats(self, stats: dict) -> torch.Tensor:
        """TRL's per-step reward statistics in `step_names` order (one tensor per name)."""
        names = ["reward", "reward_std", "frac_reward_zero_std"]
        for i in range(len(self.rewards)):
            names += [f"rewards/{i}/mean", f"rewards/{i}/std"]
        return torch.stack([stats[n].to(self.dist.device).double() for n in names]).unbind(0)

    def score(self, batch: dict, rolled) -> tuple[torch.Tensor, list[dict]]:
        """([B * num_generations, functions] rewards of one micro-batch's rollouts, their
        rows of the sample table)."""
        rewards, prompts, texts = score_completions(
            self.tokenizer, self.rewards, batch["reward_inputs"], rolled.done,
            self.g.num_generations, trainer_state=self.state, key=rewards_key(self.cfg),
            prompts=rolled.prompts, environments=rolled.environments)
        rows = [{"prompt": p if isinstance(p, str) else json.dumps(p), "completion": text,
                 **{f.name: float(v) for f, v in zip(self.rewards, r.tolist())}}
                for p, text, r in zip(prompts, texts, rewards)]
        done = rolled.done
        if done.tool_calls is not None:  # an episode: its turns are in the completion's text
            for row, calls, failed in zip(rows, done.tool_calls.tolist(),
                                          done.tool_failures.tolist()):
                row.update(tool_calls=calls, tool_failures=failed)
        return rewards, rows

    def resample(self, batches: list[dict], per_func: torch.Tensor, columns: torch.Tensor
                 ) -> tuple[list[dict], torch.Tensor, torch.Tensor]:
        """Dynamic sampling (engine.recipe.grpo.dynamic_sampling): each group of this rank
        whose rewards have no spread is replaced by the group of a train prompt drawn by its
        position, up to max_resample_times rounds; the sample table follows. Returns the
        micro-batches (the same row counts), their rewards, and their completion columns
        with a last column that is 1 on the rows of a replaced group."""
        from engine.datapath.data import load_tokenized, take_rows
        from engine.recipe.grpo.dynamic_sampling import (draw_rows, join_batches,
                                                         no_spread, refill_seeds, split_batch)

        g, t, d = self.g, self.cfg.training, self.dist
        group, step, pad = g.num_generations, self.progress.step, self.tokenizer.pad_token_id
        sizes = [len(b["input_ids"]) for b in batches]
        positions = [(i * d.world_size + d.rank) * t.per_device_train_batch_size + j
                     for i, n in enumerate(sizes) for j in range(n // group)]
        replaced = torch.zeros(per_func.shape[0], 1, dtype=columns.dtype, device=columns.device)
        joined = None
        for attempt in range(1, g.max_resample_times + 1):
            dead = no_spread(per_func, group).nonzero().flatten().tolist()
            if not dead:
                break
            if self.prompt_rows is None:
                self.prompt_rows = load_tokenized(self.paths.train_data, PROMPT_COLUMNS)
            at = [positions[k] for k in dead]
            batch = self.collate_fn(take_rows(self.prompt_rows, draw_rows(
                t.seed, step, attempt, at, len(self.prompt_rows))))
            p_ids, p_mask, rolled = self.generate(batch, refill_seeds(t.seed, step, attempt, at))
            rewards, rows = self.score(batch, rolled)
            new = self.completion_batch(p_ids, p_mask, rolled.done)
            n = per_func.shape[0]
            index = torch.arange(n)
            for r, k in enumerate(dead):
                index[k * group:(k + 1) * group] = torch.arange(n + r * group,
                                                                n + (r + 1) * group)
            both = join_batches([joined or join_batches(batches, pad), new], pad)
            joined = {key: value[index.to(value.device)] for key, value in both.items()}
            per_func = torch.cat([per_func, rewards.to(per_func)])[index]
            columns = torch.cat([columns, completion_columns(rolled.done).to(columns)])[index]
            pooled = self.samples + rows
            self.samples = [pooled[i] for i in index.tolist()]
            for k in dead:
                replaced[k * group:(k + 1) * group] = 1
        out = batches if joined is None else split_batch(joined, sizes)
        return out, per_func, torch.cat([columns, replaced], dim=1)

    def advantages(self, per_func: torch.Tensor, completions: torch.Tensor,
                   batches: list[dict]) -> tuple[torch.Tensor, dict]:
        """The advantages of this rank's completions, and the step's statistics over every
        rank's completions (TRL gathers them): the rewards of every rank are gathered
        (`scale_rewards: batch` takes their std over the whole step), with what
        `advantage_inputs` adds from `batches` and `completions`, each completion's [length,
        clipped] (with tools, then its calls and failed calls), for the length and tool
        statistics. Every rank then logs the step's values (a mean of the ranks' means,
        each weighted by its targets, would not be the mean over the step's completions)."""
        d = self.dist
        funcs = per_func.shape[1]
        extra = self.advantage_inputs(batches)
        extra = (per_func.new_zeros(per_func.shape[0], 0) if extra is None
                 else extra.to(d.device, per_func.dtype))
        local = torch.cat([per_func.to(d.device), extra,
                           completions.to(d.device, per_func.dtype)], dim=1)
        if d.world_size > 1:
            gathered = [torch.empty_like(local) for _ in range(d.world_size)]
            torch.distributed.all_gather(gathered, local)
            everyone = torch.cat(gathered)
        else:
            everyone = local
        cut = funcs + extra.shape[1]
        adv, stats = self.compute_advantages(everyone[:, :funcs], everyone[:, funcs:cut])
        rest = everyone[:, cut:]
        if self.g.dynamic_sampling:  # resample's last column: the rows of replaced groups
            stats[DYNAMIC[0]] = rest[:, -1].double().mean()
            rest = rest[:, :-1]
        stats["completions/mean_length"] = rest[:, 0].double().mean()
        stats["completions/clipped_ratio"] = rest[:, 1].double().mean()
        if rest.shape[1] > 2:  # tool calls and failures (TRL's definitions)
            calls = rest[:, 2].double().sum()
            stats["tools/call_frequency"] = calls / everyone.shape[0]
            stats["tools/failure_frequency"] = rest[:, 3].double().sum() / calls.clamp_min(1.0)
        n = local.shape[0]
        return adv[d.rank * n:(d.rank + 1) * n], stats

    def advantage_inputs(self, batches: list[dict]) -> torch.Tensor | None:
        """[n, e] per-completion values `compute_advantages` needs beside the rewards,
        gathered with them (GRPO: none)."""
        return None

    def compute_advantages(self, per_func: torch.Tensor, inputs: torch.Tensor
                           ) -> tuple[torch.Tensor, dict]:
        """Every rank's completions' advantages and statistics from their [N, F] rewards
        (and `advantage_inputs`, gathered): GRPO's group-normalised ones."""
        g = self.g
        return group_advantages(per_func, self.weights.to(per_func.device), g.num_generations,
                                g.scale_rewards, g.multi_objective_aggregation)

    def completion_batch(self, prompt_ids, prompt_mask, done) -> dict:
        """The training rows of B * G rollouts: `prompt_ids` / `prompt_mask` are each
        rollout's prompt ([B * G, P], Rollouts.forward_prompts)."""
        g = self.g
        mask = done.mask if done.trained is None else done.mask * done.trained
        if g.mask_truncated_completions:
            mask = mask * (~done.clipped).unsqueeze(1).to(mask.dtype)
        batch = {"input_ids": torch.cat([prompt_ids, done.ids], dim=1),
                 "attention_mask": torch.cat([prompt_mask, done.mask.to(prompt_mask.dtype)],
                                             dim=1),
                 "completion_mask": mask,
                 "labels": done.ids.masked_fill(mask == 0, IGNORE_INDEX)}
        if done.sampling_logps is not None:  # a vLLM server's (engine.rollout.vllm_server)
            batch["sampling_logps"] = done.sampling_logps.to(done.ids.device)
        return batch

    def keeps_old_logps(self) -> bool:
        """Whether the rollout keeps the policy's log-probabilities at generation: for the
        ratio after the weights moved (num_iterations > 1), and for vLLM's
        importance-sampling correction, which compares them with the server's (TRL keeps
        them then too)."""
        return self.g.num_iterations > 1 or self.g.corrects_sampling

    def add_logps(self, module, batch: dict) -> None:
        """The log-probabilities the loss compares with, taken before the first update: the
        policy's at generation (num_iterations > 1) and the reference's (beta > 0)."""
        g, device = self.g, self.dist.device
        length = batch["completion_mask"].shape[1]

        def logps(model, b):
            with torch.autocast(device.type, dtype=self.amp, enabled=self.amp is not None):
                return completion_logps(model, b["input_ids"], b["attention_mask"], length,
                                        g.temperature, group=self.prompt_group)[0]

        if self.keeps_old_logps():
            batch["old_logps"] = logps(module, batch)
        if self.correction is not None:  # vLLM's importance-sampling ratio (TRL's)
            batch["is_ratio"] = importance_sampling_ratio(
                batch["old_logps"], batch["sampling_logps"], batch["completion_mask"],
                self.correction)
        if self.reference is not None:
            batch["ref_logps"] = self.reference.score(logps, batch)

    # -- the objective ---------------------------------------------------------------------
    def count_targets(self, host_batch: dict) -> int | float:
        return host_batch["targets"]

    def micro_step(self, host_labels: torch.Tensor, batch: dict, divisor) -> torch.Tensor:
        g, t, device = self.g, self.cfg.training, self.dist.device
        mask = batch["completion_mask"]
        with activation_offloading(t, device):
            with torch.autocast(device.type, dtype=self.amp, enabled=self.amp is not None):
                logps, entropy = completion_logps(self.model, batch["input_ids"],
                                                  batch["attention_mask"], mask.shape[1],
                                                  g.temperature, with_entropy=True,
                                                  group=self.prompt_group)
            losses, loss_sum = self.policy_loss(logps, entropy, batch)
            loss = loss_sum / divisor
            (self.scaler.scale(loss) if self.scaler else loss).backward()
        self.token_sums += token_stat_sums(losses, entropy, mask,
                                           self.objective.level == "sequence")
        return loss_sum.detach()

    def window_metrics(self) -> dict[str, torch.Tensor]:
        """The window's statistics as sums over its micro-batches (the loop sums them over
        ranks): the step values weighted by each step's targets, and the token statistics'
        raw sums and counts (`TOKEN_SLOTS`), so `window_means` pools them over every rank's
        tokens (or completions) as one process would. The sample table of the last rollout
        goes to `SAMPLES_FILE` here."""
        token, self.token_sums = self.token_sums, torch.zeros_like(self.token_sums)
        steps, self.step_sums = self.step_sums, torch.zeros_like(self.step_sums)
        stats = dict(zip(self.step_names, steps))
        stats.update(zip(TOKEN_SLOTS, token))
        stats[ROLLOUT_TARGETS], self.rollout_targets = (self.rollout_targets,
                                                        torch.zeros_like(self.rollout_targets))
        self.write_samples()  # a step that reuses a rollout trained on its rows: written too
        return stats

    def window_means(self, sums: dict[str, float], targets: float) -> dict[str, float]:
        """The step values over the window's rollout steps' targets (none logged for a
        window without a rollout); the token statistics pooled (`stat_means` of the summed
        slots); the rest over the window's targets."""
        pooled = torch.tensor([sums.pop(name) for name in TOKEN_SLOTS], dtype=torch.float64)
        rolled = sums.pop(ROLLOUT_TARGETS)
        steps = {name: sums.pop(name) for name in self.step_names}
        means = super().window_means(sums, targets)
        if rolled > 0:
            means.update({name: value / rolled for name, value in steps.items()})
        means.update({k: float(v) for k, v in stat_means(pooled, self.objective).items()})
        return means

    def write_samples(self) -> None:
        """Appends the last rollout's rows, every rank's (TRL's table gathers them), rank by
        rank. A run's first write starts the table over: empty
        for a fresh run, for a resumed one the rows up to its checkpoint's step (a crashed run
        may have written later ones, which the resumed run writes again)."""
        samples = self.samples
        if self.dist.world_size > 1:  # every rank calls this at a logging step
            gathered: list = [None] * self.dist.world_size
            torch.distributed.all_gather_object(gathered, samples)
            samples = [row for rank in gathered for row in rank]
        if not (self.dist.is_main and samples):
            return
        path = self.paths.plots_dir / SAMPLES_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        step = self.progress.step
        if not self.samples_started:
            kept = []
            if self.start_step and path.exists():
                kept = [line for line in path.read_text().splitlines()
                        if line.strip() and json.loads(line)["step"] <= self.start_step]
            path.write_text("".join(line + "\n" for line in kept))
            self.samples_started = True
        with path.open("a") as f:
            for row in samples:
                f.write(json.dumps({"step": step, **row}) + "\n")

    # -- evaluation ------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """In-training evaluation: the held-out prompts' mean reward, greedy (`eval_reward`
        and one per function), on the first eval.eval_batches batches."""
        from engine.recipe.grpo.heldout import greedy_rewards

        with self.meter.pause():
            evaluated = greedy_rewards(self, self.eval_data)
        self.monitor.update(evaluated, self.progress.step)
        if self.reporters:
            self.reporters.on_log(self.state, dict(evaluated))
            self.reporters.on_evaluate(self.state, evaluated)
        return evaluated

    @classmethod
    def heldout_metrics(cls, held, after_loss=None):
        """Base and fine-tuned: each reward's mean on held-out prompts (greedy), the pass
        rate of the correctness reward greedy (pass_at_1) and over k samples (pass_at_k)."""
        return reward_metrics(held, after_loss)

