"""Figures and the Markdown report from small synthetic tables (no training, no torch)."""
import re

import numpy as np
import pandas as pd
import pytest

from bench.report import markdown as paper, figures as plots, style
from bench.report.aggregate import CURVE_COLUMNS, SUMMARY_COLUMNS

MIB = 2 ** 20
OOM_MESSAGE = "CapacityExceeded: live tensors reached 9.9 GB over a 8.0 GB capacity"
NAN_MESSAGE = "Diverged: loss is nan at step 7"


def memory_row(method, batch, peak_mib, status="ok", message=None, micro=1):
    split = dict(param=0.1, grad=0.1, optimizer=0.2, activation=0.5, other=0.1)
    peak = peak_mib * MIB if status == "ok" else None
    row = dict(kind="memory", method=method, model="toy-a", family="toy", n_params=1000,
               batch_size=batch, micro_batches=micro, seq_len=16, device="cpu",
               device_name="Test CPU", memory_tier="simulated", peak_bytes=peak,
               status=status, message=message)
    row.update({f"{c}_bytes": (peak * f if peak else None) for c, f in split.items()})
    return row


def throughput_row(method, model, median, status="ok", message=None, base_median=0.10):
    """A paired throughput job: the method beside adamw, whose step takes `base_median`
    (None: no paired ratio, as in a result made before pairing)."""
    tokens = 4 * 16
    ok = status == "ok"
    ratio = base_median / median if ok and base_median else None
    return dict(kind="throughput", method=method, model=model, family="toy", batch_size=4,
                baseline="adamw", throughput_ratio=ratio,
                throughput_ratio_lo=ratio * 0.95 if ratio else None,
                throughput_ratio_hi=ratio * 1.05 if ratio else None,
                baseline_tokens_per_s=tokens / base_median if ok and base_median else None,
                micro_batches=1, seq_len=16, device="cpu", device_name="Test CPU",
                tokens_per_s=tokens / median if ok else None,
                step_time_median_s=median if ok else None,
                step_time_q1_s=median * 0.95 if ok else None,
                step_time_q3_s=median * 1.1 if ok else None, status=status, message=message)


def convergence_row(method, task, seed, final, floor, status="ok", message=None):
    return dict(kind="convergence", method=method, model="toy-a", family="toy", batch_size=4,
                micro_batches=1, seq_len=16, device="cpu", device_name="Test CPU", task=task,
                steps=20, final_loss=final if status == "ok" else None, loss_floor=floor,
                status=status, message=message, seed=seed)


def synthetic_summary() -> pd.DataFrame:
    rows = [
        memory_row("adamw", 4, 40.0), memory_row("grad_accum", 4, 25.0, micro=2),
        memory_row("zeta_new", 4, 30.0),
        memory_row("adamw", 8, 80.0), memory_row("grad_accum", 8, 45.0, micro=2),
        memory_row("zeta_new", 8, None, status="oom", message=OOM_MESSAGE),
        throughput_row("adamw", "toy-a", 0.10), throughput_row("grad_accum", "toy-a", 0.12),
        throughput_row("zeta_new", "toy-a", 0.20),
        # toy-b has no paired ratio: its panel falls back to absolute tokens/s
        throughput_row("grad_accum", "toy-b", 0.05, base_median=None),
    ]
    for seed in range(2):
        rows += [convergence_row("adamw", "markov", seed, 1.30 + 0.01 * seed, 1.2),
                 convergence_row("grad_accum", "markov", seed, 1.32 + 0.01 * seed, 1.2),
                 convergence_row("adamw", "text", seed, 2.0 + 0.02 * seed, None),
                 convergence_row("grad_accum", "text", seed, 2.1, None)]
    rows.append(convergence_row("zeta_new", "markov", 0, None, 1.2, status="diverged",
                                message=NAN_MESSAGE))
    frame = pd.DataFrame(rows, columns=SUMMARY_COLUMNS)
    frame["commit"], frame["torch_version"] = "abc1234", "2.13.0+cpu"
    frame["date"] = "2026-01-02T03:04:05+00:00"
    return frame


def synthetic_curves(summary: pd.DataFrame) -> pd.DataFrame:
    rows = []
    conv = summary[summary["kind"] == "convergence"]
    for r in conv.itertuples():
        steps = 20 if r.status == "ok" else 7
        for step in range(1, steps + 1):
            end = r.final_loss if r.status == "ok" else 3.0
            loss = end + 4.0 * np.exp(-step / 4.0)
            rows.append(dict(method=r.method, model=r.model, task=r.task, seed=r.seed,
                             batch_size=r.batch_size, seq_len=r.seq_len, step=step,
                             wall_s=0.01 * step, loss=loss, loss_floor=r.loss_floor,
                             status=r.status))
    return pd.DataFrame(rows, columns=CURVE_COLUMNS)


