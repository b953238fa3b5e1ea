"""Offloading to host memory (methods/offload_activations.py, methods/offload_optimizer.py)
and the tracker's host ledger: same numbers as without offloading (float64), device bytes
that drop by what was moved, host bytes and transfers to the byte, simulated = tracked.

Peers: `torch.autograd.graph.save_on_cpu` for the activations (on a CPU-only build its
move is a no-op: the reference for loss and gradients). torchao's CPUOffloadOptimizer
asserts a CUDA or XPU device, so the optimizer is checked against float64 AdamW."""
import pytest
import torch

from bench import models
from bench.hooks import on_host, to_device, to_host, transfer
from bench.measure import runner
from bench.measure.tracker import HostLedger, MemoryTracker
from bench.method import MethodError, load, lm_loss
from conftest import lm_batch

NAMES = ["gpt2-tiny", "bert-tiny", "llama-tiny"]
HOST_KEYS = ("host_peak_bytes", "transfer_bytes")
DEVICE_KEYS = ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes", "other_bytes", "peak_bytes")


def model(name, spec=None, dtype=torch.float64):
    torch.manual_seed(0)
    m = models.build(name, dropout=0.0).to(dtype)
    method = load(spec) if spec else None
    return (method.transform_model(m) if method else m), method


def block(n):
    """The pinned-memory allocator's block for a request of n bytes."""
    return HostLedger.block(n)


# -- the ledger and the hooks ---------------------------------------------------------------

def test_host_ledger_rounds_to_powers_of_two_and_keeps_its_high_water_mark():
    assert [block(n) for n in (0, 1, 4, 5, 1920, 2048, 3200)] == [0, 1, 4, 8, 2048, 2048, 4096]
    ledger = HostLedger()
    ledger.alloc("a", 1920)
    ledger.alloc("b", 3200)
    ledger.free("a")
    assert (ledger.current, ledger.peak_bytes) == (4096, 6144)
    ledger.alloc("c", 2000)  # reuses a's cached 2048-byte block
    ledger.free("b")
    ledger.alloc("d", 5000)  # no cached 8192 block: reserved
    assert (ledger.current, ledger.peak_bytes) == (2048 + 8192, 6144 + 8192)


def test_host_tensors_are_not_device_memory_and_are_not_allocator_events():
    events = []
    tracker = MemoryTracker(events=events)
    x = torch.randn(100, dtype=torch.float64)  # 800 bytes, made before: not counted
    with tracker:
        h = to_host(x)
        with on_host():
            s = torch.zeros(10)  # 40 bytes
        assert (tracker.current, tracker.host.current) == (0, 1024 + 64)
        d = to_device(h, "cpu")
        transfer(h, d)
        assert tracker.current == 800 and tracker.live_split().other == 800
        tracker.label([h, s], "optimizer")  # a label does not make host memory device memory
        assert tracker.current == 800 and tracker.live_split().optimizer == 0
    torch.testing.assert_close(d, x, rtol=0, atol=0)
    assert tracker.transfer_bytes == 3 * 800 and tracker.host.peak_bytes == 1024 + 64
    assert [e[2] for e in events if e[0] == "alloc"] == [800]  # only the device copy
    del h, s
    assert tracker.host.current == 0 and tracker.host.peak_bytes == 1024 + 64  # cached, kept


def test_without_a_tracker_the_hooks_still_copy():
    x = torch.randn(7, 3)
    h = to_host(x)
    assert h.untyped_storage().data_ptr() != x.untyped_storage().data_ptr() and torch.equal(h, x)
    y = to_device(h, "cpu")
    assert y.untyped_storage().data_ptr() != h.untyped_storage().data_ptr() and torch.equal(y, x)


# -- offload_activations ----------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_activations_same_loss_and_gradients_as_plain_and_save_on_cpu(name):
    b = lm_batch(2, 16, 256, seed=1)
    ref, _ = model(name)
    with torch.autograd.graph.save_on_cpu(pin_memory=False):
        want = lm_loss(ref, b)
    want.backward()
    plain, _ = model(name)
    lm_loss(plain, b).backward()
    ours, method = model(name, "offload_activations")
    got = lm_loss(ours, b)
    got.backward()
    assert torch.equal(got, want)
    for (key, p), q, r in zip(ours.named_parameters(), ref.parameters(), plain.parameters()):
        assert (p.grad is None) == (q.grad is None), key
        if q.grad is not None:
            assert torch.equal(p.grad, q.grad) and torch.equal(p.grad, r.grad), key
    # save_on_cpu has no threshold: every saved tensor moves; ours keeps small ones
    report = method.report
    assert report["offloaded"] > 0 and report["kept"] > 0 and report["offloaded_bytes"] > 0


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(20, 20, bias=False), torch.nn.Tanh(),
                               torch.nn.Linear(20, 20, bias=False)).double()


