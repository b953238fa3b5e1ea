"""The estimated step time (bench.estimate): the roofline of one operator, the efficiency
fit on synthetic data, and the summary's estimated columns."""
import json
import random

import pytest
import torch

from bench import estimate
from bench.estimate import GPUS
from bench.measure.cost import StepCost
from bench.report import aggregate


def _matmul_ops(m, k, n, dtype):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # shapes only: a paper-sized matmul costs nothing to count
        a, b = torch.empty(m, k, dtype=dtype), torch.empty(k, n, dtype=dtype)
        with StepCost() as cost:
            a @ b
    return cost.result()["per_op"]


@pytest.mark.parametrize("gpu", sorted(GPUS))
@pytest.mark.parametrize("shape", [(4096, 4096, 4096), (8, 4096, 8)])  # compute- / bandwidth-bound
def test_single_matmul_is_max_of_compute_and_bandwidth_plus_launch(gpu, shape):
    m, k, n = shape
    ops = _matmul_ops(m, k, n, torch.bfloat16)
    assert [r[1:] for r in ops] == [["mm", "bfloat16", 2 * m * k * n, 2 * (m * k + k * n + m * n), 1]]
    spec = GPUS[gpu]
    peak = spec.tflops.get("bf16", spec.tflops["fp32"]) * 1e12
    flops, moved = 2 * m * k * n, 2 * (m * k + k * n + m * n)
    expected = max(flops / peak, moved / (spec.bandwidth_gbs * 1e9)) + estimate.LAUNCH_S
    assert estimate.estimate(ops, gpu) == expected


def test_h100_big_matmul_is_compute_bound_and_small_one_bandwidth_bound():
    big = estimate.components(_matmul_ops(4096, 4096, 4096, torch.bfloat16), "h100-sxm-80gb")
    small = estimate.components(_matmul_ops(8, 4096, 8, torch.bfloat16), "h100-sxm-80gb")
    assert big["memory_s"] == 0 and big["compute_s"] == pytest.approx(2 * 4096 ** 3 / 989.5e12)
    assert small["compute_s"] == 0 and small["memory_s"] > 0


def test_float32_uses_the_fp32_rate_unless_tf32():
    ops = _matmul_ops(4096, 4096, 4096, torch.float32)
    flops = 2 * 4096 ** 3
    h100 = GPUS["h100-sxm-80gb"]
    assert estimate.components(ops, h100)["compute_s"] == pytest.approx(flops / 67e12)
    assert estimate.components(ops, h100, tf32=True)["compute_s"] == pytest.approx(flops / 494.5e12)


def test_every_gpu_states_dense_figures_and_a_source():
    for key, gpu in GPUS.items():
        assert gpu.source and gpu.bandwidth_gbs > 0 and gpu.tflops["fp32"] > 0, key
        assert "dense" in gpu.source or "halved for dense" in gpu.source, key
    # spot checks against the sheets (dense = the sparsity figure / 2)
    assert GPUS["h100-sxm-80gb"].tflops["bf16"] == 1979 / 2
    assert GPUS["a100-sxm-80gb"].tflops["bf16"] == 624 / 2


def _synthetic_step(rng):
    """A step's per-operator rows of random sizes: big matmuls, small ones, elementwise."""
    rows = []
    for _ in range(rng.randint(5, 30)):
        n = rng.choice([64, 512, 2048, 8192])
        rows.append(["forward", "mm", "bfloat16", 2 * n ** 3, 6 * n * n, rng.randint(1, 20)])
    for _ in range(rng.randint(5, 30)):
        rows.append(["backward", "mul", "bfloat16", 0, rng.randint(1, 10 ** 8), rng.randint(1, 200)])
    return rows


