"""A training step as a graph of operators and tensors, and a memory simulator for it.

Capture (`capture_adamw_step`): one whole training step of a model (forward, the
`bench.method.lm_loss` cross-entropy, backward via `torch.autograd.grad`, and the AdamW
update written as in-place ATen ops) is traced with `make_fx` into an fx graph of ATen
ops. Tracing runs the step for real (on real or fake tensors), in PyTorch's own eager
order: that order is the graph's default order, and tracing *is* the first training
step. A pass over the graph on fresh fake tensors then finds, for every node, which
storages its outputs live in (views and in-place results share their input's storage)
and their sizes, and builds a `StepGraph`:

- a `Storage` is what memory is counted in (as `bench.measure.tracker.MemoryTracker` does):
  bytes, the op that creates it (``None`` for graph inputs: parameters, optimizer state,
  the batch, buffers, constants, which are *resident*, live throughout), a kind
  (``param``, ``optimizer``, ``input`` for residents; ``grad``, ``activation``,
  ``other`` for the storages the step creates), and ``keep`` for what the step returns;
- an `Op` reads and writes storages (through any view of them), creates new ones
  (views and in-place ops create none: they are *free*), and must run after the ops in
  its ``after`` (data edges, plus the order of reads and in-place writes of a storage,
  plus the order of random-number ops, so a reordered step draws the same numbers).

Memory model (`simulate`): ops run one at a time in a given topological order; an op's
outputs are allocated while its inputs are alive; a storage is freed right after the
last op that uses it (for one never used: right after the op that made it). This is
what the fx code generator does when the graph runs (it drops every value after its
last use), so the simulated live bytes are what the tracker counts when the captured
graph runs in that order (tests check equality). Layouts: `check_layout` verifies that
no two storages alive at the same step overlap in address.
"""
from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass, field

import torch

CATEGORY = {"param": "param", "optimizer": "optimizer", "grad": "grad",
            "activation": "activation", "input": "other", "other": "other"}
RESIDENT_KINDS = ("param", "optimizer", "input")


@dataclass
class Storage:
    nbytes: int
    producer: int | None = None  # index of the op creating it; None: resident graph input
    kind: str = "other"
    name: str = ""
    keep: bool = False  # returned by the step: alive until its end


@dataclass
class Op:
    name: str
    creates: tuple = ()  # storages this op allocates
    reads: tuple = ()  # storages it reads (through any view)
    writes: tuple = ()  # storages it mutates in place
    after: tuple = ()  # ops that must run before it (data edges are added from reads/writes)
    target: str = ""


class StepGraph:
    """Ops in their default (captured) order and the storages they use; see the module
    docstring. Indices of ops are positions in the default order."""

    def __init__(self, ops: list[Op], storages: list[Storage]):
        self.ops, self.storages = ops, storages
        n = len(ops)
        for i, op in enumerate(ops):
            for s in op.creates:
                if storages[s].producer not in (None, i):
                    raise ValueError(f"storage {s} created by two ops")
                storages[s].producer = i
        self.uses: list[list[int]] = [[] for _ in storages]
        preds: list[set] = [set(op.after) for op in ops]
        for i, op in enumerate(ops):
            for s in set(op.reads) | set(op.writes):
                if storages[s].producer != i:
                    self.uses[s].append(i)
                    if storages[s].producer is not None:
                        preds[i].add(storages[s].producer)
            preds[i].discard(i)
        self.preds = [tuple(sorted(p)) for p in preds]
        self.succs: list[list[int]] = [[] for _ in range(n)]
        for i, ps in enumerate(self.preds):
            for p in ps:
                if p >= i:
                    raise ValueError(f"op {i} ({ops[i].name}) runs after op {p} in the default "
                                     f"order but depends on it")
                self.succs[p].append(i)
        self.alloc = [sum(storages[s].nbytes for s in op.creates) for op in ops]
        self.resident_bytes = sum(s.nbytes for s in storages if s.producer is None)

    def __len__(self) -> int:
        return len(self.ops)

    @property
    def n_storages(self) -> int:
        return len(self.storages)

    def is_free(self, i: int) -> bool:
        """An op that allocates nothing (a view, an in-place update)."""
        return self.alloc[i] == 0

    def is_topological(self, order) -> bool:
        if sorted(order) != list(range(len(self.ops))):
            return False
        pos = {o: t for t, o in enumerate(order)}
        return all(pos[p] < pos[i] for i in range(len(self.ops)) for p in self.preds[i])

    def summary(self) -> dict:
        temps = [s for s in self.storages if s.producer is not None]
        return {"ops": len(self.ops), "tensors": len(self.storages), "temporaries": len(temps),
                "resident_bytes": self.resident_bytes}


