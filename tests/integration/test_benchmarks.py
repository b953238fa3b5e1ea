"""Micro-benchmarks of one training step per baseline (pytest-benchmark).

Plain `pytest` runs each once, as a smoke test (benchmarks are disabled in pytest.ini).
Time them with:  pytest tests/integration/test_benchmarks.py --benchmark-enable
"""
import pytest
import torch

from bench import data, models
from bench.method import load


@pytest.mark.parametrize("method_name", ["adamw", "grad_accum", "checkpointing"])
def test_train_step_gpt2_tiny(benchmark, method_name):
    torch.manual_seed(0)
    method = load(method_name)
    model = method.transform_model(models.build("gpt2-tiny"))
    optimizer = method.make_optimizer(model)
    batch = data.Stream(data.MarkovTask(), "causal", 256, 8, 128, seed=0).next()
    benchmark.extra_info.update(model="gpt2-tiny", batch_size=8, seq_len=128,
                                torch_threads=torch.get_num_threads())
    loss = benchmark.pedantic(method.train_step, args=(model, optimizer, batch),
                              rounds=5, iterations=1, warmup_rounds=1)
    assert torch.isfinite(loss)
