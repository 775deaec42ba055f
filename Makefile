# Two commands on a fresh Debian machine (as root, or with sudo):
#   make demo   — install everything, start a local Slurm with simulated GPUs, estimate and submit a job
#                 (SLURM=24.11 or SLURM=26.05: that Slurm, from a Debian chroot built once and cached)
#   make test   — install everything, run the whole test suite (unit + real-Slurm integration) on the host's
#                 Slurm 22.05, then the tests marked `slurm` again on 26.05 and those also marked
#                 `version_sensitive` on 24.11 (the tiers below `check`)
VENV ?= .venv
PY := $(VENV)/bin/python
# Debian's interpreter, not a per-user one (pyenv lives under /root): Slurm jobs and estimation jobs run
# as ordinary users and must be able to execute the virtualenv's python and gpu-estimate.
BASE_PYTHON ?= $(shell [ -x /usr/bin/python3 ] && echo /usr/bin/python3 || echo python3)
# prometheus: the tests' real Prometheus server (devcluster/prometheus.py) scrapes the node agents;
# slurmdbd and MariaDB: the tests' accounting database (devcluster/accounting.py).
DEBS := slurmctld slurmd slurm-client slurmdbd mariadb-server mariadb-client munge lua-socket lua5.1 lua5.3 lua5.4 python3-venv lmod prometheus gcc libc6-dev logrotate chromium
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# Newer Slurm releases the integration tests also run on (devcluster/chroot.py builds their chroots).
CHROOT_SLURM ?= 24.11 26.05
SLURM ?=

.PHONY: setup system-packages demo lint check test slurm-chroots python-envs bench clean

HARDCAP_LIB := build/hardcap/libgpushare-hardcap.so
setup: system-packages $(VENV)/.installed $(HARDCAP_LIB)

# The hard memory cap shim (gres/hardcap/, docs/isolation.md), built with the system compiler (gcc, libc6-dev in
# DEBS); the TaskProlog preloads it into shared jobs where [agent] hardcap selects it.
$(HARDCAP_LIB): gres/hardcap/hardcap.c gres/hardcap/cuda_types.h
	@mkdir -p $(dir $@)
	gcc -O2 -Wall -fPIC -shared -o $@ $< -ldl -lpthread

