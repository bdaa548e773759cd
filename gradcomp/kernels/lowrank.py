"""PowerSGD's compiled products: ``P = M Q``, ``Q = M^T P`` and ``M ~ P Q^T`` on a whole bucket.

Why not BLAS: with rank r of 1 to 8, ``M Q`` is a matrix times a few vectors, and OpenBLAS's GEMM
spends twice a memory pass on it (it packs and re-reads M), while the step around it also adds the
residual before the product and subtracts the approximation after it, each one more pass over the
bucket. These loops read every matrix once per product and fold those passes in:

- ``project``: ``M += G`` (the new gradient onto the residual) and ``P = M Q`` in one pass;
- ``project_t``: ``Q = M^T P``;
- ``reconstruct``: ``OUT = P Q^T`` and ``M -= OUT`` (the new residual) in one pass.

A whole bucket is one call: ``table`` has a row ``(offset, n, m, r, p_offset, q_offset)`` per
matrix, the element offsets of M in the flat bucket and of its row-major P (n x r) and Q (m x r)
blocks. Rows are taken four at a time where a row of Q^T no longer fits in L1 (wide layers such
as ResNet-50's 512 x 4608), so each load of Q serves four rows.

Numbers: float32 (and float64) sums in a fixed order that does not depend on the arrays'
addresses, so every rank gets the same bits from the same inputs; ``reconstruct`` adds its r
products left to right without fused multiply-adds. ``project``'s dot products are reassociated
(vectorized partial sums), which differs from BLAS's order by a few units in the last place.
"""

from __future__ import annotations

import numpy as np

from .primitives import inline, kernel, summing, summing_inline

#: a row of Q^T larger than this (bytes) is shared by four rows of M (see the module docstring)
_WIDE_BYTES = 8192


@inline
def _zero(x):
    return np.zeros(1, x.dtype)[0]


@inline
def _transposed(q, qo, m, r, dtype):
    qt = np.empty((r, m), dtype)
    for j in range(m):
        for k in range(r):
            qt[k, j] = q[qo + j * r + k]
    return qt


@inline
def _add_rows(x, g, start, stop):
    xs = x[start:stop]
    gs = g[start:stop]
    for j in range(xs.shape[0]):
        xs[j] += gs[j]


@inline
def _rows_at(x, g, add, off, i, n, m, step):
    """How many rows (``step``, 4 or 1, and 1 for the last few) to take from row i of the
    matrix at ``off``, after adding ``g`` to them where ``add``."""
    if i + step > n:
        step = 1
    if add:
        _add_rows(x, g, off + i * m, off + (i + step) * m)
    return step


@inline
def _four_rows(x, start, m):
    return (x[start:start + m], x[start + m:start + 2 * m], x[start + 2 * m:start + 3 * m],
            x[start + 3 * m:start + 4 * m])


@summing_inline
def _dot(x, a):
    s = _zero(x)
    for j in range(x.shape[0]):
        s += x[j] * a[j]
    return s


@summing_inline
def _dot_1x4(x, a, b, c, d):
    """One row against four columns of Q: four sums, one read of the row."""
    s0 = s1 = s2 = s3 = _zero(x)
    for j in range(x.shape[0]):
        v = x[j]
        s0 += v * a[j]
        s1 += v * b[j]
        s2 += v * c[j]
        s3 += v * d[j]
    return s0, s1, s2, s3


@summing_inline
def _dot_4x1(x0, x1, x2, x3, a):
    s0 = s1 = s2 = s3 = _zero(x0)
    for j in range(x0.shape[0]):
        v = a[j]
        s0 += x0[j] * v
        s1 += x1[j] * v
        s2 += x2[j] * v
        s3 += x3[j] * v
    return s0, s1, s2, s3


