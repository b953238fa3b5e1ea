"""A simulated step's allocation trace as periodic in the model's depth, so that a deep
model's trace follows from shallow copies of it.

A decoder's training step runs the same code once per block: the block's forward, its
backward, the update of its parameters. Its allocation trace (`MemoryTracker` events, read
as one token per event, `_parse`) then grows with the depth by runs of copies: the trace
one block deeper is the shallow one with one copy of each *unit*
inserted at its *point* (in the run of that unit's copies), k blocks deeper with k copies.
What an inserted free releases is read as its distance back (in events) to the allocation
it ends: in a periodic trace that distance is the same for every copy, or grows by whole
units with the copy and the depth (a backward block freeing its forward's activations, an
update freeing the gradients of every block), so it is affine in the copy c and in k:
`d = alpha + beta c + gamma k` (beta = 0 for the shallow trace's own frees).

`Depth` learns this from the traces at three depths a, a + 1 and a + m (m >= 3; the search
uses 3, 4 and 6 blocks) at one batch: the units where a + 1 differs from a (`_inserts`), their
points (`_candidates`), the rule of each free from all three, and it holds (`ok`) only if the
traces it gives at all three are the ones run, byte for byte. The deepest trace checks what
was not learned from it: its events must be m copies of each unit found between a and a + 1,
at the units' points; and every rule is over-determined (a free of the shallow trace: two
numbers, alpha and gamma, at three depths; an inserted one: three numbers at m + 1 copies,
one at a + 1 and m at a + m, whose spread in c checks beta). `at(depth)` gives the trace at any
depth from a on (keys: allocation numbers, as `trace_line.Line.at`), and `read` the same rule
at another batch from that batch's trace at a + 1 alone. Beyond a + m it is a claim about
code that repeats per block. A model whose blocks differ (alternating attention kinds: the
deepest trace is not copies of one block) or a step with a count that is not per block
(buckets of a fixed number of bytes) gives no rule, and runs at full depth.
Blocks at the ends of a run may differ from the rest (the first block of the backward has
no gradient to add to; an early block frees its input an event later): the units' points
are put between blocks that do not, which needs a >= 3 (two blocks at depth 2 are both
ends).
"""
from __future__ import annotations

import copy


def _parse(trace: list) -> tuple[list[tuple], list[int | None]]:
    """Per event, its token, what two traces must share to be the same run of events:
    ("a", bytes[, category]) for an allocation, ("f", bytes of what it frees), ("l", kind, what,
    bytes of what it labels) for a label in a labelled trace (`MemoryTracker(labelled=True)`:
    a ("label", key, category), or a sharded tracker's ("part", key, part)), ("m", name) for a
    mark, ("u",) for a free or a label of a storage the trace never allocated; and per
    event its distance: for a free or a label, the events between it and the allocation it
    names (else None)."""
    tokens, distances, number, sizes, where = [], [], {}, [], []
    for e, event in enumerate(trace):
        kind, ref = event[0], None
        if kind == "alloc":
            number[event[1]] = len(sizes)
            sizes.append(event[2])
            where.append(e)
            tokens.append(("a", *event[2:]))
        elif kind == "mark":
            tokens.append(("m", event[1]))
        else:
            ref = number.pop(event[1], None) if kind == "free" else number.get(event[1])
            tokens.append(("u",) if ref is None else ("f", sizes[ref]) if kind == "free"
                          else ("l", kind, event[2], sizes[ref]))
        distances.append(None if ref is None else e - where[ref])
    return tokens, distances


