"""Agent benchmark (issue 38): LangGraph's prebuilt ReAct agent, unchanged, with a long system
prompt (>= 2,000 tokens of instructions, then ten tool schemas) and a retrieval tool over MuSiQue
passages, several users x several turns, against kvfuse (cache on, cache off), kvfuse's Anthropic
Messages API (``--anthropic``: ``langchain_anthropic.ChatAnthropic`` with ``cache_control`` on the
system prompt) and vLLM CPU with its tool parser (``--enable-auto-tool-choice --tool-call-parser
hermes``), the same weights, one run.

The agent: ``langchain.agents.create_agent`` where ``langchain`` is installed and ``--tool-choice
auto``, else ``langgraph.prebuilt.create_react_agent``, its model chosen per call:
``--tool-choice forced`` (default) sends ``tool_choice: required`` until the turn has a tool
result, then ``none`` (a 0.5B model left free calls tools again and again); ``auto`` leaves it to
the model (``--recursion-limit`` ends a loop). Inputs (``bench/lib/agent_setup.py``): the system
prompt, the ten tools (all real Python functions: ``search_documents`` ranks the split's passages
by shared words), user ``u``'s questions (consecutive MuSiQue questions of the split, ``--split``
dev by default: examples 0-49; test: 50-149). Users take turns round-robin (turn 1 of every user,
then turn 2, ...), each user's history growing with the agent's messages; one client, greedy.

Measured per model call through a LangChain callback (the calls are streamed): TTFT (the model
call starts -> its first streamed content or tool-call chunk), duration, prompt / cached /
completion tokens (``usage_metadata``: OpenAI's ``prompt_tokens_details.cached_tokens``,
Anthropic's ``cache_read_input_tokens``); per turn: tool calls valid (a known tool, arguments
valid against its JSON schema) and answered (every call has a tool result, the turn ends in a text
answer). A tool call's first chunk carries its name (kvfuse and vLLM both stream the arguments
in pieces after it); TTFT p50 of turns >= 2 is also given for the tool-calling and the answering
calls apart. Every run starts cold: the system prompt's first line names the run, so no run reuses
another's cache. Candidates run interleaved, rotated, ``--rounds`` times within one server (vLLM
after kvfuse, never both at once); medians with min and max over rounds.

Targets (checked and printed, pass/fail): from turn 2 on, kvfuse cache on serves >= 90% of prompt
tokens from cache, and its TTFT p50 (turns >= 2) is >= 5x lower than kvfuse with the cache off.

    python bench/agents.py                                   # qwen2.5-0.5b, 4 users x 4 turns
    python bench/agents.py --model qwen2.5-1.5b --anthropic --servers kvfuse,vllm --split test
    python bench/agents.py --smoke                           # 1 user, 2 turns, kvfuse only

Writes ``docs/bench/agents.json`` and ``agents.png`` (``--tag T``: ``agents-T``; ``--smoke``:
``agents-smoke``).
"""

from __future__ import annotations

import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.lib import agent_setup as setup
from bench.lib import servers as srvs
from bench.lib.cli import add_common
from bench.lib.client import percentile
from bench.lib.data import musique
from bench.lib.results import output_name, print_table, pyplot, save_figure, write_json
from bench.lib.rounds import interleaved, spread

LABELS = {
    "kvfuse-on": "kvfuse cache on",
    "kvfuse-off": "kvfuse cache off",
    "kvfuse-anthropic": "kvfuse /v1/messages (cache_control)",
    "vllm": "vLLM CPU (prefix caching on, hermes parser)",
}
CACHE_SHARE_GOAL = 0.90
TTFT_SPEEDUP_GOAL = 5.0

# ------------------------------------------------------------------------------ measurement


def recorder_class():
    """A LangChain callback handler recording every model call (imported late: langchain_core)."""
    from langchain_core.callbacks import BaseCallbackHandler

    class Recorder(BaseCallbackHandler):
        """Times each chat-model call: start, first streamed content or tool-call chunk, end;
        keeps its usage. ``turn`` and ``user`` label the calls that follow."""

        def __init__(self) -> None:
            self.calls: list[dict] = []
            self.open: dict = {}
            self.turn, self.user = 0, 0

        def on_chat_model_start(self, serialized, messages, *, run_id, **kw) -> None:
            self.open[run_id] = {"turn": self.turn, "user": self.user, "t0": time.perf_counter()}

        def on_llm_new_token(self, token, *, chunk=None, run_id, **kw) -> None:
            c = self.open.get(run_id)
            msg = getattr(chunk, "message", None)
            has_call = bool(getattr(msg, "tool_call_chunks", None))
            if c is not None and "first" not in c and (token or has_call):
                c["first"] = time.perf_counter()

        def on_llm_end(self, response, *, run_id, **kw) -> None:
            c = self.open.pop(run_id, None)
            if c is not None:
                msg = response.generations[0][0].message
                kind = "tool" if getattr(msg, "tool_calls", None) else "text"
                self.calls.append(call_record(c, time.perf_counter(), msg.usage_metadata, kind))

    return Recorder


