"""GRPO's clipped objective on generated completions, with TRL's formulas (GRPOTrainer's
`_compute_loss`), so its loss and statistics can be checked against TRL's on the same inputs.

Per completion token t of completion i, with r = exp(log pi - log pi_old) and advantage A_i:

    loss_it = -min(r A_i, clip(r, 1 - eps, 1 + eps_high) A_i) + beta * KL_it
    KL_it   = exp(log ref - log pi) - (log ref - log pi) - 1      (the k3 estimator)

times r with `use_bias_correction_kl` (TRL's default: the unbiased reverse-KL gradient).
The rest of the family changes the surrogate (`Objective`, TRL's names and formulas):
- importance_sampling_level sequence (GSPO): r is one ratio per completion, the exp of the
  token mean of log r;
- delta (INTELLECT-2's two-sided clipping): r capped at delta in the unclipped term;
- cispo: -min(r, eps_high).detach() * A * log pi (the ratio caps a REINFORCE weight);
- sapo: -sigmoid(tau (r - 1)) * 4 / tau * A, tau per the advantage's sign (a soft clip);
- luspo: the grpo surrogate, summed over each completion's tokens;
- vespo: -phi(w) * A * log pi, phi(w) = exp(lambda + k log w - lambda w) a gamma weight of the
  completion's ratio w (the exp of its summed token log-ratios), k and lambda per the
  advantage's sign, detached;
- top_entropy_quantile < 1 ("Beyond the 80/20 rule"): only the completion tokens whose entropy
  is at least that quantile of the micro-batch's (all ranks) train the policy term;
- off_policy_mask_threshold (DeepSeek-V3.2): a negative-advantage completion whose mean
  log(pi_old / pi) exceeds the threshold leaves the loss (pi_old: the sampler's, with vLLM);
- with a vLLM server as the sampler (`SamplingCorrection`, TRL's
  vllm_importance_sampling_correction): the policy term times the importance-sampling ratio
  pi_old / pi_vllm, per token or per completion, truncated or masked to its bounds
  (`importance_sampling_ratio`), and TRL's sampling/* statistics (`sampling_stats`).
The log-probabilities are those of the tempered distribution (logits / temperature), the one
the completions were sampled from. How the token losses become the step's loss is `loss_type`:
`reduce` returns a micro-batch's loss *sum* and what it is averaged over, so the loop's
divisor (summed over the step's micro-batches and ranks) makes the mean TRL takes:
- grpo: each completion's token mean, averaged over completions (count: completions);
- bnpo: the micro-batch's token mean, averaged over micro-batches (count: 1 per micro-batch);
- dr_grpo: the token sum over max_completion_length, averaged over completions;
- dapo, cispo and vespo: the token sum over the step's tokens on all ranks (count: tokens);
- sapo: as grpo; luspo: each completion's token sum, averaged over completions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: the statistics a micro-batch adds to the logging row, as masked sums over its tokens (the
#: run divides by the token count; a sequence-level ratio's clip flags by the completion
#: count, as TRL does): TRL's names
TOKEN_STATS = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
               "clip_ratio/region_mean")
#: the sums' layout: TOKEN_STATS, vespo's phi (summed over completions), then the token count
#: and the completion count
STAT_SLOTS = len(TOKEN_STATS) + 3
#: the slots' names among a logging window's sums (engine.recipe.grpo.run.window_metrics)
TOKEN_SLOTS = tuple(f"_sum/{n}" for n in (*TOKEN_STATS, "vespo_phi", "tokens", "completions"))
#: the loss types whose surrogate is the clipped ratio (their clip statistics are TRL's
#: clip_ratio/*; cispo logs cispo_clip_ratio, sapo none)
CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


@dataclass(frozen=True)
class Objective:
    """The surrogate's settings, as grpo.* names them (`of`)."""

    loss_type: str = "dapo"
    eps_low: float = 0.2
    eps_high: float = 0.2
    beta: float = 0.0
    kl_correction: bool = True
    level: str = "token"  # importance_sampling_level
    delta: float | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    off_policy_mask_threshold: float | None = None
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    top_entropy_quantile: float = 1.0

    @classmethod
    def of(cls, g) -> "Objective":
        return cls(g.loss_type, g.epsilon, g.clip_high, g.beta, g.use_bias_correction_kl,
                   g.importance_sampling_level, g.delta, g.sapo_temperature_pos,
                   g.sapo_temperature_neg, g.off_policy_mask_threshold, g.vespo_k_pos,
                   g.vespo_lambda_pos, g.vespo_k_neg, g.vespo_lambda_neg,
                   g.top_entropy_quantile)