class Depth:
    """The trace at any depth from those at depths a, a + 1 and a + m (see the module
    docstring); `ok` is False where they are not one periodic trace."""

    def __init__(self, traces: dict[int, list]):
        self.a = min(traces)
        depths = sorted(traces)
        self.ks = [d - self.a for d in depths]  # copies of each unit per depth: 0, 1, m
        parsed = [_parse(traces[d]) for d in depths]
        tokens = [t for t, _ in parsed]
        self.ok = False
        self.base = tokens[0]
        self.units: list[tuple[int, list]] = []  # (point in the shallow trace, unit's tokens)
        self.rules: dict[tuple, tuple | None] = {}  # a free's distance rule by where it sits
        if len(depths) != 3 or self.ks[1] != 1 or self.ks[2] < 3:
            raise ValueError(f"three depths a, a + 1 and a + 3 or deeper are needed, not {depths}")
        inserts = _inserts(tokens[0], tokens[1])
        if not inserts:
            return
        candidates = _candidates(tokens[0], parsed[0][1], inserts)
        self.units = [c[0] for c in candidates]
        if any([t for _, t in self._layout(k)] != tokens[i] for i, k in enumerate(self.ks) if k):
            return
        distances = [d for _, d in parsed]
        tried = [0] * len(candidates)
        for _ in range(_ATTEMPTS):
            self.units = [c[n] for c, n in zip(candidates, tried)]
            rules, wrong = self._rules(distances)
            if not wrong:
                self.rules = rules
                self.ok = all(self.at(d) == numbered(traces[d]) for d in depths)
                return
            # the next candidate point of each unit a wrong rule sits in or next to
            stuck = True
            for j in wrong:
                if tried[j] + 1 < len(candidates[j]):
                    tried[j] += 1
                    stuck = False
            if stuck:
                return

    def _rules(self, distances: list) -> tuple[dict, set]:
        """Each free's distance rule, keyed by where it sits (("b", i) or ("u", j, offset)),
        and the units whose frees (or the shallow trace's frees nearest their point) fit none."""
        seen: dict[tuple, list] = {}
        for k, ds in zip(self.ks, distances):
            for (where, _), d in zip(self._layout(k), ds):
                seen.setdefault(where[:2] if where[0] == "b" else where[:3], []).append(
                    (where[3] if where[0] == "u" else 0, k, d))
        rules, wrong = {}, set()
        points = [p for p, _ in self.units]
        for where, fits in seen.items():
            rules[where] = rule = _fit(fits)
            if rule is False:
                wrong.add(where[1] if where[0] == "u" else
                          min(range(len(points)), key=lambda j: abs(points[j] - where[1])))
        return rules, wrong

    def _layout(self, k: int) -> list[tuple]:
        """The events at depth a + k: (where, token), where = ("b", i) for the shallow
        trace's event i, ("u", j, offset, copy) for an inserted copy of unit j."""
        out, point = [], 0
        for j, (p, unit) in enumerate(self.units + [(len(self.base), [])]):
            out += [(("b", i), self.base[i]) for i in range(point, p)]
            out += [(("u", j, o, c), t) for c in range(k) for o, t in enumerate(unit)]
            point = p
        return out

    def read(self, trace: list) -> Depth | None:
        """This rule with the sizes of `trace`, a step at depth a + 1 (another batch), or None
        if that step is not this rule's at a + 1 with other sizes: the same events in the same
        places, each free ending the allocation the rule says."""
        layout = self._layout(1)
        tokens = _parse(trace)[0]
        if len(tokens) != len(layout) or any(t[0] != u[0] for (_, u), t in zip(layout, tokens)):
            return None
        other = copy.copy(self)  # the same rules and points, other sizes
        other.base = list(self.base)
        units = [list(unit) for _, unit in self.units]
        for (where, _), token in zip(layout, tokens):
            if where[0] == "b":
                other.base[where[1]] = token
            else:
                units[where[1]][where[2]] = token
        other.units = [(p, unit) for (p, _), unit in zip(self.units, units)]
        return other if other.at(self.a + 1) == numbered(trace) else None

    def at(self, depth: int) -> list | None:
        """The trace at `depth` (at least a; keys: allocation numbers), or None where a free's
        or a label's distance does not land on a live allocation of its size."""
        k = depth - self.a
        if k < 0 or not self.rules:
            return None
        trace, number, alive = [], {}, {}  # event -> allocation number; live number -> bytes
        for e, (token, back) in enumerate(self._distances(k)):
            kind = token[0]
            if kind == "a":
                number[e] = n = len(number)
                alive[n] = token[1]
                trace.append(("alloc", n, *token[1:]))
            elif kind == "m":
                trace.append(("mark", token[1]))
            elif kind != "u":
                n = number.get(e - back)
                if n is None or alive.get(n) != token[-1]:
                    return None
                if kind == "f":
                    del alive[n]
                    trace.append(("free", n))
                else:
                    trace.append((token[1], n, token[2]))
        return trace

    def _distances(self, k: int) -> list[tuple]:
        """The events at depth a + k as `_layout` has them, each as (token, its distance by
        its rule: alpha + beta c + gamma k; None for an allocation, a mark or an unknown free)."""
        rules, out, point = self.rules, [], 0
        for j, (p, unit) in enumerate(self.units + [(len(self.base), [])]):
            for i in range(point, p):
                rule = rules.get(("b", i))
                out.append((self.base[i], None if rule is None else rule[0] + rule[2] * k))
            unit_rules = [rules.get(("u", j, o)) for o in range(len(unit))]
            for c in range(k):
                out += [(token, None if rule is None else rule[0] + rule[1] * c + rule[2] * k)
                        for token, rule in zip(unit, unit_rules)]
            point = p
        return out


def _fit(points: list) -> tuple | None | bool:
    """(alpha, beta, gamma) of a free's distance d = alpha + beta c + gamma k over its
    points (copy c, k, d): solved from the first points that fix it, and holding at every
    other; None for an allocation or an unknown free; False if there is no such rule."""
    if all(d is None for *_, d in points):
        return None
    if any(d is None for *_, d in points):
        return False
    (c0, k0, d0), rest = points[0], points[1:]
    later = next(((c, k, d) for c, k, d in rest if k != k0 and c == c0), None)
    if later is None:
        return False
    gamma = (later[2] - d0) // (later[1] - k0)
    other = next(((c, k, d) for c, k, d in rest if c != c0), None)
    beta = 0 if other is None else (other[2] - d0 - gamma * (other[1] - k0)) // (other[0] - c0)
    alpha = d0 - beta * c0 - gamma * k0
    return (alpha, beta, gamma) if all(d == alpha + beta * c + gamma * k for c, k, d in points) else False


