"""What constrained decoding costs a busy server (issue 38's target: at most 10% of the
unconstrained output tokens per second at 16 clients).

One ``kvfuse serve``; passes of the same chat requests (ShareGPT dev first messages, cut to
``--chars``) at ``--clients`` concurrent streaming clients, alternately free and constrained
(``response_format`` ``json_schema`` strict: an object whose ``answer`` string must be at least
``--min-chars`` long, so every constrained answer runs to ``--max-tokens`` like the free ones with
``ignore_eos``), the order swapped every round; each pass a fresh ``cache_salt`` (prefill work
equal in both modes). Constrained and free requests share the engine's batched steps: the token
masks are applied inside the step. Per mode: the median over rounds of output tokens/s and
requests/s; the cost is 1 - constrained / free. Every constrained answer is parsed and checked.

    python bench/structured_serve.py --smoke   # the plumbing: 4 clients, 8 requests, 1 round
    python bench/structured_serve.py           # 16 clients, 64 requests, 5 rounds (a quiet machine)

Results: docs/bench/structured_serve.json (structured_serve-quick with --smoke).
"""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.lib import results  # noqa: E402
from bench.lib.cli import parser  # noqa: E402
from bench.lib.client import Runner, Workload, warm_up  # noqa: E402
from bench.lib.paths import DATA, default_home  # noqa: E402
from bench.lib.rounds import feature_cost, order  # noqa: E402
from bench.serve import sharegpt_requests  # noqa: E402
from kvfuse_testkit import ServerProcess, ensure_model  # noqa: E402


def schema(min_chars: int) -> dict:
    """The constrained answer's ``response_format``: strict, one long string and a short list."""
    body = {
        "type": "object",
        "properties": {
            "answer": {"type": "string", "minLength": min_chars},
            "topics": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        },
        "required": ["answer", "topics"],
        "additionalProperties": False,
    }
    return {"type": "json_schema", "json_schema": {"name": "reply", "schema": body, "strict": True}}


def args_parser():
    p = parser(__doc__, "model", "home", ("rounds", {"default": 5}), "tag")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--chars", type=int, default=400, help="a ShareGPT message's characters")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--min-chars", type=int, default=2000, help="the answer string's minLength")
    p.add_argument("--smoke", action="store_true", help="4 clients, 8 requests, 1 round")
    return p


def one_pass(runner: Runner, args, wl: Workload, constrained: bool) -> dict:
    """``wl`` once at ``args.clients`` clients, cold (a fresh salt); its rates and checks."""
    extra = runner.extra(True, uuid.uuid4().hex)
    if constrained:
        extra["response_format"] = schema(args.min_chars)
    p = runner.run(wl, args.clients, extra)
    out_tokens = sum(s["completion_tokens"] or 0 for s in p.samples)
    return {
        "constrained": constrained,
        "req_s": len(p.samples) / p.wall_s,
        "out_tok_s": out_tokens / p.wall_s,
        "out_tokens": out_tokens,
        "errors": len(p.errors),
        "first_error": p.errors[0] if p.errors else None,
        "prefix_ok": sum(json_prefix(t) for t in p.outputs.values()) if constrained else None,
    }


def json_prefix(text: str) -> bool:
    """A constrained answer cut at max_tokens is a prefix of the schema's form: an object opening
    with ``"answer"`` (the string still open), or, when it finished, a valid object."""
    try:
        obj = json.loads(text)
        return isinstance(obj, dict) and isinstance(obj.get("answer"), str)
    except json.JSONDecodeError:
        return text.lstrip().startswith('{"answer"') or text.lstrip().startswith('{ "answer"')


def cost(passes: list[dict]) -> dict:
    """Medians per mode, their min / max and the relative cost of constraining
    (1 - constrained / free): ``rounds.feature_cost``."""
    return feature_cost(passes, "constrained", ("free", "constrained"))


def main() -> None:
    args = args_parser().parse_args()
    if args.smoke:
        args.clients, args.requests, args.rounds, args.max_tokens = 4, 8, 1, 16
    args.home = args.home or str(default_home())
    ensure_model(args.home, args.model)
    reqs = sharegpt_requests(DATA / "sharegpt_multiturn_dev.jsonl", args.requests, args.chars)
    wl = Workload("sharegpt-json", reqs, args.max_tokens, "sharegpt dev")
    passes = []
    with ServerProcess(args.home, config={"model": args.model}) as srv:
        runner = Runner(srv.base_url, args.model, "kvfuse", ignore_eos=True)
        warm_up(runner, args.clients)
        for r in range(args.rounds):
            for constrained in order([False, True], r, alternate=True):
                passes.append(one_pass(runner, args, wl, constrained))
                print(f"round {r} {'constrained' if constrained else 'free':11} {passes[-1]}")
    summary = cost(passes)
    print(f"free        {summary['free']}\nconstrained {summary['constrained']}")
    print(f"cost        {summary['cost']}  (target: out_tok_s cost <= 0.10)")
    name = results.output_name("structured_serve", args.tag, args.smoke)
    payload = {"settings": vars(args), "passes": passes, **summary}
    print("wrote", results.write_json(name, payload, default=str))


if __name__ == "__main__":
    main()
