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


def test_the_workflow_plans_every_figure_drawn_each_with_a_report_section_and_caption():
    """The Snakefile takes the figures' names from captions/categories.yaml (so that planning
    does not import the plotting libraries): the same names as the figures drawn."""
    import yaml

    from conftest import REPO

    captions = REPO / "bench" / "report" / "captions"
    categories = yaml.safe_load((captions / "categories.yaml").read_text())
    assert sorted(categories) == sorted(plots.FIGURES)
    assert all((captions / f"{name}.rst").exists() for name in plots.FIGURES)


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


def test_precision_keeps_its_own_cells(tmp_path):
    """Searches of one family under mixed and pure precision are two cells: each method is
    compared with AdamW of its own precision, in the tables, the figure and the article."""
    from bench.report import article
    from bench.report.tables import largest_model_table, read_summary

    def row(method, gb, n, precision):
        return dict(kind="model_capacity", method=method, model="toy-tiny", family="toy", batch_size=8, seq_len=16,
                    dtype="bfloat16", precision=precision, memory_tier="simulated", capacity_gb=gb,
                    largest_model=f"toy-{n:g}", n_params=n, at_ladder_top=False, status="ok")

    rows = [row("adamw", 24, 4e8, "pure"), row("lomo", 24, 8e8, "pure"),
            row("adamw", 24, 2e8, "mixed"), row("lomo", 24, 5e8, "mixed")]
    path = tmp_path / "summary.csv"
    frame = pd.DataFrame(rows).reindex(columns=SUMMARY_COLUMNS)
    frame.to_csv(path, index=False)
    summary = read_summary(path)
    table = largest_model_table(summary).set_index(["method", "precision"])
    assert table.loc[("lomo", "mixed"), "pct_vs_baseline"] == pytest.approx(150.0)  # against adamw mixed
    assert table.loc[("lomo", "pure"), "pct_vs_baseline"] == pytest.approx(100.0)
    fig = plots.figure_model_capacity(summary)
    assert sorted(ax.get_title() for ax in fig.axes if ax.get_visible() and ax.lines) == [
        "toy from toy-tiny · batch 8 · seq 16 · bfloat16", "toy from toy-tiny · batch 8 · seq 16 · bfloat16 mixed"]
    plots.plt.close(fig)
    text = article.article(article.from_summary(path), [])
    assert "| 24 | toy, mixed precision | lomo | toy-5e+08 (500 M) | toy-2e+08 (200 M); 2.50x |" in text
    assert "| 24 | toy | lomo | toy-8e+08 (800 M) | toy-4e+08 (400 M); 2.00x |" in text
    # results from before the field are pure
    frame.assign(precision=None).iloc[:2].to_csv(path, index=False)
    assert set(read_summary(path)["precision"]) == {"pure"}


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


def gpus_row(method, gb, n, world_size=1, sharding="none", top=False, status="ok", model=None,
             tier=None):
    """A model_capacity row of the search per GPU of `world_size` (docs/sharding.md)."""
    tier = tier or ("modelled" if sharding.startswith("zero") else "simulated")
    model = model or ("llama-60m" if world_size == 1 else "llama-1b")
    return dict(kind="model_capacity", method=method, model=model, family="llama", batch_size=8,
                seq_len=512, dtype="bfloat16", memory_tier=tier, capacity_gb=gb, world_size=world_size,
                sharding=sharding, largest_model=f"llama-{n / 1e9:g}b" if n else None, n_params=n,
                at_ladder_top=top, status=status, message=None if status == "ok" else "boom")


def gpus_summary(tmp_path) -> pd.DataFrame:
    """adamw and checkpointing on one GPU (from llama-60m) and per GPU of 8 and 64 (from
    llama-1b) under FSDP2 and ZeRO-3 at 16-80 GiB; checkpointing reaches the ladder's top
    (65B) on 64 GPUs; at 16 GiB adamw on one GPU fits nothing; a one-GPU-only method
    (adama) stays out of the per-GPU figure."""
    sizes = (16, 24, 40, 80)
    one = {"adamw": (0, 1.2e9, 2.0e9, 4.0e9), "checkpointing": (0.8e9, 1.3e9, 2.4e9, 4.5e9),
           "adama": (1.5e9, 2e9, 3e9, 6e9)}
    rows = [gpus_row(m, gb, n) for m, ns in one.items() for gb, n in zip(sizes, ns)]
    for m, boost in (("adamw", 1.0), ("checkpointing", 1.3)):
        for sharding, factor in (("fsdp", 1.0), ("zero3", 0.9)):
            for ws, scale in ((8, 5.0), (64, 25.0)):
                for gb in sizes:
                    n = min(scale * factor * boost * gb / 16 * 1e9, 65e9)
                    rows.append(gpus_row(m, gb, n, ws, sharding, top=n >= 65e9))
    path = tmp_path / "gpus.csv"
    pd.DataFrame(rows).reindex(columns=SUMMARY_COLUMNS).to_csv(path, index=False)
    from bench.report.tables import read_summary
    return read_summary(path)  # through the CSV, as the figures read it


