# gpucourse — everything a learner, an instructor or CI needs is one `make` away.
#
#   make lab        create .venv if needed, install, open JupyterLab at chapter 00
#   make lab TORCH=cpu   the same with PyTorch's CPU-only wheels (~0.2 GB instead of ~3 GB to download)
#   make test       create .venv if needed, install, run every test and every notebook
#   make test-ui    the course in a real browser: JupyterLab driven in headless Chromium (tests/ui)
#   make site       the course as a website in _build/site/ (lessons with their stored outputs, API)
#   make serve-site read it: serves _build/site/ on http://127.0.0.1:8000/
#   make check NB=exercises/04_…ipynb        self-check one exercises notebook in a fresh kernel
#                                            (CHECK_ARGS=--hidden: the hidden checks too, where solutions/ is)
#   make grade SUBMISSIONS=subs/             grade a class (GRADE_ARGS="--hidden --csv grades.csv")
#   make gpu-check  on a CUDA machine: GPU tests, every lesson, GPU benchmarks -> one report (9 min)
#   make gpu-wheels the wheels gpu-check needs on a GPU machine whose Python lacks them, into .whl/
#
# Only python3 (>= 3.11) with pip and venv is needed; exact versions come from constraints.txt.

PYTHON    ?= python3
VENV      ?= .venv
PY        := $(VENV)/bin/python
STAMP     := $(VENV)/.gpucourse-installed$(if $(filter cpu,$(TORCH)),-cpu,)
LAB_ARGS  ?=
# TORCH=pypi (default, what CI uses): torch from PyPI, exact pins from constraints.txt. PyPI's Linux
# wheel brings ~3 GB of CUDA libraries and triton, GPU or not. TORCH=cpu: the same torch and
# torchvision versions (read from constraints.txt) from PyTorch's own CPU-only wheel index, as
# pytorch.org's install selector gives it (`pip install torch torchvision --index-url ...cpu`);
# every other package still comes from PyPI with its pin.
TORCH     ?= pypi
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_PINS = $(shell grep -E '^(torch|torchvision)==' constraints.txt)
$(if $(filter-out pypi cpu,$(TORCH)),$(error TORCH must be pypi (the default) or cpu, got '$(TORCH)'))
PIP       := $(PY) -m pip install --disable-pip-version-check
# the lab's application settings (lab/settings/overrides.json: no news pop-up, no update check);
# they change JupyterLab's defaults for this lab only, the user's own settings still win
LAB_SETTINGS := $(CURDIR)/lab/settings
# JupyterLab refuses to start as root (common in containers) unless told it is deliberate
LAB_ROOT  := $(if $(filter 0,$(shell id -u 2>/dev/null)),--allow-root,)
# xdist workers for the test runs (each test/notebook starts its own processes, 2 suits 2 cores)
WORKERS   ?= 2
# the test runs take one more: many tests (and lesson cells) wait on a timeout or a peer (a hung
# rank, a killed kernel), and a third worker keeps both cores busy meanwhile (2 cores: 97% busy)
TEST_WORKERS ?= $(shell expr $(WORKERS) + 1)
NBVAL     := --nbval-lax --nbval-current-env --nbval-sanitize-with tests/sanitize.cfg
# tests: one intra-op thread per process (the tests start their own processes and threads),
# fixed hashing. (No MPLBACKEND: notebook kernels pick the inline backend themselves, and the
# package's plotting helpers never open windows.) torch's store looks up the host name of every
# loopback connection (reverse DNS of ::ffff:127.0.0.1); a resolver that drops a query stalls that
# connection for glibc's default 5 s, so the tests ask for 1 s retries (see README, troubleshooting).
TEST_ENV  := OMP_NUM_THREADS=1 PYTHONHASHSEED=0 RES_OPTIONS="timeout:1 attempts:3"
# each test run has its own TMPDIR, removed when it ends: what a run leaves in a temporary folder
# (torchrun's torchelastic_* logs, the docstrings' mkdtemp() examples, the scratch folders of lesson
# kernels that nbval kills) would otherwise pile up in /tmp, run after run
RUN_TMP   := tmp=$$(mktemp -d "$${TMPDIR:-/tmp}/gpucourse-tests-XXXXXX") && trap 'rm -rf "$$tmp"' EXIT && TMPDIR=$$tmp

.PHONY: lab test test-ui site serve-site test-package test-notebooks env exercises notebooks benchmarks check-exercises constraints doctor clean check grade gpu-check gpu-wheels