def call_record(c: dict, end: float, usage: dict | None, kind: str = "text") -> dict:
    """One model call's sample: turn, user, kind (``tool``: it called tools; ``text``), TTFT and
    duration (s), token counts."""
    usage = usage or {}
    details = usage.get("input_token_details") or {}
    first = c.get("first")
    return {
        "turn": c["turn"],
        "user": c["user"],
        "kind": kind,
        "ttft_s": None if first is None else first - c["t0"],
        "duration_s": end - c["t0"],
        "prompt_tokens": usage.get("input_tokens"),
        "cached_tokens": details.get("cache_read") or 0,
        "completion_tokens": usage.get("output_tokens") or 0,
    }


def valid_call(name: str, args, schemas: dict) -> bool:
    """A known tool, its arguments valid against its JSON schema."""
    import jsonschema

    if name not in schemas or not isinstance(args, dict):
        return False
    try:
        jsonschema.validate(args, schemas[name])
    except jsonschema.ValidationError:
        return False
    return True


def check_turn(new_messages: list, schemas: dict) -> dict:
    """One turn's messages (after the user's): its tool calls, how many were valid, whether every
    call has a tool result without error and the turn ends in a text answer."""
    calls, invalid, results = [], 0, {}
    for m in new_messages:
        if m.type == "ai":
            calls += [(t["name"], t["args"], t.get("id")) for t in m.tool_calls]
            invalid += len(getattr(m, "invalid_tool_calls", []) or [])
        elif m.type == "tool":
            results[m.tool_call_id] = getattr(m, "status", "success") != "error"
    valid = sum(valid_call(n, a, schemas) for n, a, _ in calls)
    last = new_messages[-1] if new_messages else None
    text = last is not None and last.type == "ai" and not last.tool_calls and bool(last.content)
    answered = bool(calls) and all(results.get(i, False) for _, _, i in calls) and text
    return {
        "tool_calls": len(calls) + invalid,
        "valid_calls": valid,
        "answered": bool(answered),
        "tools": [n for n, _, _ in calls],
    }


# ------------------------------------------------------------------------------ the agent


def chat_model(kind: str, base_url: str, model: str, max_tokens: int, extra: dict):
    """The streamed, greedy chat model of a candidate: ChatOpenAI or ChatAnthropic."""
    if kind == "anthropic":
        from langchain_anthropic import ChatAnthropic

        return ChatAnthropic(
            model=model,
            base_url=base_url,
            api_key="unused",
            temperature=0,
            max_tokens=max_tokens,
            streaming=True,
            max_retries=0,
            default_request_timeout=1800,
        )
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model=model,
        base_url=base_url,
        api_key="unused",
        temperature=0,
        max_tokens=max_tokens,
        streaming=True,
        stream_usage=True,
        max_retries=0,
        timeout=1800,
        extra_body=extra or None,
    )


