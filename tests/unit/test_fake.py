"""The simulated tier's fake mode (`bench.measure.fake`): the key it builds for the dispatch
cache is PyTorch's own, operator for operator, so it caches, hits and misses exactly as
FakeTensorMode does, and every simulated byte stays what it was."""
from torch._subclasses.fake_tensor import FakeTensorMode, _BypassDispatchCache

from bench.job import Job
from bench.measure import fake, runner

# simulated memory jobs whose operators cover what steps pass: dtypes, autocast and the
# loss scaler, quantised state and activations, NF4 weights, recomputation, DTensors
JOBS = [
    dict(method="adamw", model="gpt2-tiny"),
    dict(method="adamw", model="llama-tiny", dtype="bfloat16"),
    dict(method="adamw", model="bert-tiny", dtype="float16", precision="mixed"),
    dict(method="mesa8bit", model="llama-tiny"),
    dict(method="qlora", model="llama-tiny", dtype="bfloat16"),
    dict(method="galore", model="gpt2-tiny"),
    dict(method="checkpointing", model="llama-tiny"),
    dict(method="adamw", model="llama-tiny", sharding="fsdp", world_size=2),
]


def _run_jobs() -> None:
    for spec in JOBS:
        result = runner.run(Job(kind="memory", batch_size=4, seq_len=32, simulate=True, **spec))
        assert result["status"] == "ok", (spec, result["message"])


def _run_jobs_dispatching(monkeypatch, dispatch) -> None:
    """`_run_jobs` with `FakeMode.dispatch` replaced by `dispatch(ours, mode, func, types, args,
    kwargs)`, `ours` being FakeMode's own."""
    ours = fake.FakeMode.dispatch
    monkeypatch.setattr(fake.FakeMode, "dispatch", lambda mode, func, types, args=(), kwargs=None:
                        dispatch(ours, mode, func, types, args, kwargs or {}))
    _run_jobs()

def _key(build, *args):
    try:
        key = build(*args).key
    except _BypassDispatchCache as e:  # not cached: both must say so, for the same reason
        return ("not cached", str(e))
    return repr(key)  # (a NaN argument is not equal to itself; its repr is)


def test_every_operators_key_is_pytorchs_own(monkeypatch):
    compared = []
    build = fake.FakeMode._cache_key  # FakeTensorMode's, which walks the arguments with our walk

    def both(self, state, func, args, kwargs):
        ours = _key(build, self, state, func, args, kwargs)
        with monkeypatch.context() as m:  # PyTorch's own walk
            m.setattr(fake.FakeMode, "_prep_args_for_hash", FakeTensorMode._prep_args_for_hash)
            own = _key(build, self, state, func, args, kwargs)
        assert ours == own, func
        compared.append(ours[0] != "not cached")
        if not compared[-1]:
            raise _BypassDispatchCache(own[1])
        return build(self, state, func, args, kwargs)

    monkeypatch.setattr(fake.FakeMode, "_cache_key", both)
    _run_jobs()
    assert sum(compared) > 5000 and len(compared) > sum(compared)  # keys built, and bypasses


def _same_tensor(ours, own) -> None:
    """Two cache hits' outputs are the same tensor to every reader: type, metadata, the
    storage a view shares, dispatch keys, and the attributes FakeTensor keeps."""
    import torch

    if not isinstance(own, torch.Tensor):
        assert ours is own or ours == own
        return
    assert type(ours) is type(own)
    assert (ours.shape, ours.stride(), ours.storage_offset(), ours.dtype, ours.device, ours.requires_grad) == \
        (own.shape, own.stride(), own.storage_offset(), own.dtype, own.device, own.requires_grad)
    assert ours.untyped_storage().nbytes() == own.untyped_storage().nbytes()
    assert torch._C._dispatch_keys(ours) == torch._C._dispatch_keys(own)
    assert ours.__dict__ == own.__dict__


def test_every_cache_hits_output_is_pytorchs_own(monkeypatch):
    """`FakeMode` makes a cache hit's output tensor directly: the same tensor PyTorch's own
    method makes, for every hit of the training steps."""
    import torch

    made = []
    ours = fake.FakeMode._get_output_tensor_from_cache_entry

    def both(self, state, entry, key, func, args):
        out = ours(self, state, entry, key, func, args)
        own = FakeTensorMode._get_output_tensor_from_cache_entry(self, state, entry, key, func, args)
        _same_tensor(out, own)
        if isinstance(func, torch._ops.OpOverload) and func.is_view and isinstance(own, torch.Tensor):
            assert out.untyped_storage()._cdata == own.untyped_storage()._cdata  # the input's storage
        made.append(entry.metadata is not None and entry.inplace_idx is None)
        return out

    monkeypatch.setattr(fake.FakeMode, "_get_output_tensor_from_cache_entry", both)
    _run_jobs()
    assert sum(made) > 5000


