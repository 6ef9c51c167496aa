"""The promotion gate's judgement: the target metric must improve beyond its noise, and every
no-regression guard (registry.guard_metrics) must hold.

Pure arithmetic on two dicts of metric values (the candidate's and the champion's, keys as
MLflow logs them: eval.loss, eval.harness.TASK.METRIC.FILTER, and their stderr keys), so the
registry (tasks.registry) only reads and records. A difference's noise is the standard error of
the difference of two independent estimates, sqrt(se_champion^2 + se_candidate^2).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from finetune.config.registry import RegistryConfig, higher_wins, stderr_key

PASS, FAIL = "pass", "fail"


@dataclass
class Row:
    """One line of the decision table. `difference` is candidate - champion; `allowed` the
    bound it had to meet, as text ('>= -0.02 (2 se)')."""

    metric: str
    role: str  # "target" or "guard"
    champion: float | None
    candidate: float | None
    difference: float | None
    allowed: str
    verdict: str
    why: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def _noise(metric: str, champion: dict, candidate: dict) -> float | None:
    """The standard error of candidate - champion, or None when either side has none."""
    key = stderr_key(metric)
    a, b = champion.get(key), candidate.get(key)
    if a is None or b is None:
        return None
    return math.sqrt(float(a) ** 2 + float(b) ** 2)


def _bound(higher: bool, limit: float, strict: bool = False) -> str:
    """The bound on candidate - champion as text: improvements are signed by direction."""
    op = (">" if strict else ">=") if higher else ("<" if strict else "<=")
    return f"{op} 0" if limit == 0 else f"{op} {limit if higher else -limit:+.6g}"


def target_row(cfg: RegistryConfig, champion: dict, candidate: dict) -> Row:
    """The gate metric: an improvement > 0, >= min_improvement, and >= min_improvement_stderr
    standard errors of the difference."""
    metric, higher = cfg.gate_metric, cfg.higher_wins
    champ, cand = champion.get(metric), candidate.get(metric)
    row = Row(metric, "target", champ, cand, None, "", FAIL)
    needed, units = cfg.min_improvement, ""
    if cfg.min_improvement_stderr:
        noise = _noise(metric, champion, candidate)
        if noise is None:
            row.allowed = _bound(higher, needed, strict=needed == 0)
            row.why = f"no {stderr_key(metric)} for both models"
            return _with_difference(row)
        needed = max(needed, cfg.min_improvement_stderr * noise)
        units = f" ({cfg.min_improvement_stderr:g} se = {cfg.min_improvement_stderr * noise:.4g})"
    row.allowed = _bound(higher, needed, strict=needed == 0) + units
    if champ is None or cand is None:
        row.why = f"no {metric} for the {'champion' if champ is None else 'candidate'}"
        return _with_difference(row)
    gain = cand - champ if higher else champ - cand
    row.verdict = PASS if gain > 0 and gain >= needed else FAIL
    return _with_difference(row)


def guard_rows(cfg: RegistryConfig, champion: dict, candidate: dict) -> list[Row]:
    """Each guard: the candidate may be worse than the champion by at most its allowance."""
    rows = []
    for guard in cfg.guard_metrics:
        metric, higher = guard.metric, higher_wins(guard.metric)
        champ, cand = champion.get(metric), candidate.get(metric)
        row = Row(metric, "guard", champ, cand, None, "", FAIL)
        if guard.max_drop is not None:
            allowance, units = guard.max_drop, ""
        else:
            noise = _noise(metric, champion, candidate)
            allowance = None if noise is None else guard.max_drop_stderr * noise
            units = f" ({guard.max_drop_stderr:g} se)"
        if allowance is None:
            row.allowed = f"drop <= {guard.max_drop_stderr:g} se"
            row.why = f"no {stderr_key(metric)} for both models"
        else:
            row.allowed = _bound(higher, -allowance) + units
            if champ is None or cand is None:
                row.why = f"no {metric} for the {'champion' if champ is None else 'candidate'}"
            else:
                change = cand - champ if higher else champ - cand  # > 0: better
                row.verdict = PASS if change >= -allowance else FAIL
                if row.verdict == FAIL:
                    row.why = f"dropped by {-change:.6g}, more than {allowance:.6g}"
        rows.append(_with_difference(row))
    return rows


def _with_difference(row: Row) -> Row:
    if row.champion is not None and row.candidate is not None:
        row.difference = row.candidate - row.champion
    return row


#: the candidate's contamination metrics (the evaluate stage's check), as MLflow has them
CONTAMINATION = ("contamination.", ".overlap_fraction")


def is_contamination(key: str) -> bool:
    return key.startswith(CONTAMINATION[0]) and key.endswith(CONTAMINATION[1])


def contamination_metrics(section: dict) -> dict[str, float]:
    """The metrics file's contamination section (tasks.contamination.metrics) as the MLflow
    run and the gate name its numbers: `contamination.<set>.overlap_fraction`."""
    prefix, suffix = CONTAMINATION
    return {f"{prefix}{name}{suffix}": m["overlap_fraction"] for name, m in section.items()}


def contamination_rows(cfg: RegistryConfig, candidate: dict) -> list[Row]:
    """With registry.max_contamination: each evaluation set's overlap fraction at most that
    (the candidate's alone: contamination is the training data's, not a comparison)."""
    limit = cfg.max_contamination
    if limit is None:
        return []
    keys = sorted(k for k in candidate if is_contamination(k))
    if not keys:
        return [Row("contamination", "contamination", None, None, None, f"<= {limit:g}", FAIL,
                    "no contamination check in the evaluation (run the evaluate stage)")]
    rows = []
    for key in keys:
        value = candidate[key]
        row = Row(key, "contamination", None, value, None, f"<= {limit:g}",
                  PASS if value <= limit else FAIL)
        if row.verdict == FAIL:
            row.why = f"{value:.6g} of its rows overlap the training rows"
        rows.append(row)
    return rows


def judge(cfg: RegistryConfig, champion: dict, candidate: dict) -> list[Row]:
    """The target's row, then each guard's, then each contamination check's."""
    return [target_row(cfg, champion, candidate), *guard_rows(cfg, champion, candidate),
            *contamination_rows(cfg, candidate)]


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.6g}"


def markdown(rows: list[Row], title: str) -> str:
    """The decision table: metric, champion, candidate, difference, allowed, verdict."""
    lines = [title, "", "| metric | champion | candidate | difference | allowed | verdict |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        diff = "-" if r.difference is None else f"{r.difference:+.6g}"
        verdict = r.verdict + (f" ({r.why})" if r.why else "")
        lines.append(f"| {r.metric} ({r.role}) | {_cell(r.champion)} | {_cell(r.candidate)} | "
                     f"{diff} | {r.allowed} | {verdict} |")
    return "\n".join(lines) + "\n"
