"""gradcomp: gradient compression over MPI collectives, NumPy on CPU and CuPy on GPU.

    from gradcomp import MPICommunicator, FP16, Allreduce, allreduce_gradients
    comm = MPICommunicator()
    allreduce_gradients(grads, FP16(Allreduce()), comm)

Launch with ``mpiexec -n N python train.py``. PyTorch users: ``gradcomp.torch``.
"""
from .bucket import Bucket
from .comm import (CollectiveError, Communicator, CommunicatorBroken, MPICommunicator,
                   default_communicator)
from .compressors import (BF16, FP16, REGISTRY, Allgather, Allreduce, Compressor,
                          QuantizePerChannel, QuantizePerTensor, make, register)
from .compressors.powersgd import BatchedPowerSGD, PowerSGD
from .schedule import Schedule
from .gradients import allreduce_gradients

__version__ = "0.1.0"

__all__ = ["Bucket", "Communicator", "MPICommunicator", "CollectiveError", "CommunicatorBroken",
           "default_communicator", "Compressor", "Allreduce", "Allgather", "FP16", "BF16",
           "QuantizePerTensor", "QuantizePerChannel", "PowerSGD", "BatchedPowerSGD", "Schedule",
           "REGISTRY", "make", "register", "allreduce_gradients"]