def test_the_trackers_device_answer_is_the_fake_modes():
    """The tracker answers a fake tensor's device (`prim.device`) itself: what FakeTensorMode
    answers, on a fake CPU and a fake CUDA tensor."""
    import torch

    from bench.measure.tracker import MemoryTracker

    mode = fake.FakeMode()
    with mode:
        tensors = [torch.empty(2, 3), torch.empty(2, 3, device="cuda")]
    for t in tensors:
        with mode:
            own = torch.ops.prim.device.default(t)
        with mode, MemoryTracker():
            ours = torch.ops.prim.device.default(t)
        assert ours == own == t.device and ours.type in ("cpu", "cuda")


def _beside_pytorchs(monkeypatch, op, check) -> int:
    """`_run_jobs`, with `check(ours, own, args)` at each call of `op`: FakeMode's output and
    PyTorch's (FakeTensorMode's `dispatch`) for the same arguments; returns the calls checked."""
    calls = []

    def both(ours, mode, func, types, args, kwargs):
        out = ours(mode, func, types, args, kwargs)
        if func is op:
            check(out, FakeTensorMode.dispatch(mode, func, types, args, kwargs), args)
            calls.append(func)
        return out

    _run_jobs_dispatching(monkeypatch, both)
    return len(calls)


def test_an_unsafe_views_output_is_pytorchs_own(monkeypatch):
    """`FakeMode` runs `aten._unsafe_view` as the view PyTorch's decomposition of it runs, through
    the cache (PyTorch leaves it out): the same tensor, on its input's storage, every time the
    training steps call it."""
    import torch

    def same(out, own, args):
        _same_tensor(out, own)
        assert out.untyped_storage()._cdata == own.untyped_storage()._cdata == args[0].untyped_storage()._cdata

    assert _beside_pytorchs(monkeypatch, torch.ops.aten._unsafe_view.default, same) > 100


def test_an_items_number_is_pytorchs_own(monkeypatch):
    """`FakeMode` answers `item()` of a constant (`aten._local_scalar_dense`; an optimizer's
    step count) with the number it holds, as PyTorch's mode does outside its cache: the same
    number, of the same type, every time the training steps ask."""
    import torch

    constants = []

    def same(out, own, args):
        assert type(out) is type(own) and out == own
        constants.append(args[0].constant is not None)

    assert _beside_pytorchs(monkeypatch, torch.ops.aten._local_scalar_dense.default, same) > 100
    assert sum(constants) > 100


def test_an_inplace_foreach_with_numbers_is_pytorchs_own(monkeypatch):
    """`FakeMode` keys an in-place foreach operator's numbers (`_foreach_div_.ScalarList`:
    AdamW's step sizes) by their types: it returns what PyTorch's mode returns with the numbers
    themselves (nothing) and leaves the tensors' metadata as that does; and a step's call hits
    the cache where the numbers are new (PyTorch's key, made of them, would miss)."""
    import torch

    calls, by_types = [], []
    seen = set()  # the calls so far, numbers and all

    def metadata(args) -> list:
        return [(t.shape, t.stride(), t.dtype) for a in args if type(a) is list
                for t in a if isinstance(t, torch.Tensor)]

    def both(ours, mode, func, types, args, kwargs):
        if not fake._number_lists(func):
            return ours(mode, func, types, args, kwargs)
        before, hits = metadata(args), FakeTensorMode.cache_hits
        out = ours(mode, func, types, args, kwargs)
        hit = FakeTensorMode.cache_hits > hits
        assert out is FakeTensorMode.dispatch(mode, func, types, args, kwargs) is None
        assert metadata(args) == before
        call = (func, repr(args))
        if hit and call not in seen:
            by_types.append(func)
        seen.add(call)
        calls.append(func)
        return out

    _run_jobs_dispatching(monkeypatch, both)
    assert len(calls) > 20 and torch.ops.aten._foreach_addcdiv_.ScalarList in by_types
