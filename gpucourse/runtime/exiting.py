"""Leave a torchrun-started rank without a crash at interpreter shutdown.

``DistributedDataParallel`` keeps gloo's process group alive after
``torch.distributed.destroy_process_group()``: its worker threads survive (torch 2.14.1; without
DDP the same call joins them). A worker thread that is still releasing a finished collective's
tensors when Python shuts down needs the GIL, which is gone by then: the rank dies with SIGABRT and
``terminate called without an active exception`` after it has done all its work, and torchrun
reports the run as failed. Seen here in about 1 run in 8 of ``scripts/train_elastic.py`` on a
loaded machine (``gdb``: ``ProcessGroupGloo::runLoop`` → ``~AsyncBroadcastWork`` →
``gil_scoped_acquire`` during ``Py_FinalizeEx``; the abandoned fix is pytorch PR #179291).

``run_main(main)`` runs the script's ``main``, destroys the process group, flushes the output and
leaves with ``os._exit``: no interpreter teardown, so no thread can meet a half-destroyed Python.
``gc.launch``'s forked ranks leave the same way.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable

__all__ = ["run_main"]


def run_main(main: Callable[[], int | None]) -> None:
    """Run ``main()`` and exit through ``os._exit``: with ``main``'s return value if it is an
    ``int``, else 0 (a ``main`` may return its results).

    An exception prints its traceback and exits 1; ``SystemExit`` keeps its meaning (``None`` 0,
    an ``int`` that code, anything else printed and 1). The default
    process group, if any is left, is destroyed first. Call it as the script's last line::

        if __name__ == "__main__":
            gc.runtime.run_main(main)
    """
    try:
        result = main()
        status = result if isinstance(result, int) and not isinstance(result, bool) else 0
    except SystemExit as e:
        status = 0 if e.code is None else e.code
    except BaseException:  # noqa: BLE001 - reported, then the rank exits non-zero
        traceback.print_exc()
        status = 1
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - leaving anyway
        traceback.print_exc()
    if not isinstance(status, int):
        print(status, file=sys.stderr)
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