def test_model_capacity_gpus_figure(tmp_path):
    summary = gpus_summary(tmp_path)
    fig = plots.figure_model_capacity_gpus(summary)
    panels = [ax for ax in fig.axes if ax.get_visible() and ax.lines]
    assert len(panels) == 4                                     # one per memory size
    assert [ax.get_title() for ax in panels] == [f"{gb} GiB per GPU" for gb in (16, 24, 40, 80)]
    for ax in panels:
        assert ax.get_xscale() == "log"
        assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "8", "64"]
        assert list(ax.get_xticks()) == [1, 8, 64]
        assert "GPU" in ax.get_xlabel()
    assert "parameters" in panels[0].get_ylabel()
    # a line per method x scheme, each from the method's one-GPU point (adama has no sharded row)
    for ax in panels:
        drawn = [line for line in ax.lines if len(line.get_xdata()) == 3]
        assert len(drawn) == 4
        assert {round(float(line.get_xdata()[0])) for line in drawn} == {1}
        assert len({tuple(line.get_color()) if not isinstance(line.get_color(), str) else line.get_color()
                    for line in drawn}) == 2                    # colour by method
        assert {line.get_linestyle() for line in drawn} == {"-", "--"}  # style by scheme
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels[:4] == ["adamw, FSDP2", "adamw, ZeRO-3", "checkpointing, FSDP2", "checkpointing, ZeRO-3"]
    assert "the ladder's top: at least this" in labels and "none fits" in labels
    assert not any("adama" == t.split(",")[0] for t in labels)
    # the ladder's top: open triangles where checkpointing reaches 65 B on 64 GPUs (40 and 80 GiB)
    tops = [c for ax in panels[2:] for c in ax.collections
            if c.get_offsets().size and c.get_paths() and (c.get_facecolor()[:, :3] == 1).all()]
    assert tops and all(off[0] > 32 for c in tops for off in c.get_offsets())
    # adamw fits nothing on one 16 GiB GPU: a red x on the floor there, the floor labelled
    assert any(t.get_text() == "none fits" for t in panels[0].texts)
    assert not any(t.get_text() == "none fits" for t in panels[1].texts)
    # the tiers named, per scheme
    assert "FSDP2 simulated; ZeRO-3 modelled; one GPU simulated" in fig.get_suptitle()
    plots.plt.close(fig)

    # the one-GPU figure keeps to one GPU: a line per method, none for the sharded rows
    fig = plots.figure_model_capacity(summary)
    (ax,) = [ax for ax in fig.axes if ax.get_visible() and ax.lines]
    assert sorted(line.get_label() for line in ax.lines) == ["adama", "adamw", "checkpointing"]
    assert all(len(line.get_xdata()) == 4 for line in ax.lines)
    plots.plt.close(fig)


def test_model_capacity_gpus_no_data(tmp_path):
    one_gpu = gpus_summary(tmp_path)
    one_gpu = one_gpu[one_gpu["world_size"] == 1]
    for summary in (one_gpu, one_gpu.iloc[0:0]):
        fig = plots.figure_model_capacity_gpus(summary)
        assert len(fig.axes) == 1 and not fig.axes[0].axison
        assert "No data: no model_capacity rows of more than one GPU" in " ".join(
            t.get_text() for t in fig.axes[0].texts)
        plots.plt.close(fig)
    failed = gpus_summary(tmp_path).assign(status="error")
    fig = plots.figure_model_capacity_gpus(failed)
    assert "no model_capacity search of more than one GPU finished ok" in fig.axes[0].texts[0].get_text()
    plots.plt.close(fig)
    # no sharded rows: the report's capacity section has no per-GPU part
    assert "### Largest model on several GPUs" not in paper.capacity_section(one_gpu)