@summing_inline
def _dot_4x4(x0, x1, x2, x3, a, b, c, d):
    """Four rows against four columns: sixteen sums, each load of a row or column used four times."""
    s00 = s01 = s02 = s03 = s10 = s11 = s12 = s13 = _zero(x0)
    s20 = s21 = s22 = s23 = s30 = s31 = s32 = s33 = _zero(x0)
    for j in range(x0.shape[0]):
        qa = a[j]
        qb = b[j]
        qc = c[j]
        qd = d[j]
        v = x0[j]
        s00 += v * qa
        s01 += v * qb
        s02 += v * qc
        s03 += v * qd
        v = x1[j]
        s10 += v * qa
        s11 += v * qb
        s12 += v * qc
        s13 += v * qd
        v = x2[j]
        s20 += v * qa
        s21 += v * qb
        s22 += v * qc
        s23 += v * qd
        v = x3[j]
        s30 += v * qa
        s31 += v * qb
        s32 += v * qc
        s33 += v * qd
    return (s00, s01, s02, s03, s10, s11, s12, s13, s20, s21, s22, s23, s30, s31, s32, s33)


@inline
def _scaled_rows_4x4(acc, k, p, at, r, x0, x1, x2, x3, m):
    """``acc[k + b] += (c0 x0 + c1 x1) + (c2 x2 + c3 x3)`` for b < 4, ``c`` the four rows'
    entries of P's column k + b (row a's from ``p[at + a * r + k + b]``), in one loop over
    the columns: each value of the rows is loaded once for the four sums (a loop per b would
    re-read the rows, and the memory would idle while it does). The same operations on each
    sum as one loop per b."""
    a0, a1, a2, a3 = acc[k], acc[k + 1], acc[k + 2], acc[k + 3]
    c00, c01, c02, c03 = p[at + k], p[at + r + k], p[at + 2 * r + k], p[at + 3 * r + k]
    c10, c11, c12, c13 = p[at + k + 1], p[at + r + k + 1], p[at + 2 * r + k + 1], p[at + 3 * r + k + 1]
    c20, c21, c22, c23 = p[at + k + 2], p[at + r + k + 2], p[at + 2 * r + k + 2], p[at + 3 * r + k + 2]
    c30, c31, c32, c33 = p[at + k + 3], p[at + r + k + 3], p[at + 2 * r + k + 3], p[at + 3 * r + k + 3]
    for j in range(m):
        v0, v1, v2, v3 = x0[j], x1[j], x2[j], x3[j]
        a0[j] += (c00 * v0 + c01 * v1) + (c02 * v2 + c03 * v3)
        a1[j] += (c10 * v0 + c11 * v1) + (c12 * v2 + c13 * v3)
        a2[j] += (c20 * v0 + c21 * v1) + (c22 * v2 + c23 * v3)
        a3[j] += (c30 * v0 + c31 * v1) + (c32 * v2 + c33 * v3)


@summing
def _project(x, g, add, q, p, table, wide):
    """``x += g`` where ``add``, then ``P = X Q``, matrix by matrix."""
    for t in range(table.shape[0]):
        off, n, m, r, po, qo = table[t]
        qt = _transposed(q, qo, m, r, x.dtype)
        step = 4 if m * r * x.itemsize > wide else 1
        i = 0
        while i < n:
            step = _rows_at(x, g, add, off, i, n, m, step)
            if step == 4:
                x0, x1, x2, x3 = _four_rows(x, off + i * m, m)
                k = 0
                while k + 4 <= r:
                    s = _dot_4x4(x0, x1, x2, x3, qt[k], qt[k + 1], qt[k + 2], qt[k + 3])
                    for a in range(4):
                        for b in range(4):
                            p[po + (i + a) * r + k + b] = s[4 * a + b]
                    k += 4
                while k < r:
                    s0, s1, s2, s3 = _dot_4x1(x0, x1, x2, x3, qt[k])
                    p[po + i * r + k] = s0
                    p[po + (i + 1) * r + k] = s1
                    p[po + (i + 2) * r + k] = s2
                    p[po + (i + 3) * r + k] = s3
                    k += 1
            else:
                row = x[off + i * m: off + (i + 1) * m]
                k = 0
                while k + 4 <= r:
                    s0, s1, s2, s3 = _dot_1x4(row, qt[k], qt[k + 1], qt[k + 2], qt[k + 3])
                    p[po + i * r + k] = s0
                    p[po + i * r + k + 1] = s1
                    p[po + i * r + k + 2] = s2
                    p[po + i * r + k + 3] = s3
                    k += 4
                while k < r:
                    p[po + i * r + k] = _dot(row, qt[k])
                    k += 1
            i += step


