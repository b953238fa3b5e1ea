"""Operator orders and memory layouts for a `methods.roam.graph.StepGraph`, each measured with
`methods.roam.graph.simulate`.

Orders (each a topological order of the graph):

- `default_order`: PyTorch's eager order, as captured (the baseline).
- `update_early_order`: the eager order, but every op of the optimizer update of a
  parameter runs as soon as it can (right after the parameter's gradient is produced and
  its last reader ran), so gradients die during backward instead of at its end (ROAM's
  `constrain_weight_updates_early`).
- `greedy_order`: a list scheduler that respects dependencies, keeps the update ops
  early, and otherwise runs the ready op that frees most memory (net bytes), ties and
  ops that free nothing in eager order (rule `free`); rule `peak` first prefers the op
  that raises the peak so far least (it can pull backward-only work into the forward
  pass, so both are measured).
- `exact_order`: CP-SAT (OR-Tools) minimises the peak over all orders of a small graph:
  one allocating op per time step, boolean "done by step t" per op, a tensor is alive at
  t when its producer is done and some user is not (MODeL/ROAM's time-indexed
  formulation, ordering part). Free ops (views, in-place updates: they allocate nothing)
  run as soon as they are ready, which never raises the peak, so they get no time steps.
- `refine_order`: the decomposition for large graphs. Memory outside a window of
  consecutive steps does not depend on the order inside it, so each window is a
  subtask: the window around the current peak is re-solved exactly (CP-SAT, hinted with
  the current order) and stitched back; repeat at the new peak until no window there
  improves or the solver's budget is spent. (ROAM decomposes into nested
  forward/backward segment pairs and solves them in parallel; this uses windows of the
  order instead.)

`plan` runs the heuristics, keeps the best, and refines it (exactly when small).

Layouts (byte offset per created storage; resident inputs sit below, from 0):

- `first_fit_layout`: an allocator-like first fit, in order of allocation.
- `best_fit_layout`: offline, largest (then longest-lived) storage first, each into the
  tightest gap among the storages alive with it (greedy by size, best fit); variants
  (lowest gap; longest-lived first; allocation order) are tried too and the best kept.
- `exact_layout`: CP-SAT's 2-D no-overlap (time x address) minimising the peak address,
  for small graphs, hinted with the best fit.

The solver's budget (`time_limit`) is in CP-SAT's deterministic time (its count of work,
roughly in seconds), and its workers search in a fixed interleaving: a plan is the same on
any machine, under any load, every time it is made (a limit in seconds of wall clock made
it depend on both: four plans of llama-tiny's step at a 0.3 s limit were three orders).

A layout's peak address is at least the order's peak live bytes; the difference is
fragmentation.
"""
from __future__ import annotations

import bisect
import heapq
import math
import time
from dataclasses import dataclass, field

from methods.roam.graph import StepGraph, check_layout, lifetimes, simulate

PLANNERS = ("default", "update_early", "greedy", "exact", "roam")


# -- orders ------------------------------------------------------------------------------

def default_order(graph: StepGraph) -> list:
    return list(range(len(graph)))


def update_ops(graph: StepGraph) -> set:
    """Ops of the optimizer update: those that write a resident parameter or optimizer
    state in place, and the ops after the loss (descendants of the op making what the
    step returns) whose every successor is one of them (the gradient's producer, the
    update's temporaries). Ops that only read forward values stay out: run early, their
    outputs would live through the rest of the forward pass."""
    after_loss = _descendants(graph, {graph.storages[s].producer for s in range(graph.n_storages)
                                      if graph.storages[s].keep and graph.storages[s].producer is not None})
    out: set = set()
    for i in reversed(range(len(graph))):
        op = graph.ops[i]
        if any(graph.storages[s].producer is None and graph.storages[s].kind in ("param", "optimizer")
               for s in op.writes):
            out.add(i)
        elif (graph.succs[i] and all(j in out for j in graph.succs[i])
              and (after_loss is None or i in after_loss)):
            out.add(i)
    return out


def _descendants(graph: StepGraph, roots: set) -> set | None:
    if not roots:
        return None
    seen, stack = set(), list(roots)
    while stack:
        i = stack.pop()
        if i not in seen:
            seen.add(i)
            stack.extend(graph.succs[i])
    return seen