def test_largest_model_gpus_tables_and_report(tmp_path):
    from bench.report.tables import (claim_table, largest_model_gpus_finding, largest_model_gpus_table,
                                     largest_model_gpus_text, largest_model_table)

    summary = gpus_summary(tmp_path)
    long = largest_model_gpus_table(summary)
    # adamw and checkpointing: one GPU, then 2 schemes x 2 GPU counts, at 4 memory sizes; adama stays out
    assert len(long) == 2 * (1 + 2 * 2) * 4 and set(long["method"]) == {"adamw", "checkpointing"}
    row = long.set_index(["method", "sharding", "world_size", "capacity_gb"]).loc[("adamw", "fsdp", 8, 24)]
    assert row["n_params"] == pytest.approx(7.5e9) and row["label"] == "adamw [fsdp x8]"
    assert row["memory_tier"] == "simulated" and row["model"] == "llama-1b"

    text = largest_model_gpus_text(summary)
    assert list(text.columns[-4:]) == ["16 GiB", "24 GiB", "40 GiB", "80 GiB"]
    rows = {(r["method"], r["scheme"], r["world_size"]): r for _, r in text.iterrows()}
    assert len(rows) == 10
    r = rows[("adamw", "one GPU", 1)]
    assert [r["16 GiB"], r["24 GiB"], r["40 GiB"], r["80 GiB"]] == ["none", "1.2 B", "2 B", "4 B"]
    r = rows[("checkpointing", "ZeRO-3", 64)]
    assert r["memory_tier"] == "modelled" and r["80 GiB"] == ">= 65 B"
    assert text["scheme"].tolist()[:5] == ["one GPU", "FSDP2", "FSDP2", "ZeRO-3", "ZeRO-3"]

    finding = largest_model_gpus_finding(summary)
    assert finding == ("With 24 GiB per GPU (llama at batch 8 per GPU, seq 512, bfloat16), adamw trains up to "
                       "1.2 B on one GPU (simulated); under FSDP2 (simulated), up to 7.5 B on 8 GPUs and up to "
                       "37.5 B on 64; under ZeRO-3 (modelled), up to 6.75 B on 8 GPUs and up to 33.8 B on 64.")

    section = paper.capacity_section(summary)
    assert "### Largest model on several GPUs" in section and f"**Finding.** {finding}" in section
    assert ("| llama | 8 | 512 | bfloat16 | checkpointing | ZeRO-3 | 64 | modelled | llama-1b | 29.2 B | "
            "43.9 B | >= 65 B | >= 65 B |") in section
    # the one-GPU table and its headlines keep to one GPU
    assert set(largest_model_table(summary)[["world_size", "sharding"]].itertuples(index=False)) == {(1, "none")}
    assert "- 24 GiB, llama at batch 8 (seq 512, bfloat16, simulated): adama trains llama-2b" in section

    # a claim compares like with like: on one GPU's cells, or, naming a scheme, on that
    # scheme's cells of several GPUs, each sharded setting with itself
    claim = dict(method="checkpointing", versus="adamw", metric="largest_model_ratio", claim="c", setup="s",
                 source="x")
    ours = claim_table(summary, [claim]).iloc[0]
    assert ours["n"] == 3 and "[" not in ours["ours"]
    assert "24 GiB from llama-60m at batch 8: 1.2 B -> 1.3 B" in ours["ours"]
    sharded = claim_table(summary, [{**claim, "sharding": "fsdp"}]).iloc[0]
    assert sharded["n"] == 2 * 4 - 2                           # pairs where either is at the top are out
    assert "24 GiB from llama-1b at batch 8 [fsdp x8]: 7.5 B -> 9.75 B" in sharded["ours"]
    assert "zero3" not in sharded["ours"] and "llama-60m" not in sharded["ours"]
    with pytest.raises(ValueError, match="key sharding is 'fsdp2'"):
        claim_table(summary, [{**claim, "sharding": "fsdp2"}])


def test_article_capacity_on_several_gpus(tmp_path):
    """The article's capacity section: a paragraph and the figure where rows of more than one
    GPU exist, neither without them."""
    from bench.report import article

    gpus_summary(tmp_path)
    sources = article.from_summary(tmp_path / "gpus.csv")
    text = article.article(sources, [])
    capacity = text.split("## Capacity", 1)[1].split("## Recommendations", 1)[0]
    assert "**On several GPUs.**" in capacity and "up to 7.5 B on 8 GPUs and up to 37.5 B on 64" in capacity
    assert "One GPU, one process" not in text
    assert article.FIGURE_IF["model_capacity_gpus"](sources.role("capacity"))
    # the recommendations per GPU of several: per size and count, the method and scheme that
    # train the largest model per GPU, beside AdamW's best scheme on as many GPUs and on one
    several = text.split("### On several GPUs", 1)[1].split("## The claims", 1)[0]
    assert ("**Finding.** On 8 GPUs of 24 GiB each (llama, batch 8 per GPU), checkpointing (FSDP2) trains up to "
            "a 9.75 B model, 1.3x adamw's 7.5 B (FSDP2).") in several
    assert ("| 24 | 8 | llama | checkpointing (FSDP2) | llama-9.75b (9.75 B), simulated | 7.5 B (FSDP2) | "
            "1.2 B; 8.12x |") in several
    assert "| 80 | 64 | llama | adamw (FSDP2) = adamw (ZeRO-3) = checkpointing (FSDP2) = checkpointing (ZeRO-3) |" \
        in several

    one = pd.read_csv(tmp_path / "gpus.csv")
    one[one["world_size"] == 1].to_csv(tmp_path / "one.csv", index=False)
    sources = article.from_summary(tmp_path / "one.csv")
    text = article.article(sources, [])
    assert "**On several GPUs.**" not in text and "One GPU, one process" in text
    assert "### On several GPUs" not in text
    assert not article.FIGURE_IF["model_capacity_gpus"](sources.role("capacity"))