@kernel
def _project_t(x, g, add, p, q, table, wide):
    """``x += g`` where ``add``, then ``Q = X^T P``: rows of X scaled by P's entries summed
    into Q^T, row after row (a fixed order; no reassociation)."""
    for t in range(table.shape[0]):
        off, n, m, r, po, qo = table[t]
        acc = np.zeros((r, m), x.dtype)
        step = 4 if m * r * x.itemsize > wide else 1
        i = 0
        while i < n:
            step = _rows_at(x, g, add, off, i, n, m, step)
            if step == 4:
                x0, x1, x2, x3 = _four_rows(x, off + i * m, m)
                k = 0
                while k + 4 <= r:
                    _scaled_rows_4x4(acc, k, p, po + i * r, r, x0, x1, x2, x3, m)
                    k += 4
                while k < r:
                    a = acc[k]
                    c0 = p[po + i * r + k]
                    c1 = p[po + (i + 1) * r + k]
                    c2 = p[po + (i + 2) * r + k]
                    c3 = p[po + (i + 3) * r + k]
                    for j in range(m):
                        a[j] += (c0 * x0[j] + c1 * x1[j]) + (c2 * x2[j] + c3 * x3[j])
                    k += 1
            else:
                row = x[off + i * m: off + (i + 1) * m]
                for k in range(r):
                    a = acc[k]
                    c = p[po + i * r + k]
                    for j in range(m):
                        a[j] += c * row[j]
            i += step
        for j in range(m):
            for k in range(r):
                q[qo + j * r + k] = acc[k, j]


@kernel
def _reconstruct(out, p, q, table, x, subtract):
    """``OUT = P Q^T`` (the r products added left to right, in groups of four), and
    ``x -= OUT`` where ``subtract``, while the row is still in cache."""
    for t in range(table.shape[0]):
        off, n, m, r, po, qo = table[t]
        qt = _transposed(q, qo, m, r, out.dtype)
        for i in range(n):
            o = out[off + i * m: off + (i + 1) * m]
            xr = x[off + i * m: off + (i + 1) * m]
            pr = p[po + i * r: po + (i + 1) * r]
            k = 0
            while k < r:
                width = 4 if k + 4 <= r else 1
                last = subtract and k + width == r
                if width == 4:
                    c0, c1, c2, c3 = pr[k], pr[k + 1], pr[k + 2], pr[k + 3]
                    a, b, c, d = qt[k], qt[k + 1], qt[k + 2], qt[k + 3]
                    if k == 0 and last:
                        for j in range(m):
                            v = ((c0 * a[j] + c1 * b[j]) + c2 * c[j]) + c3 * d[j]
                            o[j] = v
                            xr[j] -= v
                    elif k == 0:
                        for j in range(m):
                            o[j] = ((c0 * a[j] + c1 * b[j]) + c2 * c[j]) + c3 * d[j]
                    elif last:
                        for j in range(m):
                            v = o[j] + (((c0 * a[j] + c1 * b[j]) + c2 * c[j]) + c3 * d[j])
                            o[j] = v
                            xr[j] -= v
                    else:
                        for j in range(m):
                            o[j] += ((c0 * a[j] + c1 * b[j]) + c2 * c[j]) + c3 * d[j]
                else:
                    c0 = pr[k]
                    a = qt[k]
                    if k == 0 and last:
                        for j in range(m):
                            v = c0 * a[j]
                            o[j] = v
                            xr[j] -= v
                    elif k == 0:
                        for j in range(m):
                            o[j] = c0 * a[j]
                    elif last:
                        for j in range(m):
                            v = o[j] + c0 * a[j]
                            o[j] = v
                            xr[j] -= v
                    else:
                        for j in range(m):
                            o[j] += c0 * a[j]
                k += width


def project(x, q, p, table, add=None):
    """``x += add`` (matrix rows only) where given, then ``P = X Q`` for every matrix of ``table``."""
    _project(x, x if add is None else add, add is not None, q, p, table, _WIDE_BYTES)


def project_t(x, p, q, table, add=None):
    """``x += add`` (matrix rows only) where given, then ``Q = X^T P`` for every matrix."""
    _project_t(x, x if add is None else add, add is not None, p, q, table, _WIDE_BYTES)


def reconstruct(out, p, q, table, residual=None):
    """``OUT = P Q^T`` for every matrix, and ``residual -= OUT`` there where given."""
    _reconstruct(out, p, q, table, out if residual is None else residual, residual is not None)