env: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
ifeq ($(TORCH),cpu)
	@echo "== downloading PyTorch, CPU-only wheels (~0.2 GB) from $(TORCH_CPU_INDEX) ..."
	$(PIP) --index-url $(TORCH_CPU_INDEX) --no-deps --force-reinstall $(TORCH_PINS)
else
	@echo "== PyTorch from PyPI: the first time a ~3 GB download (its CUDA libraries and triton; 5.8 GB on disk) ..."
	@echo "   (no NVIDIA GPU? Ctrl-C, then: make clean; make lab TORCH=cpu  -- a ~0.2 GB download)"
	$(PIP) -c constraints.txt torch torchvision
endif
	@echo "== installing the course package, JupyterLab and the test tools ..."
	$(PIP) -q -c constraints.txt -e '.[test]'
	@touch $(STAMP)

lab: $(STAMP)
	$(VENV)/bin/jupyter lab --ServerApp.root_dir="$(CURDIR)" --LabApp.default_url=/lab/tree/notebooks/00_setup.ipynb --LabApp.app_settings_dir="$(LAB_SETTINGS)" $(LAB_ROOT) $(LAB_ARGS)

test: test-package test-notebooks

# pytest over gpucourse/ (unit tests, doctests) and tests/ (launcher, exercise pipeline, packaging);
# the slowest tests are listed at the end (the 15-minute budget: see where the time goes)
test-package: $(STAMP)
	$(RUN_TMP) $(TEST_ENV) $(PY) -m pytest -n $(TEST_WORKERS) --dist loadscope -q --durations=30

# nbval over every lesson and every solutions notebook
test-notebooks: $(STAMP)
	$(RUN_TMP) $(TEST_ENV) $(PY) -m pytest -p no:python -n $(TEST_WORKERS) --dist loadscope -q --durations=15 $(NBVAL) notebooks solutions

# the course as a learner sees it: JupyterLab on a temporary copy of the course, driven in the
# system's Chromium (apt-get install chromium) by playwright (the "ui" extra, installed here; no
# browser is downloaded). Without either, every test skips and says which is missing. The same run
# builds the website (the "site" extra, installed here too) and reads every page of it.
UI_STAMP  := $(VENV)/.gpucourse-ui-installed
$(UI_STAMP): $(STAMP)
	$(PIP) -q -c constraints.txt -e '.[test,ui,site]' && touch $(UI_STAMP) || echo "no playwright: the browser tests will skip"

test-ui: $(UI_STAMP)
	$(RUN_TMP) $(TEST_ENV) $(PY) -m pytest -m ui -q -rs tests/ui

# the course as a website: README, the lessons with their stored outputs (nothing is executed),
# the exercises and the API reference, as a book in _build/site/ (website/build.py: Sphinx, myst-nb,
# sphinx-book-theme from the "site" extra; MathJax 3 from the npm registry, pinned by
# website/mathjax/package-lock.json, fetched once with npm). Strict: a warning fails the build.
SITE_STAMP := $(VENV)/.gpucourse-site-installed
SITE_PORT ?= 8000
$(SITE_STAMP): $(STAMP)
	$(PIP) -q -c constraints.txt -e '.[test,site]' && touch $(SITE_STAMP)

site: $(SITE_STAMP)
	$(PY) website/build.py

# loopback only; another port: make serve-site SITE_PORT=8001 (builds the site first if there is none;
# after editing, make site serve-site)
serve-site:
	@test -f _build/site/index.html || $(MAKE) --no-print-directory site
	@echo "== the course website: http://127.0.0.1:$(SITE_PORT)/  (Ctrl-C stops it)"
	$(PY) -m http.server --bind 127.0.0.1 --directory _build/site $(SITE_PORT)

# regenerate exercises/ from solutions/ (the single source of every exercise), and the public cases
# in exercises/public/ of every chapter whose checks or solutions changed (the judge computes them;
# `$(PY) -m gpucourse exercises --refresh-public` recomputes all)
exercises: $(STAMP)
	$(PY) -m gpucourse exercises

check-exercises: $(STAMP)
	$(PY) -m gpucourse exercises --check