def assert_figures(folder):
    for name in plots.FIGURES:
        for ext in ("png", "pdf"):
            path = folder / f"{name}.{ext}"
            assert path.exists(), path
            assert path.stat().st_size > 5_000, f"{path} looks empty"


@pytest.fixture
def tables(tmp_path):
    summary = synthetic_summary()
    summary_path, curves_path = tmp_path / "summary.csv", tmp_path / "curves.csv"
    summary.to_csv(summary_path, index=False)
    synthetic_curves(summary).to_csv(curves_path, index=False)
    return summary_path, curves_path


def test_figures_and_report(tables, tmp_path):
    summary_path, curves_path = tables
    figures = tmp_path / "results" / "figures"
    assert plots.main(["--summary", str(summary_path), "--curves", str(curves_path),
                       "--out", str(figures)]) == 0
    assert_figures(figures)

    out = tmp_path / "paper" / "results.md"
    assert paper.main(["--summary", str(summary_path), "--out", str(out),
                       "--figures", str(figures)]) == 0
    text = out.read_text()
    for header in (paper.MEMORY_HEADER, paper.THROUGHPUT_HEADER, paper.CONVERGENCE_HEADER,
                   paper.FAILED_HEADER):
        assert "| " + " | ".join(header) + " |" in text
    assert OOM_MESSAGE in text and NAN_MESSAGE in text
    assert "](../results/figures/overview.png)" in text
    assert "abc1234" in text and "not ok: 2" in text
    assert not list(out.parent.glob(".*.tmp")), "temporary file left behind"

    # % change vs adamw for grad_accum at batch 4, computed here from the bytes
    expected = (25.0 * MIB - 40.0 * MIB) / (40.0 * MIB) * 100
    row = next(line for line in text.splitlines()
               if re.match(r"\| toy-a \| 4 \| 16 \| cpu \| grad_accum \|", line))
    change = row.split("|")[1 + paper.MEMORY_HEADER.index("change vs adamw")].strip()
    assert change == f"{expected:+.1f}%" == "-37.5%"
    # the failed memory job is listed with its status, not dropped
    assert re.search(r"\| toy-a \| 8 \| 16 \| cpu \| zeta_new \| 1 \| oom \|", text)


def test_tables_agree_with_hand_computation():
    summary = synthetic_summary()
    thr = plots.throughput_table(summary).set_index(["model", "method"])
    assert thr.loc[("toy-a", "grad_accum"), "ratio"] == pytest.approx(0.10 / 0.12)
    assert thr.loc[("toy-a", "grad_accum"), "ratio_lo"] == pytest.approx(0.95 * 0.10 / 0.12)
    assert thr.loc[("toy-a", "grad_accum"), "baseline"] == "adamw"
    assert not thr.loc[("toy-b", "grad_accum"), "has_baseline"]
    conv = plots.convergence_table(summary).set_index(["task", "method"])
    assert conv.loc[("markov", "grad_accum"), "gap_vs_baseline"] == pytest.approx(0.02)
    assert conv.loc[("markov", "adamw"), "gap_to_floor"] == pytest.approx(0.105)
    assert np.isnan(conv.loc[("text", "adamw"), "loss_floor"])
    assert conv.loc[("markov", "zeta_new"), "status"] == "diverged"
    assert plots.method_order(["zeta_new", "grad_accum", "adamw"]) == \
        ["adamw", "grad_accum", "zeta_new"]


def test_empty_summary_still_draws_every_figure(tmp_path):
    summary_path = tmp_path / "summary.csv"
    summary_path.write_text(",".join(SUMMARY_COLUMNS) + "\n")
    curves_path = tmp_path / "curves.csv"
    curves_path.write_text(",".join(CURVE_COLUMNS) + "\n")
    figures = tmp_path / "figures"
    assert plots.main(["--summary", str(summary_path), "--curves", str(curves_path),
                       "--out", str(figures)]) == 0
    assert_figures(figures)
    out = tmp_path / "results.md"
    assert paper.main(["--summary", str(summary_path), "--out", str(out)]) == 0
    assert "_No memory jobs._" in out.read_text()


