"""Optimal piecewise-constant approximations q of an activation's derivative f'.

    minimise  E(q) = integral_L^R (f'(x) - q(x))^2 w(x) dx
    over      q(x) = l_k  for x in (x_k, x_{k+1}],  k = 0 .. 2^b - 1,  x_0 = L, x_{2^b} = R

Given the borders, the best level of an interval is the weighted mean of f' there,
l_k = F_k / W_k with F_k = integral f' w, W_k = integral w over the interval, and then

    E = S - sum_k F_k^2 / W_k,      S = integral_L^R f'^2 w      (a constant).

So E is a sum of per-interval costs c(a, b) = S(a, b) - F(a, b)^2 / W(a, b), and the
global optimum with borders on a grid g_0 = L < g_1 < ... < g_n = R is a shortest path
(Novikov et al. 2022, notebook `custom_gelu_dynamic_programming.py`):

    D_1(j) = c(0, j);   D_k(j) = min_{i < j} D_{k-1}(i) + c(i, j);   E* = D_{2^b}(n)

from prefix sums of the cell integrals of w, f' w and f'^2 w: O(2^b n^2) additions, done
as one (n x n) cost matrix and 2^b vectorised min-plus steps (numpy, float64).

The grid: n = 2000 cells, x = sinh(u) for u uniform on [asinh L, asinh R] (cells of
2.7e-3 near 0, 8e-3 at |x| = 3, 0.27 at |x| = 100 on [-100, 100]), plus 0 and the
function's kinks (where f' or f'' jumps), so every cell integral is of a smooth function:
8-point Gauss-Legendre per cell, exact to rounding. Then the borders are polished to the
continuous optimum of that basin: Newton's method on dE/dx_k = w(x_k) (l_k - l_{k-1})
(2 f'(x_k) - l_{k-1} - l_k) = 0, each step halved until E decreases (borders on a kink
stay), so tables do not depend on the grid's resolution beyond the choice of the basin.
E itself (`l2_error`) is summed directly, cell by cell, as integral (f' - q)^2 w: no
large terms cancel. Tables are cached (`tables.json` for the defaults; see `table`).

A weight other than the uniform one may vanish in the tails: a normal weight's interval
is clipped to +-6 sigma (`weight_support`).

With w = 1 the integrals F and W are exact: F(a, b) = f(b) - f(a), W = b - a (the
library's setting: w = 1 on [-100, 100]). f and f' are PyTorch's own functions in
float64 (f' by autograd: the derivative the replaced layer's backward computes).

Activations: those of fewbit's list (celu, elu, gelu, hardswish, logsigmoid, mish,
selu, sigmoid, silu, softplus, softsign, tanh, tanhshrink; celu and elu with alpha = 1,
softplus with beta = 1 and threshold 20), plus gelu_tanh (the tanh approximation GPT-2
uses) and the piecewise-linear relu and leaky_relu (slope 0.01), whose derivatives are
step functions: exact (E = 0) at 1 bit, border 0.
"""
from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

# name -> (f as a float64 torch function, points where f' or f'' is not smooth)
ACTIVATIONS: dict[str, tuple[Callable, tuple[float, ...]]] = {
    "gelu": (F.gelu, ()),
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), ()),
    "silu": (F.silu, ()),
    "tanh": (torch.tanh, ()),
    "sigmoid": (torch.sigmoid, ()),
    "celu": (F.celu, (0.0,)),
    "elu": (F.elu, (0.0,)),
    "hardswish": (F.hardswish, (-3.0, 3.0)),
    "logsigmoid": (F.logsigmoid, ()),
    "mish": (F.mish, ()),
    "selu": (F.selu, (0.0,)),
    "softplus": (F.softplus, (20.0,)),  # threshold 20: linear (slope exactly 1) above
    "softsign": (F.softsign, (0.0,)),
    "tanhshrink": (F.tanhshrink, ()),
    "relu": (F.relu, (0.0,)),
    "leaky_relu": (F.leaky_relu, (0.0,)),
}
STEPWISE = ("relu", "leaky_relu")  # f' is a step function: exact at 1 bit
INTERVAL = (-100.0, 100.0)
GRID_CELLS = 2000
_GAUSS = np.polynomial.legendre.leggauss(8)


def f(name: str, x) -> np.ndarray:
    fn = ACTIVATIONS[name][0]
    with torch.no_grad():
        return fn(torch.as_tensor(np.asarray(x, dtype=np.float64))).numpy()


