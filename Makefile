# Two commands on a fresh Debian machine (as root, or with sudo):
#   make demo   — install everything, start a local Slurm with simulated GPUs, estimate and submit a job
#   make test   — install everything, run the whole test suite (unit + real-Slurm integration)
VENV ?= .venv
PY := $(VENV)/bin/python
# Debian's interpreter, not a per-user one (pyenv lives under /root): Slurm jobs and estimation jobs run
# as ordinary users and must be able to execute the virtualenv's python and gpu-estimate.
BASE_PYTHON ?= $(shell [ -x /usr/bin/python3 ] && echo /usr/bin/python3 || echo python3)
DEBS := slurmctld slurmd slurm-client munge lua-socket lua5.1 python3-venv
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup system-packages demo test bench clean

setup: system-packages $(VENV)/.installed

system-packages:
	@missing=""; for p in $(DEBS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

# torch is pinned first so the package's own `torch>=2.4` is already met by the CPU build.
$(VENV)/.installed: pyproject.toml
	$(BASE_PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[estimator,node,test]'
	touch $@

demo: setup
	$(PY) -m devcluster.demo

test: setup
	$(PY) -m pytest -q

bench: setup
	$(PY) benchmarks/submit_latency.py
	$(PY) benchmarks/allocator_replay.py
	$(PY) benchmarks/mig_planner.py

clean:
	rm -rf $(VENV) build *.egg-info