def mlp_memory(spec=None):
    """Device bytes the forward adds (at its peak, and kept at its end), the host ledger
    and the transfers of one forward and backward of a 12 x 20 float64 input through
    Linear, Tanh, Linear (no bias), loss sum(y^2) computed after the model."""
    m = mlp()
    method = load(spec) if spec else None
    if method:
        m = method.transform_model(m)
    x = torch.randn(12, 20, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    tracker = MemoryTracker()
    tracker.register_model(m)
    tracker.register([x], "other")
    with tracker:
        start = tracker.current
        loss = m(x).square().sum()
        forward, kept = tracker.peak - start, tracker.current - start
        forward_host = tracker.host.current
        loss.backward()
    return dict(forward=forward, kept=kept, forward_host=forward_host, host=tracker.host.peak_bytes,
                left=tracker.host.current, transfer=tracker.transfer_bytes,
                grads=[p.grad for p in m.parameters()], report=method.report if method else None)


def test_activations_exact_bytes_on_a_small_mlp():
    """What autograd saves, in the model: Linear 1 (its input x does not require grad) keeps
    x; Tanh keeps its output h; Linear 2 keeps h again and W2^T (a weight view); the loss,
    after the model, keeps y. x and h are 12 x 20 float64 (1920 bytes, a 2048 block on the
    host), W2^T 20 x 20 (3200 bytes, a 4096 block). Offloaded at >= 1024 bytes: x, h twice,
    W2^T; but only h leaves the device: x is the batch's, W2^T the weight's, y is saved
    after the model's forward. So the forward's device peak and what it keeps both drop by
    1920 bytes; the host holds 3 x 2048 + 4096; each offloaded byte crosses twice."""
    plain, ours = mlp_memory(), mlp_memory("offload_activations")
    assert plain["kept"] == 1920 + 1920 + 8  # h, y, the loss
    assert plain["kept"] - ours["kept"] == 1920 and plain["forward"] - ours["forward"] == 1920
    assert ours["forward_host"] == ours["host"] == 3 * 2048 + 4096 and ours["left"] == 0
    moved = 3 * 1920 + 3200
    assert ours["report"] == {"offloaded": 4, "offloaded_bytes": moved, "kept": 0}
    assert ours["transfer"] == 2 * moved
    assert plain["host"] == plain["transfer"] == 0
    for p, q in zip(ours["grads"], plain["grads"]):
        assert torch.equal(p, q)
    # above 2000 bytes only the weight view moves: host and transfers, no device saving
    view = mlp_memory("offload_activations@min_offload_bytes=2000")
    assert view["report"] == {"offloaded": 1, "offloaded_bytes": 3200, "kept": 3}
    assert (view["kept"], view["forward"]) == (plain["kept"], plain["forward"])
    assert (view["host"], view["transfer"]) == (4096, 2 * 3200)


def test_activations_job_drops_the_activations_simulates_byte_for_byte(tiny_job):
    """A memory job (GPT-2 tiny, 16 x 64: activations make the plain peak). Offloaded, the
    device keeps no saved activation at its peak (what stays on the device, saved after the
    model's forward or under 1024 bytes, is freed by then); the host holds one forward's
    offloaded bytes, each in its power-of-two block, and the transfers are twice those
    bytes. The simulated run equals the tracked one, host ledger included."""
    job = dict(batch_size=16, seq_len=64, dropout=0.0)
    base = runner.run(tiny_job(method="adamw", **job))
    ours = runner.run(tiny_job(method="offload_activations", **job))
    fake = runner.run(tiny_job(method="offload_activations", simulate=True, **job))
    assert base["status"] == ours["status"] == fake["status"] == "ok", (ours.get("message"), fake.get("message"))
    mem, base_mem, report = ours["memory"], base["memory"], ours["method_report"]
    assert ours["loss"] == base["loss"]
    assert base_mem["host_peak_bytes"] == base_mem["transfer_bytes"] == 0
    assert mem["transfer_bytes"] == 2 * report["offloaded_bytes"]
    assert report["offloaded_bytes"] <= mem["host_peak_bytes"] < 2 * report["offloaded_bytes"]
    assert mem["peak_bytes"] < base_mem["peak_bytes"] - base_mem["activation_bytes"] // 2
    for key in DEVICE_KEYS + HOST_KEYS:
        assert fake["memory"][key] == mem[key], key
    assert fake["method_report"] == report


STACKS = [  # (with offloading, the same without it, model)
    ("checkpointing+offload_activations", "checkpointing", "gpt2-tiny"),
    ("offload_activations+grad_accum", "grad_accum", "llama-tiny"),
    ("offload_activations+chunked_ce@chunk=16", "chunked_ce@chunk=16", "bert-tiny"),
    ("offload_activations+offload_optimizer", "adamw", "llama-tiny"),
    ("offload_optimizer+grad_accum", "grad_accum", "gpt2-tiny"),
]


@pytest.mark.parametrize("spec,plain,name", STACKS)
def test_stacked_same_step_as_without_offloading_float64(spec, plain, name):
    b = lm_batch(4, 12, 256, seed=2)
    ref, ref_method = model(name, plain)
    ours, method = model(name, spec)
    want = ref_method.train_step(ref, ref_method.make_optimizer(ref), b)
    got = method.train_step(ours, method.make_optimizer(ours), b)
    torch.testing.assert_close(got, want, rtol=1e-14, atol=0)
    for (key, p), q in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14, msg=key)


