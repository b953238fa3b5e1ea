"""`membench fit` on a config.json of an architecture outside the suite's three families,
checked against separate simulated memory jobs; its one-line errors; models from a
config.json."""
import json
import subprocess
import sys

import pytest

from bench import fit, models
from bench.measure import runner

REPO_ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]

QWEN2 = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 128,
         "torch_dtype": "float32"}  # the file's dtype is not used: --dtype is
# GiB: the CUDA context alone is 0.5; 0.4 holds nothing, 0.503 a batch of a few sequences
SIZES = [0.4, 0.503, 0.506]
METHODS = ["adamw", "grad_accum"]  # grad_accum: batches in units of its 4 micro-batches


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    path = tmp_path_factory.mktemp("fit") / "config.json"
    path.write_text(json.dumps(QWEN2))
    return str(path)


@pytest.fixture(scope="module")
def answered(qwen2, tmp_path_factory):
    out = tmp_path_factory.mktemp("fit") / "rows.json"
    import contextlib
    import io

    err = io.StringIO()
    # in this process (--jobs 1): two spawned workers would double its time; answers from
    # worker processes: test_answers_are_the_memory_jobs_with_any_number_of_workers
    with contextlib.redirect_stderr(err):
        code = fit.main(["--model", qwen2, "--methods", *METHODS, "--batch-size", "4",
                         "--seq-len", "32", "--memory-gb", *map(str, SIZES), "--max-batch", "16",
                         "--jobs", "1", "--json", str(out)])
    return code, json.loads(out.read_text()), err.getvalue()


def test_config_json_model(qwen2):
    import torch
    import transformers

    assert models.is_known(qwen2) and models.family(qwen2) == "qwen2"
    assert models.OBJECTIVE[models.family(qwen2)] == "causal"
    assert models.vocab_size(qwen2) == 256 and models.max_positions(qwen2) == 128
    assert models.shape(qwen2) == (64, 2)
    with torch.device("meta"):
        ours = models.build(qwen2)
        theirs = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**QWEN2))
    assert type(ours) is transformers.Qwen2ForCausalLM
    assert models.n_params(ours) == models.n_params(theirs)
    with pytest.raises(ValueError, match="no family ladder"):
        models.ladder(qwen2)


def test_masked_lm_config_trains_masked(tmp_path):
    path = tmp_path / "roberta.json"
    path.write_text(json.dumps({"model_type": "roberta", "architectures": ["RobertaForMaskedLM"],
                                "hidden_size": 64, "num_hidden_layers": 1,
                                "num_attention_heads": 4, "intermediate_size": 128,
                                "vocab_size": 256, "max_position_embeddings": 66}))
    assert models.OBJECTIVE[models.family(str(path))] == "masked"
    assert type(models.build(str(path))).__name__ == "RobertaForMaskedLM"


def test_config_json_trains_on_real_tensors(tiny_job, qwen2):
    record = runner.run(tiny_job(kind="convergence", model=qwen2, steps=2))
    assert record["status"] == "ok", record.get("message")
    assert all(c["loss"] > 0 for c in record["curve"])


def test_rows_for_each_method_and_size(answered):
    code, rows, _ = answered
    assert code == 0
    assert sorted((r["method"], r["memory_gb"]) for r in rows) == sorted(
        (m, gb) for m in METHODS for gb in SIZES)
    for r in rows:
        assert r["status"] == "ok", r["message"]
        for key in ("method", "memory_gb", "fits", "n_params", "predicted_gpu_bytes",
                    "largest_batch", "param_bytes", "activation_bytes", "peak_bytes"):
            assert key in r, key


