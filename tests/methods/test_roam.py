"""ROAM: the step graph and its memory simulator, the orders and layouts, the method."""
import random

import pytest
import torch

from methods.roam import graph as G
from bench import models
from bench.job import Job
from methods.roam import planners as P
from bench.measure import runner
from bench.measure.tracker import MemoryTracker
from bench.method import MethodError, load
from conftest import lm_batch

MODELS = ["gpt2-tiny", "bert-tiny", "llama-tiny"]


# -- utilities -----------------------------------------------------------------------------

def batch(n=2, t=16, seed=0):
    return lm_batch(n, t, seed=seed)


def captured(name, dtype=torch.float32, n=2, t=16):
    """A model, its AdamW state, the captured step (which performed one step) and the
    inputs its module takes."""
    torch.manual_seed(0)
    model = models.build(name, dropout=0.0).to(dtype)
    model.train()
    params = dict(model.named_parameters())
    m = [torch.zeros_like(p) for p in params.values()]
    v = [torch.zeros_like(p) for p in params.values()]
    scalars = {k: torch.tensor(x, dtype=torch.float64)
               for k, x in G.adamw_scalars(1e-3, 0.9, 0.999, 1e-8, 0.0, 1).items()}
    b = batch(n, t)
    step = G.capture_adamw_step(model, b, m, v, scalars, (0.9, 0.999))
    buffers = [dict(model.named_buffers())[k] for k in step.buffer_names]
    inputs = ([p.detach() for p in params.values()] + m + v + list(scalars.values())
              + [x.detach() for x in buffers] + [b[k] for k in step.batch_keys])
    return step, inputs


@pytest.fixture(scope="module")
def steps():
    return {name: captured(name) for name in MODELS}


def tracked_run(module, inputs, constants=()):
    tracker = MemoryTracker()
    tracker.register(inputs, "other")
    tracker.register(constants, "other")
    with torch.no_grad(), tracker:
        module(*inputs)
    return tracker.peak


def constants_of(cap):
    return [getattr(cap.module, n.target) for n in cap.module.graph.nodes if n.op == "get_attr"]


def random_graph(rng: random.Random, n_ops: int, free_p=0.2, edge_p=0.15) -> G.StepGraph:
    """A random step graph: resident inputs, ops creating one storage each (or none: a
    free, view-like op), reading up to three earlier storages, a few extra edges."""
    storages = [G.Storage(rng.choice([64, 96]), kind="param") for _ in range(2)]
    ops = []
    for i in range(n_ops):
        reads = tuple(sorted(rng.sample(range(len(storages)), rng.randint(1, min(3, len(storages))))))
        after = tuple(j for j in range(i) if rng.random() < edge_p)
        if i and rng.random() < free_p:
            ops.append(G.Op(f"v{i}", (), reads, (), after))
        else:
            storages.append(G.Storage(rng.choice([8, 16, 24, 40, 64, 100])))
            ops.append(G.Op(f"o{i}", (len(storages) - 1,), reads, (), after))
    storages[-1].keep = storages[-1].kind != "param"
    return G.StepGraph(ops, storages)


def all_orders(graph):
    n = len(graph)
    indeg = [len(p) for p in graph.preds]
    order = []

    def rec():
        if len(order) == n:
            yield list(order)
            return
        for i in range(n):
            if indeg[i] == 0 and i not in order:
                order.append(i)
                for j in graph.succs[i]:
                    indeg[j] -= 1
                yield from rec()
                for j in graph.succs[i]:
                    indeg[j] += 1
                order.pop()

    yield from rec()


# -- the graph and the simulator -------------------------------------------------------------

@pytest.mark.parametrize("name", MODELS)
def test_simulated_peak_equals_tracked_run_of_the_graph(steps, name):
    step, inputs = steps[name]
    cap = step.capture
    consts = constants_of(cap)
    default = G.simulate(cap.graph)
    assert tracked_run(cap.module, inputs, consts) == default.peak
    # and for a planned order: the module built for it frees exactly as simulated
    order = P.greedy_order(cap.graph)
    assert tracked_run(G.reorder(cap, order), inputs, consts) == G.simulate(cap.graph, order).peak
    assert default.peak_split["param"] == sum(p.untyped_storage().nbytes() for p in inputs[:len(step.param_names)])


