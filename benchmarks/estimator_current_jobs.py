"""gpu-estimate on the jobs researchers run now (benchmarks/current_jobs/): estimated or failed, mode, seconds.

Each corpus script is written in the manner of a current public example of its library — Hugging Face
Trainer, PEFT LoRA/DoRA and QLoRA (bitsandbytes 4-bit), TRL SFT (packing) and DPO (frozen reference copy),
diffusers text-to-image full and LoRA fine-tuning, accelerate, a 3D U-Net, PyTorch Geometric, torchrun DDP and FSDP2 — and loads its weights
from a local pretrained directory that ``benchmarks/current_jobs/make_pretrained.py`` writes first with
``save_pretrained`` (small configurations, random weights, no download). Multi-GPU scripts are given as the
batch script's launcher line (``torchrun --nproc_per_node=N ...``). Each is estimated unmodified:
``gpu-estimate --json --no-cache --gpu a100-80gb [LAUNCHER] SCRIPT ARGS`` through the warm worker (one
unmeasured run starts it), with ``--timeout`` and ``--max-cpu-memory`` bounds; the time is the whole
``gpu-estimate`` process. Rows whose libraries are missing are listed as skipped (the ``bench-hf`` extra
installs them).

    python benchmarks/estimator_current_jobs.py [--work DIR] [--timeout 300] [--max-cpu-memory 16G] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "benchmarks", "current_jobs")
# name -> (style, packages beyond torch, launcher words, script, pretrained folder or None, extra args)
JOBS: dict[str, tuple[str, list[str], list[str], str, str | None, list[str]]] = {
    "hf_trainer_clm": ("Trainer, causal LM, bf16, grad accumulation + checkpointing, eval steps",
                       ["transformers", "datasets", "accelerate"], [], "hf_trainer_clm.py", "llama", []),
    "peft_lora": ("PEFT LoRA r=16 on all projections, Trainer, fp16", ["peft", "datasets"], [],
                  "peft_lora_trainer.py", "llama", []),
    "peft_dora": ("PEFT DoRA, Trainer, fp16", ["peft", "datasets"], [], "peft_lora_trainer.py", "llama", ["--dora"]),
    "peft_lora_bin": ("the PEFT LoRA job on a float32 pytorch_model.bin folder (torch.save, no safetensors)",
                      ["peft", "datasets"], [], "peft_lora_trainer.py", "llama_bin", []),
    "peft_qlora": ("QLoRA: 4-bit NF4 base (bitsandbytes), PEFT LoRA r=64, Trainer, bf16, paged 8-bit AdamW",
                   ["peft", "datasets", "bitsandbytes"], [], "peft_qlora.py", "llama", []),
    "trl_sft": ("TRL SFTTrainer, chat template, packing, bf16", ["trl", "datasets"], [], "trl_sft_packing.py",
                "llama", []),
    "trl_dpo": ("TRL DPOTrainer, frozen reference copy, bf16", ["trl", "datasets"], [], "trl_dpo.py", "llama", []),
    "diffusers_t2i": ("diffusers text-to-image, fp16 mixed, EMA, VAE + CLIP frozen",
                      ["diffusers", "accelerate"], [], "diffusers_text_to_image.py", "sd", []),
    "diffusers_lora": ("diffusers text-to-image LoRA, 512 px, fp16", ["diffusers", "peft", "accelerate"], [],
                       "diffusers_lora.py", "sd", []),
    "unet3d": ("3D U-Net, 96^3 patches, Dice + CE, AMP + GradScaler", [], [], "unet3d_segmentation.py", None, []),
    "gcn_pyg": ("PyG GCNConv, PubMed-sized graph, full batch", ["torch_geometric"], [], "gcn_pyg.py", None, []),
    "accelerate_vit": ("accelerate, pretrained ViT, new head, bf16, workers", ["transformers", "accelerate"], [],
                       "accelerate_vit.py", "vit", []),
    "accelerate_vit_x2": ("the same through `accelerate launch --num_processes 2`", ["transformers", "accelerate"],
                          ["accelerate", "launch", "--num_processes", "2"], "accelerate_vit.py", "vit", []),
    "ddp_torchrun_x4": ("torchrun --nproc_per_node=4, DDP, LOCAL_RANK, nccl", ["transformers"],
                        ["torchrun", "--nproc_per_node=4"], "torchrun_ddp_lm.py", "llama", []),
    "fsdp2_torchrun_x8": ("torchrun --nproc_per_node=8, FSDP2 per layer, meta init, set_model_state_dict",
                          ["transformers", "safetensors"], ["torchrun", "--nproc_per_node=8"],
                          "torchrun_fsdp2_lm.py", "llama", []),
    "deepspeed_zero3_x8": ("`deepspeed --num_gpus=8`, ZeRO stage 3, DeepSpeed's AdamW (torch_adam)", ["deepspeed"],
                           ["deepspeed", "--num_gpus=8"], "deepspeed_zero.py", None, ["--stage", "3"]),
}


def one_run(launcher: list[str], script: str, args: list[str], timeout: float, memory: str) -> dict:
    cmd = [sys.executable, "-m", "gpushare.estimator_cli.cli", "--json", "--no-cache", "--gpu", "a100-80gb",
           "--timeout", str(timeout), "--max-cpu-memory", memory, *launcher, script, *args]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=CORPUS, timeout=timeout + 120)
    wall = time.monotonic() - start
    if proc.returncode != 0:
        last = proc.stderr.strip().splitlines() or ["(no message)"]
        reason = next((line for line in last if line.startswith("gpu-estimate:")), last[-1])
        return {"ok": False, "wall_s": wall, "exit": proc.returncode, "error": reason[:200]}
    doc = json.loads(proc.stdout)
    target = doc["targets"][0]
    return {"ok": True, "wall_s": wall, "mode": doc["mode"], "fallback": doc.get("fallback_reason"),
            "peak_total": target["peak_total_bytes"], "iterations": doc["iterations"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", help="where the pretrained folders are written (default: a new temporary folder)")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--max-cpu-memory", default="16G")
    parser.add_argument("--only", nargs="*", default=None)
    opts = parser.parse_args()
    sys.path.insert(0, ROOT)
    from gpushare.estimator_cli.warm_worker import private_runtime

    work = opts.work or tempfile.mkdtemp(prefix="gpushare-current-jobs-")
    start = time.monotonic()
    subprocess.run([sys.executable, os.path.join(CORPUS, "make_pretrained.py"), work], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print(f"pretrained folders in {work} ({time.monotonic() - start:.1f} s)", flush=True)
    rows = []
    with private_runtime("gpushare-bench-runtime-"):
        one_run([], os.path.join(CORPUS, "unet3d_segmentation.py"), ["--patch", "32"], opts.timeout,
                opts.max_cpu_memory)  # starts the warm worker
        for name, (style, needs, launcher, script, folder, extra) in JOBS.items():
            if opts.only and name not in opts.only:
                continue
            missing = [p for p in needs if importlib.util.find_spec(p) is None]
            if missing:
                rows.append((name, style, {"ok": False, "skipped": True, "error": "needs " + ", ".join(missing)}))
                continue
            args = ([os.path.join(work, folder)] if folder else []) + extra
            result = one_run(launcher, os.path.join(CORPUS, script), args, opts.timeout, opts.max_cpu_memory)
            rows.append((name, style, result))
            print(_row(name, result), flush=True)
    print()
    print("| job | style | result | mode | seconds | peak total a100-80gb | fallback / failure |")
    print("|---|---|---|---|---:|---:|---|")
    for name, style, r in rows:
        if r.get("skipped"):
            print(f"| {name} | {style} | skipped | | | | {r['error']} |")
        elif not r["ok"]:
            print(f"| {name} | {style} | failed | | {r['wall_s']:.1f} | | exit {r['exit']}: {r['error']} |")
        else:
            print(f"| {name} | {style} | estimated | {r['mode']} | {r['wall_s']:.1f} | "
                  f"{r['peak_total'] / 2**30:.2f} GiB | {r['fallback'] or ''} |")
    ran = [r for _, _, r in rows if not r.get("skipped")]
    if ran:
        ok = [r for r in ran if r["ok"]]
        fake = [r for r in ok if r["mode"] == "fake"]
        times = [r["wall_s"] for r in ran]
        print(f"\nestimated: {len(ok)}/{len(ran)} ({100 * len(ok) / len(ran):.0f} %), in fake mode {len(fake)}/{len(ran)}; "
              f"median {statistics.median(times):.1f} s, max {max(times):.1f} s")
    return 0


def _row(name: str, r: dict) -> str:
    if not r["ok"]:
        return f"{name:<20} FAILED     {r['wall_s']:6.1f} s  {r['error']}"
    return f"{name:<20} estimated  {r['mode']:<7} {r['wall_s']:6.1f} s  {r['peak_total'] / 2**30:6.2f} GiB  {r['fallback'] or ''}"


if __name__ == "__main__":
    raise SystemExit(main())
