"""MemoryTracker against bytes computed by hand and against PyTorch's own MemTracker."""
import pytest
import torch
from torch import nn

from bench.measure.tracker import CapacityExceeded, MemoryTracker
from bench.method import load
from bench import models

B, D_IN, D_HID, D_OUT = 8, 16, 32, 4
F32 = 4


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, D_HID), nn.ReLU(), nn.Linear(D_HID, D_OUT))


def param_bytes():
    return (D_IN * D_HID + D_HID + D_HID * D_OUT + D_OUT) * F32


def test_categories_by_hand():
    model, x, y = mlp(), torch.randn(B, D_IN), torch.randn(B, D_OUT)
    opt = torch.optim.AdamW(model.parameters())
    tracker = MemoryTracker()
    tracker.register_model(model)
    tracker.register([x, y], "other")
    with tracker:
        loss = nn.functional.mse_loss(model(x), y)
        after_forward = tracker.live_split()
        loss.backward()
        after_backward = tracker.live_split()
        opt.step()
        tracker.label([t for s in opt.state.values() for t in s.values()], "optimizer")
        opt.zero_grad(set_to_none=True)
        del loss
        after_step = tracker.live_split()

    assert after_forward.param == param_bytes()
    # saved for backward: ReLU's output (B x D_HID) and the model output kept by mse (B x D_OUT);
    # inputs are registered as `other` and keep that label; weights stay `param`.
    assert after_forward.activation == B * (D_HID + D_OUT) * F32
    assert after_forward.grad == 0
    assert after_backward.activation == 0
    assert after_backward.grad == param_bytes()
    # AdamW: exp_avg and exp_avg_sq per parameter, plus a float32 step counter per tensor
    assert after_step.optimizer == 2 * param_bytes() + 4 * F32
    assert after_step.grad == 0
    assert after_step.other == (B * D_IN + B * D_OUT) * F32


def test_peak_split_adds_up_and_is_max():
    model, x, y = mlp(), torch.randn(B, D_IN), torch.randn(B, D_OUT)
    tracker = MemoryTracker()
    tracker.register_model(model)
    tracker.register([x, y], "other")
    seen = []
    with tracker:
        out = model(x)
        seen.append(tracker.current)
        nn.functional.mse_loss(out, y).backward()
        seen.append(tracker.current)
    assert tracker.peak_split.peak_bytes == tracker.peak
    assert tracker.peak >= max(seen)


def test_views_share_one_storage():
    tracker = MemoryTracker()
    with tracker:
        a = torch.zeros(1000)
        b = a[:10]
        c = a.view(10, 100)
        assert tracker.current == 1000 * F32
        del a, b, c
    assert tracker.current == 0


def test_capacity_raises():
    tracker = MemoryTracker(capacity_bytes=1000)
    with pytest.raises(CapacityExceeded):
        with tracker:
            torch.zeros(1000)


def test_matches_pytorch_memtracker_peak():
    """Independent reference: torch.distributed._tools.mem_tracker counts the same storages."""
    from torch.distributed._tools.mem_tracker import MemTracker

    def step_fn():
        torch.manual_seed(0)
        model = models.build("gpt2-tiny", dropout=0.0)
        method = load("adamw")
        batch = {"input_ids": torch.randint(0, 256, (4, 32))}
        batch["labels"] = batch["input_ids"].clone()
        return model, method, method.make_optimizer(model), batch

    model, method, opt, batch = step_fn()
    ours = MemoryTracker()
    ours.register_model(model)
    ours.register(batch.values(), "other")
    with ours:
        for _ in range(2):
            method.train_step(model, opt, batch)

    model, method, opt, batch = step_fn()
    ref = MemTracker()
    ref.track_external(model, opt, *batch.values())
    with ref:
        for i in range(2):
            method.train_step(model, opt, batch)
            if i == 0:
                ref.reset_mod_stats()
    ref_peak = ref.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    assert ours.peak == ref_peak


def test_cpu_memory_jobs_keep_what_cuda_kernels_keep():
    import torch.nn.functional as F

    from bench.measure.tracker import cuda_kernels

    x = torch.randn(2, 4, 64, 16, requires_grad=True)

    def saved_by(fn):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            fn()
        return saved

    plain_dropout = saved_by(lambda: F.dropout(x, 0.1))
    plain_sdpa = saved_by(lambda: F.scaled_dot_product_attention(x, x, x, dropout_p=0.1))
    with cuda_kernels():
        fused_dropout = saved_by(lambda: F.dropout(x, 0.1))
        fused_sdpa = saved_by(lambda: F.scaled_dot_product_attention(x, x, x, dropout_p=0.1))
    assert [t.dtype for t in plain_dropout] == [torch.float32]  # CPU: a float mask
    assert [t.dtype for t in fused_dropout] == [torch.bool]  # CUDA: one byte per element
    square = lambda saved: [t for t in saved if t.shape[-2:] == (64, 64)]
    assert len(square(plain_sdpa)) >= 2 and square(fused_sdpa) == []
    assert F.dropout.__name__ == "dropout"  # restored


def test_a_step_that_fails_before_backward_leaves_no_activation_alive():
    """An output saved by its own grad_fn (sigmoid keeps its result) makes a cycle through
    the tracker's saved-tensor hook that Python's collector cannot see; a step that fails
    before backward (out of memory in a capacity probe) must not leave it behind."""
    import gc
    import weakref

    lin = torch.nn.Linear(8, 8)
    with pytest.raises(RuntimeError, match="probe"):
        with MemoryTracker():
            y = torch.sigmoid(lin(torch.randn(4, 8)))
            alive = weakref.ref(y)
            del y
            raise RuntimeError("probe ran out of memory")
    gc.collect()
    assert alive() is None