def test_claims_compare_like_with_like():
    from bench.report.tables import claim_table

    rows = []
    for method, peak, tps, seeds in (("grad_accum", 100.0, 50.0, (1.00, 1.10)),
                                     ("adama", 80.0, 45.0, (1.02, 1.16))):
        rows.append(dict(kind="memory", method=method, model="m", batch_size=8, seq_len=16,
                         device="cpu", status="ok", peak_bytes=peak, param_bytes=10.0,
                         grad_bytes=10.0 if method == "grad_accum" else 1.0, optimizer_bytes=20.0,
                         memory_tier="tracked"))
        rows.append(dict(kind="throughput", method=method, model="m", batch_size=8, seq_len=16,
                         device="cpu", status="ok", tokens_per_s=tps, seed=0))
        for seed, loss in enumerate(seeds):
            rows.append(dict(kind="convergence", method=method, model="m", task="markov",
                             device="cpu", status="ok", final_loss=loss, seed=seed))
    summary = pd.DataFrame(rows).reindex(columns=SUMMARY_COLUMNS)
    claims = [dict(method="adama", versus="grad_accum", metric=m, claim="c", setup="s", source="x")
              for m in ("peak_memory_change", "state_memory_change", "throughput_ratio",
                        "final_loss_gap")]
    table = claim_table(summary, claims).set_index("metric")
    assert table.loc["peak_memory_change", "ours"] == "-20.0% to -20.0%"
    assert table.loc["state_memory_change", "ours"] == "-22.5% to -22.5%"  # 31 vs 40
    assert table.loc["throughput_ratio", "ours"] == "0.90 to 0.90"
    gaps = np.array([0.02, 0.06])  # paired by seed
    assert table.loc["final_loss_gap", "ours"] == f"markov {gaps.mean():+.3f} ± {gaps.std(ddof=1):.3f} (n=2)"


def test_largest_model_table_report_figure_and_claim(tmp_path):
    from bench.report.tables import claim_table, largest_model_table, read_summary

    def row(method, gb, largest, n, top=False, status="ok"):
        return dict(kind="model_capacity", method=method, model="toy-tiny", family="toy",
                    batch_size=8, seq_len=16, dtype="float32", memory_tier="simulated",
                    capacity_gb=gb, largest_model=largest, n_params=n, at_ladder_top=top,
                    status=status, message=None if status == "ok" else "boom")

    rows = [row("adamw", 16, "toy-d128-l2", 1e8), row("adamw", 24, "toy-d256-l2", 2e8),
            row("adama", 16, "toy-d256-l2", 2e8), row("adama", 24, "toy-big", 5e8, top=True),
            row("zeta_new", 16, None, 0), row("zeta_new", 24, None, None, status="error")]
    path = tmp_path / "summary.csv"
    pd.DataFrame(rows).reindex(columns=SUMMARY_COLUMNS).to_csv(path, index=False)
    summary = read_summary(path)  # through the CSV: None and booleans survive

    table = largest_model_table(summary).set_index(["method", "capacity_gb"])
    assert table.loc[("adama", 16), "pct_vs_baseline"] == pytest.approx(100.0)
    assert table.loc[("adama", 24), "pct_vs_baseline"] == pytest.approx(150.0)
    assert table.loc[("zeta_new", 16), "pct_vs_baseline"] == pytest.approx(-100.0)
    assert table.loc[("zeta_new", 16), "largest_model"] is None

    text = paper.capacity_section(summary)
    assert ("- 24 GiB, toy at batch 8 (seq 16, float32, simulated): adama trains toy-big "
            "(500 M parameters, the top of the ladder); 2.50x the parameters of adamw's "
            "toy-d256-l2.") in text
    assert ("| toy | 8 | 16 | float32 | simulated | adamw | toy-d128-l2 (100 M) | "
            "toy-d256-l2 (200 M) |") in text
    assert "| adama | toy-d256-l2 (200 M) | >= toy-big (500 M) |" in text
    assert "| zeta_new | none | error |" in text
    assert "_No capacity jobs._" not in text and "### Largest batch" not in text

    fig = plots.figure_model_capacity(summary)
    assert len([ax for ax in fig.axes if ax.get_visible() and ax.lines]) == 1
    assert "Not drawn (search failed): zeta_new from toy-tiny (error)." in " ".join(
        fig.texts[-1].get_text().split())

    claim = dict(method="adama", versus="adamw", metric="largest_model_ratio", claim="c",
                 setup="s", source="x")
    ours = claim_table(summary, [claim]).iloc[0]  # at 24 GiB adama is at the ladder's top
    assert ours["n"] == 1 and ours["ours"] == ("2.00x to 2.00x (16 GiB from toy-tiny at batch 8: "
                                               "100 M -> 200 M)")


@pytest.mark.parametrize("n", [5, 12, 33])
def test_no_two_methods_share_colour_and_line_style(n):
    """The convergence figure tells its curves apart by colour and line style; beyond the
    palette's ten or twenty colours a colour comes back, never with the same style."""
    methods = ["adamw"] + [f"m{i:02d}" for i in range(n - 1)]
    colors, styles = style.method_colors(methods), style.method_linestyles(methods)
    pairs = {(colors[m], styles[m]) for m in methods}
    assert len(pairs) == n


@pytest.mark.parametrize("n", [1, 3, 32])
def test_nudged_points_stay_near_their_memory_size(n):
    factors = [style.nudge(i, n) for i in range(n)]
    assert all(a < b for a, b in zip(factors, factors[1:]))  # apart, in order
    assert 0.88 < min(factors) <= 1 <= max(factors) < 1.13
