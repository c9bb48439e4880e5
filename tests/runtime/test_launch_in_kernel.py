"""launch() inside a real Jupyter kernel: cell-defined functions, grouped output, failure, re-run."""

import nbformat
from nbformat.v4 import new_code_cell, new_notebook

from gpucourse.grading.selfcheck import run_notebook


def _outputs_text(cell):
    parts = []
    for out in cell.outputs:
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type == "execute_result":
            parts.append(out.data.get("text/plain", ""))
        elif out.output_type == "error":
            parts.append(f"{out.ename}: {out.evalue}")
    return "".join(parts)


def test_launch_from_notebook_cells(tmp_path):
    nb = new_notebook(cells=[
        new_code_cell("import torch, torch.distributed as dist\nimport gpucourse as gc"),
        new_code_cell(
            "def total(rank, world_size):\n"
            "    t = torch.tensor([rank + 1.0])\n"
            "    dist.all_reduce(t)\n"
            "    print(f'rank {rank} sees {t.item()}')\n"
            "    return t.item()\n"
            "gc.launch(total, 2)"),
        new_code_cell(
            "def broken(rank, world_size):\n"
            "    if rank == 1:\n"
            "        raise KeyError('missing')\n"
            "    dist.barrier()\n"
            "try:\n"
            "    gc.launch(broken, 2, timeout=30)\n"
            "except gc.WorkerError as e:\n"
            "    print('caught rank', e.rank, e.exc_type)"),
        new_code_cell("gc.launch(total, 3)"),
        new_code_cell("gc.launch(lambda r, w: r * 10, 2, init_process_group=False)"),
    ])
    path = tmp_path / "launch.ipynb"
    nbformat.write(nb, path)
    executed, fatal = run_notebook(path, cell_timeout=120, allow_errors=True)
    assert not fatal
    texts = [_outputs_text(c) for c in executed.cells]
    assert "[rank 0] rank 0 sees 3.0\n[rank 1] rank 1 sees 3.0" in texts[1]
    assert "[3.0, 3.0]" in texts[1]
    assert "caught rank 1 KeyError" in texts[2]
    assert "[6.0, 6.0, 6.0]" in texts[3]
    assert "[0, 10]" in texts[4]
    assert not any(o.output_type == "error" for c in executed.cells for o in c.outputs)


def test_spawned_ranks_run_cell_defined_functions(tmp_path):
    # as after a lesson touched CUDA: fork is unsafe, so launch spawns and sends fn by value
    nb = new_notebook(cells=[
        new_code_cell("import torch, torch.distributed as dist\nimport gpucourse as gc\n"
                      "torch.cuda.is_initialized = lambda: True"),
        new_code_cell(
            "class Box:\n"
            "    def __init__(self, v):\n"
            "        self.v = v\n"
            "def total(rank, world_size, scale):\n"
            "    t = torch.tensor([rank + 1.0])\n"
            "    dist.all_reduce(t)\n"
            "    print(f'rank {rank} sees {t.item()}')\n"
            "    return Box(t.item() * scale)\n"
            "boxes = gc.launch(total, 2, args=(2,))\n"
            "print([b.v for b in boxes], all(isinstance(b, Box) for b in boxes))"),
        new_code_cell("offset = 7\ngc.launch(lambda r, w: r + offset, 2, init_process_group=False)"),
    ])
    path = tmp_path / "spawn.ipynb"
    nbformat.write(nb, path)
    executed, fatal = run_notebook(path, cell_timeout=240, allow_errors=True)
    assert not fatal
    texts = [_outputs_text(c) for c in executed.cells]
    assert "[rank 0] rank 0 sees 3.0\n[rank 1] rank 1 sees 3.0" in texts[1], texts[1]
    assert "[6.0, 6.0] True" in texts[1]
    assert "[7, 8]" in texts[2], texts[2]
