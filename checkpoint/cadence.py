"""How often to save under random failures (Young 1974, Daly 2006): the interval that maximizes expected
goodput given the save cost C (time the loop is blocked), the mean time between failures M and the
restart cost R, with exponential (Poisson) failures and work lost back to the last committed save."""
from __future__ import annotations

import math


def optimal_interval_s(save_s: float, mtbf_s: float) -> float:
    """Daly's higher-order estimate of the compute time between saves (Young's sqrt(2 C M) to first order):

    tau = sqrt(2 C M) [1 + sqrt(C / 2M) / 3 + (C / 2M) / 9] - C  for C < 2M, else M."""
    if save_s <= 0:
        return 0.0
    if save_s >= 2 * mtbf_s:
        return mtbf_s
    x = save_s / (2 * mtbf_s)
    return math.sqrt(2 * save_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - save_s


def expected_goodput(interval_s: float, save_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """Useful share of wall time when every `interval_s` of work is followed by a save of `save_s`.

    A segment of work plus save, T = tau + C, restarted from its beginning after each failure (each restart
    costing R, during which failures can also strike), takes M e^(R/M) (e^(T/M) - 1) in expectation (Daly
    2006, eq. 9 with exponential failures); goodput is tau over that."""
    if interval_s <= 0:
        return 0.0
    expected = mtbf_s * math.exp(restart_s / mtbf_s) * math.expm1((interval_s + save_s) / mtbf_s)
    return interval_s / expected


def system_mtbf_s(mtbf_hours: float, scope: str, devices: int, devices_per_host: int) -> float:
    """The job's MTBF from one component's: failures of n independent parts add up (M / n)."""
    parts = devices if scope == "device" else math.ceil(devices / devices_per_host)
    return mtbf_hours * 3600.0 / parts
