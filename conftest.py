"""Loaded by every pytest run in this checkout: the package tests, the doctests, and nbval over
notebooks/ and solutions/ (``make test-notebooks``), which has no conftest of its own.

nbval starts one kernel per notebook with its stderr sent to /dev/null. A kernel that dies before
its first reply therefore fails all of the notebook's cells with "Kernel died before replying to
kernel_info" and no reason. It happened once in CI (2026-11-29, solutions/11, all 19 cells, on a
fresh clone; it passed when run again). The likeliest cause is Jupyter's known start-up race: the
client picks free loopback ports and closes them, and the kernel binds them a moment later, by
which time another process (here: another worker's kernel, or a rank's gloo socket) may hold one
(jupyter/jupyter_client#154). So a kernel that dies *before running any cell* is started once
more, and the first one's stderr is kept and shown as a warning. Nothing a notebook runs is retried.
"""

import tempfile
import warnings


def _start_again_once(start):
    def start_new_kernel(*args, **kwargs):
        for attempt in (1, 2):
            stderr = tempfile.TemporaryFile()
            kwargs["stderr"] = stderr
            try:
                return start(*args, **kwargs)
            except RuntimeError as e:
                if "died before replying" not in str(e) or attempt == 2:
                    raise
                stderr.seek(0)
                why = stderr.read()[-1500:].decode(errors="replace").strip() or "it wrote nothing to stderr"
                warnings.warn(f"nbval: a kernel died at start-up, before any cell ran; starting another. "
                              f"Its stderr: {why}", RuntimeWarning, stacklevel=2)
    return start_new_kernel


try:
    from nbval import kernel as _nbval_kernel
except ImportError:                      # nbval is a test extra
    pass
else:
    _nbval_kernel.start_new_kernel = _start_again_once(_nbval_kernel.start_new_kernel)
