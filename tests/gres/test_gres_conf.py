"""gres.conf and node-line generation (pure functions, plus reading a simulated node)."""

from __future__ import annotations

import pytest

from gpushare.gpus import BUILTIN_GPUS
from gpushare.gres.gres_conf import (MigSlot, NodeGpu, device_files, gres_conf_lines, gres_types, node_gpus, node_gres)
from gpushare.gres.sim_backend import SimBackend


def test_device_files_ranges():
    assert device_files([0]) == "/dev/nvidia0"
    assert device_files([0, 1]) == "/dev/nvidia[0-1]"
    assert device_files([3, 0, 1, 2, 5, 7, 8], "/tmp/d") == "/tmp/d/nvidia[0-3,5,7-8]"


def test_whole_gpus_and_shards_as_slurm_accepts_them():
    gpus = [NodeGpu(0, "a100-40gb", 40), NodeGpu(1, "a100-40gb", 40)]
    assert gres_conf_lines(gpus, dev_dir="DIR") == [
        "Name=gpu Type=a100-40gb File=DIR/nvidia[0-1]",
        "Name=shard Count=40 File=DIR/nvidia0",
        "Name=shard Count=40 File=DIR/nvidia1",
    ]
    assert node_gres(gpus) == "gpu:a100-40gb:2,shard:80"
    assert gres_types(gpus) == "gpu,shard"


def test_heterogeneous_node_shards_follow_memory():
    a30, h100 = BUILTIN_GPUS["a30-24gb"], BUILTIN_GPUS["h100-80gb"]
    gpus = [NodeGpu(0, a30.name, a30.shards), NodeGpu(1, h100.name, h100.shards)]
    lines = gres_conf_lines(gpus, node_name="n1")
    assert "NodeName=n1 Name=shard Count=24 File=/dev/nvidia0" in lines
    assert "NodeName=n1 Name=shard Count=79 File=/dev/nvidia1" in lines
    assert node_gres(gpus) == "gpu:a30-24gb:1,gpu:h100-80gb:1,shard:103"


def test_mig_devices_use_multiple_files():
    gpus = [NodeGpu(1, "a100-40gb", 40, mig=(MigSlot("1g.10gb", 21, 22), MigSlot("1g.10gb", 30, 31))),
            NodeGpu(0, "a100-40gb", 40)]
    lines = gres_conf_lines(gpus, dev_dir="DIR", ci_caps=False)
    assert "Name=gpu Type=1g.10gb MultipleFiles=DIR/nvidia1,DIR/nvidia-caps/nvidia-cap21" in lines
    assert lines.count("Name=shard Count=40 File=DIR/nvidia0") == 1
    assert not any("nvidia1" in ln and "shard" in ln for ln in lines)  # a MIG GPU offers no shards
    assert node_gres(gpus) == "gpu:1g.10gb:2,gpu:a100-40gb:1,shard:40"
    assert node_gres(gpus, shards=False) == "gpu:1g.10gb:2,gpu:a100-40gb:1"
    with_ci = gres_conf_lines(gpus, dev_dir="DIR")
    assert any(ln.endswith("MultipleFiles=DIR/nvidia1,DIR/nvidia-caps/nvidia-cap21,DIR/nvidia-caps/nvidia-cap22")
               for ln in with_ci)


def test_all_mig_node_needs_no_shard_type():
    gpus = [NodeGpu(0, "a100-40gb", 40, mig=(MigSlot("7g.40gb", 3, 4),))]
    assert gres_types(gpus) == "gpu" and node_gres(gpus) == "gpu:7g.40gb:1"


def test_bad_type_names_are_refused():
    with pytest.raises(ValueError, match="GRES type 'a100:40'"):
        gres_conf_lines([NodeGpu(0, "a100:40", 40)])


def test_lines_from_a_simulated_node(clock):
    b = SimBackend.from_scenario({"version": 1, "gpus": [{"model": "a100-40gb", "mig_mode": True},
                                                          {"model": "l40s-48gb"}]}, clock=clock)
    for profile, start in ((9, 0), (19, 4)):
        gi = b.create_gpu_instance(0, profile, start)
        b.create_compute_instance(0, gi.id)
    gpus = node_gpus(b)
    assert gpus[1] == NodeGpu(1, "l40s-48gb", 44)
    assert [s.profile for s in gpus[0].mig] == ["3g.20gb", "1g.5gb"]
    assert node_gres(gpus) == "gpu:3g.20gb:1,gpu:1g.5gb:1,gpu:l40s-48gb:1,shard:44"
    assert "Name=gpu Type=3g.20gb MultipleFiles=/dev/nvidia0,/dev/nvidia-caps/nvidia-cap12,/dev/nvidia-caps/nvidia-cap13" \
        in gres_conf_lines(gpus)
