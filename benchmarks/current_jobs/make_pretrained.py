"""Write the local "pretrained" directories the current-jobs corpus loads, as ``save_pretrained`` writes
them (config JSON + safetensors weights + tokenizer files): a Llama-style causal LM with its tokenizer (and
the same model as a float32 ``pytorch_model.bin``), a Stable-Diffusion-style pipeline folder (UNet, VAE,
CLIP text encoder, tokenizer, DDPM scheduler) and a ViT image classifier. Small configurations, random
weights, no download: what matters to gpu-estimate is the code path a real checkpoint takes (config,
header, dtype, tied weights), not the values.

    python benchmarks/current_jobs/make_pretrained.py DIR
"""

from __future__ import annotations

import os
import sys

WORDS = [f"w{i}" for i in range(4000)]


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(["<unk>", "<pad>", "<s>", "</s>", *WORDS])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
                                  eos_token="</s>", model_max_length=512)
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} </s> {% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}")
    return tok


def causal_lm(path: str) -> None:
    import torch
    import transformers

    config = transformers.LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=6,
                                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                                      tie_word_embeddings=True, bos_token_id=2, eos_token_id=3, pad_token_id=1)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)  # bf16, as hub checkpoints are
    tokenizer().save_pretrained(path)


def causal_lm_bin(path: str) -> None:
    """The same causal LM in the format older hub checkpoints have: float32 weights in a ``torch.save``
    archive (``pytorch_model.bin``), no safetensors."""
    import torch
    import transformers

    causal_lm(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    os.remove(os.path.join(path, "model.safetensors"))
    torch.save({k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"},
               os.path.join(path, "pytorch_model.bin"))


def diffusion(path: str) -> None:
    import transformers
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel

    UNet2DConditionModel(sample_size=32, in_channels=4, out_channels=4, layers_per_block=2,
                         block_out_channels=(128, 256, 256), cross_attention_dim=256,
                         down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
                         up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
                         attention_head_dim=8).save_pretrained(os.path.join(path, "unet"))
    AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(64, 128, 128, 128),
                  down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                  layers_per_block=1, sample_size=256).save_pretrained(os.path.join(path, "vae"))
    transformers.CLIPTextModel(transformers.CLIPTextConfig(vocab_size=4096, hidden_size=256, intermediate_size=1024,
                                                            num_hidden_layers=4, num_attention_heads=4,
                                                            max_position_embeddings=77, bos_token_id=2,
                                                            eos_token_id=3, pad_token_id=1)
                               ).save_pretrained(os.path.join(path, "text_encoder"))
    tokenizer().save_pretrained(os.path.join(path, "tokenizer"))
    DDPMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear").save_pretrained(os.path.join(path, "scheduler"))


def vit(path: str) -> None:
    import transformers

    config = transformers.ViTConfig(image_size=224, patch_size=16, hidden_size=384, num_hidden_layers=6,
                                    num_attention_heads=6, intermediate_size=1536, num_labels=100)
    transformers.ViTForImageClassification(config).save_pretrained(path)
    transformers.ViTImageProcessor(size={"height": 224, "width": 224}).save_pretrained(path)


def main(argv: list[str]) -> int:
    out = argv[0] if argv else "pretrained"
    makers = {"llama": causal_lm, "llama_bin": causal_lm_bin, "sd": diffusion, "vit": vit}
    for name, make in makers.items():
        target = os.path.join(out, name)
        if os.path.exists(os.path.join(target, "done")):
            continue
        try:
            make(target)
        except ImportError as exc:  # a library the corpus's scripts of that kind need is missing
            print(f"make_pretrained: {name} skipped ({exc})", file=sys.stderr)
            continue
        open(os.path.join(target, "done"), "w").close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
