"""The torch-optimi peer: equal to AdamW with one micro-batch, an approximation of AdamA beyond."""
import pytest
import torch

from bench.method import load
from test_adama import batch, tiny_model

pytest.importorskip("optimi")
HP = dict(lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)


def test_one_micro_batch_equals_torch_adamw():
    ours, ref = tiny_model(), tiny_model()
    peer = load("optimi_accum", {"micro_batches": 1, **HP})
    opt, torch_opt = peer.make_optimizer(ours), torch.optim.AdamW(ref.parameters(), **HP)
    for step in range(3):
        peer.train_step(ours, opt, batch(seed=step))
        load("adamw").train_step(ref, torch_opt, batch(seed=step))
        assert all(p.grad is None for p in ours.parameters())
    for p, q in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)


def test_many_micro_batches_differ_from_adama():
    # optimi advances the EMA once per micro-batch; AdamA once per optimizer step
    a, b = tiny_model(), tiny_model()
    peer, adama = load("optimi_accum", HP), load("adama", HP)
    opt_peer, opt_adama = peer.make_optimizer(a), adama.make_optimizer(b)
    peer.train_step(a, opt_peer, batch())
    adama.train_step(b, opt_adama, batch())
    p, q = next(a.parameters()), next(b.parameters())
    assert not torch.allclose(opt_peer.state[p]["exp_avg"], opt_adama.state[q]["exp_avg"], rtol=1e-3)