# re-execute lesson and solutions notebooks in place so their stored outputs are fresh
# (course authors: run on an otherwise idle machine, the stored timings are measurements)
notebooks: $(STAMP)
	PYTHONHASHSEED=0 $(PY) scripts/execute_notebooks.py notebooks/*.ipynb solutions/*.ipynb
	$(PY) -m gpucourse exercises

# every script prints its ratios and exits non-zero when it misses its target; all of them run,
# then the misses are listed (and make fails)
benchmarks: $(STAMP)
	@$(PY) benchmarks/_machine.py before; \
	failed=""; for b in benchmarks/[!_]*.py; do echo "== $$b"; $(PY) $$b || failed="$$failed $$b"; done; \
	$(PY) benchmarks/_machine.py after; \
	if [ -n "$$failed" ]; then echo "target missed or error:$$failed"; exit 1; fi

doctor: $(STAMP)
	$(PY) -m gpucourse doctor

# the learner's self-check: make check NB=exercises/02_data_parallel_exercises.ipynb
check: $(STAMP)
	@test -n "$(NB)" || { echo "usage: make check NB=exercises/NN_<topic>_exercises.ipynb [CHECK_ARGS=--hidden]"; exit 2; }
	$(PY) -m gpucourse check $(CHECK_ARGS) $(NB)

# the instructor's gradebook: make grade SUBMISSIONS=subs/ GRADE_ARGS="--hidden --csv grades.csv"
# (2 workers and grades.json by default; anything in GRADE_ARGS wins)
GRADE_ARGS ?=
GRADEBOOK ?= grades.json
grade: $(STAMP)
	@test -n "$(SUBMISSIONS)" || { echo "usage: make grade SUBMISSIONS=folder-or-notebooks [GRADE_ARGS=...]"; exit 2; }
	$(PY) -m gpucourse grade $(SUBMISSIONS) --workers $(WORKERS) --json $(GRADEBOOK) $(GRADE_ARGS)

# the course on a CUDA machine (README, "Checking the course on a GPU"): tests marked cuda/multigpu,
# every lesson, the benchmarks with a GPU side, under one time limit; one report in $(GPU_OUT).
# Without CUDA it says so and exits 0. GPU_CHECK_ARGS="--time-limit 300" etc.
GPU_CHECK_ARGS ?=
GPU_OUT ?= $(if $(OUT),$(OUT),.)
gpu-check: $(STAMP)
	$(PY) scripts/gpu_check.py --out $(GPU_OUT) $(GPU_CHECK_ARGS)

# what gpu-check needs on the lent GPU machine (its own Python 3.12 with torch, no Jupyter stack, no
# network) and that machine lacks: nbclient and the kernel (ipykernel, IPython, their needs) and
# ipywidgets for the lessons, as manylinux x86_64 wheels for CPython 3.12, each at its version in
# constraints.txt (--no-deps: the list is the whole closure minus what the machine has). Into .whl/
# (git-ignored), carried with the call; README, "Checking the course on a GPU".
GPU_WHEELS := nbclient nbformat jupyter_client jupyter_core traitlets pyzmq tornado fastjsonschema \
	jsonschema jsonschema-specifications referencing rpds-py platformdirs ipykernel ipython comm \
	matplotlib-inline nest-asyncio2 jedi parso pexpect ptyprocess prompt_toolkit wcwidth stack_data \
	executing asttokens pure_eval ipython_pygments_lexers ipywidgets widgetsnbextension jupyterlab_widgets
GPU_WHEEL_PLATFORMS := $(foreach n,28 27 17,--platform manylinux_2_$(n)_x86_64) --platform manylinux2014_x86_64 --platform manylinux1_x86_64
gpu-wheels:
	@rm -rf .whl && mkdir -p .whl
	@pins=""; for n in $(GPU_WHEELS); do \
	  pin=$$(grep -iE "^$$(echo $$n | sed 's/[-_.]/[-_.]/g')==" constraints.txt | head -1); \
	  pins="$$pins $${pin:-$$n}"; done; \
	echo "== pip download$$pins"; \
	$(PYTHON) -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --abi cp312 --abi abi3 --abi none $(GPU_WHEEL_PLATFORMS) --platform any -d .whl $$pins
	@ls .whl | wc -l | xargs echo "== wheels in .whl/:"; du -sh .whl

# refresh the exact pins after changing pyproject.toml (course authors)
constraints: $(STAMP)
	{ echo "# Exact versions for \`make lab\` / \`make test\` (pip install -c constraints.txt -e '.[test]')."; \
	  echo "# Lower bounds live in pyproject.toml. Regenerate: make constraints"; \
	  $(PY) -m pip freeze --exclude-editable | grep -v '^gpucourse'; } > constraints.txt

clean:
	rm -rf $(VENV) .pytest_cache build _build *.egg-info