def system_message(kind: str, header: str):
    """The system prompt; for the Anthropic API a text block with ``cache_control``."""
    from langchain_core.messages import SystemMessage

    text = setup.system_prompt(header)
    if kind == "anthropic":
        block = {"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}
        return SystemMessage(content=[block])
    return SystemMessage(content=text)


def make_agent(llm, tools: list, system, kind: str, policy: str):
    """The prebuilt agent. ``forced``: a model per call, ``required`` until the turn has a tool
    result, then ``none``; ``auto``: the model as it is (``create_agent`` if installed)."""
    if policy == "auto":
        try:
            from langchain.agents import create_agent
        except ImportError:
            create_agent = None
        if create_agent is not None:
            return create_agent(llm, tools, system_prompt=system)
    from langgraph.prebuilt import create_react_agent

    # LangGraph 1.x warns that it moved to langchain.agents, which is not installed here
    warnings.filterwarnings("ignore", message=".*create_react_agent has been moved")

    if policy == "auto":
        return create_react_agent(llm.bind_tools(tools), tools, prompt=system)
    force = "any" if kind == "anthropic" else "required"
    none = {"type": "none"} if kind == "anthropic" else "none"

    def model(state, runtime):
        msgs = state["messages"]
        since = len(msgs) - next(i for i, m in enumerate(reversed(msgs)) if m.type == "human")
        called = any(m.type == "tool" for m in msgs[since:])
        return llm.bind_tools(tools, tool_choice=none if called else force)

    return create_react_agent(model, tools, prompt=system)


def run_conversations(agent, questions: list[list[str]], recorder, limit: int) -> dict:
    """Every user's turns, round-robin; each user's history grows with the agent's messages."""
    from langchain_core.messages import HumanMessage

    histories: list[list] = [[] for _ in questions]
    turns, errors, t0 = [], [], time.perf_counter()
    for t in range(max(len(q) for q in questions)):
        for u, qs in enumerate(questions):
            if t >= len(qs):
                continue
            recorder.turn, recorder.user = t + 1, u
            msgs = [*histories[u], HumanMessage(qs[t])]
            try:
                state = agent.invoke(
                    {"messages": msgs}, {"callbacks": [recorder], "recursion_limit": limit}
                )
            except Exception as e:  # noqa: BLE001 - a failed turn is a result
                errors.append(f"user {u} turn {t + 1}: {type(e).__name__}: {e}"[:500])
                histories[u] = msgs
                continue
            new = state["messages"][len(msgs) :]
            turns.append({"turn": t + 1, "user": u, **check_turn(new, setup.SCHEMAS)})
            histories[u] = state["messages"]
    return {"calls": recorder.calls, "turns": turns, "errors": errors, "wall_s": _t(t0)}


def _t(t0: float) -> float:
    return round(time.perf_counter() - t0, 3)


# ------------------------------------------------------------------------------ statistics


def ttft_by_turn(calls: list[dict]) -> dict[int, dict]:
    """TTFT p50 and p95 (ms) of each turn's model calls, pooled over users."""
    out = {}
    for turn in sorted({c["turn"] for c in calls}):
        xs = [c["ttft_s"] * 1e3 for c in calls if c["turn"] == turn and c["ttft_s"] is not None]
        if xs:
            out[turn] = {"p50": percentile(xs, 0.5), "p95": percentile(xs, 0.95), "n": len(xs)}
    return out


def cache_share(calls: list[dict], from_turn: int = 2) -> float | None:
    """Prompt tokens served from cache / prompt tokens, over the calls of turns >= ``from_turn``."""
    cs = [c for c in calls if c["turn"] >= from_turn and c["prompt_tokens"]]
    total = sum(c["prompt_tokens"] for c in cs)
    return sum(c["cached_tokens"] for c in cs) / total if total else None


def later_ttft_p50(calls: list[dict], kind: str | None = None) -> float | None:
    """TTFT p50 (ms) of the calls of turns >= 2 (of one ``kind`` only if given)."""
    xs = [
        c["ttft_s"] * 1e3
        for c in calls
        if c["turn"] >= 2 and c["ttft_s"] is not None and kind in (None, c.get("kind"))
    ]
    return percentile(xs, 0.5)


def run_summary(run: dict) -> dict:
    """One run's numbers: TTFT p50/p95 per turn and p50 over turns >= 2 (all calls, tool-calling
    calls, answering calls), cache shares, output tokens/s (completion tokens / time in model
    calls), tool calls valid and turns answered."""
    calls, turns = run["calls"], run["turns"]
    busy = sum(c["duration_s"] for c in calls)
    out: dict = {
        "ttft_p50_ms_from_turn2": later_ttft_p50(calls),
        "ttft_p50_ms_tool_calls_from_turn2": later_ttft_p50(calls, "tool"),
        "ttft_p50_ms_answers_from_turn2": later_ttft_p50(calls, "text"),
        "cache_share_from_turn2": cache_share(calls, 2),
        "cache_share_all": cache_share(calls, 1),
        "tokens_per_s": sum(c["completion_tokens"] for c in calls) / busy if busy else None,
        "calls": len(calls),
        "tool_calls": sum(t["tool_calls"] for t in turns),
        "valid_calls": sum(t["valid_calls"] for t in turns),
        "turns": len(turns) + len(run["errors"]),
        "answered_turns": sum(t["answered"] for t in turns),
        "errors": len(run["errors"]),
    }
    for turn, s in ttft_by_turn(calls).items():
        out[f"ttft_p50_ms_turn{turn}"], out[f"ttft_p95_ms_turn{turn}"] = s["p50"], s["p95"]
    return out


def aggregate(summaries: list[dict]) -> dict[str, dict]:
    """Median, min and max over rounds of every numeric metric (rounds lacking it skipped)."""
    keys = sorted({k for s in summaries for k in s})
    out = {}
    for k in keys:
        xs = [s[k] for s in summaries if s.get(k) is not None]
        if xs:
            out[k] = spread(xs)
    return out


def _med(agg: dict, cand: str, key: str) -> float | None:
    return agg.get(cand, {}).get(key, {}).get("median")


def targets(agg: dict[str, dict]) -> list[dict]:
    """The issue's targets on the medians, each with its value, goal and verdict (None: not
    measured in this run)."""
    out = []
    for cand in ("kvfuse-on", "kvfuse-anthropic"):
        if cand not in agg:
            continue
        share = _med(agg, cand, "cache_share_from_turn2")
        out.append(
            {
                "target": f"{LABELS[cand]}: share of prompt tokens from cache, turns >= 2",
                "value": share,
                "goal": f">= {CACHE_SHARE_GOAL}",
                "met": None if share is None else share >= CACHE_SHARE_GOAL,
            }
        )
    on = _med(agg, "kvfuse-on", "ttft_p50_ms_from_turn2")
    off = _med(agg, "kvfuse-off", "ttft_p50_ms_from_turn2")
    x = off / on if on and off else None
    out.append(
        {
            "target": "kvfuse TTFT p50 (turns >= 2): cache off / cache on",
            "value": x,
            "goal": f">= {TTFT_SPEEDUP_GOAL}",
            "met": None if x is None else x >= TTFT_SPEEDUP_GOAL,
        }
    )
    return out


# ------------------------------------------------------------------------------ output


def cell(agg: dict, cand: str, key: str, scale: float = 1.0, nd: int = 0) -> str:
    """``median [min-max]`` of a metric, or ``-``."""
    s = agg.get(cand, {}).get(key)
    if s is None:
        return "-"
    v = [s[k] * scale for k in ("median", "min", "max")]
    return f"{v[0]:.{nd}f} [{v[1]:.{nd}f}-{v[2]:.{nd}f}]"


def table_rows(agg: dict[str, dict], turns: int) -> tuple[list[str], list[list]]:
    """Per candidate: TTFT p50 and p95 per turn (ms), cache share from turn 2 (%), tokens/s,
    tool calls valid/total, turns answered/total (medians [min-max] over rounds)."""
    head = ["candidate"]
    head += [f"TTFT p50 t{t}" for t in range(1, turns + 1)]
    head += [f"p95 t{t}" for t in range(1, turns + 1)]
    head += [
        "TTFT p50 t>=2: tool calls",
        "answers",
        "cached% t>=2",
        "tok/s",
        "valid calls",
        "answered",
    ]
    rows = []
    for cand, a in agg.items():
        row = [LABELS[cand]]
        row += [cell(agg, cand, f"ttft_p50_ms_turn{t}") for t in range(1, turns + 1)]
        row += [cell(agg, cand, f"ttft_p95_ms_turn{t}") for t in range(1, turns + 1)]
        row.append(cell(agg, cand, "ttft_p50_ms_tool_calls_from_turn2"))
        row.append(cell(agg, cand, "ttft_p50_ms_answers_from_turn2"))
        row.append(cell(agg, cand, "cache_share_from_turn2", 100.0))
        row.append(cell(agg, cand, "tokens_per_s", 1.0, 1))
        med = {k: _med(agg, cand, k) for k in ("valid_calls", "tool_calls")}
        row.append(f"{med['valid_calls'] or 0:.0f}/{med['tool_calls'] or 0:.0f}")
        row.append(
            f"{_med(agg, cand, 'answered_turns') or 0:.0f}/{_med(agg, cand, 'turns') or 0:.0f}"
        )
        rows.append(row)
    return head, rows


def print_targets(checks: list[dict]) -> None:
    print("\ntargets")
    for c in checks:
        verdict = {True: "PASS", False: "FAIL", None: "n/a "}[c["met"]]
        value = "-" if c["value"] is None else f"{c['value']:.3f}"
        print(f"  [{verdict}] {c['target']}: {value} (goal {c['goal']})")


def plot(agg: dict[str, dict], turns: int, path, title: str) -> None:
    """TTFT p50 per turn (min-max bars) per candidate; cache share from turn 2 per candidate."""
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    xs = list(range(1, turns + 1))
    for cand in agg:
        pts = [agg[cand].get(f"ttft_p50_ms_turn{t}") for t in xs]
        t_ok = [t for t, p in zip(xs, pts) if p]
        if not t_ok:
            continue
        med = [agg[cand][f"ttft_p50_ms_turn{t}"]["median"] for t in t_ok]
        lo = [m - agg[cand][f"ttft_p50_ms_turn{t}"]["min"] for m, t in zip(med, t_ok)]
        hi = [agg[cand][f"ttft_p50_ms_turn{t}"]["max"] - m for m, t in zip(med, t_ok)]
        ax1.errorbar(t_ok, med, yerr=[lo, hi], marker="o", capsize=3, label=LABELS[cand])
    ax1.set(xlabel="turn", ylabel="TTFT p50 (ms)", yscale="log", title="TTFT p50 by turn")
    ax1.set_xticks(xs)
    ax1.legend(fontsize=7)
    names = [c for c in agg if _med(agg, c, "cache_share_from_turn2") is not None]
    ax2.bar(range(len(names)), [100 * _med(agg, c, "cache_share_from_turn2") for c in names])
    ax2.set_xticks(range(len(names)), [LABELS[c] for c in names], rotation=15, fontsize=7)
    ax2.axhline(100 * CACHE_SHARE_GOAL, color="red", linestyle="--", linewidth=1)
    ax2.set(ylabel="% of prompt tokens from cache", ylim=(0, 100), title="cache share, turns >= 2")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)


