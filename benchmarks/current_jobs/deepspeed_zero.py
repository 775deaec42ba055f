"""A model trained with DeepSpeed ZeRO, written as DeepSpeed's training examples are: ``deepspeed.add_config_arguments``,
``deepspeed.init_distributed()``, ``deepspeed.initialize`` with the model's parameters, then ``engine.backward`` and
``engine.step``. The ZeRO stage comes from ``--deepspeed_config FILE`` or, without one, from ``--stage`` (the
config built in the script, as DeepSpeed's CIFAR example does). DeepSpeed's AdamW section with ``torch_adam``
(torch.optim.AdamW); ``--optimizer fused``: the same section as DeepSpeed's FusedAdam (a CUDA op, which
gpu-estimate replaces by torch's fused AdamW); ``--optimizer client``: torch's AdamW made here and handed to
DeepSpeed (``zero_allow_untested_optimizer``). Data generated, nothing downloaded.

    deepspeed --num_gpus=8 deepspeed_zero.py --deepspeed --deepspeed_config ds_config.json
    torchrun --nproc_per_node=8 deepspeed_zero.py --stage 3
"""

import argparse

import deepspeed
import torch
import torch.nn as nn

p = argparse.ArgumentParser()
p.add_argument("--local_rank", type=int, default=-1)  # the deepspeed launcher passes it
p.add_argument("--stage", type=int, default=2)
p.add_argument("--width", type=int, default=2048)
p.add_argument("--layers", type=int, default=6)
p.add_argument("--batch-size", type=int, default=16)
p.add_argument("--steps", type=int, default=10)
p.add_argument("--optimizer", choices=["torch_adam", "fused", "client"], default="torch_adam",
               help="DeepSpeed's AdamW section with torch_adam, the same section as DeepSpeed's FusedAdam, "
                    "or torch's AdamW made here and handed to deepspeed.initialize")
p = deepspeed.add_config_arguments(p)
args = p.parse_args()

deepspeed.init_distributed()


class Net(nn.Module):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.body = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)])
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        return self.head(self.body(x))


ds_config = None
if not args.deepspeed_config:
    ds_config = {
        "train_micro_batch_size_per_gpu": args.batch_size,
        "gradient_accumulation_steps": 1,
        "zero_allow_untested_optimizer": True,
        # buckets of 5M elements, below this model's 25M parameters (DeepSpeed's default is 500M)
        "zero_optimization": {"stage": args.stage, "overlap_comm": False, "contiguous_gradients": True,
                              "reduce_bucket_size": 5e6, "allgather_bucket_size": 5e6,
                              "stage3_prefetch_bucket_size": 5e6},
        "steps_per_print": 100,
    }
    if args.optimizer != "client":
        ds_config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}}
        # torch_adam: torch.optim.AdamW; without it DeepSpeed's FusedAdam, a CUDA op built on first use
        ds_config["optimizer"]["params"]["torch_adam"] = args.optimizer == "torch_adam"

net = Net(args.width, args.layers)
if args.optimizer == "client":
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4, weight_decay=0.01)
    engine, optimizer, _, _ = deepspeed.initialize(args=args, model=net, optimizer=optimizer, config=ds_config)
else:
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    engine, optimizer, _, _ = deepspeed.initialize(args=args, model=net, model_parameters=parameters,
                                                   config=ds_config)
criterion = nn.CrossEntropyLoss()
for step in range(args.steps):
    x = torch.randn(args.batch_size, args.width, device=engine.device)
    y = torch.randint(0, 10, (args.batch_size,), device=engine.device)
    loss = criterion(engine(x), y)
    engine.backward(loss)
    engine.step()