def test_views_and_in_place_ops_allocate_nothing(steps):
    g = steps["gpt2-tiny"][0].capture.graph
    for op in g.ops:
        if op.target.startswith(("aten.view.", "aten.t.", "aten.transpose.", "aten.unsqueeze.")) \
                or op.target.endswith("_.Tensor") or op.target in ("aten.lerp_.Scalar", "aten.addcdiv_.default"):
            assert g.alloc[g.ops.index(op)] == 0, op.target
    updates = [op for op in g.ops if op.target == "aten.addcdiv_.default"]
    assert len(updates) == len(steps["gpt2-tiny"][0].param_names)
    assert all(g.storages[op.writes[0]].kind == "param" for op in updates)


def eager_peak(name, dtype=torch.float32, n=2, t=16):
    """Tracked peak of eager AdamW's second step, measured as the runner does."""
    torch.manual_seed(0)
    model = models.build(name, dropout=0.0).to(dtype)
    model.train()
    adamw = load("adamw")
    opt = adamw.make_optimizer(model)
    b = batch(n, t)
    tracker = MemoryTracker()
    tracker.register_model(model)
    tracker.register(b.values(), "other")
    with tracker:
        adamw.train_step(model, opt, b)
        tracker.label(adamw.state_tensors(opt), "optimizer")
        tracker.reset_peak()
        adamw.train_step(model, opt, b)
    return tracker.peak, len(opt.state)


@pytest.mark.parametrize("name", MODELS)
def test_default_order_against_eager_training(steps, name):
    # The captured graph in its default order against eager AdamW (loss.backward(), then
    # optimizer.step()), tracked as the runner does. They run the same ops, but:
    # - eager keeps every `.grad` until zero_grad after the optimizer step; the graph frees
    #   each gradient right after its parameter's update (updates run at the end, one
    #   parameter after the other). When eager's peak is in the optimizer step (small
    #   activations, as here), the graph's is lower by up to the gradients' bytes;
    # - the autograd engine keeps a backward node's incoming gradient until the node
    #   returns, the graph frees every value right after its last use;
    # - eager holds its loss and the gradient seed a little longer (a few bytes), and
    #   AdamW's `step` counters (4 bytes per parameter) lie outside the graph.
    # So 0 <= eager - graph <= gradient bytes, within a few bytes. Measured: at batch
    # 2 x 16, eager - graph = 32,760 / -8 / 397,296 bytes (gpt2 / bert / llama tiny); at
    # 4 x 32, 262,136 / -8 / 135,160.
    step, inputs = steps[name]
    eager, n_params = eager_peak(name)
    graph = G.simulate(step.capture.graph).peak + 4 * n_params
    grad_bytes = sum(p.untyped_storage().nbytes() for p in inputs[:n_params])
    assert -64 <= eager - graph <= grad_bytes


def test_check_layout_finds_an_overlap():
    g = G.StepGraph([G.Op("a", (1,), (0,)), G.Op("b", (2,), (1,)), G.Op("c", (3,), (1, 2))],
                    [G.Storage(8, kind="param"), G.Storage(16), G.Storage(16), G.Storage(4, keep=True)])
    order = [0, 1, 2]
    G.check_layout(g, order, {1: 0, 2: 16, 3: 32})  # all three are alive at step 2
    with pytest.raises(AssertionError):
        G.check_layout(g, order, {1: 0, 2: 16, 3: 20})
    with pytest.raises(AssertionError):
        G.check_layout(g, order, {1: 0, 2: 8, 3: 32})
    G.check_layout(g, [0, 1, 2], {1: 0, 2: 16, 3: 32})


def test_simulator_counts_by_hand():
    # resident 8; op a makes 16 (alive until c), b makes 16 (until c), c makes 4 (kept)
    g = G.StepGraph([G.Op("a", (1,), (0,)), G.Op("b", (2,), (0,)), G.Op("c", (3,), (1, 2))],
                    [G.Storage(8, kind="param"), G.Storage(16), G.Storage(16), G.Storage(4, keep=True)])
    prof = G.simulate(g)
    assert prof.live == [24, 40, 44] and prof.peak == 44 and prof.peak_step == 2