def completion_logps(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     completion_len: int, temperature: float, with_entropy: bool = False,
                     group: int = 1) -> tuple[torch.Tensor, torch.Tensor | None]:
    """([N, T] log-probabilities of the last `completion_len` tokens of each row under the
    tempered distribution, [N, T] entropies or None), fp32. Only the completion positions'
    logits are computed (`logits_to_keep`); positions follow the attention mask, as in
    generation, so left padding does not shift them.

    `group` > 1: the rows come in runs of `group` with the same prompt columns (the
    completions of one prompt, TRL's repeat_interleave order), and the prompt is run once per
    run (`completion_logits`): the same values up to float rounding, for 1/group of the
    prompt's compute, forward and backward."""
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
    logits = completion_logits(model, input_ids, attention_mask, position_ids, completion_len,
                               group)
    logits = logits.float() / temperature
    targets = input_ids[:, -completion_len:]
    norm = torch.logsumexp(logits, dim=-1)
    logps = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - norm
    entropy = None
    if with_entropy:  # a logged statistic: no gradient, no graph kept for it
        with torch.no_grad():
            entropy = norm - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return logps, entropy


def completion_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      position_ids: torch.Tensor, completion_len: int, group: int = 1
                      ) -> torch.Tensor:
    """[N, completion_len, V] logits, each position's predicting its completion token.

    With `group` > 1 (see `completion_logps`), two forwards: the prompt columns of one row per
    group with a KV cache (the last prompt position's logits predict the first completion
    token), the cache repeated `group` times (its gradient flows back to the shared prompt
    activations), then every row's completion tokens but the last against it. Prompt tokens
    are usually most of a GRPO row's tokens on short completions, so this cuts the training
    and reference forwards' work by up to (group - 1) / group of the prompt's share. Falls back
    to one forward when the model returns no cache (activation checkpointing turns it off)."""
    rows, width = input_ids.shape
    prompt_len = width - completion_len
    if group > 1 and rows % group == 0 and prompt_len > 0:
        head = model(input_ids=input_ids[::group, :prompt_len],
                     attention_mask=attention_mask[::group, :prompt_len],
                     position_ids=position_ids[::group, :prompt_len], logits_to_keep=1,
                     use_cache=True)
        cache = head.past_key_values
        if cache is not None and hasattr(cache, "batch_repeat_interleave"):
            first = head.logits.repeat_interleave(group, dim=0)
            if completion_len == 1:
                return first
            cache.batch_repeat_interleave(group)
            tail = model(input_ids=input_ids[:, prompt_len:-1],
                         attention_mask=attention_mask[:, :-1],
                         position_ids=position_ids[:, prompt_len:-1], past_key_values=cache,
                         use_cache=True).logits
            return torch.cat([first, tail], dim=1)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   logits_to_keep=completion_len + 1, use_cache=False).logits
    return logits[:, :-1]


@dataclass
class TokenLosses:
    """A micro-batch's per-token objective and what its statistics are made of."""

    per_token: torch.Tensor  # [N, T] ([N, 1] for a sequence-level ratio without KL)
    kl: torch.Tensor | None  # [N, T], None when beta is 0
    low_clipped: torch.Tensor  # [N, T] or [N, 1] bool
    high_clipped: torch.Tensor  # [N, T] or [N, 1] bool (cispo: its cap reached)
    phi: torch.Tensor | None = None  # [N, 1] vespo's weights


