"""PowerSGD's ordered stage past the warm-up: the messages, the second factor, the output.

Runs on the wire thread after the local stage (``local_stage``): sends the uncompressed tensors
with the first factor, computes and sends the second (``rounds=2``), reconstructs the bucket and
keeps the residual and the factors for the next step. ``PowerSGD.finish`` counts the traffic and
calls ``_send``.
"""
from __future__ import annotations

from ..arrays import Array, array_module, cast, subtract_into
from ..bucket import Bucket
from ..comm import Communicator
from ..compressors.quantize import QuantizedAllreduce
from ..state import TensorStore
from .plan import orthogonalize
from .work import Work


class OrderedStage:
    """``PowerSGD``'s ordered stage (a base of it, not used alone): what it reads of the
    compressor is declared below."""

    error_feedback: bool
    warm_start: bool
    rounds: int
    orthogonalization_epsilon: float
    _factor_codec: QuantizedAllreduce | None
    _errors: TensorStore
    _q: TensorStore
    _p: TensorStore

    def _factor_numel(self, n: int, itemsize: int) -> int:
        """What ``n`` factor values cost on the wire, counted in values of ``itemsize`` bytes."""
        codec = self._factor_codec
        return n if codec is None else -(-codec.message_size(n) // itemsize)

    def _mean(self, wire: Array, comm: Communicator, w: Work, exact: int = 0) -> Array:
        """The mean over ranks of ``wire``, returned in ``compute`` (in ``wire`` itself where it
        can be); with ``factor_bits`` its first ``exact`` values (the uncompressed tensors) go
        exactly and the rest, the factor, as quantized codes."""
        codec = self._factor_codec
        if codec is None:
            return self._exact_mean(wire, comm, w)
        if exact:
            wire[:exact] = self._exact_mean(wire[:exact], comm, w)  # a copy onto itself at most
        factor = Bucket(wire[exact:], scratch=True)
        mean = codec.finish(factor, comm, codec.prepare(factor, comm, comm.workspace))
        if mean is not factor.buffer:
            wire[exact:] = mean
        return wire

    def _exact_mean(self, wire: Array, comm: Communicator, w: Work) -> Array:
        """Sum of ``wire / size`` over ranks, sent in the bucket's dtype, returned in ``compute``."""
        xp = array_module(wire)
        if comm.size > 1:
            xp.divide(wire, w.compute.type(comm.size), out=wire)
        if w.compute != w.storage:
            half = comm.workspace.array(self, "half-wire", wire.shape[0], w.storage, like=wire)
            summed = comm.allreduce(cast(wire, w.storage, out=half), overwrite=True)
            return cast(summed, w.compute, out=wire)
        return comm.allreduce(wire, overwrite=True)

    def _send(self, bucket: Bucket, comm: Communicator, w: Work) -> Array:
        """Exchange a compressed bucket prepared in ``w`` and return its mean over ranks; keep the
        new residual and factors, or drop them on every rank where the factors are not finite."""
        xp = array_module(bucket.buffer)
        plan, n = w.plan, bucket.numel
        assert plan is not None  # compressing
        summed = self._mean(w.wire, comm, w, exact=plan.n_unc)
        pos = 0
        for a, b in plan.runs:
            w.out[a:b] = summed[pos:pos + b - a]
            pos += b - a
        new = summed[plan.n_unc:]
        residual = w.x if w.fold else None
        if self.rounds == 2:
            p = new
            orthogonalize(p, plan.p_groups, not w.half, self.orthogonalization_epsilon)
            p = w.rounded(p)
            q_local = comm.workspace.array(self, "q-local", plan.q_size, w.compute, like=w.mx)
            w.products.project_t(w.mx, p, q_local)
            q = self._mean(q_local, comm, w)
            w.products.reconstruct(w.out, p, q, residual)
        else:
            p, q = (new, w.basis) if w.phase == 0 else (w.basis, new)
            w.products.reconstruct(w.out, p, q, residual)
        result = w.out
        if not w.direct:
            result = cast(w.out[:n], w.storage, out=bucket.buffer if bucket.scratch else None)
        keys = [t.key for t in plan.matrices]
        if not (bool(xp.isfinite(p).all()) and bool(xp.isfinite(q).all())):
            # identical P and Q on every rank: every rank drops the memory together
            self._errors.drop(bucket.keys)
            self._q.drop(keys)
            self._p.drop(keys)
            return result
        if self.error_feedback:
            if not w.fold:
                subtract_into(w.x, result if result.dtype == w.x.dtype else cast(result, w.x.dtype))
            for a, b in plan.runs:
                w.x[a:b] = 0
        if self.warm_start:
            self._q.region(plan.q_placements, plan.q_size, w.compute, like=w.mx)[0][...] = q
            if self.rounds == 1:
                self._p.region(plan.p_placements, plan.p_size, w.compute, like=w.mx)[0][...] = p
        return result
