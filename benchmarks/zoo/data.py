"""The zoo's data: nothing downloaded, everything the same on every rank and every run.

Each data set is a ``Data``: ``train_batch(gen, n)`` draws one rank's mini-batch from a
``torch.Generator`` that the worker seeds with (seed, step, rank), so every method of a job sees
the same examples in the same order; ``eval_x`` / ``eval_y`` are a fixed held-out set. A data
set's own contents never depend on the run's seed (only its initial weights and batch order do),
so two seeds measure the same task.

Sources: scikit-learn's generators (``make_classification``, ``make_gaussian_quantiles``,
``make_friedman1``), synthetic 16x16 images of shapes and 1-D waveforms (NumPy, fixed seed), a
random order-2 Markov chain, sorting and majority tasks drawn afresh at every step, and the bytes
of files that ship with installed packages (scikit-learn's ``.py`` sources, the ``METADATA``
files of the environment's distributions).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class Data:
    """A training sampler and a fixed held-out set. ``info`` holds facts worth recording (sizes,
    the task's own floor where it is known)."""

    sample: Callable[[torch.Generator, int], Batch]
    eval_x: torch.Tensor
    eval_y: torch.Tensor
    info: dict = field(default_factory=dict)

    def train_batch(self, gen: torch.Generator, n: int) -> Batch:
        return self.sample(gen, n)


def from_arrays(x_train, y_train, x_eval, y_eval, **info) -> Data:
    """A fixed training set, sampled with replacement (uniform indices from ``gen``)."""
    x_train, y_train = torch.as_tensor(x_train), torch.as_tensor(y_train)

    def sample(gen: torch.Generator, n: int) -> Batch:
        idx = torch.randint(0, len(y_train), (n,), generator=gen)
        return x_train[idx], y_train[idx]

    info = dict(train_examples=len(y_train), eval_examples=len(y_eval), **info)
    return Data(sample, torch.as_tensor(x_eval), torch.as_tensor(y_eval), info)


def _standardize(x_train: np.ndarray, x_eval: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    mean, std = x_train.mean(0), x_train.std(0) + 1e-8
    return ((x_train - mean) / std).astype(np.float32), ((x_eval - mean) / std).astype(np.float32)


# -- tabular (scikit-learn's generators) ----------------------------------------------------------
def tabular_classes(n_eval: int = 2000) -> Data:
    """``make_classification``: 40 features (24 informative, 8 redundant), 10 classes of 3
    Gaussian clusters each, 2% of labels flipped; standardized on the training split."""
    from sklearn.datasets import make_classification

    x, y = make_classification(n_samples=14000 + n_eval, n_features=40, n_informative=24, n_redundant=8,
                               n_classes=10, n_clusters_per_class=3, class_sep=1.5, flip_y=0.02,
                               random_state=0)
    xt, xe = _standardize(x[n_eval:], x[:n_eval])
    return from_arrays(xt, y[n_eval:].astype(np.int64), xe, y[:n_eval].astype(np.int64), classes=10)


def gaussian_shells(n_eval: int = 2000) -> Data:
    """``make_gaussian_quantiles``: 10-D standard normal points, the class the quantile of their
    squared radius (6 concentric shells): a non-linear boundary that needs the whole MLP."""
    from sklearn.datasets import make_gaussian_quantiles

    x, y = make_gaussian_quantiles(n_samples=14000 + n_eval, n_features=10, n_classes=6, random_state=1)
    x = x.astype(np.float32)
    return from_arrays(x[n_eval:], y[n_eval:].astype(np.int64), x[:n_eval], y[:n_eval].astype(np.int64),
                       classes=6)


def friedman(n_eval: int = 2000) -> Data:
    """``make_friedman1`` regression (10 features, 5 of them used, noise 1.0); the target is
    standardized, so the noise alone leaves a mean squared error of about 0.04."""
    from sklearn.datasets import make_friedman1

    x, y = make_friedman1(n_samples=10000 + n_eval, n_features=10, noise=1.0, random_state=2)
    mean, std = y[n_eval:].mean(), y[n_eval:].std()
    y = ((y - mean) / std).astype(np.float32)[:, None]
    x = x.astype(np.float32)
    return from_arrays(x[n_eval:], y[n_eval:], x[:n_eval], y[:n_eval], noise_mse=float((1.0 / std) ** 2))


# -- synthetic images and signals -------------------------------------------------------------------
def shapes(n_train: int = 8000, n_eval: int = 2000, size: int = 16, noise: float = 0.45) -> Data:
    """16x16 grey images of 8 shapes (disc, ring, square, hollow square, plus, X, triangle,
    diamond) at a random place, size and brightness, on a random linear background, with Gaussian
    noise: small shapes under noise are ambiguous, so accuracy keeps improving with training."""
    rng = np.random.default_rng(3)
    n = n_train + n_eval
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) + 0.5
    label = rng.integers(0, 8, n)
    cx, cy = (rng.uniform(5, size - 5, n)[:, None, None] for _ in range(2))
    r = rng.uniform(2.2, 4.8, n)[:, None, None]
    dx, dy = xx[None] - cx, yy[None] - cy
    dist, box, l1 = np.hypot(dx, dy), np.maximum(abs(dx), abs(dy)), abs(dx) + abs(dy)
    masks = [dist <= r, abs(dist - r) < 0.8, box <= r, abs(box - r) < 0.8,
             ((abs(dx) < 0.8) & (abs(dy) <= r)) | ((abs(dy) < 0.8) & (abs(dx) <= r)),
             (abs(abs(dx) - abs(dy)) < 0.9) & (box <= r),
             (dy >= -r) & (dy <= r) & (abs(dx) <= (dy + r) / 2), l1 <= r]
    img = np.select([label[:, None, None] == k for k in range(8)], masks).astype(np.float32)
    img *= rng.uniform(0.6, 1.4, n)[:, None, None]
    slope = rng.normal(0, 0.03, (n, 2))
    img += slope[:, 0, None, None] * (xx - size / 2) + slope[:, 1, None, None] * (yy - size / 2)
    img += rng.normal(0, noise, img.shape).astype(np.float32)
    img = img[:, None].astype(np.float32)
    label = label.astype(np.int64)
    return from_arrays(img[n_eval:], label[n_eval:], img[:n_eval], label[:n_eval], classes=8)


def waves(n_train: int = 8000, n_eval: int = 2000, length: int = 64, noise: float = 0.45) -> Data:
    """1-D signals of 64 samples, 8 classes of waveform (sine, square, sawtooth, triangle, rising
    and falling chirp, damped sine, amplitude-modulated sine) at a random frequency (2-6 cycles),
    phase, amplitude and offset, under Gaussian noise."""
    rng = np.random.default_rng(4)
    n = n_train + n_eval
    t = np.linspace(0, 1, length, endpoint=False)[None]
    label = rng.integers(0, 8, n)
    f, phase = rng.uniform(2, 6, n)[:, None], rng.uniform(0, 2 * math.pi, n)[:, None]
    arg = 2 * math.pi * f * t + phase
    frac = (arg / (2 * math.pi)) % 1.0
    forms = [np.sin(arg), np.sign(np.sin(arg)), 2 * frac - 1, 4 * abs(frac - 0.5) - 1,
             np.sin(2 * math.pi * f * (t + 0.5 * t * t) + phase), np.sin(2 * math.pi * f * (t - 0.25 * t * t) + phase),
             np.exp(-3 * t) * np.sin(arg), (1 + 0.8 * np.sin(2 * math.pi * t)) * np.sin(arg) / 1.8]
    x = np.select([label[:, None] == k for k in range(8)], forms)
    x = x * rng.uniform(0.5, 1.5, n)[:, None] + rng.normal(0, 0.3, n)[:, None]
    x = (x + rng.normal(0, noise, x.shape))[:, None].astype(np.float32)
    label = label.astype(np.int64)
    return from_arrays(x[n_eval:], label[n_eval:], x[:n_eval], label[:n_eval], classes=8)


# -- sequences --------------------------------------------------------------------------------------
def markov(vocab: int = 16, length: int = 32, n_train: int = 20000, n_eval: int = 2000,
           concentration: float = 0.25) -> Data:
    """Sequences of a random order-2 Markov chain over 16 symbols (each transition row drawn
    from a Dirichlet(0.25), so some contexts are nearly deterministic and others not): next-symbol
    prediction. ``info["floor"]``: the chain's own cross-entropy on the held-out targets after
    the first two (nats per symbol), the best any model can do there."""
    rng = np.random.default_rng(5)
    table = rng.dirichlet(np.full(vocab, concentration), size=(vocab, vocab))
    cum = table.cumsum(-1)
    n = n_train + n_eval
    seq = np.empty((n, length + 1), np.int64)
    seq[:, :2] = rng.integers(0, vocab, (n, 2))
    for i in range(2, length + 1):
        rows = cum[seq[:, i - 2], seq[:, i - 1]]
        seq[:, i] = np.minimum((rows < rng.random((n, 1))).sum(1), vocab - 1)
    held = seq[:n_eval]
    floor = -np.log(table[held[:, :-2], held[:, 1:-1], held[:, 2:]]).mean()
    return from_arrays(seq[n_eval:, :-1], seq[n_eval:, 1:], held[:, :-1], held[:, 1:], vocab=vocab,
                       floor=float(floor))


def sorting(length: int = 12, vocab: int = 32, n_eval: int = 1000) -> Data:
    """A fresh batch at every step: ``length`` random integers below ``vocab``; the target at
    position i is the i-th smallest (metric: per-position accuracy)."""

    def sample(gen: torch.Generator, n: int) -> Batch:
        x = torch.randint(0, vocab, (n, length), generator=gen)
        return x, x.sort(dim=1).values

    ex, ey = sample(torch.Generator().manual_seed(6), n_eval)
    return Data(sample, ex, ey, dict(vocab=vocab, length=length, eval_examples=n_eval, train_examples="fresh"))


def majority(length: int = 24, vocab: int = 8, n_eval: int = 2000) -> Data:
    """A fresh batch at every step: ``length`` symbols drawn from a per-sequence random
    distribution (Dirichlet(1) over 8 symbols); the label is the most frequent symbol (ties: the
    smallest). Counting over a whole sequence is what recurrent models find hard."""

    def sample(gen: torch.Generator, n: int) -> Batch:
        p = -torch.log(torch.rand(n, vocab, generator=gen).clamp_min(1e-12))
        x = torch.multinomial(p / p.sum(1, keepdim=True), length, replacement=True, generator=gen)
        counts = torch.nn.functional.one_hot(x, vocab).sum(1)
        return x, counts.argmax(1)  # argmax returns the first maximum: ties go to the smallest

    ex, ey = sample(torch.Generator().manual_seed(7), n_eval)
    return Data(sample, ex, ey, dict(vocab=vocab, length=length, eval_examples=n_eval, train_examples="fresh"))


def _site_packages() -> Path:
    import sklearn

    return Path(sklearn.__file__).resolve().parent.parent


def text_bytes(files: list[Path], train_bytes: float, context: int, n_eval: int = 256,
               val_every: int = 10, **info) -> Data:
    """Next-byte prediction over ``files`` (read in the given order until ``train_bytes``; every
    ``val_every``-th file is held out): windows of ``context`` bytes at random starts; the
    held-out set is ``n_eval`` fixed windows."""
    train, held, n = [], [], 0
    for i, path in enumerate(files):
        try:
            data = path.read_bytes() + b"\n"
        except OSError:
            continue
        (held if i % val_every == 0 else train).append(data)
        n += len(data) if i % val_every else 0
        if n >= train_bytes:
            break
    as_tensor = lambda parts: torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8).long()
    text, val = as_tensor(train), as_tensor(held)
    span = torch.arange(context + 1)

    def sample(gen: torch.Generator, n: int) -> Batch:
        chunk = text[torch.randint(0, len(text) - context - 1, (n,), generator=gen)[:, None] + span]
        return chunk[:, :-1], chunk[:, 1:]

    starts = torch.randint(0, len(val) - context - 1, (n_eval,), generator=torch.Generator().manual_seed(8))
    chunk = val[starts[:, None] + span]
    return Data(sample, chunk[:, :-1], chunk[:, 1:],
                dict(train_bytes=len(text), eval_bytes=len(val), eval_windows=n_eval, **info))


def sklearn_source(context: int = 64, train_mb: float = 1.5) -> Data:
    """Bytes of scikit-learn's own ``.py`` files (sorted by path): code, but not the standard
    library the repository's LM reads."""
    root = _site_packages() / "sklearn"
    files = sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix())
    return text_bytes(files, train_mb * 1e6, context, source="sklearn/**/*.py")


def package_metadata(context: int = 64, train_mb: float = 1.0) -> Data:
    """Bytes of the environment's ``*.dist-info/METADATA`` files (sorted by distribution): mostly
    English prose and Markdown, the descriptions that PyPI shows. gradcomp's own is left out: it
    holds this repository's README, which would change the corpus at every edit."""
    files = sorted((p for p in _site_packages().glob("*.dist-info/METADATA")
                    if not p.parent.name.lower().startswith("gradcomp-")), key=lambda p: p.parent.name.lower())
    return text_bytes(files, train_mb * 1e6, context, source="site-packages/*.dist-info/METADATA")