def token_losses(logps: torch.Tensor, old_logps: torch.Tensor | None,
                 ref_logps: torch.Tensor | None, advantages: torch.Tensor, mask: torch.Tensor,
                 objective: Objective, entropy_mask: torch.Tensor | None = None,
                 is_ratio: torch.Tensor | None = None,
                 sampling_logps: torch.Tensor | None = None) -> TokenLosses:
    """The surrogate (`objective.loss_type`) plus the KL term, per token. `old_logps` None:
    the completions were sampled from these very weights (num_iterations 1), so the ratio is
    1 with the gradient of log pi (TRL uses logps.detach()). `kl_correction`: the KL term is
    weighted by the ratio r (TRL's use_bias_correction_kl: the unbiased reverse-KL
    gradient). The order of the steps is TRL's, so the clip flags see delta's cap.
    `entropy_mask` ([N, T] bool, `high_entropy_mask`): the tokens the policy term keeps.
    `is_ratio` ([N, T] or [N, 1], `importance_sampling_ratio`): vLLM's importance-sampling
    correction, multiplying the policy term (vespo: folded into its completion weight), as
    TRL does; `sampling_logps`: the sampler's log-probabilities (a vLLM server's), which the
    off-policy mask compares with instead of `old_logps` (TRL's)."""
    o = objective
    old = logps.detach() if old_logps is None else old_logps
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    mask = mask.to(logps.dtype)
    log_ratio = token_log_ratio = logps - old
    if o.level == "sequence":  # GSPO: one ratio per completion
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_ratio)
    kl = None
    if o.beta != 0.0:
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1
        if o.kl_correction:
            kl = kl * coef_1
    no = torch.zeros_like(coef_1, dtype=torch.bool)
    phi = None
    if o.loss_type == "vespo":
        phi = vespo_weights(token_log_ratio, advantages, mask, o, is_ratio)
        per_token = -phi * advantages * logps
        low = high = no
    elif o.loss_type == "cispo":
        per_token = -torch.clamp(coef_1, max=o.eps_high).detach() * advantages * logps
        low, high = no, (coef_1 > o.eps_high) & (advantages > 0)
    elif o.loss_type == "sapo":
        tau = torch.where(advantages > 0, o.sapo_temperature_pos, o.sapo_temperature_neg)
        per_token = -torch.sigmoid(tau * (coef_1 - 1)) * 4 / tau * advantages
        low = high = no
    else:
        coef_2 = torch.clamp(coef_1, 1 - o.eps_low, 1 + o.eps_high)
        if o.delta is not None:  # two-sided clipping
            coef_1 = torch.clamp(coef_1, max=o.delta)
        per_token = -torch.min(coef_1 * advantages, coef_2 * advantages)
        low = (coef_1 < 1 - o.eps_low) & (advantages < 0)
        high = (coef_1 > 1 + o.eps_high) & (advantages > 0)
    if o.off_policy_mask_threshold is not None:
        behaviour = old if sampling_logps is None else sampling_logps
        per_token = per_token * off_policy_mask(logps, behaviour, advantages, mask,
                                                o.off_policy_mask_threshold)
    if entropy_mask is not None:
        per_token = per_token * entropy_mask
    if is_ratio is not None and o.loss_type != "vespo":
        per_token = per_token * is_ratio
    if kl is not None:
        per_token = per_token + o.beta * kl
    return TokenLosses(per_token, kl, low, high, phi)