def update_early_order(graph: StepGraph) -> list:
    """The eager order with the update ops run as soon as they are ready."""
    early = update_ops(graph)
    n = len(graph)
    indeg = [len(p) for p in graph.preds]
    heap = [(i not in early, i) for i in range(n) if indeg[i] == 0]
    heapq.heapify(heap)
    order = []
    while heap:
        _, i = heapq.heappop(heap)
        order.append(i)
        for j in graph.succs[i]:
            indeg[j] -= 1
            if indeg[j] == 0:
                heapq.heappush(heap, (j not in early, j))
    return order


def greedy_order(graph: StepGraph, update_early: bool = True, rule: str = "free") -> list:
    """Memory-aware list scheduling; see the module docstring. Among the ready ops (after
    the update ops, with `update_early`): rule `free` runs the one that frees most (net
    bytes), ties and ops that free nothing in eager order; rule `peak` first the one
    that raises the peak so far least.

    Each step picks the least key among the ready ops, as a scan of them would, from
    heaps: an op's net bytes change only when a temporary it touches gets down to (or
    past) its last user, so they are kept up to date per storage, not recomputed per
    step. Under `peak`, the ops whose allocation keeps within the peak so far (all
    tied on it) are found by their allocation's rank (`_PrefixMin`)."""
    if rule not in ("free", "peak"):
        raise ValueError(f"unknown greedy rule {rule!r}")
    n = len(graph)
    storages = graph.storages
    remaining = [len(u) for u in graph.uses]
    early = update_ops(graph) if update_early else set()
    size = [s.nbytes for s in storages]
    temp = [s.producer is not None and not s.keep for s in storages]
    touched = [tuple({*op.reads, *op.writes}) for op in graph.ops]
    transient = [sum(size[s] for s in op.creates if not graph.uses[s] and temp[s]) for op in graph.ops]
    alloc = graph.alloc
    touchers: list[list[int]] = [[] for _ in storages]
    for i, t in enumerate(touched):
        for s in t:
            if temp[s]:
                touchers[s].append(i)
    freed = [sum(size[s] for s in touched[i] if temp[s] and remaining[s] == 1) for i in range(n)]
    cls = [int(i not in early) for i in range(n)]
    done = [False] * n
    is_ready = [False] * n

    def gain(i):  # what the op's net bytes say in the key: only a release counts
        return min(alloc[i] - transient[i] - freed[i], 0)

    # rule free: one heap of (class, gain, op); rule peak: per class, a heap of (alloc,
    # gain, op) and the least (gain, op) by allocation rank
    heap: list = []
    by_alloc: list[list] = [[], []]
    rank = {i: r for r, i in enumerate(sorted(range(n), key=lambda i: (alloc[i], i)))}
    sorted_alloc = sorted(alloc)
    within = [_PrefixMin(n), _PrefixMin(n)]
    count = [0, 0]

    def offer(i):  # the op's current key, into the structures (older entries go stale)
        g = gain(i)
        if rule == "free":
            heapq.heappush(heap, (cls[i], g, i))
        else:
            heapq.heappush(by_alloc[cls[i]], (alloc[i], g, i))
            within[cls[i]].set(rank[i], (g, i))

    def current(entry, i):
        return is_ready[i] and entry[-2] == gain(i)

    cur = peak = graph.resident_bytes
    indeg = [len(p) for p in graph.preds]
    for i in range(n):
        if indeg[i] == 0:
            is_ready[i] = True
            count[cls[i]] += 1
            offer(i)
    order = []
    while count[0] + count[1]:
        if rule == "free":
            while not current(heap[0], heap[0][-1]):
                heapq.heappop(heap)
            best = heapq.heappop(heap)[-1]
        else:
            c = 0 if count[0] else 1
            fit = bisect.bisect_right(sorted_alloc, peak - cur)  # ops whose alloc keeps within the peak
            least = within[c].least(fit)
            if least is not None:
                best = least[1]
            else:
                q = by_alloc[c]
                while not current(q[0], q[0][-1]):
                    heapq.heappop(q)
                best = q[0][-1]
            within[c].set(rank[best], None)
        is_ready[best] = False
        done[best] = True
        count[cls[best]] -= 1
        order.append(best)
        peak = max(peak, cur + alloc[best])
        cur += alloc[best] - transient[best] - freed[best]
        for s in touched[best]:
            remaining[s] -= 1
            if temp[s] and remaining[s] in (0, 1):  # crossed 1: its touchers' freed bytes change
                delta = size[s] if remaining[s] == 1 else -size[s]
                for j in touchers[s]:
                    if not done[j]:
                        freed[j] += delta
                        if is_ready[j]:
                            offer(j)
        for j in graph.succs[best]:
            indeg[j] -= 1
            if indeg[j] == 0:
                is_ready[j] = True
                count[cls[j]] += 1
                offer(j)
    return order