# The packages' maintainer scripts start no service meanwhile (policy-rc.d answers 101 while we install, where
# the machine has none of its own): the tests start their own daemons, and prometheus's postinst would otherwise
# start a server on port 9090 (or fail the install where no init system runs, as in a CI container).
system-packages:
	@missing=""; for p in $(DEBS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get update -qq || exit 1; \
	  guard=; if [ ! -e /usr/sbin/policy-rc.d ]; then guard=1; \
	    printf '#!/bin/sh\nexit 101\n' | $(SUDO) tee /usr/sbin/policy-rc.d >/dev/null; $(SUDO) chmod 755 /usr/sbin/policy-rc.d; fi; \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	  rc=$$?; [ -z "$$guard" ] || $(SUDO) rm -f /usr/sbin/policy-rc.d; exit $$rc; \
	fi

# torch is pinned first so the package's own `torch>=2.4` is already met by the CPU build.
$(VENV)/.installed: pyproject.toml
	$(BASE_PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[estimator,node,test]'
	touch $@

demo: setup
	$(PY) -m devcluster.demo $(if $(SLURM),--slurm $(SLURM))

# The packages and the tests pass ruff; mypy checks the packages as installed (gpushare.<folder>). The
# folder-to-name mapping exists only at install time, so build/typecheck mirrors it with symbolic links:
# run on the folders themselves, mypy would see every import between them as Any.
PACKAGES := gpushare gres estimator_cli mig_manager agent slurm_plugins prolog epilog simulator
TYPECHECK := build/typecheck
lint: setup
	$(PY) -m ruff check $(PACKAGES) devcluster tests benchmarks
	@rm -rf $(TYPECHECK)/gpushare && mkdir -p $(TYPECHECK)/gpushare && \
	for f in gpushare/*; do ln -s "$(CURDIR)/$$f" $(TYPECHECK)/gpushare/; done && \
	for d in $(filter-out gpushare,$(PACKAGES)); do ln -s "$(CURDIR)/$$d" $(TYPECHECK)/gpushare/$$d; done
	cd $(TYPECHECK) && $(abspath $(PY)) -m mypy --config-file $(CURDIR)/pyproject.toml -p gpushare

# The fast tier for the edit loop: no Slurm daemons, no torch captures, nothing slow or hostile; one worker
# per core (pytest-xdist): the tier is many short tests, many of them waiting on a subprocess or a socket.
check: lint
	$(PY) -m pytest -q -n auto -m "not slurm and not torch and not slow and not hostile"

# The tiers of `make test` (docs/testing.md has the rule and the measured times):
#   1. 22.05, the tests that start no Slurm daemon and no hostile load: one pytest-xdist worker per core
#      (TEST_WORKERS), whole modules per worker (--dist loadfile: module fixtures stay with their tests);
#   2. 22.05, the tests marked slurm and not hostile: SLURM_WORKERS pytest-xdist workers (one at a time when
#      1), whole modules per worker. They wait on Slurm (schedules, Prologs, restarts) far more than they
#      compute, and every test cluster is its own: scratch folder, munge, ports, MariaDB, Prometheus, the multi-host cluster's
#      addresses in its worker's slot (devcluster/slots.py); what exists once per machine is taken under a
#      machine-wide lock (the test users, the hard cap's folder);
#   3. 22.05, the hostile tests, one at a time: load proofs that measure what one machine does under a storm,
#      where a test beside them would be part of the storm;
#   4. each of CHROOT_SLURM: every test marked slurm on the releases in FULL_SLURM (the newest), and on the
#      others only those also marked version_sensitive (each says why its code or expectations differ by
#      release; tests/core/test_test_harness.py keeps the list honest): SLURM_WORKERS workers as in tier 2,
#      then that release's hostile tests one at a time as in tier 3.
#      The release between the oldest and the newest also leaves out the fault tests (marker faults,
#      docs/reliability.md): by hand there with GPUSHARE_TEST_SLURM=24.11 pytest -m faults.
# Each tier runs even when an earlier one failed; make fails if any did. Exit 5 ("no tests collected") is not
# a failure: a version may simply have no tests selected. The tiers' wall times are printed at the end.
TEST_WORKERS ?= auto
# Three clusters at a time on two cores: the Slurm tests mostly wait (docs/testing.md, "Measured"); 1 runs
# them one at a time.
SLURM_WORKERS ?= 3
XDIST_SLURM = $(if $(filter-out 1,$(SLURM_WORKERS)),-n $(SLURM_WORKERS) --dist loadfile)
FULL_SLURM ?= 26.05
FAULTS_SKIPPED_ON ?= 24.11

test: setup lint
	@$(MAKE) --no-print-directory python-envs || echo "python-envs not built: the tests that need it skip, saying why"
	@status=0; table=""; began=$$(date +%s); \
	tier() { name="$$1"; shift; echo "== $$name"; start=$$(date +%s); "$$@"; rc=$$?; took=$$(( $$(date +%s) - start )); \
	  if [ $$rc -eq 0 ] || [ $$rc -eq 5 ]; then result=passed; else result="FAILED (exit $$rc)"; status=1; fi; \
	  table="$$table$$(printf '%-72s %4d min %02d s  %s' "$$name" $$((took / 60)) $$((took % 60)) "$$result")\n"; }; \
	tier "22.05: no Slurm daemons (-n $(TEST_WORKERS))" env GPUSHARE_TEST_SLURM=22.05 \
	  $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slurm and not hostile"; \
	tier "22.05: -m \"slurm and not hostile\" (-n $(SLURM_WORKERS))" env GPUSHARE_TEST_SLURM=22.05 \
	  $(PY) -m pytest -q $(XDIST_SLURM) -m "slurm and not hostile"; \
	tier "22.05: -m hostile (one at a time)" env GPUSHARE_TEST_SLURM=22.05 $(PY) -m pytest -q -m hostile; \
	for v in $(CHROOT_SLURM); do \
	  marks="slurm"; case " $(FULL_SLURM) " in *" $$v "*) ;; *) marks="slurm and version_sensitive";; esac; \
	  [ "$$v" = "$(FAULTS_SKIPPED_ON)" ] && marks="$$marks and not faults"; \
	  tier "$$v: -m \"$$marks and not hostile\" (-n $(SLURM_WORKERS))" env GPUSHARE_TEST_SLURM=$$v \
	    $(PY) -m pytest -q $(XDIST_SLURM) -m "$$marks and not hostile"; \
	  tier "$$v: -m \"$$marks and hostile\" (one at a time)" env GPUSHARE_TEST_SLURM=$$v \
	    $(PY) -m pytest -q -m "$$marks and hostile"; \
	done; \
	took=$$(( $$(date +%s) - began )); \
	table="$$table$$(printf '%-72s %4d min %02d s' "all tiers" $$((took / 60)) $$((took % 60)))\n"; \
	echo "== make test: wall time per tier"; printf '%b' "$$table"; \
	exit $$status

# Researchers' environments with other PyTorch releases, for the tests of gpu-estimate --python
# (tests/estimator/test_foreign_python.py, tests/estimation/test_user_env_slurm.py): the oldest supported
# (2.4.1) and the newest this machine's pip serves (2.14.1), each as `pip install torch` gives it (the CUDA
# build and its nvidia-* wheels), made once and cached: 5.0 GB / 2 min 40 s (downloaded) and 5.4 GB / 1 min 33 s
# (local wheels), docs/estimator.md; the tests that need one skip, saying so, without it.
PYTHON_ENVS ?= /var/cache/gpushare/python-envs
OTHER_TORCH := 2.4.1 2.14.1
python-envs: $(foreach v,$(OTHER_TORCH),$(PYTHON_ENVS)/torch-$(v)/.installed)
$(PYTHON_ENVS)/torch-%/.installed:
	rm -rf $(PYTHON_ENVS)/torch-$*
	$(BASE_PYTHON) -m venv $(PYTHON_ENVS)/torch-$*
	$(PYTHON_ENVS)/torch-$*/bin/pip install -q torch==$*
	chmod -R a+rX $(PYTHON_ENVS)
	touch $@

# Optional: build the cached chroots ahead of time (the tests build them on first use otherwise).
slurm-chroots: setup
	for v in $(CHROOT_SLURM); do $(PY) -m devcluster.chroot build $$v || exit 1; done

bench: setup
	$(PY) benchmarks/submit_latency.py
	$(PY) benchmarks/allocator_replay.py
	$(PY) benchmarks/mig_planner.py

clean:
	rm -rf $(VENV) build *.egg-info
