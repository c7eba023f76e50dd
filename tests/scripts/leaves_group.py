"""One rank that leaves its process group and a DDP model (in a reference cycle) to
interpreter exit, and reports the order of what happens after it, for
tests/test_script_runner.py. First argument: ``exit N``, ``raise`` or nothing."""

import atexit
import sys
import threading
import time

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

original_destroy = dist.destroy_process_group


def reporting_destroy(*args, **kwargs):
    print("destroy_process_group called", flush=True)
    return original_destroy(*args, **kwargs)


dist.destroy_process_group = reporting_destroy


def late_thread():
    time.sleep(0.3)
    print(f"thread ended, group initialized={dist.is_initialized()}", flush=True)


dist.init_process_group("gloo")
model = DDP(nn.Linear(4, 2))
model.cycle = model  # only gc.collect() frees it
atexit.register(lambda: print(f"atexit ran, group initialized={dist.is_initialized()}", flush=True))
threading.Thread(target=late_thread).start()
if sys.argv[1:2] == ["raise"]:
    raise RuntimeError("the script fails")
if sys.argv[1:2] == ["exit"]:
    sys.exit(int(sys.argv[2]))