def derivative(name: str, x) -> np.ndarray:
    """f'(x) in float64, by autograd through PyTorch's own f."""
    fn = ACTIVATIONS[name][0]
    t = torch.tensor(np.asarray(x, dtype=np.float64), requires_grad=True)
    with torch.enable_grad():
        (grad,) = torch.autograd.grad(fn(t).sum(), t)
    return grad.numpy()


# -- weights ---------------------------------------------------------------------------


def weight_function(weight) -> Callable[[np.ndarray], np.ndarray] | None:
    """None for the uniform weight (w = 1), else a vectorised w(x).

    `weight`: "uniform"; "normal" or "normal:<sigma>" (a centred Gaussian density, e.g.
    the distribution of pre-activations); or any callable w(x) on float64 arrays."""
    if weight is None or weight == "uniform":
        return None
    if callable(weight):
        return weight
    if isinstance(weight, str) and weight.split(":")[0] == "normal":
        sigma = float(weight.split(":")[1]) if ":" in weight else 1.0
        return lambda x: np.exp(-0.5 * (np.asarray(x) / sigma) ** 2) / (sigma * math.sqrt(2 * math.pi))
    raise ValueError(f"unknown weight {weight!r}: 'uniform', 'normal', 'normal:<sigma>' or a callable")


def weight_support(weight, lo: float, hi: float) -> tuple[float, float]:
    """The part of [lo, hi] where the weight is not negligible: a normal weight's is
    +-6 sigma (beyond, w is below 1.6e-8 of its peak and holds 2e-9 of its mass; an
    interval there would have too little weight, in float64 prefix sums, to place a
    level by)."""
    if isinstance(weight, str) and weight.split(":")[0] == "normal":
        sigma = float(weight.split(":")[1]) if ":" in weight else 1.0
        return max(lo, -6 * sigma), min(hi, 6 * sigma)
    return lo, hi