@torch.no_grad()
def vespo_weights(log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                  o: Objective, is_ratio: torch.Tensor | None = None) -> torch.Tensor:
    """[N, 1] VESPO's gamma weights phi(w) = exp(lambda + k log w - lambda w), normalised so
    phi(1) = 1, of each completion's ratio w = exp(sum of its token log-ratios), in log
    space with TRL's clamps (log-ratios to [-20, 20], log w to [log 1e-8, 20]). With vLLM's
    token-level `is_ratio`, w also carries pi_old / pi_vllm: the sum of its logs (each
    clamped to [log 1e-8, 20]) over the row's positions is added to log w, as TRL adds it."""
    import math

    per_token = torch.clamp(log_ratio, -20.0, 20.0)
    summed = (per_token * mask).sum(-1, keepdim=True)
    if is_ratio is not None:
        summed = summed + torch.clamp(torch.log(is_ratio), math.log(1e-8), 20.0).sum(
            -1, keepdim=True)
    log_w = torch.clamp(summed, math.log(1e-8), 20.0)
    nonneg = advantages >= 0
    k = torch.where(nonneg, o.vespo_k_pos, o.vespo_k_neg)
    lam = torch.where(nonneg, o.vespo_lambda_pos, o.vespo_lambda_neg).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


#: vLLM's importance-sampling statistics, TRL's names (logged at the steps that generate)
SAMPLING_STATS = ("sampling/sampling_logp_difference/mean",
                  "sampling/sampling_logp_difference/max",
                  "sampling/importance_sampling_ratio/min",
                  "sampling/importance_sampling_ratio/mean",
                  "sampling/importance_sampling_ratio/max")


@dataclass(frozen=True)
class SamplingCorrection:
    """vLLM's importance-sampling correction (TRL's vllm_importance_sampling_* settings)."""

    mode: str = "sequence_mask"  # token_truncate | token_mask | sequence_truncate | _mask
    clip_min: float | None = None
    clip_max: float | None = 3.0

    @classmethod
    def of(cls, g) -> "SamplingCorrection | None":
        """The section's correction; None without use_vllm or with the correction off."""
        if not g.corrects_sampling:
            return None
        return cls(g.vllm_importance_sampling_mode, g.vllm_importance_sampling_clip_min,
                   g.vllm_importance_sampling_clip_max)

    @property
    def per_sequence(self) -> bool:
        return self.mode.startswith("sequence")


@torch.no_grad()
def importance_sampling_ratio(old_logps: torch.Tensor, sampling_logps: torch.Tensor,
                              mask: torch.Tensor, c: SamplingCorrection) -> torch.Tensor:
    """pi_old / pi_sampler of the sampled tokens: [N, T] per token, or [N, 1] per completion
    (the exp of the summed masked token log-ratios) in the sequence modes. A token the sampler
    gave no log-probability (NaN) counts as ratio 1. Truncate modes clamp the ratio to
    [clip_min, clip_max] (a null bound: none); mask modes set a ratio outside it to 0. TRL's
    formula (GRPOTrainer._generate_and_score_completions)."""
    diff = torch.nan_to_num((old_logps - sampling_logps) * mask, nan=0.0)
    if c.per_sequence:
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if c.mode.endswith("_truncate"):
        return torch.clamp(ratio, min=c.clip_min, max=c.clip_max)
    if c.mode.endswith("_mask"):
        low = -math.inf if c.clip_min is None else c.clip_min
        high = math.inf if c.clip_max is None else c.clip_max
        return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
    raise ValueError(f"vllm_importance_sampling_mode '{c.mode}': not one of token_truncate, "
                     "token_mask, sequence_truncate, sequence_mask")


