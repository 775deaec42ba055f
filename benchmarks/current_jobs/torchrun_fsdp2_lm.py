"""A causal LM fine-tuned with FSDP2 (``fully_shard`` per decoder layer, then the whole model), written
for ``torchrun``: the model built on the meta device, sharded, then its pretrained weights loaded into the
shards with ``set_model_state_dict`` from the checkpoint's safetensors file; bf16 parameters with float32
gradient reduction."""

import argparse
import os

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AutoConfig, AutoModelForCausalLM

p = argparse.ArgumentParser()
p.add_argument("model_dir")
p.add_argument("--batch-size", type=int, default=8)
p.add_argument("--seq", type=int, default=512)
args = p.parse_args()

dist.init_process_group("nccl")
local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
config = AutoConfig.from_pretrained(args.model_dir)
with torch.device("meta"):
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
for layer in model.model.layers:
    fully_shard(layer, mp_policy=policy)
fully_shard(model, mp_policy=policy)
model.to_empty(device="cuda")
state = load_file(os.path.join(args.model_dir, "model.safetensors"))
state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])  # tied in the checkpoint
set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=False))
opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
for step in range(100):
    ids = torch.randint(0, config.vocab_size, (args.batch_size, args.seq), device="cuda")
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