class Integrals:
    """Integrals of w, f' w and f'^2 w between any points of [L, R], for one activation
    and weight: prefix sums over a fine grid plus Gauss-Legendre on the partial cell."""

    def __init__(self, name: str, weight="uniform", interval=INTERVAL, cells: int = GRID_CELLS):
        if name not in ACTIVATIONS:
            raise ValueError(f"no derivative table for {name!r}; known: {', '.join(ACTIVATIONS)}")
        self.name, self.w = name, weight_function(weight)
        lo, hi = weight_support(weight, *map(float, interval))
        self.grid = default_grid(name, lo, hi, cells)
        cell = self._cell(self.grid[:-1], self.grid[1:])  # (3, n)
        self.prefix = np.concatenate([np.zeros((3, 1)), np.cumsum(cell, axis=1)], axis=1)
        if self.w is None:  # exact: W = x - L, F = f(x) - f(L)
            self.prefix[0] = self.grid - self.grid[0]
            self.prefix[1] = f(name, self.grid) - f(name, self.grid[0])

    def _cell(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """(integral w, integral f' w, integral f'^2 w) over each [a_i, b_i] (smooth inside)."""
        nodes, weights = _GAUSS
        half = (np.asarray(b) - np.asarray(a)) / 2
        x = (np.asarray(a) + np.asarray(b))[..., None] / 2 + half[..., None] * nodes
        d = derivative(self.name, x)
        w = np.ones_like(x) if self.w is None else self.w(x)
        return np.stack([(w * weights).sum(-1) * half, (d * w * weights).sum(-1) * half,
                         (d * d * w * weights).sum(-1) * half])

    def at(self, x) -> np.ndarray:
        """(W, F, S) from L to each x: shape (3, len(x))."""
        x = np.atleast_1d(np.asarray(x, dtype=np.float64))
        i = np.clip(np.searchsorted(self.grid, x, side="right") - 1, 0, len(self.grid) - 2)
        out = self.prefix[:, i] + self._cell(self.grid[i], x)
        if self.w is None:
            out[0] = x - self.grid[0]
            out[1] = f(self.name, x) - f(self.name, self.grid[0])
        return out

    def segments(self, borders) -> np.ndarray:
        """(W_k, F_k, S_k) of the intervals between L, the borders and R: shape (3, K)."""
        points = np.concatenate([[self.grid[0]], np.asarray(borders, dtype=np.float64), [self.grid[-1]]])
        if self.w is None:  # exact differences, not differences of prefixes
            vals = f(self.name, points)
            s = np.diff(self.at(points)[2])
            return np.stack([np.diff(points), np.diff(vals), s])
        return np.diff(self.at(points), axis=1)


def default_grid(name: str, lo: float, hi: float, cells: int = GRID_CELLS) -> np.ndarray:
    """sinh-spaced points on [lo, hi], plus 0 and the kinks inside."""
    u = np.linspace(np.arcsinh(lo), np.arcsinh(hi), cells + 1)
    extra = [k for k in (0.0, *ACTIVATIONS[name][1]) if lo < k < hi]
    grid = np.unique(np.concatenate([np.sinh(u), extra, [lo, hi]]))
    return grid[(grid >= lo) & (grid <= hi)]


# -- the dynamic programme ------------------------------------------------------------------


def solve_on_grid(integrals: Integrals, grid: np.ndarray, segments: int) -> tuple[np.ndarray, float]:
    """The borders (grid points) of the `segments`-interval q with the least E, and E.

    Global optimum over all choices of borders among the grid's interior points."""
    grid = np.asarray(grid, dtype=np.float64)
    n = len(grid)
    if segments > n - 1:
        raise ValueError(f"{segments} intervals need at least {segments + 1} grid points")
    W, Fs, S = integrals.at(grid)
    dW = W[None, :] - W[:, None]
    dF = Fs[None, :] - Fs[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        cost = (S[None, :] - S[:, None]) - dF * dF / dW  # cost[i, j]: interval (g_i, g_j]
    cost = np.maximum(cost, 0.0)  # >= 0 in exact arithmetic; NaN stays NaN
    cost[~np.triu(np.ones((n, n), dtype=bool), 1) | ~(dW > 0) | np.isnan(cost)] = np.inf
    best = cost[0].copy()  # D_1(j)
    back = np.zeros((segments, n), dtype=np.int64)
    for k in range(1, segments):
        total = best[:, None] + cost
        back[k] = np.argmin(total, axis=0)
        best = total[back[k], np.arange(n)]
    cuts, j = [], n - 1
    for k in range(segments - 1, 0, -1):
        j = back[k][j]
        cuts.append(j)
    return grid[np.array(cuts[::-1], dtype=np.int64)], float(best[n - 1]) + 0.0


def levels_for(integrals: Integrals, borders) -> np.ndarray:
    """The best levels for given borders: the weighted means of f' on the intervals."""
    W, Fs, _ = integrals.segments(borders)
    return Fs / W


def l2_error(integrals: Integrals, borders, levels=None) -> float:
    """E(q) = integral_L^R (f' - q)^2 w for any borders and levels (default: the optimal
    levels), summed directly: Gauss-Legendre on every cell between the grid's points and
    the borders, so no large terms cancel (accurate to about 1e-16 relative)."""
    borders = np.asarray(borders, dtype=np.float64)
    if levels is None:
        levels = levels_for(integrals, borders)
    levels = np.asarray(levels, dtype=np.float64)
    grid = integrals.grid
    points = np.union1d(grid, borders[(borders > grid[0]) & (borders < grid[-1])])
    a, b = points[:-1], points[1:]
    code = np.searchsorted(borders, (a + b) / 2, side="left")  # borders below the cell
    nodes, weights = _GAUSS
    half = (b - a) / 2
    x = ((a + b) / 2)[:, None] + half[:, None] * nodes
    diff = derivative(integrals.name, x) - levels[code][:, None]
    w = 1.0 if integrals.w is None else integrals.w(x)
    return float(((diff * diff * w * weights).sum(-1) * half).sum())


def _optimal_error(integrals: Integrals, borders) -> float:
    return l2_error(integrals, borders)


def border_gradient(integrals: Integrals, borders) -> np.ndarray:
    """dE/dx_k with the levels at their optimum: w(x_k) (l_k - l_{k-1}) (2 f'(x_k) - l_{k-1} - l_k)."""
    b = np.asarray(borders, dtype=np.float64)
    lv = levels_for(integrals, b)
    w = np.ones_like(b) if integrals.w is None else integrals.w(b)
    return w * (lv[1:] - lv[:-1]) * (2 * derivative(integrals.name, b) - lv[:-1] - lv[1:])


def polish(integrals: Integrals, borders: np.ndarray, iterations: int = 30, h: float = 1e-6) -> np.ndarray:
    """Newton's method on the borders from the grid optimum (the Jacobian of
    `border_gradient` by central differences), each step halved until E decreases and
    the borders stay ordered: the continuous optimum of the DP's basin. E never
    increases. Borders on a kink of f' (grid points) stay where they are."""
    b = np.array(borders, dtype=np.float64)
    # a border on a kink stays there: f' jumps (or bends) there, so E has a corner
    free = ~np.isin(b, ACTIVATIONS[integrals.name][1])
    if not free.any():
        return b
    best = _optimal_error(integrals, b)
    eye = np.eye(len(b))[free] * h
    for _ in range(iterations):
        g = border_gradient(integrals, b)[free]
        jac = np.stack([(border_gradient(integrals, b + e) - border_gradient(integrals, b - e))[free] / (2 * h)
                        for e in eye], axis=1)
        step = np.zeros_like(b)
        try:
            step[free] = -np.linalg.solve(jac, g)
        except np.linalg.LinAlgError:
            break
        if not np.all(np.isfinite(step)):
            break
        for _ in range(40):
            trial = b + step
            if np.all(np.diff(trial) > 0) and integrals.grid[0] < trial[0] and trial[-1] < integrals.grid[-1]:
                e = _optimal_error(integrals, trial)
                if e < best:
                    break
            step = step / 2
        else:
            break
        b, best = trial, e
        if np.abs(step).max() < 1e-13:
            break
    return b


CACHE_FILE = Path(__file__).with_name("tables.json")
CACHED_BITS = (1, 2, 3, 4)


@functools.lru_cache(maxsize=1)
def _cached() -> dict:
    """The committed tables for the default weight and interval (`membench
    fewbit-tables` writes them; a test checks them against a fresh solve)."""
    if not CACHE_FILE.exists():
        return {}
    return json.loads(CACHE_FILE.read_text())["tables"]


@functools.lru_cache(maxsize=None)
def _table(name: str, bits: int, weight, interval: tuple[float, float], use_cache: bool = True):
    entry = _cached().get(f"{name}/{bits}") if use_cache and weight == "uniform" and interval == INTERVAL else None
    if entry is not None:
        return tuple(entry["borders"]), tuple(entry["levels"]), entry["error"]
    return solve(name, bits, weight, interval)


def solve(name: str, bits: int, weight="uniform", interval=INTERVAL):
    """(borders, levels, E), computed now: the DP on the grid, then the polish."""
    interval = tuple(map(float, interval))
    integrals = Integrals(name, weight, interval)
    borders, _ = solve_on_grid(integrals, integrals.grid, 2 ** bits)
    if name in STEPWISE:  # f' is constant between the borders (one sits on its step):
        points = np.concatenate([[integrals.grid[0]], borders, [integrals.grid[-1]]])
        levels = derivative(name, (points[:-1] + points[1:]) / 2)  # the means, exactly
    else:
        borders = polish(integrals, borders)
        levels = levels_for(integrals, borders)
    borders, levels = borders + 0.0, levels + 0.0  # no negative zeros
    return tuple(float(v) for v in borders), tuple(float(v) for v in levels), l2_error(integrals, borders, levels)


def table(activation: str, bits: int, weight="uniform", interval=INTERVAL) -> tuple[list[float], list[float]]:
    """(borders, levels) of the optimal `bits`-bit step approximation of f': the
    2^bits - 1 interior borders, ascending, and the 2^bits levels. Code c of x is the
    number of borders below x (x in (x_c, x_{c+1}]); q(x) = levels[c]. Cached per
    (activation, bits, weight, interval)."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be 1..8, got {bits}")
    borders, levels, _ = _table(activation, int(bits), weight, tuple(map(float, interval)))
    return list(borders), list(levels)


def table_error(activation: str, bits: int, weight="uniform", interval=INTERVAL) -> float:
    """E of `table(activation, bits, weight, interval)`."""
    return _table(activation, int(bits), weight, tuple(map(float, interval)))[2]


def write_cache(path: Path = CACHE_FILE) -> dict:
    """Solve every activation at 1..4 bits for the default weight and interval and write
    them as JSON (JSON numbers as Python writes floats: an exact round trip)."""
    out = {}
    for name in ACTIVATIONS:
        for bits in CACHED_BITS:
            borders, levels, error = solve(name, bits)
            out[f"{name}/{bits}"] = dict(borders=list(borders), levels=list(levels), error=error)
    doc = {"about": "Optimal step approximations of activation derivatives (methods/fewbit/tables.py): "
                    "w = 1 on [-100, 100]; regenerate with `membench fewbit-tables`.",
           "interval": list(INTERVAL), "weight": "uniform", "grid_cells": GRID_CELLS, "tables": out}
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return out


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="membench fewbit-tables", description=(
        "Solve the optimal step approximations of the activations' derivatives and write "
        "them as JSON (the tables methods/fewbit reads)."))
    p.add_argument("out", nargs="?", type=Path, default=CACHE_FILE,
                   help="the JSON file to write (default: the cache methods/fewbit ships)")
    write_cache(p.parse_args(argv).out)
    print(f"wrote {len(ACTIVATIONS) * len(CACHED_BITS)} tables")
    return 0
