"""The simulated tier (fake tensors) against the tracked tier (real tensors)."""
import resource

import pytest

from bench.measure import runner
from bench.job import CATEGORIES
from bench.method import available, load
from conftest import memory_pair, pair_group

BASELINES = ["adamw", "grad_accum", "checkpointing", "checkpointing+grad_accum"]


# The runs are memory_pair's: tests/unit/test_cost.py compares the FLOPs of the same pair
@pytest.mark.parametrize("method, model", [pytest.param(method, model, marks=pair_group(method, model))
                                           for method in BASELINES
                                           for model in ("gpt2-tiny", "bert-tiny", "llama-tiny")])
def test_simulated_equals_tracked(model, method):
    real, fake = memory_pair(method, model)
    assert real["status"] == fake["status"] == "ok", (real.get("message"), fake.get("message"))
    assert fake["memory"]["tier"] == "simulated" and fake["loss"] is None
    r, f = real["memory"], fake["memory"]
    if "checkpointing" in method and model != "bert-tiny":
        # Named difference: on fake tensors Hugging Face materialises the causal attention
        # mask (micro-batch x seq x seq booleans) instead of passing is_causal to SDPA, and
        # under checkpointing such masks are alive at the peak (kept for, or made by, the
        # recomputation). The simulated peak is higher by a few whole masks, nothing else.
        micro_batch = 4 // (4 if "grad_accum" in method else 1)
        mask = micro_batch * 32 * 32
        diff = f["peak_bytes"] - r["peak_bytes"]
        assert diff % mask == 0 and 0 <= diff <= 8 * mask
        for c in ("param", "grad", "optimizer"):
            assert f[f"{c}_bytes"] == r[f"{c}_bytes"]
    else:
        for c in CATEGORIES:
            assert f[f"{c}_bytes"] == r[f"{c}_bytes"], c
        assert f["peak_bytes"] == r["peak_bytes"]


@pytest.mark.parametrize("method", [pytest.param(m, marks=pair_group(m)) for m in available() if m not in BASELINES])
def test_every_method_simulates_as_it_runs(method):
    """Byte for byte as its real run, or, where the method declares `simulates = False`,
    the clear message: the declaration is checked against what happens, both ways. (A
    package's one-time allocation is paid before the real run: conftest.FIRST_USE.)"""
    real, fake = memory_pair(method)
    assert real["status"] == "ok", real.get("message")
    if not load(method).simulates:
        assert fake["status"] == "error" and "cannot run on fake tensors" in fake["message"]
        return
    assert fake["status"] == "ok", fake.get("message")
    for c in CATEGORIES:
        assert fake["memory"][f"{c}_bytes"] == real["memory"][f"{c}_bytes"], c
    for key in ("host_peak_bytes", "transfer_bytes"):  # the host ledger (offloading methods)
        assert fake["memory"][key] == real["memory"][key], key


def test_paper_sized_model_simulates_without_its_memory(tiny_job):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    record = runner.run(tiny_job(model="llama-1b", dtype="bfloat16", batch_size=1, seq_len=256,
                                 simulate=True))
    assert record["status"] == "ok", record.get("message")
    mem = record["memory"]
    assert mem["param_bytes"] == 2 * record["n_params"]  # bfloat16
    assert mem["peak_bytes"] > 4 * 2**30  # params + grads + AdamW state alone exceed 4 GiB
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    assert grown < 1 * 2**30  # the process never held the model


def test_simulate_is_for_memory_on_cpu(tiny_job):
    record = runner.run(tiny_job(kind="throughput", simulate=True))
    assert record["status"] == "error" and "memory and capacity jobs" in record["message"]


def test_a_method_that_needs_values_is_reported_not_crashed(tiny_job):
    from bench.method import Method

    class NeedsValues(Method):
        paper = "a step that reads a loss value"

        def train_step(self, model, optimizer, batch):
            loss = super().train_step(model, optimizer, batch)
            if loss.item() > 1e9:  # data-dependent: impossible on fake tensors
                raise AssertionError
            return loss

    real = runner.run(tiny_job(), method=NeedsValues())
    fake = runner.run(tiny_job(simulate=True), method=NeedsValues())
    assert real["status"] == "ok"
    assert fake["status"] == "error" and "cannot run on fake tensors" in fake["message"]
