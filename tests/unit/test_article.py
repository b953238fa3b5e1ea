"""The article generator (bench.report.article) and its HTML (bench.report.render) on tiny
synthetic summaries whose answers are known."""
import re

import numpy as np
import pandas as pd
import pytest

from bench.report import article, render
from bench.report.aggregate import SUMMARY_COLUMNS
from bench.report.tables import read_curves, read_summary

GiB = 2 ** 30


def row(**kw) -> dict:
    base = dict.fromkeys(SUMMARY_COLUMNS)
    base.update(status="ok", device="cpu", dtype="float32", seq_len=32, seed=0, phase="scratch", tuning="fixed",
                task="markov")
    base.update(kw)
    return base


def summary_csv(tmp_path, rows) -> str:
    path = tmp_path / "summary.csv"
    pd.DataFrame(rows, columns=SUMMARY_COLUMNS).to_csv(path, index=False)
    return str(path)


def rows_known() -> list[dict]:
    rows = []
    # memory: `small` halves adamw's optimizer state
    for method, opt in (("adamw", 400), ("small", 200)):
        rows.append(row(kind="memory", method=method, model="gpt2-tiny", family="gpt2", n_params=1e6, batch_size=8,
                        memory_tier="tracked", peak_bytes=(600 + opt) * 2**20, param_bytes=200 * 2**20,
                        grad_bytes=200 * 2**20, optimizer_bytes=opt * 2**20, activation_bytes=0, other_bytes=0))
    # throughput: `small` at 0.8 of adamw
    rows.append(row(kind="throughput", method="small", model="gpt2-tiny", family="gpt2", batch_size=8, baseline="adamw",
                    tokens_per_s=800, baseline_tokens_per_s=1000, throughput_ratio=0.8, throughput_ratio_lo=0.75,
                    throughput_ratio_hi=0.85))
    # largest model at 24 GiB: `big` 3 B, adamw 1 B, `small` 2 B
    for method, n in (("adamw", 1e9), ("big", 3e9), ("small", 2e9)):
        rows.append(row(kind="model_capacity", method=method, model="gpt2-small", family="gpt2", batch_size=8,
                        capacity_gb=24, memory_tier="simulated", n_params=n, largest_model=f"gpt2-{n / 1e9:g}b",
                        at_ladder_top=0, seq_len=512))
    # largest batch at 24 GiB on gpt2-xl: `small` 12, adamw 4
    for method, b, est in (("adamw", 4, 1000.0), ("small", 12, 900.0)):
        rows.append(row(kind="capacity", method=method, model="gpt2-xl", family="gpt2", n_params=1.5e9,
                        capacity_gb=24, memory_tier="simulated", largest_batch=b, at_max_batch=0, seq_len=512,
                        est_h100_tokens_per_s=est))
    # convergence, tuned, 2 seeds: small +0.10 behind adamw
    for seed in (0, 1):
        for method, loss in (("adamw", 1.50 + 0.01 * seed), ("small", 1.60 + 0.01 * seed)):
            rows.append(row(kind="convergence", method=method, model="gpt2-tiny", family="gpt2", tuning="tuned",
                            steps=100, lr=1e-3, final_loss=loss, seed=seed, batch_size=8))
    return rows


@pytest.fixture
def sources(tmp_path):
    return article.from_summary(summary_csv(tmp_path, rows_known()))


def test_sections_and_numbers(sources):
    claims = [{"method": "small", "versus": "adamw", "metric": "peak_memory_change", "claim": "up to -20%",
               "setup": "s", "source": "x"}]
    text = article.article(sources, claims)
    for heading in ("## Abstract", "## Setup", "## Memory", "## Speed", "## Convergence", "## Capacity",
                    "## Recommendations per GPU memory size", "## The claims audit",
                    "## How much to trust the numbers", "### Limitations"):
        assert heading in text
    # the memory finding's numbers are the data's: (800 / 1000 - 1) = -20.0%, all of it optimizer bytes
    memory = re.search(r"## Memory.*?\*\*Finding\.\*\* (.*?)\n", text, re.S).group(1)
    assert "small" in memory and "-20.0%" in memory and "optimizer" in memory
    speed = re.search(r"## Speed.*?\*\*Finding\.\*\* (.*?)\n", text, re.S).group(1)
    assert "0.80x" in speed
    assert "+0.100" in text                       # the convergence gap
    # no GPU rows: the trust section says so rather than inventing
    assert article.NOT_MEASURED in re.search(r"## How much to trust.*", text, re.S).group(0)


def test_recommendation_picks_the_known_methods(sources):
    models = article.recommend_model(sources.role("capacity"))
    r = models[models["capacity_gb"] == 24].iloc[0]
    assert r["methods"] == ["big"] and r["n_params"] == 3e9 and r["base_params"] == 1e9
    batches = article.recommend_batch(sources.role("capacity"))
    b = batches[batches["capacity_gb"] == 24].iloc[0]
    assert b["methods"] == ["small"] and b["batch"] == 12 and b["base_batch"] == 4
    text = article.recommendations(sources)
    assert "3.00x" in text                                     # 3 B over adamw's 1 B
    assert "900 vs 1,000 tokens/s (estimated, H100)" in text  # estimated speed labelled
    assert "0.80x measured" in text                            # small's measured ratio
    assert "not measured at this scale" in text                # big has no convergence cell
    assert "+0.100 nats/token" in text                         # small's gap


def test_ties_put_the_fastest_measured_first(sources):
    assert article.by_speed(sources.role("speed"), ["small", "adamw", "zzz"], "gpt2") == ["adamw", "small", "zzz"]


