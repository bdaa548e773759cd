"""gradcomp: gradient compression over MPI collectives, NumPy on CPU and CuPy on GPU.

    import gradcomp
    comm = gradcomp.MPICommunicator()
    reducer = gradcomp.GradientReducer(grads, gradcomp.FP16(), comm)
    reducer.step()                       # grads now hold the means over ranks

Launch with ``mpiexec -n N python train.py``. PyTorch users: ``gradcomp.torch``. Writing a
compressor: ``gradcomp.Codec`` and the conformance kit, ``python -m gradcomp.conformance``.
What compression did, as flat scalars for any logger: ``gradcomp.metrics(stats)``, ``gradcomp.Meter``.
"""
from .bucket import Bucket
from .comm import (CollectiveError, Communicator, CommunicatorBroken, MPICommunicator,
                   default_communicator)
from .compressors import (BF16, FP16, Allgather, Allreduce, Codec, Compressor, ErrorFeedback, OneBit,
                          QuantizedAllreduce, QuantizePerChannel, QuantizePerTensor, RandomK, TopK)
from .registry import REGISTRY, make, register
from .powersgd import BatchedPowerSGD, PowerSGD
from .reducer import GradientReducer, allreduce_gradients
from .schedule import Schedule
from .planning import Recipe
from .planning.names import register_builtins as _register_builtins
from . import optim  # DGC, OneBitAdam: methods that need the optimizer
from .metrics import Meter, backoffs, metrics  # stats() as flat scalars for a logger (binds the function)

_register_builtins()

__version__ = "0.2.0"

__all__ = ["Bucket", "Communicator", "MPICommunicator", "CollectiveError", "CommunicatorBroken",
           "default_communicator", "Compressor", "Codec", "ErrorFeedback", "Allreduce", "Allgather",
           "FP16", "BF16", "QuantizePerTensor", "QuantizePerChannel", "QuantizedAllreduce", "OneBit",
           "TopK", "RandomK", "PowerSGD", "BatchedPowerSGD",
           "Schedule", "Recipe", "REGISTRY", "make", "register", "GradientReducer", "allreduce_gradients",
           "metrics", "Meter", "backoffs"]