def test_fits_is_monotone_and_agrees_with_the_largest_batch(answered):
    _, rows, _ = answered
    for method in METHODS:
        mine = sorted((r for r in rows if r["method"] == method), key=lambda r: r["memory_gb"])
        fits = [r["fits"] for r in mine]
        largest = [r["largest_batch"] for r in mine]
        assert fits == sorted(fits) and largest == sorted(largest)
        assert [r["fits"] for r in mine] == [r["largest_batch"] >= 4 for r in mine]
        assert largest[0] == 0 and largest[-1] > 4  # the sizes span the answers
        unit = 4 if method == "grad_accum" else 1
        assert all(b % unit == 0 for b in largest)


def test_rows_match_separate_simulated_memory_jobs(answered, qwen2, tiny_job):
    """The step at --batch-size is a simulated memory job's; the largest batch fits a job
    capped at the size (the allocator model) and one more micro-batch unit does not."""
    _, rows, _ = answered
    for method, unit in (("adamw", 1), ("grad_accum", 4)):
        row = next(r for r in rows if r["method"] == method and r["memory_gb"] == SIZES[1])
        job = dict(method=method, model=qwen2, batch_size=4, seq_len=32, dtype="bfloat16",
                   simulate=True)
        alone = runner.run(tiny_job(**job))
        assert alone["n_params"] == row["n_params"]
        for c in ("param", "grad", "optimizer", "activation", "other"):
            assert alone["memory"][f"{c}_bytes"] == row[f"{c}_bytes"], c
        assert alone["memory"]["predicted_gpu_bytes"] == row["predicted_gpu_bytes"]
        k = row["largest_batch"]
        fits = runner.run(tiny_job(**{**job, "batch_size": k}, capacity_gb=SIZES[1]))
        over = runner.run(tiny_job(**{**job, "batch_size": k + unit}, capacity_gb=SIZES[1]))
        assert fits["status"] == "ok", fits.get("message")
        assert over["status"] == "oom" and "predicted out of memory" in over["message"]


def test_progress_is_a_line_per_step(answered):
    _, rows, err = answered
    lines = err.splitlines()
    assert any(line.startswith("[1/2] adamw: batch 4 -> ") and "MiB predicted" in line
               for line in lines)
    assert any(line.startswith("[2/2] grad_accum: ") and "largest batch" in line for line in lines)


@pytest.mark.parametrize("content, why", [
    ({"model_type": "not-a-model", "hidden_size": 64}, "does not know model_type 'not-a-model'"),
    ({"hello": "world"}, "is not a Hugging Face config.json: it has no model_type"),
    ("{not json", "is not a JSON file"),
])
def test_a_bad_config_is_one_line_and_exit_2(tmp_path, capsys, content, why):
    path = tmp_path / "config.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    code = fit.main(["--model", str(path), "--methods", "adamw", "--memory-gb", "1"])
    err = capsys.readouterr().err
    assert code == 2
    assert "Traceback" not in err
    [line] = [x for x in err.splitlines() if x.startswith("membench fit: error:")]
    assert why in line


