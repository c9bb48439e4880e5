"""Author notebooks as text: percent-format .py  <->  clean .ipynb (course authors' tool).

    python scripts/nbtext.py to-text notebooks/02_data_parallel.ipynb > /tmp/02.py   # edit it
    python scripts/nbtext.py to-notebook /tmp/02.py notebooks/02_data_parallel.ipynb
    make notebooks                                    # execute, store outputs, regenerate exercises

Cells start with `# %%` (code) or `# %% [markdown]`; tags go in the header:
`# %% tags=["check"]`. The .ipynb is the single source in git; the text form is a scratch copy.
Needs the `dev` extra (jupytext).
"""

import sys

import nbformat

try:
    import jupytext
except ImportError:                     # the "dev" extra; `make env` installs only "test"
    sys.exit("scripts/nbtext.py needs jupytext (the course's dev extra): "
             ".venv/bin/pip install -c constraints.txt jupytext")

KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}


def to_notebook(src: str, dst: str) -> None:
    nb = jupytext.read(src, fmt="py:percent")
    nb.metadata = {"kernelspec": KERNELSPEC, "language_info": {"name": "python"}}
    for cell in nb.cells:
        tags = cell.metadata.get("tags")
        cell.metadata = {"tags": tags} if tags else {}
    nbformat.validate(nb)
    nbformat.write(nb, dst)


def to_text(src: str) -> None:
    nb = nbformat.read(src, as_version=4)
    sys.stdout.write(jupytext.writes(nb, fmt="py:percent"))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "to-notebook":
        to_notebook(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 3 and sys.argv[1] == "to-text":
        to_text(sys.argv[2])
    else:
        sys.exit(__doc__)