@dataclass
class Profile:
    """Live bytes at each step of an order (resident bytes included)."""

    order: list
    live: list
    start: dict  # storage -> first step it is alive (temporaries only)
    end: dict  # storage -> last step it is alive
    peak: int = 0
    peak_step: int = 0
    peak_split: dict = field(default_factory=dict)


def lifetimes(graph: StepGraph, order) -> tuple[dict, dict]:
    """Steps (positions in `order`) during which each created storage is alive, inclusive."""
    pos = [0] * len(graph.ops)
    for t, o in enumerate(order):
        pos[o] = t
    last = len(order) - 1
    start, end = {}, {}
    for s, st in enumerate(graph.storages):
        if st.producer is None:
            continue
        a = pos[st.producer]
        b = last if st.keep else max([a] + [pos[u] for u in graph.uses[s]])
        start[s], end[s] = a, b
    return start, end


def simulate(graph: StepGraph, order=None, round_to: int = 1) -> Profile:
    """Live bytes over the steps of `order` (default: the captured order) and the peak,
    with its split by tracker category. `round_to` rounds every storage up (512 models
    the CUDA caching allocator's blocks)."""
    order = list(range(len(graph.ops))) if order is None else list(order)
    size = [-(-s.nbytes // round_to) * round_to for s in graph.storages]
    start, end = lifetimes(graph, order)
    n = len(order)
    delta = [0] * (n + 1)
    for s, a in start.items():
        delta[a] += size[s]
        delta[end[s] + 1] -= size[s]
    resident = sum(size[s] for s, st in enumerate(graph.storages) if st.producer is None)
    live, cur = [], resident
    for t in range(n):
        cur += delta[t]
        live.append(cur)
    peak = max(live) if live else resident
    peak_step = live.index(peak) if live else 0
    split = dict.fromkeys(("param", "grad", "optimizer", "activation", "other"), 0)
    for s, st in enumerate(graph.storages):
        if st.producer is None or start[s] <= peak_step <= end[s]:
            split[CATEGORY[st.kind]] += size[s]
    return Profile(order, live, start, end, peak, peak_step, split)


def check_layout(graph: StepGraph, order, offsets: dict) -> None:
    """Raise if two storages alive at the same step of `order` overlap in `offsets`
    (storage -> byte offset; every created storage of nonzero size must have one)."""
    start, end = lifetimes(graph, order)
    items = sorted((start[s], end[s], offsets[s], offsets[s] + graph.storages[s].nbytes, s)
                   for s in start if graph.storages[s].nbytes)
    active: list = []
    for a, b, lo, hi, s in items:
        active = [x for x in active if x[1] >= a]
        for _, _, lo2, hi2, s2 in active:
            if lo < hi2 and lo2 < hi:
                raise AssertionError(f"storages {s} [{lo}, {hi}) and {s2} [{lo2}, {hi2}) are "
                                     f"alive together and overlap")
        active.append((a, b, lo, hi, s))


# -- capture ---------------------------------------------------------------------------

@dataclass
class Capture:
    """A traced training step: the fx module in its default order, the graph built from
    it, and for each op the fx nodes that run it (the op's node and its `getitem`s)."""

    module: torch.fx.GraphModule
    graph: StepGraph
    nodes: list  # op index -> [fx node, getitem nodes...]
    input_kinds: list  # kind of each positional input


def capture(fn, inputs: list, input_kinds: list[str], input_names: list[str] | None = None
            ) -> Capture:
    """Trace `fn(*inputs)` (which runs for real: on fake inputs, on fake tensors) and
    build its `StepGraph`. `input_kinds[i]` is the resident kind of input i
    (param/optimizer/input)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    if len({_storage_key(t) for t in inputs}) != len(inputs):
        raise ValueError("graph inputs must not share storages")
    module = make_fx(fn)(*inputs)
    for node in module.graph.nodes:  # make_fx keeps a fake copy of every value: drop them
        node.meta.pop("val", None)
        node.meta.pop("tensor_meta", None)
    module.graph.eliminate_dead_code()
    module.recompile()
    graph, nodes = _build(module, inputs, input_kinds, input_names)
    return Capture(module, graph, nodes, list(input_kinds))


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _fresh_fake(t, mode):
    if not isinstance(t, torch.Tensor):
        return t
    with mode:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)


def _build(module: torch.fx.GraphModule, inputs, input_kinds, input_names):
    """Run the graph on fresh fake tensors, outside any active mode (a memory tracker or
    the caller's fake mode must not see it), and record each node's storages."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import _disable_current_modes
    from torch.utils._pytree import tree_flatten, tree_map

    storages: list[Storage] = []
    key_to_storage: dict[int, int] = {}
    node_storages: dict = {}
    node_op: dict = {}  # fx node -> op index that makes its value available
    ops: list[Op] = []
    groups: list[list] = []
    keep_alive = []  # fake values stay referenced, so storage keys are never reused
    env: dict = {}

    def storages_of(value, producer=None, kind="other", name=""):
        out = []
        for t in tree_flatten(value)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            key = _storage_key(t)
            if key not in key_to_storage:
                key_to_storage[key] = len(storages)
                nbytes = t.untyped_storage().nbytes()
                storages.append(Storage(nbytes, None, kind, name))
                if producer is not None:
                    storages[-1].producer = producer
            out.append(key_to_storage[key])
        return out

    with contextlib.ExitStack() as stack:
        stack.enter_context(_disable_current_modes())
        mode = stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(inputs):
            raise ValueError("the traced graph takes a different number of inputs")
        for i, (node, value) in enumerate(zip(placeholders, inputs)):
            fake = _fresh_fake(value, mode)
            env[node] = fake
            keep_alive.append(fake)
            name = input_names[i] if input_names else node.name
            node_storages[node] = storages_of(fake, None, input_kinds[i], name)
            # the real input's storage may be larger than what its view needs
            if isinstance(value, torch.Tensor):
                storages[node_storages[node][0]].nbytes = value.untyped_storage().nbytes()
        rng_last = None
        for node in module.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "get_attr":
                real = getattr(module, node.target)
                fake = _fresh_fake(real, mode)
                env[node] = fake
                keep_alive.append(fake)
                node_storages[node] = storages_of(fake, None, "input", node.target)
                if isinstance(real, torch.Tensor):
                    storages[node_storages[node][0]].nbytes = real.untyped_storage().nbytes()
                continue
            if node.op == "output":
                for inp in node.all_input_nodes:
                    for s in node_storages[inp]:
                        storages[s].keep = True
                continue
            if node.op != "call_function":
                raise ValueError(f"unexpected fx node {node.op} {node.target}")
            args = tree_map(lambda a: env[a] if isinstance(a, torch.fx.Node) else a, node.args)
            kwargs = tree_map(lambda a: env[a] if isinstance(a, torch.fx.Node) else a, node.kwargs)
            value = node.target(*args, **kwargs)
            env[node] = value
            keep_alive.append(value)
            if node.target is operator.getitem:
                src = node.args[0]
                node_op[node] = node_op[src]
                groups[node_op[src]].append(node)
                node_storages[node] = storages_of(value)
                if isinstance(value, torch.Tensor):
                    node.meta["bench_storage"] = node_storages[node][0]
                continue
            index = len(ops)
            before = len(storages)
            outs = storages_of(value, index, "other", node.name)
            created = tuple(range(before, len(storages)))
            reads, after = set(), set()
            for inp in node.all_input_nodes:
                reads.update(node_storages[inp])
                if inp in node_op:
                    after.add(node_op[inp])
            writes = set()
            schema = getattr(node.target, "_schema", None)
            if schema is not None:
                for k, arg in enumerate(schema.arguments):
                    if arg.alias_info is not None and arg.alias_info.is_write:
                        a = node.args[k] if k < len(node.args) else node.kwargs.get(arg.name)
                        for x in tree_flatten(a)[0]:
                            if isinstance(x, torch.fx.Node):
                                writes.update(node_storages[x])
            tags = getattr(node.target, "tags", ())
            if torch.Tag.nondeterministic_seeded in tags:
                if rng_last is not None:
                    after.add(rng_last)
                rng_last = index
            node_op[node] = index
            node_storages[node] = outs
            if isinstance(value, torch.Tensor):
                node.meta["bench_storage"] = outs[0]
            groups.append([node])
            ops.append(Op(node.name, created, tuple(sorted(reads - set(created))),
                          tuple(sorted(writes)), tuple(sorted(after)), str(node.target)))
        _order_mutations(ops)
        keep_alive.clear()
        env.clear()
    graph = StepGraph(ops, storages)
    _label_temporaries(graph, module, groups)
    return graph, groups


def _order_mutations(ops: list[Op]) -> None:
    """Keep every in-place write of a storage in place relative to the other accesses of
    that storage (reads before a write stay before it, reads after stay after)."""
    last_write: dict[int, int] = {}
    readers: dict[int, list] = {}
    extra: list[set] = [set() for _ in ops]
    for i, op in enumerate(ops):
        for s in op.creates:
            readers[s] = []
        for s in op.reads:
            if s in last_write:
                extra[i].add(last_write[s])
        for s in op.writes:
            extra[i].update(readers.get(s, ()))
            if s in last_write:
                extra[i].add(last_write[s])
            last_write[s] = i
            readers[s] = []
        for s in op.reads:
            if s not in op.writes:
                readers.setdefault(s, []).append(i)
    for i, op in enumerate(ops):
        extra[i].discard(i)
        if extra[i]:
            op.after = tuple(sorted(set(op.after) | extra[i]))


def _label_temporaries(graph: StepGraph, module, groups) -> None:
    """Kinds of created storages: `grad` for what the AdamW update folds into exp_avg (the
    first in-place op on a moment, `lerp_`, reads the gradient), `activation` for what
    the forward pass (the ancestors of the loss) makes and a later op reads, `other` for
    the rest."""
    index = {g[0]: i for i, g in enumerate(groups)}
    for g in groups:
        for n in g[1:]:
            index[n] = index[g[0]]
    out = next(n for n in module.graph.nodes if n.op == "output")
    forward: set[int] = set()
    stack = [index[n] for n in out.all_input_nodes if n in index]
    while stack:
        i = stack.pop()
        if i in forward:
            continue
        forward.add(i)
        stack.extend(graph.preds[i])
    for i, op in enumerate(graph.ops):
        if op.target == "aten.lerp_.Scalar":
            for s in op.reads:
                if graph.storages[s].producer is not None:
                    graph.storages[s].kind = "grad"
    for s, st in enumerate(graph.storages):
        if st.producer in forward and st.kind == "other" and not st.keep:
            if any(u not in forward for u in graph.uses[s]):
                st.kind = "activation"


def reorder(cap: Capture, order, label=None) -> torch.fx.GraphModule:
    """A module that runs the captured step with its ops in `order` (a topological order
    of `cap.graph`): fx frees every value after its last use, so the order sets the
    lifetimes the simulator predicts. With `label`, a call `label(value, category)`
    follows each value that is a new `grad` or `activation` storage (to label it in a
    memory tracker)."""
    if not cap.graph.is_topological(order):
        raise ValueError("order is not a topological order of the graph")
    old = cap.module.graph
    new = torch.fx.Graph()
    env: dict = {}
    for node in old.nodes:
        if node.op in ("placeholder", "get_attr"):
            env[node] = new.node_copy(node, lambda n: env[n])
    for i in order:
        created = set(cap.graph.ops[i].creates)
        for node in cap.nodes[i]:
            env[node] = new.node_copy(node, lambda n: env[n])
            s = node.meta.get("bench_storage")
            if label is not None and s in created:
                kind = cap.graph.storages[s].kind
                if kind in ("grad", "activation"):
                    new.call_function(label, (env[node], kind))
    out = next(n for n in old.nodes if n.op == "output")
    new.node_copy(out, lambda n: env[n])
    new.lint()
    return torch.fx.GraphModule(cap.module, new)


# -- the AdamW training step --------------------------------------------------------------

class _Bound:
    """Calls `model` with given parameter and buffer tensors (for `lm_loss`)."""

    def __init__(self, model, tensors):
        from bench.method import precision_of, use_precision

        self.model, self.tensors = model, tensors
        use_precision(self, precision_of(model))  # lm_loss's autocast under mixed precision

    def __call__(self, **kwargs):
        from torch.func import functional_call

        return functional_call(self.model, self.tensors, (), kwargs)


@dataclass
class AdamWStep:
    """A captured AdamW training step; inputs are, in order: trainable parameters, their
    exp_avg, their exp_avg_sq, the step scalars (`scalars`), buffers and frozen
    parameters, then the batch tensors in `batch_keys` order."""

    capture: Capture
    param_names: list
    buffer_names: list
    batch_keys: list
    scalars: list  # names of the 0-dim step inputs
    unused: list  # parameters that got no gradient (no update, as torch's AdamW)


def adamw_scalars(lr, beta1, beta2, eps, weight_decay, step: int) -> dict:
    """The per-step numbers of torch's AdamW (its `capturable` formulation):
    p <- p * (1 - lr wd); p <- p + m / (sqrt(v) / (sqrt(bc2) * -lr / bc1) + eps / (-lr / bc1))."""
    bc1, bc2 = 1 - beta1 ** step, 1 - beta2 ** step
    step_size_neg = -lr / bc1
    out = {"denom_scale": bc2 ** 0.5 * step_size_neg, "eps_scaled": eps / step_size_neg}
    if weight_decay:
        out["decay"] = 1 - lr * weight_decay
    return out


def adamw_step_fn(model, param_names, buffer_names, batch_keys, scalars, betas, result=None):
    """The function that `make_fx` traces: `lm_loss`, `torch.autograd.grad`, then the
    AdamW update in place (per parameter, as torch's single-tensor AdamW)."""
    from bench.method import lm_loss

    beta1, beta2 = betas
    n, nb = len(param_names), len(buffer_names)
    unused: list = []

    def step(*flat):
        params = flat[:n]
        exp_avg, exp_avg_sq = flat[n:2 * n], flat[2 * n:3 * n]
        sc = dict(zip(scalars, flat[3 * n:3 * n + len(scalars)]))
        rest = flat[3 * n + len(scalars):]
        tensors = {**dict(zip(param_names, params)), **dict(zip(buffer_names, rest[:nb]))}
        batch = dict(zip(batch_keys, rest[nb:]))
        loss = lm_loss(_Bound(model, tensors), batch)
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        unused.clear()
        with torch.no_grad():
            for name, p, g, m, v in zip(param_names, params, grads, exp_avg, exp_avg_sq):
                if g is None:
                    unused.append(name)
                    continue
                if "decay" in sc:
                    p.mul_(sc["decay"])
                m.lerp_(g, 1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                denom = (v.sqrt() / sc["denom_scale"]).add_(sc["eps_scaled"])
                p.addcdiv_(m, denom)
        out = loss.detach()
        if result is not None:
            result["loss"] = out
        return out

    return step, unused


def capture_adamw_step(model, batch: dict, exp_avg: list, exp_avg_sq: list, scalars: dict,
                       betas, params=None, result: dict | None = None) -> AdamWStep:
    """Trace one AdamW training step of `model` on `batch` (this performs the step: the
    parameters and moments are updated, in PyTorch's eager order). `exp_avg`/`exp_avg_sq`
    are the moments of the trainable parameters (`params`: name -> tensor, default all
    with requires_grad), `scalars` the 0-dim tensors named as `adamw_scalars` returns.
    `result["loss"]` receives the step's loss."""
    if params is None:
        params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    param_names = list(params)
    frozen = {k: p for k, p in model.named_parameters() if k not in params}
    buffers = {**dict(model.named_buffers()), **frozen}
    buffer_names = list(buffers)
    batch_keys = list(batch)
    scalar_names = list(scalars)
    fn, unused = adamw_step_fn(model, param_names, buffer_names, batch_keys, scalar_names, betas,
                               result)
    inputs = ([p.detach().requires_grad_() for p in params.values()] + list(exp_avg)
              + list(exp_avg_sq) + list(scalars.values())
              + [b.detach() for b in buffers.values()] + [batch[k] for k in batch_keys])
    n = len(param_names)
    kinds = (["param"] * n + ["optimizer"] * (2 * n) + ["input"] * len(scalars)
             + ["input"] * len(buffers) + ["input"] * len(batch_keys))
    names = (param_names + [f"exp_avg.{k}" for k in param_names]
             + [f"exp_avg_sq.{k}" for k in param_names] + scalar_names + buffer_names + batch_keys)
    cap = capture(fn, inputs, kinds, names)
    return AdamWStep(cap, param_names, buffer_names, batch_keys, scalar_names, list(unused))
