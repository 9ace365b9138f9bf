"""The zero-bubble bound of a cluster, heterogeneous or not: a small linear program.

Every image of a step must be generated, rewarded and trained once. Phase ``p`` of one image
costs ``seconds[d][p]`` device-seconds on a device of type ``d`` (its FLOPs at that device's
best efficiency, no overheads), and the cluster has ``counts[d]`` devices of type ``d``.
A schedule that delivers ``X`` images/s over a long window must, per second, have done ``X``
images' worth of each phase, split across types somehow (``y[p][d]`` images/s of phase ``p``
on type ``d``), and no type can be busy more than its device count::

    maximise X   subject to   sum_d y[p][d] >= X            for every phase p
                              sum_p seconds[d][p] y[p][d] <= counts[d]   for every type d
                              y >= 0

Its optimum is an upper bound on the throughput of *any* schedule (whatever it assigns where,
however it overlaps), and it is exact for a single device type: ``counts / sum_p seconds``.
The former bound (the fastest type's per-image sum charged for every device) is not an upper
bound when each type is fastest at a different phase: a schedule that puts each phase on the
type best at it beats it. Solved here by a dense simplex (Bland's rule); the programs have at
most a few dozen variables.
"""

from __future__ import annotations

import math
from typing import Mapping

EPS = 1e-12


def max_throughput(counts: Mapping[str, int], seconds: Mapping[str, Mapping[str, float]]) -> float:
    """Images/s no schedule on ``counts`` devices can beat, from per-image phase ``seconds``
    per device type (``seconds[type][phase]``; every type lists the same phases)."""
    types = [d for d in counts if counts[d] > 0]
    if not types:
        return 0.0
    phases = sorted({p for d in types for p in seconds[d]})
    # phases some type does for free do not constrain the throughput
    phases = [p for p in phases if all(seconds[d].get(p, math.inf) > 0 for d in types)]
    if not phases:
        return math.inf
    if len(types) == 1:
        d = types[0]
        return counts[d] / sum(seconds[d][p] for p in phases)
    # variables: y[p][d] for finite costs, then X (last)
    var: list[tuple[str, str]] = [(p, d) for p in phases for d in types if math.isfinite(seconds[d].get(p, math.inf))]
    n = len(var) + 1
    rows: list[list[float]] = []
    rhs: list[float] = []
    for p in phases:  # X - sum_d y[p][d] <= 0
        rows.append([(-1.0 if v[0] == p else 0.0) for v in var] + [1.0])
        rhs.append(0.0)
    for d in types:  # sum_p seconds y[p][d] <= counts[d]
        rows.append([(seconds[d][v[0]] if v[1] == d else 0.0) for v in var] + [0.0])
        rhs.append(float(counts[d]))
    objective = [0.0] * (n - 1) + [1.0]
    return _simplex_max(objective, rows, rhs)


def _simplex_max(c: list[float], A: list[list[float]], b: list[float]) -> float:
    """max c.x s.t. A x <= b, x >= 0, with b >= 0 (the origin is feasible); Bland's rule."""
    m, n = len(A), len(c)
    # tableau rows: [A | I | b]; objective row: [-c | 0 | 0]
    T = [A[i][:] + [1.0 if j == i else 0.0 for j in range(m)] + [b[i]] for i in range(m)]
    z = [-x for x in c] + [0.0] * m + [0.0]
    basis = [n + i for i in range(m)]
    for _ in range(10_000):
        enter = next((j for j in range(n + m) if z[j] < -EPS), None)
        if enter is None:
            return z[-1]
        ratios = [(T[i][-1] / T[i][enter], basis[i], i) for i in range(m) if T[i][enter] > EPS]
        if not ratios:
            return math.inf
        _, _, leave = min(ratios)
        piv = T[leave][enter]
        T[leave] = [x / piv for x in T[leave]]
        for i in range(m):
            if i != leave and abs(T[i][enter]) > EPS:
                f = T[i][enter]
                T[i] = [x - f * y for x, y in zip(T[i], T[leave])]
        f = z[enter]
        z = [x - f * y for x, y in zip(z, T[leave])]
        basis[leave] = enter
    raise RuntimeError("simplex did not converge")  # pragma: no cover - Bland's rule terminates