# -- orders ----------------------------------------------------------------------------------

def heuristic_orders(graph):
    return {"default": P.default_order(graph), "update_early": P.update_early_order(graph),
            "greedy": P.greedy_order(graph), "greedy_peak": P.greedy_order(graph, rule="peak"),
            "greedy_no_ue": P.greedy_order(graph, update_early=False)}


def test_every_order_respects_dependencies(steps):
    graphs = [s.capture.graph for s, _ in steps.values()]
    rng = random.Random(1)
    graphs += [random_graph(rng, rng.randint(5, 40)) for _ in range(15)]
    for k, g in enumerate(graphs):
        orders = heuristic_orders(g)
        if len(g) <= 40:
            orders["exact"] = P.exact_order(g, 2.0)[0]
        orders["roam"] = P.plan(g, "roam", time_limit=0.1).order
        orders["refined"] = P.refine_order(g, orders["default"], 0.1, window=4)[0]
        for name, order in orders.items():
            assert g.is_topological(order), (k, name)


def scanned_greedy_order(graph, update_early=True, rule="free"):
    """The greedy rule as its docstring states it, by a scan of every ready op per step:
    the reference for `greedy_order`'s heaps."""
    remaining = [len(u) for u in graph.uses]
    early = P.update_ops(graph) if update_early else set()
    size = [s.nbytes for s in graph.storages]
    temp = [s.producer is not None and not s.keep for s in graph.storages]
    touched = [tuple({*op.reads, *op.writes}) for op in graph.ops]
    transient = [sum(size[s] for s in op.creates if not graph.uses[s] and temp[s]) for op in graph.ops]
    cur = peak = graph.resident_bytes

    def freed(i):
        return sum(size[s] for s in touched[i] if temp[s] and remaining[s] == 1)

    def key(i):
        net = min(graph.alloc[i] - transient[i] - freed(i), 0)
        return (i not in early, net, i) if rule == "free" else \
            (i not in early, max(cur + graph.alloc[i], peak), net, i)

    indeg = [len(p) for p in graph.preds]
    ready, order = [i for i in range(len(graph)) if indeg[i] == 0], []
    while ready:
        best = min(ready, key=key)
        ready.remove(best)
        order.append(best)
        peak = max(peak, cur + graph.alloc[best])
        cur += graph.alloc[best] - transient[best] - freed(best)
        for s in touched[best]:
            remaining[s] -= 1
        for j in graph.succs[best]:
            indeg[j] -= 1
            if indeg[j] == 0:
                ready.append(j)
    return order


def updating_graph(rng, n_ops):
    """A random graph whose later ops also write the parameters in place (update ops) and
    some of whose ops write what they make (their producer then counts among its touches,
    so a temporary's count can pass its last user early)."""
    g = random_graph(rng, n_ops, free_p=0.3)
    ops = [G.Op(op.name, op.creates, op.reads, (rng.choice([0, 1]),) if i > n_ops // 2 and rng.random() < 0.3
                else op.creates if rng.random() < 0.2 else (), op.after)  # or writes what it makes
           for i, op in enumerate(g.ops)]
    return G.StepGraph(ops, [G.Storage(s.nbytes, kind=s.kind, keep=s.keep) for s in g.storages])


def test_greedy_order_equals_the_scan_of_ready_ops(steps):
    """The heaps pick what a scan of the ready ops picks, step by step (both rules, with
    and without the update ops first), on captured and random graphs."""
    rng = random.Random(7)
    graphs = [s.capture.graph for s, _ in steps.values()]
    graphs += [random_graph(rng, rng.randint(5, 80)) for _ in range(40)]
    graphs += [updating_graph(rng, rng.randint(5, 80)) for _ in range(40)]
    for k, g in enumerate(graphs):
        for rule in ("free", "peak"):
            for early in (True, False):
                assert P.greedy_order(g, early, rule) == scanned_greedy_order(g, early, rule), (k, rule, early)