def test_with_checkpointing_only_what_is_saved_outside_the_blocks_moves(tiny_job):
    """Non-reentrant checkpointing's hooks are innermost inside each block: these hooks see
    each block's input and what is saved outside the blocks, so far fewer bytes move."""
    job = dict(batch_size=16, seq_len=64, dropout=0.0)
    alone = runner.run(tiny_job(method="offload_activations", **job))
    both = runner.run(tiny_job(method="checkpointing+offload_activations", **job))
    fake = runner.run(tiny_job(method="checkpointing+offload_activations", simulate=True, **job))
    assert alone["status"] == both["status"] == fake["status"] == "ok", both.get("message")
    moved = both["method_report"]["offload_activations"]["offloaded_bytes"]
    moved_alone = alone["method_report"]["offloaded_bytes"]
    assert 0 < 4 * moved < moved_alone
    width = models.shape("gpt2-tiny")[0]
    assert moved >= 2 * 16 * 64 * width * 4  # at least the two blocks' inputs (float32)
    assert both["memory"]["transfer_bytes"] == 2 * moved
    # the named difference of the simulated tier (tests/methods/test_simulated.py): on fake
    # tensors Hugging Face makes the causal mask a tensor, here an input of both blocks
    # (16 x 64 x 64 booleans), which the checkpoints keep, so it is offloaded twice
    mask = 16 * 64 * 64
    assert fake["memory"]["host_peak_bytes"] - both["memory"]["host_peak_bytes"] == 2 * mask
    assert fake["memory"]["transfer_bytes"] - both["memory"]["transfer_bytes"] == 2 * 2 * mask
    for key in ("param_bytes", "grad_bytes", "optimizer_bytes"):
        assert fake["memory"][key] == both["memory"][key], key


# -- offload_optimizer ------------------------------------------------------------------------

def test_torchaos_cpu_offload_optimizer_needs_a_gpu():
    cpu_offload = pytest.importorskip("torchao.optim.cpu_offload")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: torchao's optimizer runs")
    with pytest.raises(AssertionError, match="only supports CUDA"):
        cpu_offload.CPUOffloadOptimizer([torch.nn.Parameter(torch.zeros(4096))])


@pytest.mark.parametrize("spec", ["offload_optimizer", "offload_optimizer@offload_gradients=true",
                                  "offload_optimizer@minimal_size=1"])
