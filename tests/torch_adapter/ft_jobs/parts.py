"""What both replica jobs build alike: the small model and its SGD, and a torchft ``Manager`` over
gloo for one process of a replica group, reaching the lighthouse on this host."""
from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import Any, Callable

import torch
from torch.distributed import TCPStore
from torchft import Manager, ProcessGroupGloo


_STORES: list[TCPStore] = []


def model_and_optimizer(name: str) -> tuple[int, torch.nn.Module, torch.optim.Optimizer]:
    """This replica's data stream (from its name), the MLP (the same on every replica) and its SGD
    with momentum (state that must heal too)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    return sum(name.encode()), net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)


def manager(name: str, lighthouse: str, state_dict: Callable[[], Any], load_state_dict: Callable[[Any], Any],
            quorum_timeout_s: float) -> Manager:
    """One process of replica group ``name``: the synchronous quorum (gradcomp.torch.ft requires it).
    Its store lives as long as the process (the manager's process group connects to it later)."""
    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    _STORES.append(store)
    return Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), load_state_dict=load_state_dict,
        state_dict=state_dict, min_replica_size=1, use_async_quorum=False,
        replica_id=name, lighthouse_addr=lighthouse, hostname="localhost",
        store_addr="localhost", store_port=store.port, rank=0, world_size=1,
        timeout=timedelta(seconds=10), quorum_timeout=timedelta(seconds=quorum_timeout_s),
        connect_timeout=timedelta(seconds=10))


def leave(manager: Manager) -> None:
    """End this process: torchft's servers and threads need no orderly teardown here."""
    manager.shutdown(wait=False)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