def test_a_step_that_cannot_run_on_fake_tensors_is_one_line_and_exit_2(qwen2, capsys):
    pytest.importorskip("bitsandbytes")
    code = fit.main(["--model", qwen2, "--methods", "adamw_8bit", "--batch-size", "2",
                     "--seq-len", "16", "--memory-gb", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    [line] = [x for x in err.splitlines() if x.startswith("membench fit: error:")]
    assert "cannot run on fake tensors" in line


def test_help_works_and_the_one_job_cli_is_unchanged():
    fit_help = subprocess.run([sys.executable, "-m", "bench", "fit", "--help"], cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=120)
    assert fit_help.returncode == 0 and "--memory-gb" in fit_help.stdout
    assert "--json" in fit_help.stdout
    from bench.run import parser

    with pytest.raises(SystemExit):  # still requires --kind and friends
        parser().parse_args(["--model", "gpt2-tiny"])
    args = parser().parse_args(["--kind", "memory", "--method", "adamw", "--model", "gpt2-tiny",
                                "--batch-size", "4", "--seq-len", "32", "--out", "x.json"])
    assert args.kind == "memory" and args.model == "gpt2-tiny"



@pytest.mark.parametrize("args, flag, why", [
    (["--memory-gb", "-3"], "--memory-gb", "must be above 0, not -3"),
    (["--memory-gb", "24", "0"], "--memory-gb", "must be above 0, not 0"),
    (["--memory-gb", "nan"], "--memory-gb", "must be a finite number above 0"),
    (["--memory-gb", "inf"], "--memory-gb", "must be a finite number above 0"),
    (["--memory-gb", "lots"], "--memory-gb", "a number above 0 is needed, not 'lots'"),
    (["--batch-size", "0"], "--batch-size", "must be at least 1, not 0"),
    (["--batch-size", "-4"], "--batch-size", "must be at least 1, not -4"),
    (["--batch-size", "2.5"], "--batch-size", "an integer at least 1 is needed"),
    (["--seq-len", "1"], "--seq-len", "must be at least 2, not 1"),
    (["--max-batch", "0"], "--max-batch", "must be at least 1, not 0"),
    (["--max-batch", "4", "--batch-size", "8"], "--max-batch", "at least --batch-size (8), not 4"),
    (["--seed", "-1"], "--seed", "must be at least 0, not -1"),
    (["--jobs", "0"], "--jobs", "must be at least 1, not 0"),
])
def test_a_number_the_suite_rejects_is_an_argparse_error_naming_the_flag(capsys, args, flag, why):
    """What config/schema.yaml rejects for a job (batch_size >= 1, seq_len >= 2, seed >= 0,
    memory sizes above 0, max_batch >= 1), fit rejects before building anything."""
    with pytest.raises(SystemExit) as exit_:
        fit.main(["--model", "gpt2-tiny", "--methods", "adamw", *args])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err
    [line] = [x for x in err.splitlines() if x.startswith("membench fit: error:")]
    assert f"argument {flag}: " in line and why in line, line


def test_the_bounds_themselves_are_accepted():
    args = fit.parser().parse_args(["--model", "m", "--batch-size", "1", "--seq-len", "2",
                                    "--max-batch", "1", "--seed", "0", "--memory-gb", "0.001", "80"])
    assert (args.batch_size, args.seq_len, args.max_batch, args.seed) == (1, 2, 1, 0)
    assert args.memory_gb == [0.001, 80.0]


# `membench fit`'s answers on a small model, held fixed: those of simulated memory jobs (a
# warm-up step and the step, both at the batch), one per batch and memory size (each capped at
# the size: fits or a predicted out-of-memory), every batch up to --max-batch tried, no search
# (computed so once; before 2026-11-29 fit warmed up at one micro-batch and answered
# checkpointing 20 and QLoRA 4 here, with LOMO's and GaLore's 128 KiB of gradient at the peak
# counted as other). Per method: (n_params, param, grad, optimizer, activation, other, peak
# bytes of the step at batch 4, its predicted GPU need) and per memory size: (GiB, fits,
# largest batch, at max batch, the predicted GPU need at the largest batch).
HELD = dict(model="gpt2-tiny", batch_size=4, seq_len=32, memory_gb=[0.505, 0.51], max_batch=40)
HELD_ANSWERS = {
    'adamw': ((495104, 990208, 131840, 1980528, 1906944, 493576, 5503096, 543162368),
              [(0.505, False, 0, False, None), (0.51, True, 11, False, 547356672)]),
    'checkpointing': ((495104, 990208, 990208, 1980528, 0, 992260, 4953204, 543162368),
                      [(0.505, False, 0, False, None), (0.51, True, 19, False, 547356672)]),
    'grad_accum': ((495104, 990208, 990208, 1980528, 0, 992260, 4953204, 543162368),
                   [(0.505, False, 0, False, None), (0.51, True, 36, False, 547356672)]),
    'lomo': ((495104, 990208, 131072, 0, 1906944, 755720, 3783944, 541065216),
             [(0.505, True, 4, False, 541065216), (0.51, True, 14, False, 547356672)]),
    'galore_layerwise': ((495104, 990208, 131072, 2242560, 1906944, 755720, 6026504, 543162368),
                         [(0.505, False, 0, False, None), (0.51, True, 10, False, 547356672)]),
    'qlora': ((560640, 537728, 20480, 262208, 1885696, 603144, 3309256, 541065216),
              [(0.505, True, 5, False, 541065216), (0.51, True, 14, False, 547356672)]),
}


# Every held answer once: half the methods in this process (--jobs 1), the other half by two
# worker processes (--jobs 2); each method's answer does not depend on the others asked with it
@pytest.mark.parametrize("jobs, methods", [
    (1, ["adamw", "checkpointing", "grad_accum"]),
    (2, ["lomo", "galore_layerwise", "qlora"]),
])
def test_answers_are_the_memory_jobs_with_any_number_of_workers(jobs, methods, tmp_path):
    import contextlib
    import io

    out, err = tmp_path / "rows.json", io.StringIO()
    with contextlib.redirect_stderr(err):
        code = fit.main(["--model", HELD["model"], "--methods", *methods,
                         "--batch-size", str(HELD["batch_size"]), "--seq-len", str(HELD["seq_len"]),
                         "--memory-gb", *map(str, HELD["memory_gb"]), "--max-batch", str(HELD["max_batch"]),
                         "--jobs", str(jobs), "--json", str(out)])
    assert code == 0, err.getvalue()
    rows = json.loads(out.read_text())
    # the asked order, whichever worker answered first
    assert [(r["method"], r["memory_gb"]) for r in rows] == [(m, gb) for m in methods for gb in HELD["memory_gb"]]
    got = {}
    for r in rows:
        assert r["status"] == "ok", r["message"]
        step = (r["n_params"], *(r[f"{c}_bytes"] for c in ("param", "grad", "optimizer", "activation", "other",
                                                          "peak")), r["predicted_gpu_bytes"])
        got.setdefault(r["method"], (step, []))[1].append(
            (r["memory_gb"], r["fits"], r["largest_batch"], r["at_max_batch"], r["predicted_gpu_bytes_at_largest"]))
        assert got[r["method"]][0] == step  # the step at --batch-size, the same in every size's row
    assert got == {m: HELD_ANSWERS[m] for m in methods}
    # every worker's progress comes to this process's stderr, a whole line at a time
    lines = err.getvalue().splitlines()
    for i, m in enumerate(methods, 1):
        assert any(x.startswith(f"[{i}/{len(methods)}] {m}: batch 4 -> ") for x in lines), m
        assert any(x.startswith(f"[{i}/{len(methods)}] {m}: 0.505 GiB: ") for x in lines), m


def test_host_memory_is_the_memory_jobs_and_printed_where_a_method_offloads(tiny_job, capsys):
    """offload_optimizer keeps its AdamW state in host memory: fit's host bytes equal a
    simulated memory job's at the same batch, and the table gets a host column."""
    code = fit.main(["--model", "gpt2-tiny", "--methods", "offload_optimizer", "adamw", "--batch-size", "4",
                     "--seq-len", "32", "--memory-gb", "0.6", "--max-batch", "8", "--jobs", "1"])
    assert code == 0
    out = capsys.readouterr().out
    alone = runner.run(tiny_job(method="offload_optimizer", model="gpt2-tiny", batch_size=4, seq_len=32,
                                dtype="bfloat16", simulate=True))
    host = alone["memory"]["host_peak_bytes"]
    assert host > 0
    header = next(line for line in out.splitlines() if line.startswith("method"))
    assert "host" in header.split()
    row = next(line for line in out.splitlines() if line.startswith("offload_optimizer"))
    assert f"{host / 2**20:.1f}" in row.split()