def test_efficiency_fit_recovers_known_factors():
    rng = random.Random(0)
    true = {"compute": 0.62, "memory": 0.81, "launch_s": 7.5e-6}
    steps = [_synthetic_step(rng) for _ in range(12)]
    samples = [(ops, estimate.estimate(ops, "h100-sxm-80gb", true)) for ops in steps]
    fit = estimate.fit_efficiency(samples, "h100-sxm-80gb")
    for k, v in true.items():
        assert fit[k] == pytest.approx(v, rel=1e-6), k
    assert fit["max_relative_error"] < 1e-9 and fit["n_samples"] == 12
    # the calibrated estimate then reproduces a new step's time
    ops = _synthetic_step(rng)
    assert estimate.estimate(ops, "h100-sxm-80gb", estimate._usable(fit)) == pytest.approx(
        estimate.estimate(ops, "h100-sxm-80gb", true), rel=1e-6)


def test_efficiency_fit_with_noise_and_an_absent_term():
    """Steps with no compute-bound operator cannot tell the compute efficiency: None, not a
    made-up number; 2% noise on the times moves the factors by about as much."""
    rng = random.Random(1)
    steps = [[r for r in _synthetic_step(rng) if r[3] == 0] for _ in range(20)]
    true = {"memory": 0.7, "launch_s": 1e-5}
    samples = [(ops, estimate.estimate(ops, "a100-sxm-80gb", true) * (1 + rng.uniform(-0.02, 0.02)))
               for ops in steps]
    fit = estimate.fit_efficiency(samples, "a100-sxm-80gb")
    assert fit["compute"] is None
    assert fit["memory"] == pytest.approx(0.7, rel=0.05)
    assert fit["launch_s"] == pytest.approx(1e-5, rel=0.2)


def test_calibration_from_records_pairs_throughput_with_memory_costs(tmp_path):
    rng = random.Random(2)
    true = {"compute": 0.5, "memory": 0.9, "launch_s": 4e-6}
    records = []
    for i in range(4):
        ops = _synthetic_step(rng)
        job = {"method": "adamw", "model": "m", "batch_size": i + 1, "seq_len": 8, "dtype": "bfloat16"}
        records.append({"job": {**job, "kind": "memory"}, "status": "ok", "cost": {"per_op": ops}})
        records.append({"job": {**job, "kind": "throughput"}, "status": "ok",
                        "provenance": {"device_name": "NVIDIA H100 80GB HBM3"},
                        "throughput": {"step_time_median_s": estimate.estimate(ops, "h100-sxm-80gb", true)}})
    samples = estimate.samples_from_records(records, "H100")
    assert len(samples) == 4
    assert estimate.samples_from_records(records, "A100") == []
    for i, r in enumerate(records):
        (tmp_path / f"r{i}.json").write_text(json.dumps(r))
    out = tmp_path / "eff.json"
    from bench.measure import records as results

    assert all(results.read(tmp_path / f"r{i}.json") for i in range(len(records)))  # readable
    assert estimate.main([str(tmp_path / f"r{i}.json") for i in range(len(records))]
                         + ["--gpu", "h100-sxm-80gb", "--device-contains", "H100", "--out", str(out)]) == 0
    fit = estimate.load_calibration(out)["h100-sxm-80gb"]
    assert fit["compute"] == pytest.approx(0.5, rel=1e-6) and len(fit["fitted_from"]) == 8


def test_summary_has_cost_and_estimated_columns():
    ops = [["forward", "mm", "bfloat16", 2 * 10 ** 12, 10 ** 9, 3], ["optimizer", "mul", "bfloat16", 0, 10 ** 9, 5]]
    cost = {"flops": 6 * 10 ** 12, "bytes_moved": 8 * 10 ** 9, "ops": 8,
            "phases": {"forward": {"flops": 6 * 10 ** 12}, "optimizer": {"flops": 0}}, "per_op": ops}
    row = aggregate.cost_columns(cost, tokens=4096)
    fit = estimate.load_calibration().get("h100-sxm-80gb")  # the committed H100 fit, if any
    seconds = estimate.estimate(ops, "h100-sxm-80gb", estimate._usable(fit) if fit else None)
    assert row["flops"] == 6 * 10 ** 12 and row["flops_optimizer"] == 0 and row["flops_backward"] is None
    assert row["est_h100_step_time_s"] == seconds and row["est_h100_tokens_per_s"] == 4096 / seconds
    assert row["est_h100_calibrated"] is bool(fit)
    assert set(row) <= set(aggregate.SUMMARY_COLUMNS)
    assert all(v is None for v in aggregate.cost_columns(None, 4096).values())


