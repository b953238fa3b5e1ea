"""The bitsandbytes 8-bit AdamW peer: about 2 bytes of state per parameter, and it learns."""
import pytest

from bench.measure import runner

pytest.importorskip("bitsandbytes")


def test_state_bytes_and_learning(tiny_job):
    record = runner.run(tiny_job(method="adamw_8bit"))
    assert record["status"] == "ok", record.get("message")
    n = record["n_params"]
    # 2 bytes per parameter in the large tensors; small ones (< 4096 elements) stay 32-bit
    assert 2.0 * n < record["memory"]["optimizer_bytes"] < 2.5 * n
    conv = runner.run(tiny_job(kind="convergence", method="adamw_8bit", steps=20))
    losses = [p["loss"] for p in conv["curve"]]
    assert conv["status"] == "ok" and losses[-1] < losses[0] - 0.5
