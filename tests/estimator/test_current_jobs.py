"""What today's training jobs do that gpu-estimate must follow: weights moved to the GPU by worker threads
(transformers 5 loads checkpoints in a thread pool), attention under fp16 autocast with float32 q/k and half
v (Llama/Qwen-style rotary embeddings, grouped-query heads), and a researcher's terminal free of the
administrator's configuration warnings."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gpushare.estimator_cli.cli import EXIT_OK, EXIT_SCRIPT, EXIT_UNSUPPORTED
from estimator_run import estimate

pytestmark = pytest.mark.torch  # starts gpu-estimate captures: torch in a child process or the warm worker

THREADS_AND_SDPA = """
import torch
import torch.nn.functional as F
from concurrent.futures import ThreadPoolExecutor

class Attn(torch.nn.Module):
    def __init__(self, d=64, heads=4, kv_heads=2):
        super().__init__()
        self.h, self.kv, self.hd = heads, kv_heads, d // heads
        self.q = torch.nn.Linear(d, d)
        self.k = torch.nn.Linear(d, kv_heads * self.hd)
        self.v = torch.nn.Linear(d, kv_heads * self.hd)
        self.register_buffer("cos", torch.ones(128, self.hd))

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.h, self.hd).transpose(1, 2) * self.cos[:s]  # float32 after "rotary"
        k = self.k(x).view(b, s, self.kv, self.hd).transpose(1, 2) * self.cos[:s]
        v = self.v(x).view(b, s, self.kv, self.hd).transpose(1, 2)  # half under autocast
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=GQA)
        return o.transpose(1, 2).reshape(b, s, -1)

def load(shape):
    return torch.zeros(shape).to("cuda")

model = Attn()
with ThreadPoolExecutor(max_workers=2) as pool:  # moved to the GPU by worker threads, kept by the script
    loaded = list(pool.map(load, [(16, 1024, 1024)] * 4))