@torch.no_grad()
def sampling_stats(old_logps: list[torch.Tensor], sampling_logps: list[torch.Tensor],
                   ratios: list[torch.Tensor], masks: list[torch.Tensor], per_sequence: bool,
                   group=None) -> torch.Tensor:
    """[5] float64, `SAMPLING_STATS` in order, over one rollout's micro-batches (lists of
    each one's tensors) on every rank: this rank's mean and max of |log pi_old - log
    pi_sampler| over its completion tokens (NaN ones left out), and the min, mean and max of
    its importance-sampling ratios (per completion in the sequence modes, else over the
    completion tokens); 0 for none. Across ranks as TRL gathers them: the differences' mean
    of the ranks' means and max of their maxima, the ratios' NaN-ignoring min, mean and max
    of the ranks' values."""
    deltas, flat = [], []
    for old, sampled, ratio, mask in zip(old_logps, sampling_logps, ratios, masks):
        keep = mask.bool()
        delta = (old - sampled).abs()
        deltas.append(delta[keep & ~torch.isnan(delta)])
        flat.append(ratio.flatten() if per_sequence else ratio[keep])
    delta, ratio = torch.cat(deltas).double(), torch.cat(flat).double()
    zero = torch.zeros((), dtype=torch.float64, device=delta.device)

    def of(x, f):
        return f(x) if x.numel() else zero

    local = torch.stack([of(delta, torch.mean), of(delta, torch.max), of(ratio, torch.min),
                         of(ratio, torch.mean), of(ratio, torch.max)])
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world = torch.distributed.get_world_size(group)
        parts = [torch.empty_like(local) for _ in range(world)]
        torch.distributed.all_gather(parts, local, group=group)
        ranks = torch.stack(parts)
    else:
        ranks = local.unsqueeze(0)

    def nan_out(x, fill):
        return torch.where(torch.isnan(x), torch.full_like(x, fill), x)

    ratios_min = nan_out(ranks[:, 2], math.inf).min()
    ratios_max = nan_out(ranks[:, 4], -math.inf).max()
    return torch.stack([ranks[:, 0].mean(), ranks[:, 1].max(), ratios_min,
                        ranks[:, 3].nanmean(), ratios_max])


def entropy_token_mask(entropy: torch.Tensor, mask: torch.Tensor, objective: Objective
                       ) -> torch.Tensor | None:
    """`token_losses`' entropy_mask for `objective.top_entropy_quantile` (None: every token,
    at 1)."""
    q = objective.top_entropy_quantile
    return None if q >= 1.0 else high_entropy_mask(entropy, mask, 1 - q)


@torch.no_grad()
def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, quantile: float,
                      group=None) -> torch.Tensor:
    """[N, T] bool: the completion tokens whose entropy is at least the `quantile` of every
    completion token's of the micro-batch on all ranks (gathered, padded with a negative
    sentinel: entropies are >= 0), TRL's get_high_entropy_mask."""
    local = entropy[mask.bool()].float()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world = torch.distributed.get_world_size(group)
        size = torch.tensor([local.numel()], device=local.device)
        sizes = [torch.zeros_like(size) for _ in range(world)]
        torch.distributed.all_gather(sizes, size, group=group)
        longest = int(torch.stack(sizes).max())  # one host sync per micro-batch
        padded = torch.full((longest,), -1e9, device=local.device)
        padded[:local.numel()] = local
        parts = [torch.empty_like(padded) for _ in range(world)]
        torch.distributed.all_gather(parts, padded, group=group)
        local = torch.cat(parts)
        local = local[local != -1e9]
    if local.numel() == 0:
        return torch.zeros_like(entropy, dtype=torch.bool)
    # torch.quantile's linear interpolation, by sort: quantile refuses more than 2^24 values,
    # which every rank's completion tokens of a large micro-batch can exceed
    ordered = local.sort().values
    rank = torch.tensor(quantile, dtype=ordered.dtype, device=ordered.device) * (
        ordered.numel() - 1)  # in the values' dtype, as quantile computes it
    below = rank.long()
    above = (below + 1).clamp(max=ordered.numel() - 1)
    threshold = torch.lerp(ordered[below], ordered[above], rank - below)
    return ((entropy * mask.float()) >= threshold) & mask.bool()


