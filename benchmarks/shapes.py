"""Parameter shapes of real models, and heavy-tailed gradients to fill them.

The shapes are written out from the architectures (He et al. 2016, torchvision's ResNet-50 layout:
25,557,032 parameters; Devlin et al. 2019, BERT-base uncased with its pooler: 109,482,240), so the
benchmark needs no model library and the bucket layouts (what PowerSGD sees as matrices) are the
real ones.
"""
from __future__ import annotations

import math

import numpy as np


def resnet50() -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    inplanes = 64
    for planes, blocks in zip((64, 128, 256, 512), (3, 4, 6, 3)):
        for b in range(blocks):
            shapes += [(planes, inplanes, 1, 1), (planes,), (planes,),
                       (planes, planes, 3, 3), (planes,), (planes,),
                       (planes * 4, planes, 1, 1), (planes * 4,), (planes * 4,)]
            if b == 0:  # projection shortcut
                shapes += [(planes * 4, inplanes, 1, 1), (planes * 4,), (planes * 4,)]
            inplanes = planes * 4
    shapes += [(1000, 2048), (1000,)]
    return shapes


def bert_base() -> list[tuple[int, ...]]:
    h, ff = 768, 3072
    shapes: list[tuple[int, ...]] = [(30522, h), (512, h), (2, h), (h,), (h,)]
    for _ in range(12):
        shapes += [(h, h), (h,)] * 4  # query, key, value, attention output
        shapes += [(h,), (h,), (ff, h), (ff,), (h, ff), (h,), (h,), (h,)]
    shapes += [(h, h), (h,)]  # pooler
    return shapes


def tiny() -> list[tuple[int, ...]]:
    """A few small layers, for smoke tests."""
    return [(32, 16, 3, 3), (32,), (64, 32), (64,), (10, 64), (10,)]


MODELS = {"resnet50": resnet50, "bert-base": bert_base, "tiny": tiny}


def model_shapes(name: str) -> list[tuple[int, ...]]:
    try:
        return MODELS[name]()
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}") from None


def numel(shapes) -> int:
    return sum(math.prod(s) for s in shapes)


#: Layer structure shared by every rank (as the true gradient is), seeded apart from the noise.
STRUCTURE_SEED = 12345


def heavy_tailed(shapes, seed: int, low_rank: int = 4, noise: float = 0.25) -> list[np.ndarray]:
    """float32 fake gradients for one rank: per layer a scale spread over three decades (layers of
    a real network differ that much); for matrices (and convolutions seen as ``out x rest``, as
    PowerSGD sees them) a rank-``low_rank`` part with decaying singular values that every rank
    shares, the signal that PowerSGD is built to find (measured gradients are close to low rank);
    plus per-rank Student-t noise (3 degrees of freedom: finite variance, heavy tails, the
    outliers that hurt per-tensor quantization) at ``noise`` times the signal's typical size."""
    shared = np.random.default_rng(STRUCTURE_SEED)
    rng = np.random.default_rng(seed)
    out = []
    for s in shapes:
        scale = 10.0 ** shared.uniform(-4, -1)
        g = rng.standard_t(3, size=s).astype(np.float32)
        g *= np.float32(noise)
        if len(s) >= 2 and low_rank > 0:
            rows, cols = s[0], math.prod(s[1:])
            k = min(low_rank, rows, cols)
            u = shared.standard_normal((rows, k)).astype(np.float32)
            v = shared.standard_normal((k, cols)).astype(np.float32)
            u *= 0.5 ** np.arange(k, dtype=np.float32)
            g.reshape(rows, cols)[...] += u @ v
        else:
            g += np.float32(shared.standard_normal())  # a vector: a shared offset
        g *= np.float32(scale)
        out.append(g)
    return out