model.cuda()
opt = torch.optim.AdamW(model.parameters())
for step in range(3):
    x = torch.randn(2, 32, 64, device="cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(x).float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
"""


@pytest.mark.parametrize("gqa", [True, False])
def test_worker_threads_and_sdpa_under_autocast_fake(capsys, tmp_path, gqa):
    code, doc, err = estimate(capsys, tmp_path, THREADS_AND_SDPA.replace("GQA", str(gqa)), "--mode", "fake")
    assert code == EXIT_OK, err
    # the four 64 MiB tensors the worker threads put on the GPU are counted
    assert doc["targets"][0]["peak_allocated_bytes"] >= 4 * 64 * 2**20


def test_worker_threads_and_sdpa_under_autocast_profile(capsys, tmp_path):
    """Profile mode runs the attention for real on the CPU: SDPA gets autocast's casts there too. The
    profiler's trace has only the main thread's allocations: the workers' GPU tensors are counted all the same."""
    code, doc, err = estimate(capsys, tmp_path, THREADS_AND_SDPA.replace("GQA", "True"), "--mode", "profile")
    assert code == EXIT_OK, err
    assert doc["targets"][0]["peak_allocated_bytes"] >= 4 * 64 * 2**20


def test_no_configuration_warning_for_researchers(tmp_path):
    """No gpushare.toml on a login node is the administrator's concern: nothing on gpu-estimate's stderr.
    A separate process: pytest's log capture would hide a warning printed through logging's last resort."""
    env = {k: v for k, v in os.environ.items() if k != "GPUSHARE_CONFIG"}
    env["SLURM_CONF"] = str(tmp_path / "nowhere" / "slurm.conf")
    from gpushare.config import config_candidates

    if any(p.exists() for p in config_candidates(env)):
        pytest.skip("this host has a gpushare.toml")
    script = tmp_path / "train.py"
    script.write_text("import torch\nx = torch.nn.Linear(4, 4).cuda()(torch.ones(4, device='cuda'))\n")
    proc = subprocess.run([sys.executable, "-c", "import sys; from gpushare.estimator_cli.cli import main; "
                           "sys.exit(main())", "--no-cache", "--no-warm", "--gpu", "a100-40gb", str(script)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == EXIT_OK, proc.stderr
    assert "gpushare.toml" not in proc.stderr and "built-in defaults" not in proc.stderr


def test_missing_path_fails_fast_with_file_and_line(capsys, tmp_path):
    code, _, err = estimate(capsys, tmp_path, """
        import torch
        model = torch.nn.Linear(4, 4).cuda()
        state = torch.load("/nonexistent/checkpoint.pt")
    """)
    assert code == EXIT_SCRIPT
    first = err.splitlines()[0]
    assert "train.py:4" in first and "FileNotFoundError" in first and "/nonexistent/checkpoint.pt" in first


def test_gpu_only_kernel_fails_in_one_line_without_fallback(capsys, tmp_path):
    """A custom operator with only a CUDA kernel: profile mode on the CPU cannot run it either, so no
    fallback (which could only end in its error or a time-out)."""
    code, _, err = estimate(capsys, tmp_path, """
        import torch
        lib = torch.library.Library("fancykernels", "DEF")
        lib.define("fused_attn(Tensor q) -> Tensor")
        lib.impl("fused_attn", lambda q: q.clone(), "CUDA")
        x = torch.randn(2, 8, device="cuda", requires_grad=True)
        y = torch.ops.fancykernels.fused_attn(x)
    """, "--mode", "auto")
    assert code == EXIT_UNSUPPORTED
    first = err.splitlines()[0]
    assert "train.py:7" in first and "fancykernels::fused_attn is a GPU-only kernel" in first


def test_profile_failure_after_fallback_names_the_fake_mode_cause(capsys, tmp_path):
    code, _, err = estimate(capsys, tmp_path, """
        import torch
        x = torch.randn(8192, 4096, device="cuda")  # above the 16M elements whose values fake mode keeps
        n = int(x.abs().sum())  # sizes the next allocation: fake mode cannot go on
        y = torch.empty(n, device="cuda")
        raise RuntimeError("Found no NVIDIA driver on your system")
    """, "--mode", "auto")
    assert code == EXIT_SCRIPT
    first = err.splitlines()[0]
    assert "profile mode at" in first and "fake mode had stopped first: DataDependent" in first and "train.py:4" in first


def test_from_pretrained_llama_with_gqa_autocast_and_checkpointing(capsys, tmp_path):
    """A Llama-style causal LM (grouped-query attention, rotary embeddings) loaded with
    ``from_pretrained(device_map="cuda")`` from a tiny model generated here (no download), trained under bf16
    autocast with gradient checkpointing."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # device_map needs it; transformers 5 then loads in a thread pool
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "tiny")
    code, doc, err = estimate(capsys, tmp_path, """
        import sys, torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(sys.argv[1], device_map="cuda", dtype=torch.float32)
        model.gradient_checkpointing_enable()
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for step in range(3):
            ids = torch.randint(0, 1000, (2, 64), device="cuda")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            print(step, loss.item())
    """, "--mode", "fake", script_args=(str(tmp_path / "tiny"),))
    assert code == EXIT_OK, err
    parameters = sum(p.numel() for p in transformers.LlamaForCausalLM(config).parameters())
    # weights, gradients and AdamW's two states in float32
    assert doc["targets"][0]["peak_allocated_bytes"] >= 16 * parameters



def test_device_indices(capsys, tmp_path):
    """``module.to(local_rank)`` and ``torch.device(0)`` (transformers' ``device_map="auto"``) name the GPU by
    index, which the CPU wheel cannot resolve."""
    code, doc, err = estimate(capsys, tmp_path, """
        import torch
        model = torch.nn.Linear(256, 256).to(0)
        assert torch.device(0) == torch.device("cuda", 0) and model.weight.device == torch.device("cuda", 0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            model(torch.randn(8, 256, device=0)).sum().backward()
            opt.step()
            opt.zero_grad()
    """, "--mode", "fake")
    assert code == EXIT_OK, err
    assert doc["targets"][0]["peak_allocated_bytes"] >= 256 * 256 * 4


def test_threads_leave_the_inherited_modes_cleanly():
    """A thread started under the capture's modes runs under them and pops them when it ends, without error."""
    import threading

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from gpushare.estimator_cli.thread_modes import modes_follow_threads

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    failures: list[BaseException] = []
    saved_hook = threading.excepthook
    threading.excepthook = lambda hook_args: failures.append(hook_args.exc_value)
    try:
        with Count(), modes_follow_threads():
            worker = threading.Thread(target=lambda: torch.zeros(4) + 1)
            worker.start()
            worker.join()
    finally:
        threading.excepthook = saved_hook
    assert Count.calls >= 2 and not failures, failures


def test_missing_pretrained_folder_names_the_script_line(capsys, tmp_path):
    """transformers re-raises a missing model folder from inside its handler: the line is still the script's."""
    pytest.importorskip("transformers")
    code, _, err = estimate(capsys, tmp_path, """
        import torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained("/nonexistent/llama-7b", dtype=torch.bfloat16)
    """, "--mode", "fake")
    assert code == EXIT_SCRIPT
    first = err.splitlines()[0]
    assert "train.py:4" in first and "/nonexistent/llama-7b" in first
