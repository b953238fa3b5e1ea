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
    for spec in JOBS:
        result = runner.run(Job(kind="memory", batch_size=4, seq_len=32, simulate=True, **spec))
        assert result["status"] == "ok", (spec, result["message"])
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
    for spec in JOBS:
        result = runner.run(Job(kind="memory", batch_size=4, seq_len=32, simulate=True, **spec))
        assert result["status"] == "ok", (spec, result["message"])
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
