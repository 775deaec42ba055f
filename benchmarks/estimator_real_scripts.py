"""gpu-estimate on the real-script corpus (benchmarks/real_scripts/): mode, time, peak, fallback reason.

Each corpus script is written in the style of a popular kind of training script (Hugging Face Trainer
and accelerate, Lightning Trainer and Fabric, plain loops with AMP, gradient accumulation and
checkpointing, torch.compile, DataLoader workers, torchrun-style launch, LSTM, sparse GNN, diffusion,
detection, GAN, contrastive; sample images saved from GPU batches, host-side metrics with ``int(tensor)``
lookups, a long evaluation before the first step), builds its model from a config and makes its data at run time. Each is
estimated with its default arguments, unmodified, as a user would run it: ``gpu-estimate --json
--no-cache --gpu a100-80gb SCRIPT``, through the warm worker (one unmeasured run starts it, as the
first estimate of a session does), with ``--timeout`` and ``--max-cpu-memory`` bounds. Wall time is the
whole ``gpu-estimate`` process, data generation and framework start-up included (the synthetic data
files are made once and reused, as a dataset on disk would be). The corpus is run twice: *first* is each
script's first estimate (its framework not yet known to the worker), *repeat* the next one, after the
worker has preloaded the frameworks the scripts imported (estimator_cli/preload.py) — the case of a
researcher re-estimating while editing a script. Scripts whose framework is not installed
are listed as skipped. The warm worker lives in a private runtime directory and is stopped at the end.

    python benchmarks/estimator_real_scripts.py [--timeout 300] [--max-cpu-memory 16G] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "benchmarks", "real_scripts")
# script -> (style, packages it needs beyond torch)
SCRIPTS = {
    "hf_causal_lm.py": ("HF Llama, plain loop, bf16 autocast, grad checkpointing", ["transformers"]),
    "hf_bert_classifier.py": ("HF BERT, Trainer, fp16, padded masks", ["transformers", "accelerate"]),
    "hf_accelerate_gpt2.py": ("HF GPT-2, accelerate, grad accumulation, memmap", ["transformers", "accelerate"]),
    "hf_t5_seq2seq.py": ("HF T5, Adafactor, padded seq2seq", ["transformers"]),
    "nanogpt_style.py": ("GPT, torch.compile, memmap, grad accumulation", []),
    "imagenet_style_resnet.py": ("ResNet-18, image folder, workers, AMP, torch.accelerator", ["PIL"]),
    "mnist_idx_cnn.py": ("CNN, idx files, Adadelta", []),
    "word_lstm_lm.py": ("word LSTM LM, text corpus, manual SGD (no optimizer)", []),
    "gcn_sparse.py": ("GCN, sparse COO adjacency, boolean masks", []),
    "lightning_classifier.py": ("Lightning Trainer, 16-mixed, transformer encoder", ["lightning"]),
    "lightning_fabric_vit.py": ("Lightning Fabric, ViT-B/16, bf16-mixed", ["lightning"]),
    "diffusion_unet.py": ("diffusers UNet2D + DDPM, fp16 AMP, EMA", ["diffusers"]),
    "detection_fcos_style.py": ("one-stage detector, per-image boxes, mask assignment", []),
    "torchrun_ddp.py": ("torchrun-style MLP, set_device, streams, DistributedSampler", []),
    "seq2seq_transformer.py": ("nn.Transformer, padding masks, label smoothing", []),
    "dcgan.py": ("DCGAN, two optimizers", []),
    "simclr_contrastive.py": ("SimCLR, boolean-mask NT-Xent, channels_last AMP", []),
    "vae_sample_images.py": ("conv VAE, reconstructions .to('cpu') saved as PNG with PIL, .numpy()", ["PIL"]),
    "classifier_host_metrics.py": ("CNN, .cpu() metrics, NumPy confusion matrix, int(tensor) index and loop bound", []),
    "nanogpt_eval_first.py": ("GPT-2 124M, torch.compile, 2x200 eval batches at iteration 0, best-loss checkpoint", []),
}


def one_run(script: str, timeout: float, memory: str) -> dict:
    cmd = [sys.executable, "-m", "gpushare.estimator_cli.cli", "--json", "--no-cache", "--gpu", "a100-80gb",
           "--timeout", str(timeout), "--max-cpu-memory", memory, script]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=CORPUS, timeout=timeout + 60)
    wall = time.monotonic() - start
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no message)"])
        reason = next((line for line in last if line.startswith("gpu-estimate:")), last[-1])
        return {"ok": False, "wall_s": wall, "exit": proc.returncode, "error": reason[:160]}
    doc = json.loads(proc.stdout)
    target = doc["targets"][0]
    return {"ok": True, "wall_s": wall, "mode": doc["mode"], "fallback": doc.get("fallback_reason"),
            "peak_total": target["peak_total_bytes"], "peak_reserved": target["peak_reserved_bytes"],
            "iterations": doc["iterations"], "process": doc["capture_process"],
            "concrete_reads": sum(doc.get("value_reads", {}).get("concrete", {}).values())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--max-cpu-memory", default="16G")
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--settle", type=float, default=20.0, help="seconds between the two passes")
    opts = parser.parse_args()
    sys.path.insert(0, ROOT)
    from gpushare.estimator_cli.warm_worker import private_runtime

    rows = []
    with private_runtime("gpushare-bench-runtime-"):
        one_run(os.path.join(CORPUS, "mnist_idx_cnn.py"), opts.timeout, opts.max_cpu_memory)  # starts the worker
        for name, (style, needs) in SCRIPTS.items():
            if opts.only and name not in opts.only:
                continue
            missing = [p for p in needs if importlib.util.find_spec(p) is None]
            if missing:
                rows.append((name, style, {"ok": False, "skipped": True, "error": "needs " + ", ".join(missing)}))
                continue
            result = one_run(os.path.join(CORPUS, name), opts.timeout, opts.max_cpu_memory)
            rows.append((name, style, result))
            print(_row(name, result), flush=True)
        time.sleep(opts.settle)  # the idle worker imports what the scripts used
        for name, style, result in rows:
            if not result.get("skipped"):
                again = one_run(os.path.join(CORPUS, name), opts.timeout, opts.max_cpu_memory)
                result["repeat_s"] = again["wall_s"]
                result["repeat_mode"] = again.get("mode")
                print(_row(name, again) + "  (repeat)", flush=True)
    print()
    print("| script | style | mode | first (s) | repeat (s) | peak total a100-80gb | concrete reads | fallback / failure |")
    print("|---|---|---|---:|---:|---:|---:|---|")
    for name, style, r in rows:
        repeat = f"{r['repeat_s']:.1f}" if "repeat_s" in r else ""
        if r.get("skipped"):
            print(f"| {name} | {style} | skipped | | | | | {r['error']} |")
        elif not r["ok"]:
            print(f"| {name} | {style} | failed | {r['wall_s']:.1f} | {repeat} | | | exit {r['exit']}: {r['error']} |")
        else:
            print(f"| {name} | {style} | {r['mode']} | {r['wall_s']:.1f} | {repeat} | {r['peak_total'] / 2**30:.2f} GiB | "
                  f"{r['concrete_reads']} | {r['fallback'] or ''} |")
    ran = [r for _, _, r in rows if not r.get("skipped")]
    fake = [r for r in ran if r.get("ok") and r["mode"] == "fake"]
    times = [r["wall_s"] for r in ran]
    repeats = [r["repeat_s"] for r in ran if "repeat_s" in r]
    if ran:
        print(f"\nfake mode: {len(fake)}/{len(ran)} ({100 * len(fake) / len(ran):.0f} %); "
              f"failed: {sum(not r['ok'] for r in ran)}; median time first {statistics.median(times):.1f} s "
              f"(max {max(times):.1f} s), repeat {statistics.median(repeats):.1f} s (max {max(repeats):.1f} s)")
    return 0


def _row(name: str, r: dict) -> str:
    if not r["ok"]:
        return f"{name:<28} FAILED  {r['wall_s']:6.1f} s  {r['error']}"
    return (f"{name:<28} {r['mode']:<7} {r['wall_s']:6.1f} s  {r['peak_total'] / 2**30:6.2f} GiB  "
            f"{r['process']}  {r['fallback'] or ''}")


if __name__ == "__main__":
    raise SystemExit(main())