def test_throughput_at_capacity_figure_draws_a_line_per_method(tmp_path, monkeypatch):
    from bench.report import fig_throughput_capacity as fig_module
    from bench.report.tables import read_summary

    monkeypatch.setattr(aggregate, "_calibration", dict)  # as before any GPU was fitted

    ops = [["forward", "mm", "float32", 10 ** 9, 10 ** 6, 4]]
    rows = []
    for method in ("adamw", "checkpointing"):
        for gb, batch in ((16, 2), (24, 0), (80, 9)):
            job = {"kind": "capacity", "method": method, "model": "gpt2-tiny", "batch_size": 64,
                   "seq_len": 128, "dtype": "float32", "device": "cpu", "task": "markov",
                   "seed": 0, "steps": 1}
            record = {"job": job, "status": "ok", "capacity": {"tier": "simulated", "sizes": [
                {"memory_gb": gb, "largest_batch": batch, "at_max_batch": False,
                 "needed_bytes_at_largest": 1, "cost_at_largest": {"per_op": ops} if batch else None}]}}
            rows += aggregate.summary_rows(record, "x.json")
    import pandas as pd

    path = tmp_path / "summary.csv"
    pd.DataFrame(rows, columns=aggregate.SUMMARY_COLUMNS).to_csv(path, index=False)
    summary = read_summary(path)
    table = fig_module.table(summary)
    big = table[(table.method == "adamw") & (table.capacity_gb == 80)]
    assert big["est_h100_tokens_per_s"].item() == pytest.approx(9 * 128 / estimate.estimate(ops, "h100-sxm-80gb"))
    assert table.loc[table.largest_batch == 0, "est_h100_tokens_per_s"].eq(0).all()
    figure = fig_module.figure(summary)
    assert len(figure.axes[0].get_lines()) == 2 and "uncalibrated" in figure._suptitle.get_text()
    written = fig_module.throughput_at_capacity(path, tmp_path / "fig")
    assert all(p.stat().st_size > 5000 for p in written)


def test_host_transfers_take_the_link_time_with_and_without_overlap():
    """transfer_bytes over the H100's PCIe Gen5 x16 (64 GB/s a direction): added to the
    step (no overlap) or the larger of the two (full overlap); no transfers, no change."""
    ops = [["forward", "mm", "bfloat16", 2 * 10 ** 12, 10 ** 9, 3]]
    cost = {"flops": 6 * 10 ** 12, "per_op": ops, "phases": {}}
    seconds = estimate.estimate(ops, "h100-sxm-80gb")
    row = estimate.estimate_row(cost, 4096, "h100-sxm-80gb", transfer_bytes=64 * 10 ** 9)
    assert row["est_transfer_s"] == pytest.approx(1.0)
    assert row["est_step_time_serial_s"] == pytest.approx(seconds + 1.0)
    assert row["est_step_time_overlap_s"] == pytest.approx(max(seconds, 1.0))
    assert row["est_step_time_s"] == seconds  # the compute estimate is unchanged
    none = estimate.estimate_row(cost, 4096, "h100-sxm-80gb", transfer_bytes=0)
    assert none["est_step_time_serial_s"] == none["est_step_time_overlap_s"] == seconds
    columns = aggregate.cost_columns(cost, 4096, transfer_bytes=32 * 10 ** 9)
    assert columns["est_h100_transfer_s"] == pytest.approx(0.5) and set(columns) <= set(aggregate.SUMMARY_COLUMNS)
    assert all(g.host_link_gbs > 0 for g in estimate.GPUS.values())
