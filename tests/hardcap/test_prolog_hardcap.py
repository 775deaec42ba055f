"""The Prolog's hard cap files and the TaskProlog's preload line (gpushare.node.hardcap), then the shim
reading those very files in a real process over the fake driver."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from gpushare.gres.sim_backend import SimBackend
from gpushare.node import hardcap
from gpushare.prolog.slurmd_prolog import write_caps
from gpushare.prolog.task_prolog import exports

pytestmark = pytest.mark.hardcap

FRACTION = {"GPUSHARE_CAPS_MODE": "fraction", "GPUSHARE_MEM_LIMIT_MIB": "1", "GPUSHARE_MEMORY_FRACTION": "0.1"}


@pytest.mark.skipif(os.geteuid() != 0, reason="the files are root's")
def test_prolog_files_cap_a_real_process(tmp_path: Path) -> None:
    # a device backend that cannot open: no UUIDs, and each GPU is charged the default generation's context
    absent = f"sim:{tmp_path / 'absent.json'}"
    assert hardcap.apply("77", 65534, [0, 1], FRACTION, "shim", str(tmp_path), device_backend=absent) == "shim"
    d = tmp_path / "job_77"
    assert (d / "gpu0").read_text() == f"{1 << 20} {hardcap.CONTEXT_BYTES}\n" and (d / "gpu1").exists()
    assert (d / "gpu0").stat().st_uid == 0 and (d / "gpu0").stat().st_mode & 0o777 == 0o644
    st = (d / "gpu0.state").stat()
    assert st.st_uid == 65534 and st.st_mode & 0o777 == 0o600
    hardcap.clear("77", str(tmp_path))
    assert not d.exists()


def test_the_context_charge_follows_each_gpus_generation(tmp_path: Path) -> None:
    """Each limits file charges its GPU's context (gpushare.cuda_context, as the agent's framework cap counts
    it); a GPU the backend cannot describe gets the default generation's charge."""
    sim = SimBackend.from_scenario({"version": 1, "gpus": [{"model": "a100-40gb"}, {"model": "h200-141gb"},
                                                            {"model": "v100-32gb"}]})
    assert hardcap.apply("78", os.geteuid(), [1, 0, 2], FRACTION, "shim", str(tmp_path), backend=sim) == "shim"
    charged = [int((tmp_path / "job_78" / f"gpu{i}").read_text().split()[1]) >> 20 for i in range(3)]
    assert charged == [762, 612, 502]  # as the job numbers them: the H200, the A100, the V100
    assert charged == [hardcap.context_charge(sim.gpu(i)) >> 20 for i in (1, 0, 2)]
    assert hardcap.CONTEXT_BYTES == hardcap.context_charge(sim.gpu(0))  # compute capability 8.0, the default
    hardcap.write_limits("79", os.geteuid(), 2, 1 << 30, str(tmp_path), context_bytes=[5000])
    assert [(tmp_path / "job_79" / f"gpu{i}").read_text().split()[1] for i in (0, 1)] == ["5000", str(hardcap.CONTEXT_BYTES)]
    with pytest.raises(ValueError, match="context charges"):
        hardcap.write_limits("80", os.geteuid(), 1, 1 << 30, str(tmp_path), context_bytes=[-1])


def test_only_fraction_capped_jobs_under_a_hardcap_mode(tmp_path: Path) -> None:
    assert not hardcap.apply("5", 1000, [0], FRACTION, "off", str(tmp_path))
    assert not hardcap.apply("5", 1000, [0], dict(FRACTION, GPUSHARE_CAPS_MODE="mps"), "auto", str(tmp_path))
    assert not hardcap.apply("5", 1000, [0], dict(FRACTION, GPUSHARE_MEM_LIMIT_MIB="x"), "shim", str(tmp_path))
    assert not hardcap.apply("5", 1000, [0], dict(FRACTION, GPUSHARE_MEM_LIMIT_MIB="0"), "shim", str(tmp_path))
    assert not hardcap.apply("5;rm", 1000, [0], FRACTION, "shim", str(tmp_path))
    assert not (tmp_path / "job_5").exists()


def test_task_prolog_preloads_the_shim_first_keeping_the_users(tmp_path: Path) -> None:
    lib = tmp_path / "libgpushare-hardcap.so"
    lib.write_bytes(b"\x7fELF")
    write_caps(str(tmp_path), "12", dict(FRACTION, GPUSHARE_HARDCAP="1"))
    env = {"SLURM_JOB_ID": "12", "LD_PRELOAD": "/opt/a.so /opt/b.so"}
    lines = exports(env, str(tmp_path), str(lib))
    assert f"export LD_PRELOAD={lib}:/opt/a.so:/opt/b.so" in lines
    assert not any("GPUSHARE_HARDCAP" in ln for ln in lines)
    assert not any("LD_PRELOAD" in ln for ln in exports(env, str(tmp_path), str(tmp_path / "absent.so")))
    assert not any("LD_PRELOAD" in ln for ln in exports(dict(env, LD_PRELOAD="/x;y"), str(tmp_path), str(lib)))
    write_caps(str(tmp_path), "12", FRACTION)
    assert not any("LD_PRELOAD" in ln for ln in exports(env, str(tmp_path), str(lib)))
    assert json.loads((tmp_path / "jobs" / "12.json").read_text())["job"] == "12"


def test_prolog_files_are_what_the_shim_reads(tmp_path: Path) -> None:
    """The format written here is the one hardcap.c parses: a shim in a job cgroup caps at it."""
    if os.geteuid() != 0:
        pytest.skip("the files are root's")
    here = Path(__file__).parent
    for cmd in (["gcc", "-O2", "-fPIC", "-shared", "-o", str(tmp_path / "libcuda.so.1"), str(here / "fake_cuda.c")],
                ["gcc", "-O2", "-DHARDCAP_TESTING", "-fPIC", "-shared", "-o", str(tmp_path / "shim.so"),
                 str(here.parents[1] / "gres/hardcap/hardcap.c"), "-ldl", "-lpthread"],
                ["gcc", "-O2", "-o", str(tmp_path / "alloc"), str(here / "alloc.c"), "-ldl"]):
        subprocess.run(cmd, check=True)
    limits = tmp_path / "limits"
    assert hardcap.write_limits("31", 0, 1, 100000, str(limits), context_bytes=1000)
    (tmp_path / "cg").write_text("0::/system.slice/slurmstepd.scope/job_31/step_0\n")
    env = dict(os.environ, FAKE_CUDA_MEM=str(tmp_path / "mem"), LD_LIBRARY_PATH=str(tmp_path),
               GPUSHARE_HARDCAP_DIR=str(limits), GPUSHARE_HARDCAP_CGROUP=str(tmp_path / "cg"),
               LD_PRELOAD=str(tmp_path / "shim.so"))
    out = subprocess.run([str(tmp_path / "alloc"), "dlopen", "10000", "100"], env=env, capture_output=True, text=True,
                         timeout=30)
    assert out.stdout.startswith("allocated 90000 result 2"), out.stderr
