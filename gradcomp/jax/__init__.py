"""gradcomp from JAX: pytrees of gradients averaged by any gradcomp compressor, as optax transformations.

    # mpiexec -n 4 python train.py
    import optax, gradcomp.jax

    tx = optax.chain(gradcomp.jax.mean("int8"), optax.adamw(1e-3))   # the whole change to the loop
    opt_state = tx.init(params)
    grads = jax.jit(jax.grad(loss))(params, batch)                    # this rank's gradients
    updates, opt_state = tx.update(grads, opt_state, params)          # averaged over the ranks
    params = optax.apply_updates(params, updates)                     # the same bits on every rank

* ``TreeReducer`` (``tree``): a pytree's leaves packed into a ``GradientReducer``'s buckets through
  host views, the means back as JAX arrays in the same structure: the NumPy reducer's bits.
* ``mean``, ``onebit_adam``, ``dgc`` (``transform``): optax transformations; the compressor's or
  optimizer's state is on the host (``state_dict``/``load_state_dict``), the optax state holds a
  step count; ``update`` runs outside jit on concrete arrays and inside jit as an ordered
  ``io_callback``.
* ``DiLoCo`` (``diloco``): local steps of any JAX inner step, a compressed outer step every
  ``sync_every`` calls of ``params = outer.step(params)`` (``gradcomp.optim.DiLoCo`` on the host).
* ``kit``: conformance-kit targets whose buckets travel through JAX arrays
  (``python -m gradcomp.conformance gradcomp.jax.kit:int8``).

An optional extra (``pip install 'gradcomp[jax]'``); ``import gradcomp`` never imports jax.
"""
from .transform import CountState, OptimizerTransform, Transformation, dgc, mean, onebit_adam
from .diloco import DiLoCo
from .tree import TreeReducer

__all__ = ["TreeReducer", "Transformation", "CountState", "OptimizerTransform", "mean", "onebit_adam", "dgc",
           "DiLoCo"]
