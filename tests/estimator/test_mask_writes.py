"""A write through a boolean mask whose value the capture has (docs/estimator.md, "Concrete values for small
tensors"): ``inputs_embeds[input_ids == image_token_id] = image_features``, as vision-language models splice
image features into the text embeddings. The write goes through the mask's integer indices, so the backward's
``grad[mask]`` needs no ``nonzero`` on meta."""

from __future__ import annotations

import pytest
from estimator_run import estimate

from gpushare.estimator_cli.cli import EXIT_OK

pytestmark = pytest.mark.torch

SPLICE = """
    import sys, torch, torch.nn as nn
    how = sys.argv[1]
    emb = nn.Embedding(100, 64).cuda()
    proj = nn.Linear(32, 64).cuda()
    opt = torch.optim.AdamW(list(emb.parameters()) + list(proj.parameters()))
    ids = torch.randint(3, 100, (2, 50))
    ids[:, 5:9] = 2                                     # 8 image-token positions
    for step in range(5):
        input_ids = ids.cuda()
        embeds = emb(input_ids)
        image = proj(torch.randn(8, 32).cuda())
        mask = input_ids == 2
        new = embeds.clone()
        if how == "setitem":
            new[mask] = image
        else:
            new = new.index_put((mask,), image)
        new.sum().backward()
        opt.step()
        opt.zero_grad()
"""


@pytest.mark.parametrize("how", ["setitem", "index_put"])
def test_image_features_written_through_a_token_mask_train_in_fake_mode(capsys, tmp_path, how):
    code, doc, err = estimate(capsys, tmp_path, SPLICE, "--mode", "fake", script_args=(how,))
    assert code == EXIT_OK, err
    assert doc["mode"] == "fake" and doc["iterations"] == 3
    assert "a boolean mask used as an index" in doc["value_reads"]["concrete"]
