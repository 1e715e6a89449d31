"""``weights: int8`` on the real weights: SmolLM2 (loaded through the same path as ``kvfuse serve``,
``runtime.open_model``) and Gemma 3 270M, logits and greedy tokens against fp32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kvfuse_helpers import builtin_folder, load_builtin, long_text, model_home

from kvfuse.config import load_config
from kvfuse.models import load_model
from kvfuse.models.cpu import kernels
from kvfuse.models.packed import BlockedWeight
from kvfuse.models.quant import Int8Weight, weight_bytes
from kvfuse.runtime import open_model

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread (see test_real_models.one_thread)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def fp32():
    return load_builtin("smollm2", "fp32")


@pytest.fixture(scope="module")
def int8():
    builtin_folder("smollm2")
    return open_model(
        load_config(overrides={"home": str(model_home()), "model": "smollm2", "weights": "int8"})
    )


def test_int8_is_what_was_loaded(fp32, int8):
    assert int8.weights == "int8" and int8.runner.device.type == "cpu"
    kind = BlockedWeight if kernels.get() is not None else Int8Weight  # fbgemm without the kernels
    assert isinstance(int8.runner.weights.layers[0].w_down, kind)
    assert isinstance(int8.runner.weights.lm_head, kind)
    assert int8.fingerprint != fp32.fingerprint
    # what a decode step reads: about a quarter of fp32's bytes
    full, small = weight_bytes(fp32.runner.weights), weight_bytes(int8.runner.weights)
    assert (small["layers"] + small["lm_head"]) < 0.27 * (full["layers"] + full["lm_head"])


@pytest.fixture(scope="module")
def gemma3_pair():
    fp32 = load_builtin("gemma3-270m", "fp32")
    return fp32, load_model(
        "gemma3-270m", home=model_home(), device="cpu", dtype="float32", weights="int8"
    )


# model, min mean cosine, min cosine, min top-1 agreement. Measured here: smollm2 cosine 0.9986 on
# average (min 0.982), top-1 agreement 0.967, KL 0.003 nats; gemma3-270m 0.9992 (min 0.996),
# 0.987, KL 0.003 nats.
AGREEMENT = [("smollm2", 0.997, 0.95, 0.92), ("gemma3-270m", 0.998, 0.98, 0.95)]


@pytest.mark.parametrize(
    "name,mean_cos,min_cos,top1",
    [  # gemma3-270m (25 s) with -m slow
        AGREEMENT[0],
        pytest.param(*AGREEMENT[1], marks=pytest.mark.slow),
    ],
    ids=[a[0] for a in AGREEMENT],
)
def test_logits_agree_with_fp32_over_a_long_prompt(request, name, mean_cos, min_cos, top1):
    """Teacher-forced over 300 tokens of text (one prefill each)."""
    fp32, int8 = (
        (request.getfixturevalue("fp32"), request.getfixturevalue("int8"))
        if name == "smollm2"
        else request.getfixturevalue("gemma3_pair")
    )
    ids = fp32.tokenizer.encode(long_text(4))[:300]
    assert len(ids) == 300
    ref = fp32.runner.forward(ids, fp32.runner.new_cache(300), logits="all")
    got = int8.runner.forward(ids, int8.runner.new_cache(300), logits="all")
    cos = F.cosine_similarity(got, ref, dim=-1)
    assert cos.mean() > mean_cos and cos.min() > min_cos, (cos.mean(), cos.min())
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean()
    assert agree >= top1, agree
    kl = F.kl_div(
        F.log_softmax(got, -1), F.log_softmax(ref, -1), log_target=True, reduction="none"
    ).sum(-1)
    assert kl.mean() < 0.02, kl.mean()


def _greedy(model, ids: list[int], n: int) -> list[int]:
    runner = model.runner
    cache = runner.new_cache()
    logits = runner.forward(ids, cache)
    out: list[int] = []
    while len(out) < n:
        out.append(int(logits.argmax()))
        if out[-1] in model.eos_token_ids:
            break
        logits = runner.forward([out[-1]], cache)
    return out


@pytest.mark.parametrize(
    "question",
    [
        "What is the capital of France?",
        "Name three primary colors.",
        "What is 2 + 2?",
        "Translate 'thank you' into Spanish.",
    ],
)
def test_greedy_answers_to_simple_questions_equal_fp32(fp32, int8, question):
    """Prefill then one-token decode steps (the one-row products): the same answer token for token."""
    ids = fp32.tokenizer.encode_chat([{"role": "user", "content": question}])
    expected = _greedy(fp32, ids, 12)
    assert _greedy(int8, ids, 12) == expected, fp32.tokenizer.decode(expected)
