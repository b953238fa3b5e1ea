"""On a CUDA GPU: Tempo's layers and ROAM's planned step against eager PyTorch, the
measured memory tier against the tracker and the simulated tier, a capped-allocator
capacity search, and paired timing with synchronisation. Skipped without a GPU."""
import copy

import pytest
import torch

from bench import models
from bench.measure import runner, step
from bench.method import load, lm_loss
from conftest import lm_batch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
F64 = torch.float64


def on_cuda(batch):
    return {k: v.cuda() for k, v in batch.items()}


@pytest.mark.parametrize("dropout", [0.1, 0.0])
@pytest.mark.parametrize("name", ["bert-tiny", "gpt2-tiny"])
def test_tempo_whole_model_same_loss_and_gradients_on_cuda(name, dropout):
    torch.manual_seed(0)
    base = models.build(name, "eager", dropout).to("cuda", F64).train()
    tempo_model = load("tempo").transform_model(copy.deepcopy(base))
    batch = on_cuda(lm_batch(n=2, t=24))
    losses = []
    for model in (base, tempo_model):
        torch.manual_seed(1)  # the same dropout masks
        loss = lm_loss(model, batch)
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-12, atol=0)
    scale = max(p.grad.abs().max() for p in base.parameters())
    for (name_, p), q in zip(base.named_parameters(), tempo_model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-7, atol=1e-10 * scale, msg=name_)


def test_roam_planned_step_equals_eager_adamw_on_cuda():
    torch.manual_seed(0)
    eager = models.build("gpt2-tiny", dropout=0.0).to("cuda", F64)
    planned = copy.deepcopy(eager)
    adamw, roam = load("adamw"), load("roam", {"time_limit": 0.5})
    opt_e, opt_r = adamw.make_optimizer(eager), roam.make_optimizer(planned)
    for i in range(2):
        batch = on_cuda(lm_batch(4, 32, seed=i))
        loss_e = adamw.train_step(eager, opt_e, batch)
        loss_r = roam.train_step(planned, opt_r, batch)
        torch.testing.assert_close(loss_r, loss_e, rtol=1e-10, atol=1e-12)
    for p, q in zip(eager.parameters(), planned.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("method", ["adamw", "checkpointing", "adama"])
def test_measured_tier_adds_up_and_the_simulation_predicts_it(tiny_job, method):
    job = dict(method=method, model="llama-tiny", batch_size=8, seq_len=64)
    measured = runner.run(tiny_job(device="cuda", **job))
    simulated = runner.run(tiny_job(simulate=True, **job))
    assert measured["status"] == simulated["status"] == "ok", measured.get("message")
    m, s = measured["memory"], simulated["memory"]
    assert m["tier"] == "measured"
    assert sum(m[f"{c}_bytes"] for c in ("param", "grad", "optimizer", "activation", "other")) \
        == m["peak_bytes"]
    # the allocator's peak covers the tracked live bytes; beyond them, only what the tracker
    # cannot see (cuBLAS workspaces, allocated through the caching allocator: a few tens of
    # MiB on an H100, seen as 75-81 MiB in the first run) and 512-byte rounding
    assert m["peak_bytes"] >= m["tracked_peak_bytes"]
    assert 0 <= m["peak_bytes"] - s["predicted_allocated_peak_bytes"] <= 128 * 2**20
    for c in ("param", "grad", "optimizer"):
        assert m[f"{c}_bytes"] == pytest.approx(s[f"{c}_bytes"], rel=0.02, abs=64 * 1024), c


def test_capacity_search_with_a_capped_allocator(tiny_job):
    record = runner.run(tiny_job(kind="capacity", method="adamw", model="llama-tiny",
                                 device="cuda", batch_size=64, seq_len=64,
                                 memory_gb=[0.05, 0.1]))
    assert record["status"] == "ok", record.get("message")
    found = record["capacity"]
    assert found["tier"] == "measured"
    answers = [s["largest_batch"] for s in found["sizes"]]
    assert answers == sorted(answers) and answers[-1] > 0


def test_paired_throughput_on_cuda(tiny_job):
    record = runner.run(tiny_job(kind="throughput", method="grad_accum", model="gpt2-tiny",
                                 device="cuda", batch_size=16, seq_len=64, steps=16, rounds=8))
    assert record["status"] == "ok", record.get("message")
    t = record["throughput"]
    assert t["baseline"] == "adamw" and len(t["round_ratios"]) == 8
    assert t["throughput_ratio_lo"] <= t["throughput_ratio"] <= t["throughput_ratio_hi"]
    assert t["parked"] is False  # two tiny models fit side by side


def test_paired_throughput_parks_the_idle_side_when_told_to(tiny_job, monkeypatch):
    from bench.measure import timing
    monkeypatch.setattr(timing, "must_park", lambda device: True)
    record = runner.run(tiny_job(kind="throughput", method="adama", model="gpt2-tiny",
                                 device="cuda", batch_size=16, seq_len=64, steps=8, rounds=4))
    assert record["status"] == "ok", record.get("message")
    assert record["throughput"]["parked"] is True and len(record["throughput"]["round_ratios"]) == 4
    assert step.cuda_left("cuda") <= step.LEFT_OK_BYTES  # nothing left behind on the GPU