class _PrefixMin:
    """A segment tree over n slots: set a slot's value (None: empty), and the least value
    among the first k slots."""

    def __init__(self, n: int):
        self.size = 1 << max(0, (n - 1).bit_length())
        self.tree: list = [None] * (2 * self.size)

    def set(self, slot: int, value) -> None:
        i = slot + self.size
        self.tree[i] = value
        i //= 2
        while i:
            a, b = self.tree[2 * i], self.tree[2 * i + 1]
            self.tree[i] = a if b is None or (a is not None and a < b) else b
            i //= 2

    def least(self, k: int):
        """The least value among slots [0, k)."""
        best, lo, hi = None, self.size, k + self.size
        while lo < hi:
            if lo & 1:
                v = self.tree[lo]
                if v is not None and (best is None or v < best):
                    best = v
                lo += 1
            if hi & 1:
                hi -= 1
                v = self.tree[hi]
                if v is not None and (best is None or v < best):
                    best = v
            lo //= 2
            hi //= 2
        return best


# -- exact (CP-SAT) ------------------------------------------------------------------------

@dataclass
class WindowResult:
    order: list  # the whole order with the window re-solved
    window_peak: int  # solver's peak over the window
    status: str  # OPTIMAL / FEASIBLE / ...
    seconds: float
    work: float  # the solver's deterministic time


def _solver(budget: float, workers: int):
    """A CP-SAT solver that stops after `budget` of deterministic time, its `workers`
    searching in a fixed interleaving (the same answer on any machine and under any load)."""
    from ortools.sat.python import cp_model

    solver = cp_model.CpSolver()
    solver.parameters.max_deterministic_time = max(0.01, budget)
    solver.parameters.num_workers = workers
    solver.parameters.interleave_search = True
    return solver


