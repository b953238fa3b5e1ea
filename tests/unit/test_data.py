"""The tasks: the Markov chain's exact loss floor, masked batches, the checked corpus."""
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