def cells(values, lo=None, hi=None):
    return pd.DataFrame({"value": values, "lo": lo if lo is not None else np.nan,
                         "hi": hi if hi is not None else np.nan})


@pytest.mark.parametrize("claim,values,expected", [
    ({"metric": "peak_memory_change", "claim": "up to -23%"}, [-25.0, -10.0], "reproduced"),
    ({"metric": "peak_memory_change", "claim": "up to -23%"}, [-12.0, -5.0], "reproduced in part"),
    ({"metric": "peak_memory_change", "claim": "up to -23%"}, [3.0, 1.0], "not reproduced"),
    ({"metric": "largest_batch_ratio", "claim": "up to 2x"}, [2.5], "reproduced"),
    ({"metric": "largest_batch_ratio", "claim": "up to 2x"}, [1.4], "reproduced in part"),
    ({"metric": "largest_batch_ratio", "claim": "up to 2x"}, [0.9], "not reproduced"),
    ({"metric": "throughput_ratio", "claim": ">= 0.98"}, [0.99, 1.0, 0.97], "reproduced"),
    ({"metric": "throughput_ratio", "claim": ">= 0.98"}, [0.9, 0.99, 0.8], "reproduced in part"),
    ({"metric": "throughput_ratio", "claim": ">= 0.98"}, [0.9, 0.8], "not reproduced"),
    ({"metric": "optimizer_memory_change", "claim": "SGD-like memory"}, [-60.0, -50.0], "reproduced"),
    ({"metric": "optimizer_memory_change", "claim": "SGD-like memory"}, [20.0, 30.0], "not reproduced"),
    ({"metric": "peak_memory_change", "claim": "-50%", "setup": "ViT: not comparable to any cell"}, [-60.0],
     "not testable here"),
    ({"metric": "peak_memory_change", "claim": "-50%"}, [], "not testable here"),
])
def test_verdict_rule(claim, values, expected):
    assert article.verdict(claim, cells(values))[0] == expected


def test_loss_verdicts():
    on_par = {"metric": "final_loss_gap", "claim": "comparable to AdamW"}
    better = {"metric": "final_loss_gap", "claim": "superior convergence"}
    assert article.verdict(on_par, cells([0.01, -0.2], [-0.01, -0.3], [0.03, -0.1]))[0] == "reproduced"
    assert article.verdict(on_par, cells([0.01, 0.3], [0.0, 0.2], [0.02, 0.4]))[0] == "reproduced in part"
    assert article.verdict(on_par, cells([0.3], [0.2], [0.4]))[0] == "not reproduced"
    assert article.verdict(better, cells([-0.2], [-0.3], [-0.1]))[0] == "reproduced"
    assert article.verdict(better, cells([0.01], [-0.01], [0.03]))[0] == "reproduced in part"
    assert article.verdict(better, cells([0.3], [0.2], [0.4]))[0] == "not reproduced"


def test_claimed_number():
    assert article.claimed_number("peak_memory_change", "up to -23%") == -23
    assert article.claimed_number("throughput_ratio", ">= 0.98 (under 2% slower)") == 0.98
    assert article.claimed_number("largest_model_ratio", "1.26x-3.14x larger models") == 1.26
    assert article.claimed_number("largest_model_ratio", "a 65B model on one machine") is None


def test_missing_data_says_not_measured(tmp_path):
    only_memory = [r for r in rows_known() if r["kind"] == "memory"]
    text = article.article(article.from_summary(summary_csv(tmp_path, only_memory)), [])
    for section in ("## Speed", "## Convergence", "## Capacity"):
        body = text.split(section, 1)[1].split("\n## ", 1)[0]
        assert article.NOT_MEASURED in body
    assert "not testable" not in text   # no claims, no verdicts


@pytest.mark.parametrize("kind", ["memory", "throughput", "capacity", "model_capacity", "convergence"])
def test_a_run_of_one_kind_of_job_still_writes_its_article(tmp_path, kind):
    """A suite may run one kind of job only (a capacity suite): every other section says
    it was not measured, none fails."""
    rows = [r for r in rows_known() if r["kind"] == kind]
    text = article.article(article.from_summary(summary_csv(tmp_path, rows)), [])
    assert text.count(article.NOT_MEASURED) >= 3


def test_html_is_self_contained(tmp_path, sources):
    (tmp_path / "figures").mkdir()
    png = bytes.fromhex("89504e470d0a1a0a0000000d49484452000000010000000108060000001f15c4890000000d4944415478"
                        "9c6300010000000500010d0a2db40000000049454e44ae426082")
    (tmp_path / "figures" / "x.png").write_bytes(png)
    md = tmp_path / "article.md"
    md.write_text(article.article(sources, []) + "\n![x](figures/x.png)\n")
    render.render(md, tmp_path / "article.html")
    page = (tmp_path / "article.html").read_text()
    assert "<nav>" in page and 'href="#abstract"' in page and "<table>" in page
    assert 'src="data:image/png;base64,' in page
    external = re.findall(r'(?:src|href)="(?!#|data:)([^"]+)"', page)
    assert external == []


def test_manifest_roles(tmp_path):
    path = summary_csv(tmp_path, rows_known())
    (tmp_path / "sources.yaml").write_text(
        "sources:\n  a: {summary: summary.csv}\n"
        "roles:\n  memory: [{source: a, where: {kind: [memory]}}]\n  capacity: [a]\n")
    s = article.from_manifest(tmp_path / "sources.yaml", root=tmp_path)
    assert set(s.role("memory")["kind"]) == {"memory"}
    assert len(s.role("capacity")) == len(read_summary(path))
    assert s.role("trust").empty and read_curves(None).empty