def numbered(trace: list) -> list:
    """A trace with its keys replaced by allocation numbers, as `Depth.at` writes it (a free or
    a label of a storage it never allocated left out: the allocator model ignores them)."""
    out, number, count = [], {}, 0
    for event in trace:
        if event[0] == "alloc":
            number[event[1]], count = count, count + 1
            out.append(("alloc", number[event[1]], *event[2:]))
        elif event[0] == "mark":
            out.append(event)
        else:
            n = number.pop(event[1], None) if event[0] == "free" else number.get(event[1])
            if n is not None:
                out.append((event[0], n, *event[2:]))
    return out


_LOOKAHEAD = 64  # tokens two traces must go on alike after a unit to prefer it
_ATTEMPTS = 40  # sets of points tried before a trace is taken as not periodic
_CANDIDATES = 8  # points tried per unit


def _inserts(base: list, deeper: list) -> list:
    """The units (point in `base`, tokens) that make `deeper` from `base`, one copy each,
    or [] if it is not so made. Read left to right: where the two first differ, a unit is a
    run of `deeper` that repeats next to itself (a copy in a run of copies) and whose
    removal lets the two go on alike; of those, the one they go on alike the longest after
    (the shortest of equals: a run of single tokens repeats next to itself too)."""
    out, i, j = [], 0, 0
    extra = len(deeper) - len(base)
    while j < len(deeper):
        if i < len(base) and base[i] == deeper[j]:
            i, j = i + 1, j + 1
            continue
        best, after = 0, -1
        for n in range(1, min(extra, len(deeper) - j) + 1):
            unit = deeper[j:j + n]
            if deeper[j + n:j + 2 * n] != unit and deeper[max(0, j - n):j] != unit:
                continue
            same = 0
            while (same < _LOOKAHEAD and i + same < len(base) and j + n + same < len(deeper)
                   and base[i + same] == deeper[j + n + same]):
                same += 1
            if same > after or j + n + same == len(deeper) and after < _LOOKAHEAD:
                best, after = n, same
                if after == _LOOKAHEAD:
                    break
        if not best:
            return []
        out.append((i, deeper[j:j + best]))
        j += best
        extra -= best
    return out if i == len(base) and extra == 0 else []


def _candidates(base: list, distances: list, inserts: list) -> list[list]:
    """Per unit (`_inserts`: (point, tokens)), the points to insert its copies at, best
    first, each with the unit rotated to match: positions in the run of copies the shallow
    trace has there. `_inserts` finds it anywhere in its run and in any rotation; but the first
    and the last blocks of a run often differ from the others in what they free (the
    backward's first block has no gradient to add to; an early block frees what the block
    before it made a step later), and a copy that does not start where a block starts ends
    what the block before it made. So the best points are those the fewest short-lived
    allocations (made and freed within one unit's length) live across, nearest the run's
    middle; `Depth` tries the others where the distances fit no rule."""
    out = []
    for j, (p, unit) in enumerate(inserts):
        n = len(unit)
        start = inserts[j - 1][0] if j else 0
        end = inserts[j + 1][0] if j + 1 < len(inserts) else len(base)
        left = 0
        while p - left > start and base[p - left - 1] == unit[(-left - 1) % n]:
            left += 1
        right = 0
        while p + right < end and base[p + right] == unit[right % n]:
            right += 1
        middle = p - left + n * ((left + right) // n // 2)
        run = range(p - left, p + right + 1)
        links = [(e - distances[e], e) for e in range(max(0, run[0] - n), min(len(base), run[-1] + n))
                 if distances[e] is not None and distances[e] < n]
        across = _across(links, run[0], run[-1] + 1)  # per point of the run: links with i < q <= e
        best = sorted(run, key=lambda q: (across[q - run[0]], abs(q - middle)))
        out.append([(q, [unit[(q - p + i) % n] for i in range(n)]) for q in best[:_CANDIDATES]])
    return out


def _across(links: list, lo: int, hi: int) -> list[int]:
    """For each q in [lo, hi): how many links (i, e) have i < q <= e, by a running count
    (a link adds one from i + 1 and stops after e)."""
    steps = [0] * (hi - lo + 1)
    for i, e in links:
        a, b = max(i + 1, lo), min(e, hi - 1)
        if a <= b:
            steps[a - lo] += 1
            steps[b + 1 - lo] -= 1
    out, count = [], 0
    for q in range(hi - lo):
        count += steps[q]
        out.append(count)
    return out
