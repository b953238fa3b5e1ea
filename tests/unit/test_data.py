"""The tasks: the Markov chain's exact loss floor, its shifted twin, masked batches, the checked corpus."""
import math

import pytest
import torch

from bench import data


def test_markov_floor_matches_a_monte_carlo_estimate():
    task = data.MarkovTask()
    x = task.sample(256, 256, torch.Generator().manual_seed(0))
    logp = task.transition[x[:, :-1], x[:, 1:]].log()
    estimate = -float(logp.mean())
    assert estimate == pytest.approx(task.loss_floor, rel=0.01)
    assert task.loss_floor < 0.5 * math.log(task.vocab)


def test_the_shifted_chain_redraws_half_of_the_states_and_keeps_the_rest():
    base, shifted = data.MarkovTask(), data.make_task("markov_shift")
    differs = (base.transition != shifted.transition).any(dim=1)
    assert int(differs.sum()) == base.vocab // 2 == len(shifted.changed)
    assert differs.nonzero().flatten().tolist() == shifted.changed.tolist()
    assert torch.allclose(shifted.transition.sum(dim=1), torch.ones(base.vocab, dtype=torch.float64))
    # each redrawn row is a chain row again: `successors` likely tokens over a uniform `mix`
    row = shifted.transition[shifted.changed[0]]
    assert int((row > 0.01 / base.vocab + 1e-12).sum()) == 4
    x = shifted.sample(256, 256, torch.Generator().manual_seed(0))
    estimate = -float(shifted.transition[x[:, :-1], x[:, 1:]].log().mean())
    assert estimate == pytest.approx(shifted.loss_floor, rel=0.01)
    # a model that knows the old chain is wrong on the changed states: the old chain's
    # cross-entropy on the new data is far above the new floor
    old = -float(base.transition[x[:, :-1], x[:, 1:]].log().mean())
    assert old > shifted.loss_floor + 1.0


def test_masked_batches_label_only_masked_positions():
    task = data.MarkovTask()
    stream = data.Stream(task, "masked", 256, 8, 64, seed=0)
    b = stream.next()
    masked = b["input_ids"] == 255
    assert (b["labels"][~masked] == data.IGNORE).all()
    assert (b["labels"][masked] != data.IGNORE).all()
    assert 0.05 < masked.float().mean() < 0.3


def test_corpus_is_checked(monkeypatch):
    text = data.load_corpus()
    assert b"To be, or not to be" in text
    monkeypatch.setattr(data, "CORPUS_SHA256", "0" * 64)
    with pytest.raises(data.DataError, match="checksum"):
        data.load_corpus()
