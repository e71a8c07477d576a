"""The graphed, bucketed model of ``benchmarks/serving_model.py`` against plain eager forwards.

The engine-against-simulator comparison is only worth its numbers if the served model computes
what the model computes: a prompt padded to its bucket gives the first token and the cache of
the prompt alone, and the split-KV decode attention gives the logits of attention over each
slot's own context. Marked ``gpu``.
"""
import sys
from pathlib import Path

import pytest
from needs import gpu

pytestmark = [pytest.mark.gpu, gpu("torch")]
BENCHMARKS = str(Path(__file__).resolve().parents[1] / "benchmarks")

LAYERS, BLOCK = 2, 64


def close(got, want) -> bool:
    """Within bf16 rounding: 2 % of the norm. (Tokens are not compared: with random weights the
    top logits are near ties, which a different GEMM tiling may swap.)"""
    return float((got.float() - want.float()).norm() / want.float().norm()) < 0.02


@pytest.fixture(scope="module")
def torch():
    import torch

    return torch


def served(torch, split_kv: bool = True):
    sys.path.insert(0, BENCHMARKS)  # only while importing: benchmarks/engine.py must not shadow
    try:                            # the example engine other tests import as ``engine``
        from serving_model import ServedLlama
    finally:
        sys.path.remove(BENCHMARKS)

    return ServedLlama(torch, p_blocks=24, d_blocks=8, slots=4, context=1100, max_prompt=600, layers=LAYERS,
                       split_kv=split_kv)


def test_padded_graphed_prefill_is_the_prompts_own(torch):
    m = served(torch)
    gen = torch.Generator().manual_seed(0)
    for n in (1, 100, 128, 129, 600):  # bucket edges and a partial last block
        toks = torch.randint(0, 128000, (n,), generator=gen).tolist()
        table = list(range(23, 23 - -(-n // BLOCK), -1))  # blocks out of order
        tok = m.prefill(toks, table)
        kv: list = []
        with torch.no_grad(), m.attention():
            want = m.model.prefill(torch.tensor([toks], device="cuda"), kv).view(-1)
        assert close(m.prefill_logits, want), n
        assert tok == int(m.prefill_logits.argmax())
        for i, (k, v) in enumerate(kv):  # the pages hold the prompt's keys and values
            for kind, x in (("key", k), ("value", v)):
                pages = m.p_cache[kind][i][torch.tensor(table, device="cuda")]
                flat = pages.transpose(0, 1).reshape(x.shape[1], -1, x.shape[3])[:, :n]
                assert close(flat, x[0]), (n, i, kind)


def test_split_kv_step_matches_attention_over_each_context(torch):
    """Slots of different contexts, some parts past a slot's context entirely: split-KV logits
    equal the masked single-pass attention's within bf16 rounding."""
    a, b = served(torch, split_kv=True), served(torch, split_kv=False)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for pa, pb in zip(a.slots, b.slots):
        for ca, cb in zip(pa, pb):
            ca.copy_(torch.randn(ca.shape, device="cuda", generator=gen, dtype=torch.bfloat16))
            cb.copy_(ca)
    toks, pos = [11, 22, 33], [5, 300, 1000]
    ta, tb = a.step(toks, pos), b.step(toks, pos)
    for s in range(3):
        assert close(a.logits[s], b.logits[s]), s
    assert ta == a.logits[:3].argmax(-1).tolist() and tb == b.logits[:3].argmax(-1).tolist()