# ------------------------------------------------------------------------------ the run


class Bench:
    """One invocation: the inputs, the candidates' runs by round, the JSON written after each
    server."""

    def __init__(self, args) -> None:
        self.args = args
        examples = musique(args.split)
        self.questions = setup.user_questions(examples, args.users, args.turns)
        self.passages = setup.passages_of(examples)
        self.runs: dict[str, list[dict]] = {}
        self.failures: list[str] = []
        self.name = "agents-smoke" if args.smoke else output_name("agents", args.tag)
        self.meta = {
            "model": args.model,
            "split": args.split,
            "split_examples": "0-49" if args.split == "dev" else "50-149",
            "users": args.users,
            "turns": args.turns,
            "rounds": args.rounds,
            "max_tokens": args.max_tokens,
            "tool_choice": args.tool_choice,
            "tools": [name for name, *_ in setup.TOOL_SPECS],
            "system_prompt_words": len(setup.system_prompt().split()),
        }

    def candidate(self, cand: str, kind: str, base_url: str, extra: dict):
        """A function of the round index running the agent once (cold: its own system header)."""
        a = self.args

        def run(r: int) -> dict:
            header = f"Session {cand} round {r} {time.time_ns()}"
            llm = chat_model(kind, base_url, a.model, a.max_tokens, extra)
            tools = setup.make_tools(self.passages)
            agent = make_agent(llm, tools, system_message(kind, header), kind, a.tool_choice)
            out = run_conversations(agent, self.questions, recorder_class()(), a.recursion_limit)
            s = run_summary(out)
            print(
                f"  round {r} {LABELS[cand]:<44} {out['wall_s']:.1f} s, {s['calls']} calls, "
                f"cached {_pct(s['cache_share_from_turn2'])} (t>=2), errors {s['errors']}",
                file=sys.stderr,
            )
            for e in out["errors"][:2]:
                print(f"    {e}", file=sys.stderr)
            return out

        return run

    def run_rounds(self, cands: dict) -> None:
        self.runs.update(interleaved(cands, self.args.rounds, rotate=True))

    def run_kvfuse(self) -> None:
        a = self.args
        with tempfile.TemporaryDirectory(prefix="kvfuse-bench-agents-") as tmp:
            config = {
                "model": a.model,
                "cache": {"disk_path": str(Path(tmp) / "kv")},
                "responses": {"path": str(Path(tmp) / "responses.sqlite3")},
            }
            log = srvs.log_path(a, "agents", "kvfuse")
            t0 = time.perf_counter()
            with srvs.kvfuse_process(a, config, log, self.meta) as srv:
                self.meta["kvfuse_startup_s"] = _t(t0)
                print(f"kvfuse serve up (pid {srv.pid}, log {log})", file=sys.stderr)
                cands = {
                    "kvfuse-on": self.candidate("kvfuse-on", "openai", srv.base_url, {}),
                    "kvfuse-off": self.candidate(
                        "kvfuse-off", "openai", srv.base_url, {"cache": False}
                    ),
                }
                if a.anthropic:
                    anth = self.candidate("kvfuse-anthropic", "anthropic", srv.url, {})
                    cands["kvfuse-anthropic"] = anth
                self.run_rounds(cands)

    def run_vllm(self) -> None:
        a = self.args
        log = srvs.log_path(a, "agents", "vllm")
        flags = ["--enable-prompt-tokens-details", "--enable-auto-tool-choice"]
        flags += ["--tool-call-parser", "hermes", "--max-model-len", str(a.vllm_max_model_len)]
        srv, env = srvs.vllm_process(a, flags, log)
        self.meta["vllm_command"], self.meta["vllm_env"] = " ".join(srv.cmd), env
        print(f"starting vLLM (~4 min; log {log})", file=sys.stderr)
        with srv:
            self.meta["vllm_startup_s"] = round(srv.startup_s, 1)
            self.meta["vllm_prefix_caching"] = srv.prefix_caching_logged()
            self.run_rounds({"vllm": self.candidate("vllm", "openai", srv.base_url, {})})

    def run_all(self, servers: list[str]) -> None:
        for server in servers:
            try:
                {"kvfuse": self.run_kvfuse, "vllm": self.run_vllm}[server]()
            except Exception as e:  # noqa: BLE001 - keep what the other server measured
                self.failures.append(f"{server}: {type(e).__name__}: {e}"[:2000])
                print(f"{server} failed: {e}", file=sys.stderr)
            self.save()

    def results(self) -> tuple[dict, list[dict]]:
        summaries = {c: [run_summary(r) for r in runs] for c, runs in self.runs.items()}
        agg = {c: aggregate(s) for c, s in summaries.items()}
        return agg, targets(agg)

    def save(self) -> None:
        agg, checks = self.results()
        payload = {
            "meta": {**self.meta, "failures": self.failures, "labels": LABELS},
            "summary": agg,
            "targets": checks,
            "runs": self.runs,
        }
        write_json(self.name, payload)

    def finish(self) -> int:
        agg, checks = self.results()
        head, rows = table_rows(agg, self.args.turns)
        print(
            f"\n{self.args.model}, MuSiQue {self.args.split} split, {self.args.users} users x "
            f"{self.args.turns} turns, {self.args.rounds} rounds (median [min-max])"
        )
        print_table(head, rows)
        print_targets(checks)
        title = f"{self.args.model}: LangGraph ReAct agent, {self.args.users} users x {self.args.turns} turns"
        plot(agg, self.args.turns, self.name, title)
        errors = sum(len(r["errors"]) for runs in self.runs.values() for r in runs)
        return 1 if self.failures or errors else 0


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def build_parser():
    import argparse

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    srvs.add_server_flags(p, "agents", default="kvfuse,vllm")
    p.set_defaults(model="qwen2.5-0.5b")
    add_common(p, ("rounds", {"default": 3}), "split", "tag")
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=96, help="per model call (default 96)")
    p.add_argument("--tool-choice", choices=("forced", "auto"), default="forced")
    p.add_argument("--recursion-limit", type=int, default=8, help="LangGraph steps per turn")
    p.add_argument("--anthropic", action="store_true", help="also ChatAnthropic on /v1/messages")
    p.add_argument("--vllm-max-model-len", type=int, default=8192)
    p.add_argument("--smoke", action="store_true", help="1 user, 2 turns, 1 round, kvfuse only")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    servers = srvs.servers(p, args)
    if set(servers) - {"kvfuse", "vllm"}:
        p.error("agents.py runs kvfuse and vllm only (llama-server has no tool parser set up here)")
    if args.smoke:
        args.users, args.turns, args.rounds, args.max_tokens = 1, 2, 1, min(args.max_tokens, 48)
        servers = ["kvfuse"]
    bench = Bench(args)
    print(f"agents: {args.model}, MuSiQue {args.split} split, servers {servers}", file=sys.stderr)
    bench.run_all(servers)
    return bench.finish()


if __name__ == "__main__":
    sys.exit(main())