def solve_window(graph: StepGraph, order: list, a: int, b: int, budget: float,
                 workers: int = 2) -> WindowResult | None:
    """Re-order `order[a:b]` to minimise the peak live bytes inside the window, exactly
    (within `budget` of the solver's deterministic time). The rest of the order is
    unchanged. None when the window holds fewer than two allocating ops; a result with
    `order` None when no solution was found within the budget."""
    from ortools.sat.python import cp_model

    started = time.perf_counter()
    window = order[a:b]
    local = {o: i for i, o in enumerate(window)}
    alloc_ops = [o for o in window if not graph.is_free(o)]
    m = len(alloc_ops)
    if m < 2:
        return None
    is_alloc = [not graph.is_free(o) for o in window]
    # ancestors/descendants inside the window, as bit masks of window positions
    anc = [0] * len(window)
    for i, o in enumerate(window):
        mask = 0
        for p in graph.preds[o]:
            j = local.get(p)
            if j is not None:
                mask |= anc[j] | (1 << j)
        anc[i] = mask
    desc = [0] * len(window)
    for i in reversed(range(len(window))):
        mask = 0
        for q in graph.succs[window[i]]:
            j = local.get(q)
            if j is not None:
                mask |= desc[j] | (1 << j)
        desc[i] = mask
    alloc_mask = sum(1 << i for i in range(len(window)) if is_alloc[i])
    asap, alap = {}, {}
    for i, o in enumerate(window):
        if is_alloc[i]:
            asap[o] = (anc[i] & alloc_mask).bit_count()
            alap[o] = m - 1 - (desc[i] & alloc_mask).bit_count()
    for i, o in enumerate(window):  # a free op is done once its last predecessor is
        if not is_alloc[i]:
            ps = [p for p in graph.preds[o] if p in local]
            asap[o] = max([asap[p] for p in ps], default=-1)
            alap[o] = max([alap[p] for p in ps], default=-1)

    model = cp_model.CpModel()
    done: dict = {}
    hint: dict = {}  # the current order, as a complete solution (CP-SAT starts from it)
    t_of = {o: t for t, o in enumerate(alloc_ops)}

    def hv(x):
        return x if isinstance(x, int) else hint[x]

    def d(o, t):
        """Is op o done by the end of step t (constant 1 before the window, 0 after)."""
        if o not in local:
            return 1 if _before(o) else 0
        if t < asap[o]:
            return 0
        if t >= alap[o]:
            return 1
        return done[o][t]

    pos_of = {o: t for t, o in enumerate(order)}

    def _before(o):
        return pos_of[o] < a

    for o in alloc_ops:
        done[o] = {t: model.NewBoolVar(f"d{o}_{t}") for t in range(asap[o], alap[o])}
        for t, v in done[o].items():
            hint[v] = int(t_of[o] <= t)
        for t in range(asap[o] + 1, alap[o]):
            model.AddImplication(done[o][t - 1], done[o][t])
    for t in range(m):
        model.Add(sum(d(o, t) for o in alloc_ops) == t + 1)
    # precedence between allocating ops (through chains of free ops)
    frontier: dict = {}
    for i, o in enumerate(window):
        f = set()
        for p in graph.preds[o]:
            if p in local:
                f |= {p} if not graph.is_free(p) else frontier[p]
        frontier[o] = f
    for o in alloc_ops:
        for p in frontier[o]:
            for t in range(asap[o], alap[o]):
                prev = d(p, t - 1) if t > 0 else 0
                if isinstance(prev, int):  # p is done for sure (0 cannot happen: asap)
                    if prev == 0:
                        model.Add(done[o][t] == 0)
                else:
                    model.AddImplication(done[o][t], prev)
    for o in window:  # free ops: done at most when every predecessor is
        if graph.is_free(o):
            done[o] = {}
            for t in range(max(asap[o], 0), alap[o]):
                v = model.NewBoolVar(f"f{o}_{t}")
                hint[v] = min([hv(d(p, t)) for p in graph.preds[o] if p in local], default=1)
                for p in graph.preds[o]:
                    if p in local:
                        pv = d(p, t)
                        if isinstance(pv, int):
                            if pv == 0:
                                model.Add(v == 0)
                        else:
                            model.AddImplication(v, pv)
                done[o][t] = v

    # memory per step
    touched = set()
    for o in window:
        op = graph.ops[o]
        touched.update(op.creates, op.reads, op.writes)
    start, end = lifetimes(graph, order)
    background = graph.resident_bytes
    for s, st in enumerate(graph.storages):
        if st.producer is not None and s not in touched and start[s] < a and end[s] >= b:
            background += st.nbytes
    sizes = [graph.storages[s].nbytes for s in touched if graph.storages[s].nbytes]
    unit = math.gcd(*sizes) if sizes else 1
    terms: list[list] = [[] for _ in range(m)]
    const = [0] * m
    for s in touched:
        st = graph.storages[s]
        if st.producer is None or not st.nbytes:
            continue
        size = st.nbytes // unit
        P = st.producer
        uses = graph.uses[s]
        later = st.keep or any(u not in local and not _before(u) for u in uses)
        inside = [u for u in uses if u in local]
        for t in range(m):
            produced = d(P, t)
            if isinstance(produced, int) and produced == 0:
                continue
            if later:
                if isinstance(produced, int):
                    const[t] += size
                else:
                    terms[t].append((size, produced))
                continue
            if not inside:  # never used: alive only at its producer's step
                if P not in local:
                    continue
                prev = d(P, t - 1) if t > 0 else 0
                if isinstance(produced, int) and isinstance(prev, int):
                    const[t] += size * (produced - prev)
                    continue
                v = model.NewBoolVar(f"l{s}_{t}")
                hint[v] = max(0, hv(produced) - hv(prev))
                model.Add(v >= produced - prev)
                terms[t].append((size, v))
                continue
            prevs = [d(u, t - 1) if t > 0 else 0 for u in inside]
            if any(isinstance(x, int) and x == 0 for x in prevs):
                if isinstance(produced, int):
                    const[t] += size
                else:
                    terms[t].append((size, produced))
                continue
            prevs = [x for x in prevs if not isinstance(x, int)]
            if not prevs:
                continue  # every user is done before t
            v = model.NewBoolVar(f"l{s}_{t}")
            hint[v] = max([0] + [hv(produced) - hv(x) for x in prevs])
            for x in prevs:
                model.Add(v >= produced - x)
            terms[t].append((size, v))
    peak = model.NewIntVar(0, sum(sizes) // unit + 1, "peak")
    for t in range(m):
        if terms[t] or const[t]:
            model.Add(peak >= const[t] + sum(c * v for c, v in terms[t]))
    model.Minimize(peak)
    hint[peak] = max([0] + [const[t] + sum(c * hv(v) for c, v in terms[t]) for t in range(m)])
    for v, value in hint.items():
        model.AddHint(v, value)
    solver = _solver(budget, workers)
    status = solver.Solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return WindowResult(None, 0, solver.StatusName(status), time.perf_counter() - started,
                            solver.deterministic_time)
    when = {o: next((t for t in range(m) if _value(solver, d(o, t))), m) for o in alloc_ops}
    alloc_seq = sorted(alloc_ops, key=lambda o: (when[o], local[o]))
    new_window = _expand(graph, window, alloc_seq)
    new_order = order[:a] + new_window + order[b:]
    window_peak = int(solver.ObjectiveValue()) * unit + background
    return WindowResult(new_order, window_peak, solver.StatusName(status),
                        time.perf_counter() - started, solver.deterministic_time)


def _value(solver, x) -> int:
    return x if isinstance(x, int) else solver.Value(x)


def _expand(graph: StepGraph, window: list, alloc_seq: list) -> list:
    """The window's ops with the allocating ones in `alloc_seq` order and each free op
    right after its last predecessor (in eager order among free ops)."""
    local = set(window)
    emitted: set = set()
    free = [o for o in window if graph.is_free(o)]
    out: list = []

    def flush():
        changed = True
        while changed:
            changed = False
            for f in free:
                if f not in emitted and all(p in emitted or p not in local for p in graph.preds[f]):
                    emitted.add(f)
                    out.append(f)
                    changed = True

    flush()
    for o in alloc_seq:
        emitted.add(o)
        out.append(o)
        flush()
    return out


def exact_order(graph: StepGraph, time_limit: float = 10.0, initial: list | None = None,
                workers: int = 2) -> tuple[list, str]:
    """The whole graph as one CP-SAT problem (`time_limit`: the solver's deterministic
    time); returns (order, solver status)."""
    order = list(initial) if initial is not None else greedy_order(graph)
    res = solve_window(graph, order, 0, len(order), time_limit, workers)
    if res is None or res.order is None:
        return order, "UNKNOWN"
    if simulate(graph, res.order).peak > simulate(graph, order).peak:
        return order, res.status  # a solution cut short by the budget, worse than the hint
    return res.order, res.status


def refine_order(graph: StepGraph, order: list, time_limit: float = 5.0, window: int = 20,
                 workers: int = 2) -> tuple[list, dict]:
    """Re-solve windows of `window` allocating ops around the current peak exactly, each
    with the budget that is left; when no window at the peak improves, double the window
    (up to the whole graph). Stops when the whole graph is solved or the solver has spent
    `time_limit` of deterministic time. Returns (order, stats)."""
    started, spent = time.perf_counter(), 0.0
    order = list(order)
    prof = simulate(graph, order)
    n_alloc = sum(not graph.is_free(i) for i in range(len(graph)))
    stats = {"windows": 0, "improved": 0, "optimal_windows": 0, "largest_window": 0}
    tried: set = set()
    while spent < time_limit:
        peak_steps = [t for t, x in enumerate(prof.live) if x == prof.peak]
        candidates = []
        for t in peak_steps[:3]:
            for frac in (0.5, 0.25, 0.75, 0.0, 1.0):
                a, b = _window_around(graph, order, t, window, frac)
                if (a, b, prof.peak) not in tried and (a, b) not in candidates:
                    candidates.append((a, b))
        improved = False
        for a, b in candidates:
            left = time_limit - spent
            if left <= 0.05:
                break
            tried.add((a, b, prof.peak))
            before = max(prof.live[a:b])
            res = solve_window(graph, order, a, b, left, workers)
            stats["windows"] += 1
            stats["largest_window"] = max(stats["largest_window"], min(window, n_alloc))
            if res is None:
                continue
            spent += res.work
            if res.order is None:
                continue
            stats["optimal_windows"] += res.status == "OPTIMAL"
            new = simulate(graph, res.order)
            if max(new.live[a:b]) < before and new.peak <= prof.peak:
                order, prof = res.order, new
                stats["improved"] += 1
                improved = True
                break
        if not improved:
            if window >= n_alloc:
                break
            window = min(2 * window, n_alloc)
    stats["seconds"] = time.perf_counter() - started
    stats["work"] = round(spent, 3)
    return order, stats


def _window_around(graph: StepGraph, order: list, t: int, window: int, frac: float):
    """Positions [a, b) holding about `window` allocating ops, with step t at `frac` of it."""
    n = len(order)
    before = int(window * frac)
    a = t
    count = 0
    while a > 0 and count < before:
        a -= 1
        count += not graph.is_free(order[a])
    b, count = t, 0
    while b < n and count < window - before:
        count += not graph.is_free(order[b])
        b += 1
    while b < n and graph.is_free(order[b]):
        b += 1
    return a, b


# -- the planner ---------------------------------------------------------------------------

@dataclass
class Plan:
    order: list
    planner: str
    peak: int  # predicted peak live bytes of `order`
    default_peak: int
    candidates: dict = field(default_factory=dict)  # heuristic -> predicted peak
    seconds: float = 0.0
    status: str = ""  # the exact solver's status, when it ran
    stats: dict = field(default_factory=dict)


def plan(graph: StepGraph, planner: str = "roam", time_limit: float = 5.0,
         exact_max_ops: int = 60, window: int = 20, workers: int = 2) -> Plan:
    """Plan an order with `planner` (one of PLANNERS); see the module docstring.
    `roam`: the best heuristic, then the exact solver on the whole graph when it has at
    most `exact_max_ops` allocating ops, else refined window by window; `time_limit`
    bounds the solver's deterministic time (module docstring)."""
    if planner not in PLANNERS:
        raise ValueError(f"unknown planner {planner!r}; known: {', '.join(PLANNERS)}")
    started = time.perf_counter()
    default = default_order(graph)
    default_peak = simulate(graph, default).peak
    if planner == "default":
        return Plan(default, planner, default_peak, default_peak, {"default": default_peak},
                    time.perf_counter() - started)
    orders = {"default": default, "update_early": update_early_order(graph)}
    if planner != "update_early":
        orders["greedy"] = greedy_order(graph)
        orders["greedy_peak"] = greedy_order(graph, rule="peak")
    candidates = {k: simulate(graph, o).peak for k, o in orders.items()}
    if planner in ("update_early", "greedy"):
        return Plan(orders[planner], planner, candidates[planner], default_peak, candidates,
                    time.perf_counter() - started)
    best = min(candidates, key=lambda k: (candidates[k], k != "greedy"))
    order, status, stats = orders[best], "", {"start": best}
    n_alloc = sum(not graph.is_free(i) for i in range(len(graph)))
    if planner == "exact" or n_alloc <= exact_max_ops:
        order, status = exact_order(graph, time_limit, order, workers)
        stats["mode"] = "exact"
    else:
        order, more = refine_order(graph, order, time_limit, window, workers)
        stats.update(more, mode="windows")
    peak = simulate(graph, order).peak
    return Plan(order, planner, peak, default_peak, candidates, time.perf_counter() - started,
                status, stats)


# -- layouts --------------------------------------------------------------------------------

@dataclass
class Layout:
    offsets: dict  # created storage -> byte offset (resident inputs lie below `base`)
    base: int  # bytes of resident inputs, at [0, base)
    peak_address: int
    peak_live: int
    method: str

    @property
    def fragmentation(self) -> float:
        """Peak address over peak live bytes, minus one."""
        return self.peak_address / self.peak_live - 1 if self.peak_live else 0.0


def _intervals(graph: StepGraph, order):
    start, end = lifetimes(graph, order)
    return [(s, start[s], end[s], graph.storages[s].nbytes) for s in start
            if graph.storages[s].nbytes]


def first_fit_layout(graph: StepGraph, order) -> Layout:
    """Allocator-like: at each step, allocate the op's outputs at the lowest free offset
    that fits, then free what died at that step."""
    items = _intervals(graph, order)
    by_start: dict = {}
    for s, a, b, size in items:
        by_start.setdefault(a, []).append((s, b, size))
    base = graph.resident_bytes
    active: list = []  # sorted (offset, end_offset, storage, end_step)
    offsets, top = {}, 0
    for t in range(len(order)):
        for s, b, size in by_start.get(t, ()):
            off = 0
            for lo, hi, _, _ in active:
                if lo - off >= size:
                    break
                off = max(off, hi)
            offsets[s] = off
            active.append((off, off + size, s, b))
            active.sort()
            top = max(top, off + size)
        active = [x for x in active if x[3] > t]
    return Layout(offsets, base, base + top, simulate(graph, order).peak, "first_fit")


def best_fit_layout(graph: StepGraph, order) -> Layout:
    """Offline greedy by size: each storage into the tightest gap left by the storages
    already placed that are alive at the same time (largest first; ties: longest-lived
    first). Also tries the lowest fitting gap, longest-lived first, and allocation order
    (tightest gap; lowest gap, which is the first fit); keeps the best."""
    items = _intervals(graph, order)
    by_size = sorted(items, key=lambda x: (-x[3], -(x[2] - x[1]), x[1]))
    by_life = sorted(items, key=lambda x: (-(x[2] - x[1]), -x[3], x[1]))
    by_start = sorted(items, key=lambda x: x[1])
    best = None
    for sequence, tightest in ((by_size, True), (by_size, False), (by_life, True),
                               (by_start, True), (by_start, False)):
        offsets, top = _place(sequence, tightest)
        if best is None or top < best[1]:
            best = (offsets, top)
    base = graph.resident_bytes
    return Layout(best[0], base, base + best[1], simulate(graph, order).peak, "best_fit")


def _place(items, tightest: bool):
    import numpy as np

    k = len(items)
    ps, pe, po, pz = (np.zeros(k, dtype=np.int64) for _ in range(4))
    offsets, top = {}, 0
    for n, (s, a, b, size) in enumerate(items):
        mask = (ps[:n] <= b) & (pe[:n] >= a)
        lo, hi = po[:n][mask], po[:n][mask] + pz[:n][mask]
        idx = np.argsort(lo, kind="stable")
        best, best_gap, cursor = None, None, 0
        for l, h in zip(lo[idx].tolist(), hi[idx].tolist()):
            gap = l - cursor
            if gap >= size and (best_gap is None or gap < best_gap):
                best, best_gap = cursor, gap
                if not tightest:
                    break
            cursor = max(cursor, h)
        off = best if best is not None else cursor
        offsets[s] = off
        ps[n], pe[n], po[n], pz[n] = a, b, off, size
        top = max(top, off + size)
    return offsets, top


def exact_layout(graph: StepGraph, order, time_limit: float = 5.0, workers: int = 2,
                 hint: Layout | None = None) -> tuple[Layout, str]:
    """CP-SAT: offsets minimising the peak address, no two storages alive together
    overlapping (2-D no-overlap of lifetime x address boxes)."""
    from ortools.sat.python import cp_model

    items = _intervals(graph, order)
    hint = hint or best_fit_layout(graph, order)
    ub = hint.peak_address - hint.base
    model = cp_model.CpModel()
    xs, ys, offs = [], [], {}
    peak = model.NewIntVar(0, ub, "top")
    for s, a, b, size in items:
        x = model.NewFixedSizeIntervalVar(a, b - a + 1, f"x{s}")
        off = model.NewIntVar(0, ub - size, f"o{s}")
        y = model.NewFixedSizeIntervalVar(off, size, f"y{s}")
        model.Add(peak >= off + size)
        model.AddHint(off, hint.offsets[s])
        xs.append(x)
        ys.append(y)
        offs[s] = off
    model.AddNoOverlap2D(xs, ys)
    model.Minimize(peak)
    solver = _solver(time_limit, workers)
    status = solver.Solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return hint, solver.StatusName(status)
    offsets = {s: solver.Value(v) for s, v in offs.items()}
    top = max((offsets[s] + size for s, _, _, size in items), default=0)
    layout = Layout(offsets, hint.base, hint.base + top, hint.peak_live, "exact")
    if layout.peak_address > hint.peak_address:
        return hint, solver.StatusName(status)
    return layout, solver.StatusName(status)


def verify_layout(graph: StepGraph, order, layout: Layout) -> None:
    """Raise if the layout overlaps two storages alive together or undercuts the peak."""
    check_layout(graph, order, layout.offsets)
    if layout.peak_address < layout.peak_live:
        raise AssertionError("peak address below the peak live bytes")