def test_update_early_frees_gradients_during_backward(steps):
    g = steps["gpt2-tiny"][0].capture.graph
    default, early = G.simulate(g), G.simulate(g, P.update_early_order(g))
    grads = [s for s, st in enumerate(g.storages) if st.kind == "grad"]
    assert grads
    # gradients live until the end of backward in the eager order, much shorter early
    assert sum(early.end[s] - early.start[s] for s in grads) < 0.5 * sum(
        default.end[s] - default.start[s] for s in grads)


def test_exact_equals_brute_force_on_tiny_graphs():
    rng = random.Random(7)
    for _ in range(12):
        g = random_graph(rng, 7)
        best = min(G.simulate(g, o).peak for o in all_orders(g))
        order, status = P.exact_order(g, 5.0)
        assert status == "OPTIMAL"
        assert G.simulate(g, order).peak == best


def test_exact_beats_every_heuristic_on_small_graphs(steps):
    rng = random.Random(3)
    for _ in range(8):
        g = random_graph(rng, 24)
        order, status = P.exact_order(g, 5.0)
        assert status == "OPTIMAL"
        exact = G.simulate(g, order).peak
        for name, o in heuristic_orders(g).items():
            assert exact <= G.simulate(g, o).peak, name


def test_windows_never_raise_the_peak_and_reach_the_optimum():
    rng = random.Random(5)
    for _ in range(6):
        g = random_graph(rng, 30)
        start = P.default_order(g)
        order, stats = P.refine_order(g, start, 10.0, window=4)
        assert G.simulate(g, order).peak <= G.simulate(g, start).peak
        # windows grow to the whole graph when stuck: the end is the exact optimum
        exact, _ = P.exact_order(g, 5.0)
        assert G.simulate(g, order).peak == G.simulate(g, exact).peak


def test_plan_on_a_model_graph(steps):
    g = steps["llama-tiny"][0].capture.graph
    plan = P.plan(g, "roam", time_limit=0.3)
    assert plan.peak <= min(plan.candidates.values()) <= plan.default_peak
    assert plan.peak == G.simulate(g, plan.order).peak
    # the budget is the solver's deterministic time, its workers interleaved in a fixed
    # order: the same plan every time (a limit in seconds of wall clock gave another order
    # when the machine was busier); no window starts once it is spent
    assert plan.stats["mode"] == "windows" and plan.stats["work"] > 0
    assert P.plan(g, "roam", time_limit=0.3).order == plan.order
    with pytest.raises(ValueError, match="unknown planner"):
        P.plan(g, "fastest")


# -- layouts ---------------------------------------------------------------------------------

def test_layouts_never_overlap_live_tensors(steps):
    cases = [(s.capture.graph, P.greedy_order(s.capture.graph)) for s, _ in steps.values()]
    rng = random.Random(11)
    cases += [(g, P.default_order(g)) for g in (random_graph(rng, 30) for _ in range(10))]
    for k, (g, order) in enumerate(cases):
        peak = G.simulate(g, order).peak
        first, best = P.first_fit_layout(g, order), P.best_fit_layout(g, order)
        layouts = [first, best]
        if len(g) <= 30:
            exact, status = P.exact_layout(g, order, 5.0)
            assert exact.peak_address <= best.peak_address
            layouts.append(exact)
        for lay in layouts:
            P.verify_layout(g, order, lay)
            assert lay.peak_address >= lay.peak_live == peak, (k, lay.method)
            assert lay.fragmentation >= 0


# -- the method ------------------------------------------------------------------------------

def test_roam_step_equals_eager_adamw_fp64():
    torch.manual_seed(0)
    eager = models.build("gpt2-tiny", dropout=0.0).to(torch.float64)
    torch.manual_seed(0)
    planned = models.build("gpt2-tiny", dropout=0.0).to(torch.float64)
    adamw = load("adamw", {"weight_decay": 0.1})
    roam = load("roam", {"weight_decay": 0.1, "time_limit": 0.2, "layout": "none"})
    opt_e, opt_r = adamw.make_optimizer(eager), roam.make_optimizer(planned)
    for step in range(3):  # the first step is the trace; later ones run the plan
        b = batch(4, 32, seed=step)
        loss_e = adamw.train_step(eager, opt_e, b)
        loss_r = roam.train_step(planned, opt_r, b)
        torch.testing.assert_close(loss_r, loss_e, rtol=1e-12, atol=1e-12)
        for (name, p), q in zip(eager.named_parameters(), planned.parameters()):
            torch.testing.assert_close(q, p, rtol=1e-10, atol=1e-12, msg=name)
    assert roam.report["predicted_peak_bytes"] <= roam.report["predicted_default_peak_bytes"]


