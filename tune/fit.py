"""The iso-FLOP analysis (Chinchilla's approach 2, as nanochat's scaling notebook does it), pure numpy.

For each compute budget C, the final val bpb of models of different sizes N trained to exactly C
traces a valley; a parabola in ln N locates its bottom N_opt(C), and the tokens D_opt(C) that model
trains on. Power laws N_opt ~ C^a and D_opt ~ C^b across budgets then give the compute-optimal
tokens:params ratio D/N ~ C^(b-a): roughly constant when a ~ b, which is what makes a single
--target-param-data-ratio a sound default. N is the scaling parameter count (transformer matrices +
lm_head), the same N the ratio multiplies during training.

Kept free of I/O and plotting so every number can be checked against synthetic data with a known
optimum (tests/test_tune_report.py).
"""

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np


def r_squared(y: np.ndarray, y_fit: np.ndarray, num_coefficients: int) -> float | None:
    """Coefficient of determination; None when the fit has as many coefficients as points (it passes
    through every point, so its quality says nothing) or the data are constant."""
    y, y_fit = np.asarray(y, dtype=float), np.asarray(y_fit, dtype=float)
    if len(y) <= num_coefficients:
        return None
    total = float(np.sum((y - y.mean()) ** 2))
    if total == 0.0:
        return None
    return 1.0 - float(np.sum((y - y_fit) ** 2)) / total


@dataclass(frozen=True)
class PowerLaw:
    """y = coefficient * x**exponent, fitted as a line in log-log space."""

    exponent: float
    coefficient: float
    r2: float | None
    num_points: int

    def __call__(self, x: float | np.ndarray) -> float | np.ndarray:
        return self.coefficient * np.asarray(x, dtype=float) ** self.exponent


def fit_power_law(x: Iterable[float], y: Iterable[float]) -> PowerLaw:
    """Least-squares line through (ln x, ln y); needs at least two distinct x."""
    lx, ly = np.log(np.asarray(list(x), dtype=float)), np.log(np.asarray(list(y), dtype=float))
    if len(lx) < 2 or np.ptp(lx) == 0:
        raise ValueError("a power-law fit needs at least two distinct x values")
    slope, intercept = np.polyfit(lx, ly, 1)
    return PowerLaw(float(slope), float(np.exp(intercept)), r_squared(ly, slope * lx + intercept, 2), len(lx))


@dataclass(frozen=True)
class BudgetOptimum:
    """The compute-optimal model of one FLOPs budget."""

    flops: float
    params: float  # N_opt
    tokens: float  # D_opt
    val_bpb: float  # the fitted minimum (or the best point when there is no valley)
    coeffs: tuple[float, float, float] | None  # bpb = c2*(ln N)^2 + c1*ln N + c0; None if not fitted
    r2: float | None  # parabola fit quality (None with only 3 points: the fit is exact)
    source: str  # "fit": vertex inside the sizes tried; "extrapolated": vertex outside them;
    #              "best point": too few points or no valley, the best trial is taken as is
    num_points: int
    params_tried: tuple[float, float]  # smallest and largest N of the budget's trials

    @property
    def ratio(self) -> float:
        return self.tokens / self.params


def budget_optimum(flops: float, params: Iterable[float], tokens: Iterable[float],
                   val_bpb: Iterable[float]) -> BudgetOptimum:
    """Fit val_bpb = parabola(ln N) over the models of one budget and take its vertex.

    D_opt comes from a line through (ln N, ln D) of the same models, not from C = 6ND: within a
    budget D is C / (FLOPs per token of N), which the line follows closely and this keeps the
    FLOPs convention (attention included) exactly the one training used.
    """
    n = np.asarray(list(params), dtype=float)
    d = np.asarray(list(tokens), dtype=float)
    bpb = np.asarray(list(val_bpb), dtype=float)
    if not len(n) == len(d) == len(bpb) or len(n) == 0:
        raise ValueError("params, tokens and val_bpb must be non-empty and of equal length")
    ln_n, ln_d = np.log(n), np.log(d)
    if len(np.unique(ln_n)) >= 3:
        coeffs = np.polyfit(ln_n, bpb, 2)
        c2, c1, c0 = (float(c) for c in coeffs)
        if c2 > 0:
            x_opt = -c1 / (2 * c2)
            slope, intercept = np.polyfit(ln_n, ln_d, 1)
            inside = ln_n.min() <= x_opt <= ln_n.max()
            return BudgetOptimum(
                flops=flops, params=float(np.exp(x_opt)), tokens=float(np.exp(intercept + slope * x_opt)),
                val_bpb=c0 - c1 * c1 / (4 * c2), coeffs=(c2, c1, c0),
                r2=r_squared(bpb, np.polyval(coeffs, ln_n), 3),
                source="fit" if inside else "extrapolated", num_points=len(n),
                params_tried=(float(n.min()), float(n.max())))
    best = int(np.argmin(bpb))
    return BudgetOptimum(flops=flops, params=float(n[best]), tokens=float(d[best]), val_bpb=float(bpb[best]),
                         coeffs=None, r2=None, source="best point", num_points=len(n),
                         params_tried=(float(n.min()), float(n.max())))


@dataclass(frozen=True)
class ComputeOptimal:
    """Optima per budget and the power laws across budgets."""

    optima: list[BudgetOptimum]
    params_law: PowerLaw | None  # N_opt = k_N * C^a
    tokens_law: PowerLaw | None  # D_opt = k_D * C^b
    reference_flops: float | None  # geometric mean of the budgets
    ratio_at_reference: float | None  # D_opt / N_opt from the two laws at reference_flops

    @property
    def ratio_exponent(self) -> float | None:
        """b - a: how the optimal ratio drifts with compute (0 = one ratio fits every budget)."""
        if self.params_law is None or self.tokens_law is None:
            return None
        return self.tokens_law.exponent - self.params_law.exponent


def compute_optimal(points: Iterable[tuple[float, float, float, float]]) -> ComputeOptimal:
    """points: (flops budget, params N, tokens D, val bpb), one per finished trial."""
    by_budget: dict[float, list[tuple[float, float, float]]] = defaultdict(list)
    for flops, n, d, bpb in points:
        by_budget[float(flops)].append((n, d, bpb))
    optima = []
    for flops in sorted(by_budget):
        n, d, bpb = zip(*sorted(by_budget[flops]), strict=True)
        optima.append(budget_optimum(flops, n, d, bpb))
    fitted = [o for o in optima if o.source != "best point"]
    if len(fitted) < 2:
        return ComputeOptimal(optima, None, None, None, None)
    budgets = [o.flops for o in fitted]
    params_law = fit_power_law(budgets, [o.params for o in fitted])
    tokens_law = fit_power_law(budgets, [o.tokens for o in fitted])
    reference = float(np.exp(np.mean(np.log(budgets))))
    ratio = float(tokens_law(reference) / params_law(reference))
    return ComputeOptimal(optima, params_law, tokens_law, reference, ratio)
