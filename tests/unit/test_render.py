"""The render endpoints' pure parts: kvfuse's ``SamplingParams`` under vLLM's names, and the
answer read back by vLLM's own ``GenerateRequest`` (in vLLM's venv, where present)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from kvfuse.generation import SamplingParams
from kvfuse.server.render import RenderedRequest, structured_outputs, vllm_sampling_params
from kvfuse.server.structured import OutputFormat

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = os.environ.get("KVFUSE_VLLM_PYTHON", str(REPO / ".baselines/vllm-venv/bin/python"))

BASE = {
    "n": 1, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
    "temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "stop": [],
    "stop_token_ids": [], "ignore_eos": False, "max_tokens": 256,
}  # fmt: skip


@pytest.mark.parametrize(
    "params, fmt, extra",
    [
        (SamplingParams(), None, {}),
        (SamplingParams(seed=3, n=2), None, {"seed": 3, "n": 2}),
        (SamplingParams(logprobs=2, prompt_logprobs=1), None, {"logprobs": 2, "prompt_logprobs": 1}),
        (SamplingParams(logit_bias={7: -2.5}), None, {"logit_bias": {"7": -2.5}}),
        (SamplingParams(stop=("a", "b"), stop_token_ids=(5,)), None,
         {"stop": ["a", "b"], "stop_token_ids": [5]}),
        (SamplingParams(top_k=4, ignore_eos=True), None, {"top_k": 4, "ignore_eos": True}),
        (SamplingParams(), OutputFormat("regex", "guided_regex", pattern="[0-9]+"),
         {"structured_outputs": {"regex": "[0-9]+"}}),
    ],
)  # fmt: skip
def test_sampling_params_under_vllms_names(params, fmt, extra):
    assert vllm_sampling_params(params, fmt) == {**BASE, **extra}


@pytest.mark.parametrize(
    "fmt, expected",
    [
        (OutputFormat("json_object", "response_format"), {"json_object": True}),
        (OutputFormat("json_schema", "response_format", schema={"type": "object"}),
         {"json": {"type": "object"}}),
        (OutputFormat("regex", "guided_regex", pattern="a|b"), {"regex": "a|b"}),
        (OutputFormat("choice", "guided_choice", choices=("x", "y")), {"choice": ["x", "y"]}),
    ],
)  # fmt: skip
def test_structured_outputs_as_vllm_names_them(fmt, expected):
    assert structured_outputs(fmt) == expected


READ_BACK = r"""
import json, sys
from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest
g = GenerateRequest.model_validate_json(sys.stdin.read())
print(json.dumps({"ids": g.token_ids, "sp": {k: getattr(g.sampling_params, k) for k in
    ("n", "temperature", "top_k", "max_tokens", "seed", "stop", "logprobs")},
    "salt": g.cache_salt, "same_keys": sorted(g.model_dump()) == sorted(json.loads(
    sys.argv[1]))}))
"""


@pytest.mark.slow  # vLLM's import takes a while
def test_vllms_generate_request_reads_the_answer():
    if not Path(VLLM_PYTHON).is_file():
        pytest.skip(f"no vLLM venv at {VLLM_PYTHON}: bash bench/setup_vllm.sh")
    params = SamplingParams(max_tokens=5, temperature=0.7, top_k=3, seed=1, stop=("x",), logprobs=1)
    answer = RenderedRequest(
        request_id="chatcmpl-1", token_ids=[1, 2, 3], sampling_params=vllm_sampling_params(params),
        model="m", cache_salt="salt",
    ).model_dump_json()  # fmt: skip
    out = subprocess.run(
        [VLLM_PYTHON, "-c", READ_BACK, answer], input=answer, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["ids"] == [1, 2, 3] and got["salt"] == "salt" and got["same_keys"]
    assert got["sp"] == {"n": 1, "temperature": 0.7, "top_k": 3, "max_tokens": 5, "seed": 1,
                         "stop": ["x"], "logprobs": 1}  # fmt: skip