def test_roam_keeps_dropout_draws_of_eager():
    # random ops keep their relative order, so a planned step draws what eager draws
    torch.manual_seed(0)
    eager = models.build("gpt2-tiny", dropout=0.1).to(torch.float64)
    torch.manual_seed(0)
    planned = models.build("gpt2-tiny", dropout=0.1).to(torch.float64)
    adamw, roam = load("adamw"), load("roam", {"planner": "greedy", "layout": "none"})
    opt_e, opt_r = adamw.make_optimizer(eager), roam.make_optimizer(planned)
    for step in range(2):
        torch.manual_seed(100 + step)
        loss_e = adamw.train_step(eager, opt_e, batch(4, 32, seed=step))
        torch.manual_seed(100 + step)
        loss_r = roam.train_step(planned, opt_r, batch(4, 32, seed=step))
        torch.testing.assert_close(loss_r, loss_e, rtol=1e-12, atol=1e-12)


def test_memory_job_runs_the_plan_and_matches_its_prediction():
    planned = runner.run(Job(kind="memory", method="roam", model="gpt2-tiny",
                                    batch_size=4, seq_len=32))
    assert planned["status"] == "ok", planned.get("message")
    rep = planned["method_report"]
    for key in ("graph_ops", "graph_tensors", "planner", "plan_s", "predicted_default_peak_bytes",
                "predicted_peak_bytes", "layout_peak_address_bytes"):
        assert key in rep, key
    assert rep["graph_ops"] > 100 and rep["planner"] == "roam" and rep["plan_work"] > 0
    assert rep["predicted_peak_bytes"] <= rep["predicted_default_peak_bytes"]
    assert rep["layout_peak_address_bytes"] >= rep["predicted_peak_bytes"]
    # The tracker also counts what lies outside the graph: AdamW's per-parameter `step`
    # counters (float32 scalars), and the other step's batch if the runner still holds it
    # (2 x 4 x 32 int64; the runner frees the first step's batch before the measured one).
    n_params = len(list(models.build("gpt2-tiny").parameters()))
    mem = planned["memory"]
    outside = mem["peak_bytes"] - rep["predicted_peak_bytes"]
    assert outside in (4 * n_params, 4 * n_params + 2 * 4 * 32 * 8)
    # the default order's module frees as predicted too (test above): the plan is no worse
    assert mem["peak_bytes"] <= rep["predicted_default_peak_bytes"] + outside
    assert mem["optimizer_bytes"] == 2 * mem["param_bytes"] + 4 * n_params
    assert mem["activation_bytes"] > 0  # labelled inside the graph


def test_simulated_tier_equals_tracked(tiny_job):
    job = dict(method="roam", model="bert-tiny", hparams={"time_limit": 0.2})
    real = runner.run(tiny_job(**job))
    fake = runner.run(tiny_job(simulate=True, **job))
    assert real["status"] == fake["status"] == "ok", fake.get("message")
    for key in ("peak_bytes", "activation_bytes", "grad_bytes", "other_bytes"):
        assert fake["memory"][key] == real["memory"][key], key


def test_options_are_checked():
    model = models.build("gpt2-tiny")
    with pytest.raises(MethodError, match="micro_batches=2 is not supported: roam takes at most 1"):
        load("roam", {"micro_batches": 2})
    with pytest.raises(MethodError, match="micro_batches=4 is not supported: roam takes at most 1"):
        load("roam+grad_accum")
    with pytest.raises(MethodError, match="'planner' must be one of \"default\", .*\"roam\", not \"magic\""):
        load("roam", {"planner": "magic"})
    with pytest.raises(MethodError, match="'layout' must be one of \"best_fit\""):
        load("roam", {"layout": "tetris"})
    assert load("roam", {"planner": "greedy"}).make_optimizer(model)
    with pytest.raises(MethodError, match="cannot be stacked"):
        load("roam+checkpointing")
