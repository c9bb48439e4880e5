"""Check the course on a CUDA machine in one call: GPU tests, every lesson, the GPU benchmarks.

    python scripts/gpu_check.py [--time-limit 540] [--out DIR] [--report NAME]     (make gpu-check)

Without CUDA it says so in one line and exits 0. With CUDA it runs, under ONE overall time limit
(default 9 minutes; every subprocess gets the time that is left as its timeout, and is killed, with
everything it started, at the end — nothing outlives this script):

1. the tests marked ``cuda`` and ``multigpu`` (pytest, pytest-timeout), while the lessons run.
   With one GPU the ``multigpu`` ones are skipped by tests/conftest.py, and the report lists each
   with its reason;
2. every lesson notebook ``notebooks/NN_*.ipynb``, top to bottom in a fresh kernel (nbclient,
   kernel ``python3``), unchanged: the learner's default device choice. Several run at once: as
   many as the GPU's free memory / ``--notebook-gib`` allows, at most the CPU count / 2;
3. the benchmarks with a GPU side (the files of benchmarks/ that mention cuda), first, alone.

``--parts`` and ``--chapters`` narrow it down for a second, shorter call: ``--parts notebooks
--chapters 04,08`` re-checks two lessons. A failed lesson's report row carries the last lines of
its error (a rank's traceback included).

It writes one report, ``gpu_check_report.json`` and ``.md``, in ``--out`` (default: ``$OUT`` when
set, else the current folder): per chapter ran / failed (first error line) / skipped (why), seconds;
the GPU, driver, CUDA, torch and Python versions; and what needs a newer torch than this machine's
(an ImportError / AttributeError of a torch API is reported as "needs a newer torch", not as a
failure of the chapter). Exit status: 0 when nothing failed (or there is no CUDA), 1 otherwise.

Only the standard library here; nbclient/nbformat/ipykernel are imported by the notebook worker
(``make gpu-wheels`` prepares them as wheels for a machine whose Python lacks them; README,
"Checking the course on a GPU").
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import ctypes
import datetime
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REPORT = "gpu_check_report"
#: the seconds kept back at the end for collecting results and writing the report
RESERVE_S = 10.0
#: a notebook worker is told to stop this much before it is killed (so it can say which cell hung)
GRACE_S = float(os.environ.get("GPU_CHECK_GRACE_S", 8.0))     # (the tests change it)
#: a folder of tests/ or gpucourse/ → the chapter it belongs to (the rest: "package")
PART_CHAPTER = {"basics": "01", "data_parallel": "02", "distributed": "04", "cluster": "05",
                "precision": "06", "pipeline": "07", "sharding": "08", "tensor_parallel": "09",
                "observability": "10", "long_context": "11", "experts": "11", "planning": "12"}
#: torch APIs the course uses that older torch releases lack: substring of the error → version
KNOWN_TORCH_APIS = {"fully_shard": "2.6", "torch.distributed.tensor": "2.5", "torch.accelerator": "2.6",
                    "varlen_attn": "2.9"}
STATUS_ORDER = ["failed", "needs newer torch", "ran", "skipped"]


# --- processes: nothing outlives the script ------------------------------------------------------

def become_subreaper() -> None:
    """Orphans of our children (a kernel's ranks, a process that started its own session) are
    re-parented to this process rather than to init, so the final sweep finds them (Linux)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)      # PR_SET_CHILD_SUBREAPER


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def descendants(pid: int) -> list[int]:
    kids, out, todo = _children_map(), [], [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``, its process group and every process below it, then reap it."""
    victims = descendants(proc.pid)
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in [proc.pid, *victims]:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        proc.wait(timeout=10)


def sweep() -> None:
    """Kill whatever is still below this process (adopted orphans included) and reap it."""
    for _ in range(5):
        left = descendants(os.getpid())
        if not left:
            return
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
        with contextlib.suppress(ChildProcessError, OSError):
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass


def run_until(cmd: list[str], deadline: float, *, cwd: Path, env: dict) -> tuple[int | None, str, float]:
    """Run ``cmd`` in its own process group until it ends or ``deadline`` (time.monotonic()).
    Returns (exit status, or None when it was killed at the deadline; its output; seconds)."""
    start = time.monotonic()
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            rc = None
        # what it left behind goes too (a kernel it started, a process in a new session)
        kill_tree(proc)
        log.seek(0)
        out = log.read().decode(errors="replace")
    return rc, out, time.monotonic() - start


# --- classifying an error ------------------------------------------------------------------------

def needs_newer_torch(error: str) -> str:
    """``"needs torch >= X"`` when ``error`` (an exception line) is a torch API this torch lacks."""
    m = re.search(r"\b(ImportError|ModuleNotFoundError|AttributeError)\b:?(.*)", error)
    if not m or "torch" not in m.group(2):
        return ""
    for api, version in KNOWN_TORCH_APIS.items():
        if api in m.group(2):
            return f"needs torch >= {version}"
    return f"needs a newer torch than {TORCH_VERSION or 'this one'}"


def first_error_line(text: str) -> str:
    """The exception line of the last traceback in ``text`` (else its last non-empty line)."""
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if re.match(r"^(E\s+)?[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit|Timeout)\b", line.strip()):
            return line.strip().removeprefix("E").strip()
    return lines[-1] if lines else ""


TORCH_VERSION = ""


def item(kind, name, chapter, status, seconds=0.0, detail="", **extra) -> dict:
    if status == "failed" and (req := needs_newer_torch(detail)):
        status, extra["requirement"] = "needs newer torch", req
    return {"kind": kind, "name": name, "chapter": chapter, "status": status,
            "seconds": round(seconds, 1), "detail": detail, **extra}


def chapter_of_path(path: str) -> str:
    m = re.search(r"(?:^|/)(\d\d)_", path)
    if m:
        return m.group(1)
    parts = Path(path).parts
    for part in parts:
        if part in PART_CHAPTER:
            return PART_CHAPTER[part]
    return "package"


# --- the machine ---------------------------------------------------------------------------------

PROBE = r"""
import json, platform, sys
info = {"python": platform.python_version(), "executable": sys.executable}
try:
    import torch
except Exception as e:
    info["error"] = f"torch does not import: {type(e).__name__}: {e}"
    print(json.dumps(info)); raise SystemExit
info.update(torch=torch.__version__, cuda_build=torch.version.cuda, gpus=[])
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        info["gpus"].append({"index": i, "name": p.name, "capability": f"{p.major}.{p.minor}",
                             "total_gib": round(total / 2**30, 1), "free_gib": round(free / 2**30, 1)})
    info["nccl"] = torch.distributed.is_available() and torch.distributed.is_nccl_available()
    info["bf16"] = torch.cuda.is_bf16_supported()
print(json.dumps(info))
"""

IMPORT_PROBE = r"""
import importlib, json, pathlib, sys, traceback
out = {}
for part in sys.argv[1:]:
    try:
        importlib.import_module(part)
        out[part] = ""
    except BaseException as e:
        out[part] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
print(json.dumps(out))
"""


def probe(python: str, deadline: float, env: dict, pretend: int) -> dict:
    if pretend:
        return {"python": platform.python_version(), "executable": python, "torch": "pretend",
                "cuda_build": "pretend", "nccl": False, "bf16": False,
                "gpus": [{"index": i, "name": "pretend GPU", "capability": "0.0", "total_gib": 80.0,
                          "free_gib": 80.0} for i in range(pretend)]}
    rc, out, _ = run_until([python, "-c", PROBE], min(deadline, time.monotonic() + 120), cwd=ROOT, env=env)
    try:
        return json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": f"the probe failed (exit {rc}): {first_error_line(out)}", "gpus": []}


def driver_version() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout
        return out.strip().splitlines()[0] if out.strip() else ""
    except (OSError, subprocess.SubprocessError):
        return ""


# --- 1) the GPU tests ----------------------------------------------------------------------------

def gpu_test_files(root: Path) -> list[str]:
    pattern = re.compile(r"^\s*(@pytest\.mark\.(cuda|multigpu)\b|pytestmark\s*=.*\bmark\.(cuda|multigpu)\b)",
                         re.M)
    return sorted(str(p.relative_to(root)) for p in (root / "tests").rglob("test_*.py")
                  if pattern.search(p.read_text(errors="replace")))


def parse_junit(path: Path) -> list[dict]:
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        file = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        seconds = float(case.get("time") or 0)
        chapter = chapter_of_path(file if "/" in file else case.get("classname", "").replace(".", "/"))
        skipped = case.find("skipped")
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            detail = first_error_line(bad.text or "") or (bad.get("message") or "").splitlines()[0]
            rows.append(item("test", name, chapter, "failed", seconds, detail))
        elif skipped is not None:
            reason = skipped.get("message") or ""
            rows.append(item("test", name, chapter, "skipped", seconds, reason,
                             multigpu="multigpu" in (skipped.text or "") + reason
                                      or ">= 2 CUDA GPUs" in reason))
        else:
            rows.append(item("test", name, chapter, "ran", seconds))
    return rows


def run_tests(root: Path, python: str, deadline: float, env: dict, n_gpu: int) -> list[dict]:
    files = gpu_test_files(root)
    if not files:
        return [item("test", "pytest -m cuda", "package", "skipped", detail="no test is marked cuda")]
    junit = Path(tempfile.mkdtemp(prefix="gpu-check-")) / "junit.xml"
    per_test = max(10, min(300, int(deadline - time.monotonic())))
    # cuda and multigpu together: with fewer than 2 GPUs tests/conftest.py skips the multigpu ones
    # and says why (the report lists them); with 2 or more they run
    marker = "cuda or multigpu"
    cmd = [python, "-m", "pytest", "-m", marker, "-p", "no:cacheprovider", "-q", "-rs",
           f"--timeout={per_test}", f"--junitxml={junit}", "--continue-on-collection-errors",
           "-o", "junit_family=xunit1", *files]
    rc, out, seconds = run_until(cmd, deadline, cwd=root, env=env)
    rows = parse_junit(junit) if junit.exists() else []
    if rc is None:
        rows.append(item("test", f"pytest -m '{marker}'", "package", "failed", seconds,
                         f"timeout: pytest was killed at the overall time limit after {seconds:.0f} s"))
    elif not rows:
        rows.append(item("test", f"pytest -m '{marker}'", "package", "failed" if rc else "ran", seconds,
                         first_error_line(out) if rc else ""))
    with contextlib.suppress(OSError):
        junit.unlink()
        junit.parent.rmdir()
    for r in rows:
        if r["status"] == "skipped" and r.get("multigpu") and n_gpu >= 2:
            r["detail"] += " (unexpected: this machine has 2 or more GPUs)"
    return rows


# --- 2) the lessons ------------------------------------------------------------------------------

def lesson_notebooks(root: Path) -> list[Path]:
    return sorted(p for p in (root / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def ensure_kernelspec(env: dict, python: str) -> str:
    """Make sure the kernel ``python3`` is found (ipykernel's own spec is, when ipykernel imports;
    otherwise a temporary kernelspec folder on JUPYTER_PATH). Returns how it was found."""
    check = ("from jupyter_client.kernelspec import KernelSpecManager as K; "
             "print(K().get_kernel_spec('python3').argv[0])")
    rc, out, _ = run_until([python, "-c", check], time.monotonic() + 60, cwd=ROOT, env=env)
    if rc == 0:
        return f"found: {out.strip().splitlines()[-1]}"
    folder = Path(tempfile.mkdtemp(prefix="gpu-check-kernels-"))
    (folder / "kernels" / "python3").mkdir(parents=True)
    (folder / "kernels" / "python3" / "kernel.json").write_text(json.dumps({
        "argv": [python, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (ipykernel)", "language": "python"}))
    env["JUPYTER_PATH"] = os.pathsep.join(filter(None, [str(folder), env.get("JUPYTER_PATH")]))
    return f"written to {folder} (the lookup said: {first_error_line(out)})"


def _line(ename: str, evalue: str | None) -> str:
    """``"ExcType: first line of the message"``."""
    lines = (evalue or "").strip().splitlines()
    return f"{ename}: {lines[0] if lines else ''}".rstrip(": ")


#: how many of a lesson's slowest cells the report lists
SLOWEST_CELLS = 5


def slowest_cells(timings: dict[int, float], sources: list[str], running: tuple[int, float] | None = None,
                  n: int = SLOWEST_CELLS) -> list[dict]:
    """The ``n`` slowest code cells, slowest first: ``{"cell", "seconds", "first_line"}``; a cell still
    running when the notebook stopped is listed with ``"running": True`` and its time so far, so a
    time-out shows whether one cell hung or the cells before it used up the time.

    >>> rows = slowest_cells({0: 0.1, 2: 3.0, 3: 1.0}, ["a", "b", "go()", "c", "d"], running=(4, 2.0), n=3)
    >>> for row in rows:
    ...     print(row)
    {'cell': 2, 'seconds': 3.0, 'first_line': 'go()'}
    {'cell': 4, 'seconds': 2.0, 'first_line': 'd', 'running': True}
    {'cell': 3, 'seconds': 1.0, 'first_line': 'c'}
    """
    cells = [(i, t, False) for i, t in timings.items()] + ([(*running, True)] if running else [])
    rows = [{"cell": i, "seconds": round(t, 2), "first_line": (sources[i].strip().splitlines() or [""])[0][:80],
             **({"running": True} if still else {})} for i, t, still in cells]
    return sorted(rows, key=lambda r: -r["seconds"])[:n]


def run_one_notebook(path: Path, seconds: float, result: Path) -> None:
    """The worker (``--run-notebook``): execute ``path`` in a fresh ``python3`` kernel, cwd = its
    folder, every cell within what is left of ``seconds``; write {status, detail, cell, slowest}
    as JSON (``slowest``: its slowest cells with their seconds, see :func:`slowest_cells`)."""
    start = time.monotonic()
    deadline = start + seconds
    record = {"status": "ran", "detail": "", "cell": None}
    timings: dict[int, float] = {}
    sources: list[str] = []
    cell_at: dict = {}
    try:
        import nbformat
        from nbclient import NotebookClient
        from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

        nb = nbformat.read(path, as_version=4)
        client = NotebookClient(nb, kernel_name="python3", timeout=int(seconds), startup_timeout=120,
                                allow_errors=False, record_timing=False,
                                resources={"metadata": {"path": str(path.parent)}})
        client.timeout_func = lambda cell: max(1, int(deadline - time.monotonic()))
        sources[:] = [c.source if c.cell_type == "code" else "" for c in nb.cells]

        def on_cell_start(cell, cell_index):            # every cell, markdown too
            cell_at["index"] = cell_index

        def on_cell_execute(cell, cell_index):          # a code cell, just before it is sent
            cell_at["since"] = time.monotonic()

        def on_cell_executed(cell, cell_index, execute_reply):
            timings[cell_index] = time.monotonic() - cell_at.pop("since", time.monotonic())

        client.on_cell_start = on_cell_start
        client.on_cell_execute = on_cell_execute
        client.on_cell_executed = on_cell_executed
        try:
            client.execute()
        except CellTimeoutError:
            record.update(status="failed", cell=cell_at.get("index"),
                          detail=f"timeout: cell {cell_at.get('index')} still running when the notebook's "
                                 f"{seconds:.0f} s were up")
        except DeadKernelError as e:
            record.update(status="failed", cell=cell_at.get("index"),
                          detail=f"the kernel died: {str(e).splitlines()[0] if str(e) else ''}")
        except CellExecutionError as e:
            # the error's last lines (a rank's traceback included) go into the report: one
            # device call must be enough to see *why* a cell failed, not only that it did
            text = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip().splitlines()
            record.update(status="failed", cell=cell_at.get("index"), detail=_line(e.ename, e.evalue),
                          output=text[-30:])
    except Exception as e:                       # nbclient missing, the kernel would not start, ...
        record.update(status="failed", detail=_line(type(e).__name__, str(e)))
    if sources:
        # "since" is set only between a code cell's start and its reply (on_cell_start set "index" first)
        running = (cell_at["index"], time.monotonic() - cell_at["since"]) if "since" in cell_at else None
        record["slowest"] = slowest_cells(timings, sources, running)
    record["seconds"] = time.monotonic() - start
    result.write_text(json.dumps(record))


def run_notebooks(root: Path, python: str, deadline: float, env: dict, workers: int,
                  chapters: set[str] | None = None) -> list[dict]:
    notebooks = [nb for nb in lesson_notebooks(root) if not chapters or chapter_of_path(nb.name) in chapters]
    rows: dict[Path, dict] = {}
    scratch = Path(tempfile.mkdtemp(prefix="gpu-check-nb-"))

    def one(nb: Path) -> dict:
        chapter = chapter_of_path(nb.name)
        left = deadline - time.monotonic()
        if left < 5:
            return item("notebook", nb.name, chapter, "skipped",
                        detail="the overall time limit was reached before it could start")
        result = scratch / f"{nb.stem}.json"
        cmd = [python, str(Path(__file__).resolve()), "--run-notebook", str(nb), "--result", str(result),
               "--seconds", f"{max(1.0, left - GRACE_S):.0f}"]
        rc, out, seconds = run_until(cmd, deadline, cwd=nb.parent, env=env)
        if rc is None:
            return item("notebook", nb.name, chapter, "failed", seconds,
                        f"timeout: killed at the overall time limit after {seconds:.0f} s")
        try:
            rec = json.loads(result.read_text())
        except (OSError, ValueError):
            return item("notebook", nb.name, chapter, "failed", seconds,
                        f"the worker ended (exit {rc}) without a result: {first_error_line(out)}")
        extra = {key: rec[key] for key in ("output", "slowest") if rec.get(key)}
        return item("notebook", nb.name, chapter, rec["status"], seconds, rec["detail"], cell=rec["cell"], **extra)

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = {pool.submit(one, nb): nb for nb in notebooks}
        for fut in concurrent.futures.as_completed(futures):
            rows[futures[fut]] = fut.result()
    with contextlib.suppress(OSError):
        for f in scratch.iterdir():
            f.unlink()
        scratch.rmdir()
    return [rows[nb] for nb in notebooks]


# --- 3) the benchmarks with a GPU side -----------------------------------------------------------

def gpu_benchmarks(root: Path) -> list[Path]:
    return sorted(p for p in (root / "benchmarks").glob("[!_]*.py")
                  if re.search(r"\bcuda\b", p.read_text(errors="replace")))


def run_benchmarks(root: Path, python: str, deadline: float, env: dict) -> list[dict]:
    rows = []
    for bench in gpu_benchmarks(root):
        chapter = {"mixed_precision": "06"}.get(bench.stem, chapter_of_path(bench.name))
        if deadline - time.monotonic() < 5:
            rows.append(item("benchmark", bench.name, chapter, "skipped",
                             detail="the time given to the benchmarks was used up before it could start"))
            continue
        rc, out, seconds = run_until([python, str(bench)], deadline, cwd=root, env=env)
        tail = out.strip().splitlines()[-40:]
        if rc is None:
            rows.append(item("benchmark", bench.name, chapter, "failed", seconds,
                             f"timeout: killed after {seconds:.0f} s", output=tail))
        elif rc == 0:
            rows.append(item("benchmark", bench.name, chapter, "ran", seconds, output=tail))
        elif "Traceback" in out:
            rows.append(item("benchmark", bench.name, chapter, "failed", seconds, first_error_line(out),
                             output=tail))
        else:
            # it ran to its end and printed its ratios; exit 1 says a target (the CPU one, for
            # mixed_precision.py) was missed: a measurement, not a broken GPU path
            missed = next((line.strip() for line in tail if "NOT MET" in line), tail[-1] if tail else "")
            rows.append(item("benchmark", bench.name, chapter, "ran", seconds,
                             f"exit status {rc}, target missed: {missed}", output=tail))
    return rows


# --- the report ----------------------------------------------------------------------------------

def summarize(items: list[dict]) -> dict:
    chapters: dict[str, dict] = {}
    for it in items:
        ch = chapters.setdefault(it["chapter"], {"status": "skipped", "seconds": 0.0, "ran": 0, "failed": 0,
                                                 "skipped": 0, "needs newer torch": 0})
        ch[it["status"]] += 1
        ch["seconds"] = round(ch["seconds"] + it["seconds"], 1)
        if STATUS_ORDER.index(it["status"]) < STATUS_ORDER.index(ch["status"]):
            ch["status"] = it["status"]
    return dict(sorted(chapters.items()))


def write_report(report: dict, out: Path, name: str) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / f"{name}.json", out / f"{name}.md"
    json_path.write_text(json.dumps(report, indent=1) + "\n")
    m = report["machine"]
    gpus = ", ".join(f"{g['name']} ({g['total_gib']} GiB)" for g in m.get("gpus", [])) or "none"
    lines = [f"# gpu-check report, {report['started']}", "",
             f"- GPU: {gpus}; driver {m.get('driver') or '?'}; CUDA {m.get('cuda_build') or '?'}",
             f"- torch {m.get('torch')}, Python {m.get('python')} ({m.get('executable')})",
             f"- {report['elapsed_s']:.0f} s of a {report['time_limit_s']:.0f} s limit; "
             f"{report['notebook_workers']} notebook(s) at once; kernel: {report.get('kernel', '')}",
             f"- ran {report['counts']['ran']}, failed {report['counts']['failed']}, skipped "
             f"{report['counts']['skipped']}, needs newer torch {report['counts']['needs newer torch']}", "",
             "| chapter | status | seconds | ran | failed | skipped | needs newer torch |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for ch, s in report["chapters"].items():
        lines.append(f"| {ch} | {s['status']} | {s['seconds']:.0f} | {s['ran']} | {s['failed']} | "
                     f"{s['skipped']} | {s['needs newer torch']} |")
    lines += ["", "| chapter | kind | name | status | seconds | detail |",
              "| --- | --- | --- | --- | ---: | --- |"]
    for it in report["items"]:
        detail = (it.get("requirement", "") + " — " if it.get("requirement") else "") + it["detail"]
        lines.append(f"| {it['chapter']} | {it['kind']} | {it['name']} | {it['status']} | "
                     f"{it['seconds']:.0f} | {detail.replace('|', '/')} |")
    if report["needs_newer_torch"]:
        lines += ["", "## Needs a newer torch than this machine's", ""]
        lines += [f"- {n['name']}: {n['requirement']} ({n['detail']})" for n in report["needs_newer_torch"]]
    if report["skipped_multigpu"]:
        lines += ["", "## multigpu tests skipped", ""]
        lines += [f"- {n['name']}: {n['detail']}" for n in report["skipped_multigpu"]]
    slow = [it for it in report["items"] if it.get("slowest")]
    if slow:
        lines += ["", "## The slowest cells of each lesson", "",
                  "| lesson | status | cell | seconds | first line |", "| --- | --- | ---: | ---: | --- |"]
        for it in slow:
            for c in it["slowest"]:
                state = " (still running)" if c.get("running") else ""
                lines.append(f"| {it['name']} | {it['status']} | {c['cell']}{state} | {c['seconds']:.1f} | "
                             f"`{c['first_line'].replace('|', '/').replace('`', chr(39))}` |")
    for it in report["items"]:
        if it.get("output"):
            lines += ["", f"## {it['name']} (last lines of its output)", "", "```", *it["output"], "```"]
    md_path.write_text("\n".join(lines) + "\n")
    return json_path, md_path


def check(args) -> int:
    global TORCH_VERSION
    start = time.monotonic()
    deadline = start + args.time_limit - RESERVE_S
    root = Path(args.root).resolve()
    python = args.python
    env = dict(os.environ)
    # the kernels, ranks and tests import this checkout's gpucourse (as README's one call sets it)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("PYTHONHASHSEED", "0")
    machine = probe(python, deadline, env, args.pretend_cuda)
    if not machine.get("gpus"):
        why = machine.get("error") or f"torch {machine.get('torch')}: torch.cuda.is_available() is False"
        print(f"gpu-check: no CUDA GPU on this machine ({why}); nothing to check — run it where "
              "an NVIDIA GPU is (README, 'Checking the course on a GPU').")
        return 0
    TORCH_VERSION = machine.get("torch", "")
    machine["driver"] = "" if args.pretend_cuda else driver_version()
    n_gpu = len(machine["gpus"])
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    print(f"gpu-check: {n_gpu} GPU(s): {machine['gpus'][0]['name']}; torch {machine.get('torch')}; "
          f"{args.time_limit:.0f} s in all", flush=True)
    items: list[dict] = []

    # 0) does each part of the package import on this torch?
    parts = sorted(p.parent.name for p in (root / "gpucourse").glob("*/__init__.py"))
    if parts:
        rc, out, _ = run_until([python, "-c", IMPORT_PROBE, *[f"gpucourse.{p}" for p in parts]],
                               min(deadline, time.monotonic() + 120), cwd=root, env=env)
        try:
            results = json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            results = {}
        for mod, error in results.items():
            if error:
                items.append(item("import", mod, PART_CHAPTER.get(mod.split(".")[1], "package"), "failed",
                                  detail=error))

    # 3) benchmarks first, alone on the machine (they time things): at most a quarter of the time
    # (the GPU part of mixed_precision.py comes after its CPU part); then 1) the tests and 2) the
    # lessons side by side (neither times anything), until the deadline
    wanted = set(args.parts.split(","))
    chapters = set(args.chapters.split(",")) if args.chapters else None
    if "benchmarks" in wanted:
        print("gpu-check: 3) benchmarks with a GPU side", flush=True)
        items += run_benchmarks(root, python, min(deadline, time.monotonic() + (deadline - time.monotonic()) / 4),
                                env)
    background = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    tests = None
    if "tests" in wanted:
        print("gpu-check: 1) tests marked cuda/multigpu", flush=True)
        tests = background.submit(run_tests, root, python, deadline, env, n_gpu)

    kernel = ensure_kernelspec(env, python)
    free = min(g["free_gib"] for g in machine["gpus"])
    workers = args.workers or max(1, min((os.cpu_count() or 2) // 2, int(free // args.notebook_gib)))
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // workers)))
    print(f"gpu-check: 2) lessons, {workers} at once (kernel {kernel})", flush=True)
    if "notebooks" in wanted:
        items += run_notebooks(root, python, deadline, env, workers, chapters)
    if tests is not None:
        items = tests.result() + items
    background.shutdown()

    counts = {s: sum(it["status"] == s for it in items) for s in STATUS_ORDER}
    report = {"started": started, "time_limit_s": args.time_limit,
              "elapsed_s": round(time.monotonic() - start, 1),
              "machine": machine, "notebook_workers": workers, "kernel": kernel, "counts": counts,
              "chapters": summarize(items), "items": items,
              "needs_newer_torch": [it for it in items if it["status"] == "needs newer torch"],
              "skipped_multigpu": [it for it in items if it["status"] == "skipped" and it.get("multigpu")]}
    json_path, md_path = write_report(report, Path(args.out), args.report)
    print(f"gpu-check: ran {counts['ran']}, failed {counts['failed']}, skipped {counts['skipped']}, "
          f"needs newer torch {counts['needs newer torch']}; report: {json_path} and {md_path.name}")
    for it in items:
        if it["status"] in ("failed", "needs newer torch"):
            print(f"  {it['status']}: {it['chapter']} {it['kind']} {it['name']}: {it['detail']}")
    return 1 if counts["failed"] else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=540.0,
                        help="seconds for everything, the report included (default 540 = 9 minutes)")
    parser.add_argument("--out", default=os.environ.get("OUT") or ".",
                        help="folder of the report (default: $OUT when set, else the current folder)")
    parser.add_argument("--report", default=REPORT, help=f"the report's name, without .json/.md ({REPORT})")
    parser.add_argument("--notebook-gib", type=float, default=8.0,
                        help="GPU memory one lesson may need, to size the notebook pool (default 8 GiB)")
    parser.add_argument("--workers", type=int, default=0,
                        help="notebooks at once (default: from the GPU's free memory and the CPUs)")
    parser.add_argument("--parts", default="tests,benchmarks,notebooks",
                        help="what to run, comma-separated (default: tests,benchmarks,notebooks)")
    parser.add_argument("--chapters", default="",
                        help="only these lessons, e.g. 00,04,08 (default: every lesson) — to re-check "
                             "what failed in a short second call")
    parser.add_argument("--python", default=sys.executable, help=argparse.SUPPRESS)
    parser.add_argument("--root", default=str(ROOT), help=argparse.SUPPRESS)
    parser.add_argument("--pretend-cuda", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--run-notebook", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=60.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = set(args.parts.split(",")) - {"tests", "benchmarks", "notebooks"}
    if unknown:
        parser.error(f"--parts takes tests, benchmarks and notebooks, not {', '.join(sorted(unknown))}")
    if args.run_notebook:
        run_one_notebook(Path(args.run_notebook).resolve(), args.seconds, Path(args.result))
        return 0
    become_subreaper()

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        return check(args)
    finally:
        sweep()


if __name__ == "__main__":
    sys.exit(main())