def off_policy_mask(logps: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """[N, 1]: 0 for a completion with a negative advantage whose mean log(pi_old / pi) over
    its tokens exceeds `threshold` (DeepSeek-V3.2's off-policy sequence mask), else 1."""
    drift = torch.nan_to_num(old - logps.detach(), nan=0.0)
    mean = (drift * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    return ((advantages >= 0) | (mean <= threshold)).to(mask.dtype)


def averaged_over(loss_type: str, mask: torch.Tensor) -> torch.Tensor:
    """What the step averages a micro-batch's loss sum over (see the module docstring):
    completions, 1 per micro-batch, or completion tokens; a device tensor (no host sync)."""
    if loss_type in ("grpo", "dr_grpo", "sapo", "luspo"):
        return torch.tensor(float(mask.shape[0]), device=mask.device)
    if loss_type == "bnpo":
        return torch.ones((), device=mask.device)
    if loss_type in ("dapo", "cispo", "vespo"):
        return mask.float().sum()
    raise ValueError(f"grpo.loss_type '{loss_type}': not one of grpo, bnpo, dr_grpo, dapo, "
                     "cispo, sapo, luspo, vespo")


def reduce(loss_type: str, per_token: torch.Tensor, mask: torch.Tensor,
           max_completion_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the micro-batch's loss sum, what the step averages it over: `averaged_over`)."""
    count = averaged_over(loss_type, mask)
    mask = mask.to(per_token.dtype)
    masked = per_token * mask  # a [N, 1] sequence-level loss counts once per token
    if loss_type in ("grpo", "sapo"):
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum(), count
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0), count
    if loss_type == "dr_grpo":
        return masked.sum() / max_completion_length, count
    return masked.sum(), count  # dapo, cispo, vespo; luspo: over completions (`averaged_over`)


def token_stat_sums(losses: TokenLosses, entropy: torch.Tensor | None, mask: torch.Tensor,
                    per_sequence: bool = False) -> torch.Tensor:
    """[STAT_SLOTS]: each statistic's masked sum over the micro-batch's tokens (with
    `per_sequence`, a sequence-level ratio's clip flags: their sum over completions; vespo's
    phi always), then the token and completion counts (means are taken over the logging
    window, all ranks: `stat_means`)."""
    mask = mask.to(torch.float32)
    zero = torch.zeros((), device=mask.device)

    def masked_sum(x, over_completions=False):
        if x is None:
            return zero
        return x.float().sum() if over_completions else (x.float() * mask).sum()

    region = losses.low_clipped | losses.high_clipped
    completions = torch.tensor(float(mask.shape[0]), device=mask.device)
    with torch.no_grad():  # statistics: no graph kept for them
        return torch.stack([masked_sum(losses.kl), masked_sum(entropy),
                            masked_sum(losses.low_clipped, per_sequence),
                            masked_sum(losses.high_clipped, per_sequence),
                            masked_sum(region, per_sequence), masked_sum(losses.phi, True),
                            mask.sum(), completions]).double()


def stat_means(sums: torch.Tensor, objective: Objective) -> dict[str, torch.Tensor]:
    """The logged statistics from summed `token_stat_sums`, under TRL's names for the loss
    type: kl (beta > 0), entropy, and clip_ratio/{low,high,region}_mean (cispo:
    cispo_clip_ratio; vespo: vespo/phi_seq_mean, over completions; sapo: none), each a mean
    over tokens or, for a sequence-level ratio's clip flags, over completions."""
    tokens, completions = sums[-2].clamp_min(1.0), sums[-1].clamp_min(1.0)
    clips = completions if objective.level == "sequence" else tokens
    means = dict(zip(TOKEN_STATS, [sums[0] / tokens, sums[1] / tokens,
                                   *(sums[2:5] / clips)]))
    if objective.beta == 0.0:
        del means["kl"]
    if objective.loss_type == "cispo":
        means["cispo_clip_ratio"] = means["clip_ratio/high_mean"]
    if objective.loss_type == "vespo":
        means["vespo/phi_seq_mean"] = sums[5] / completions
    if objective.loss_type not in CLIPPED:
        for name in TOKEN_STATS[2:]:
            del means[name]
    return means
