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
