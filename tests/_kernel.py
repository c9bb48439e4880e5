"""A real Jupyter kernel for tests: an ipykernel of this interpreter on unix sockets, importing the
same ``gpucourse`` as the test, and a way to run a cell and keep its outputs."""

import os
import tempfile
from pathlib import Path

import pytest

import gpucourse as gc

REPO = Path(gc.__file__).resolve().parents[1]     # the kernel imports the same gpucourse as this test


class Kernel:
    """An ipykernel of this interpreter (unix sockets), and a way to run a cell and keep its outputs."""

    def __init__(self, tmp_path, env: dict | None = None):
        import ipykernel.kernelspec
        from jupyter_client.kernelspec import KernelSpecManager
        from jupyter_client.manager import KernelManager

        class CurrentEnv(KernelSpecManager):
            def get_kernel_spec(self, kernel_name):
                return self.kernel_spec_class(resource_dir=ipykernel.kernelspec.RESOURCES,
                                              **ipykernel.kernelspec.get_kernel_dict())

        self.sockets = tempfile.mkdtemp(prefix="gpucourse-kernel-")
        self.km = KernelManager(kernel_name="python3", kernel_spec_manager=CurrentEnv())
        self.km.transport, self.km.ip = "ipc", os.path.join(self.sockets, "kernel")
        env = dict(os.environ if env is None else env)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        self.km.start_kernel(env={**env, "OMP_NUM_THREADS": "1"}, cwd=str(tmp_path))
        self.pid = self.km.provisioner.process.pid
        self.client = self.km.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=120)

    def run(self, code: str, timeout: float = 120):
        """``(status, outputs)``: outputs as ``(kind, text or mime types)`` in the order they came."""
        outputs = []

        def keep(msg):
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                if outputs and outputs[-1][0] == content["name"]:      # as a notebook merges them
                    outputs[-1] = (content["name"], outputs[-1][1] + content["text"])
                else:
                    outputs.append((content["name"], content["text"]))
            elif kind in ("execute_result", "display_data"):
                outputs.append((kind, content["data"].get("text/plain") if kind == "execute_result"
                                else sorted(content["data"])))
            elif kind == "error":
                outputs.append(("error", content["ename"], content["evalue"], content["traceback"]))

        reply = self.client.execute_interactive(code, output_hook=keep, timeout=timeout)
        return reply["content"]["status"], outputs

    def close(self):
        if getattr(self, "closed", False):
            return
        self.closed = True
        self.client.stop_channels()
        self.km.shutdown_kernel(now=True)
        import shutil
        shutil.rmtree(self.sockets, ignore_errors=True)


@pytest.fixture
def kernel(tmp_path):
    """A :class:`Kernel` in ``tmp_path``, shut down afterwards (closing twice is a no-op)."""
    k = Kernel(tmp_path)
    try:
        yield k
    finally:
        k.close()