# not GPT-2: its key bias has a zero gradient up to rounding, which Adam turns into a
# full-size step of random sign (the fused host kernel and the loop round differently)
@pytest.mark.parametrize("name", ["bert-tiny", "llama-tiny"])
def test_optimizer_equals_adamw_float64_over_steps(name, spec):
    hp = dict(lr=1e-2, weight_decay=0.1)
    ref, _ = model(name)
    ours, method = model(name, spec)
    adamw = load("adamw", hp)
    method.hp.update(hp)
    ref_opt, opt = adamw.make_optimizer(ref), method.make_optimizer(ours)
    offloaded = set(map(id, opt.host_of))
    assert offloaded and (spec.endswith("=1") or len(offloaded) < len(list(ours.parameters())))
    for step in range(3):
        b = lm_batch(2, 12, 256, seed=step)
        want = adamw.train_step(ref, ref_opt, b)
        got = method.train_step(ours, opt, b)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    start, moved = model(name)[0], 0.0
    for (key, p), q, p0 in zip(ours.named_parameters(), ref.parameters(), start.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-13, msg=key)
        if id(p) in offloaded:
            assert torch.equal(opt.host_of[p], p)  # the host copy is the parameter
            moved = max(moved, float((p - p0).detach().abs().max()))
    assert moved > 1e-3  # the offloaded parameters were trained


def test_offload_gradients_refuses_accumulation():
    method = load("offload_optimizer@offload_gradients=true+grad_accum")
    with pytest.raises(MethodError, match="cannot accumulate"):
        method.make_optimizer(model("gpt2-tiny")[0])


def offloaded_and_small(name="gpt2-tiny", minimal_size=4096):
    torch.manual_seed(0)
    params = list(models.build(name).parameters())  # tiny_job's dtype: float32
    return ([p for p in params if p.numel() >= minimal_size], [p for p in params if p.numel() < minimal_size])


def nbytes(p):
    return p.numel() * p.element_size()


@pytest.mark.parametrize("micro_batches", [1, 4])
def test_optimizer_job_bytes_to_the_byte_and_simulated(tiny_job, micro_batches):
    """GPT-2 tiny, batch 4 x 32, float32. Offloaded, the device keeps the small parameters'
    state only (exp_avg, exp_avg_sq and a 4-byte step each), so the optimizer category drops
    by the offloaded parameters' state, 2 b + 4 each, and nothing is added on the device:
    at every moment the device holds at least that much less, so the peak drops by at least
    it. In one micro-batch both peaks are in backward (activations, some gradients), where
    nothing else differs: it drops by exactly that. In four, AdamW's peak is in its
    multi-tensor step, whose temporaries shrink too. The host holds per offloaded parameter its
    copy, gradient, exp_avg, exp_avg_sq (a power-of-two block of b each) and the step (4);
    per step, each gradient crosses once per micro-batch and each parameter once back."""
    suffix = "+grad_accum" if micro_batches > 1 else ""
    base = runner.run(tiny_job(method="adamw" + suffix))
    ours = runner.run(tiny_job(method="offload_optimizer" + suffix))
    fake = runner.run(tiny_job(method="offload_optimizer" + suffix, simulate=True))
    assert base["status"] == ours["status"] == fake["status"] == "ok", (ours.get("message"), fake.get("message"))
    large, small = offloaded_and_small()
    mem, base_mem = ours["memory"], base["memory"]
    assert mem["optimizer_bytes"] == sum(2 * nbytes(p) + 4 for p in small)
    moved_state = sum(2 * nbytes(p) + 4 for p in large)
    assert base_mem["optimizer_bytes"] - mem["optimizer_bytes"] == moved_state
    drop = base_mem["peak_bytes"] - mem["peak_bytes"]
    assert drop == moved_state if micro_batches == 1 else drop > moved_state
    assert mem["host_peak_bytes"] == sum(4 * block(nbytes(p)) + 4 for p in large)
    assert mem["transfer_bytes"] == (micro_batches + 1) * sum(nbytes(p) for p in large)
    assert ours["loss"] == pytest.approx(base["loss"], rel=1e-6)
    for key in DEVICE_KEYS + HOST_KEYS:
        assert fake["memory"][key] == mem[key], key


def test_offload_gradients_frees_the_large_gradients(tiny_job):
    kept = runner.run(tiny_job(method="offload_optimizer", batch_size=16, seq_len=64))
    freed = runner.run(tiny_job(method="offload_optimizer@offload_gradients=true", batch_size=16, seq_len=64))
    assert kept["status"] == freed["status"] == "ok", freed.get("message")
    large, small = offloaded_and_small()
    assert freed["memory"]["grad_bytes"] <= sum(nbytes(p) for p in small) + max(nbytes(p) for p in large)
    assert freed["memory"]["peak_bytes"] < kept["memory"]["peak_bytes"]
    assert freed["memory"]["host_peak_bytes"] == kept["memory"]["host_peak_bytes"]
