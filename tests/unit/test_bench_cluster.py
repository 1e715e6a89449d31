"""The pure parts of bench/cluster.py: its workloads, a pass's summary (hit share, TTFT, rates),
the kill run's summary, issue 40's targets and the router's command line (with the failover
flags scripts/cluster.sh uses too)."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.lib.cluster import (  # noqa: E402
    ROUTER_FAILOVER,
    bounds,
    chat_system,
    chat_users,
    check_targets,
    differing,
    kill_summary,
    median_of,
    rag_users,
    round_ratios,
    router_command,
    summarize_pass,
)


def sample(user="u0", turn=0, ok=True, ttft=0.1, prompt=100, cached=0, out=4, t=0.0, text="a"):
    return {"user": user, "turn": turn, "key": f"{user}/{turn}", "ok": ok, "ttft_s": ttft,
            "prompt_tokens": prompt if ok else 0, "cached_tokens": cached if ok else 0,
            "completion_tokens": out if ok else 0, "t_sent": t, "text": text}  # fmt: skip


def test_a_pass_counts_hits_over_the_answered_requests_only():
    s = [sample(prompt=100, cached=0), sample(turn=1, prompt=300, cached=200),
         sample(turn=2, ok=False, ttft=None)]  # fmt: skip
    out = summarize_pass(s, wall_s=2.0)
    assert out["requests"] == 3 and out["failed"] == 1
    assert out["hit_share"] == 0.5  # 200 / 400
    assert out["req_s"] == 1.0 and out["out_tok_s"] == 4.0


def test_ttft_percentiles_are_nearest_rank_in_ms():
    s = [sample(turn=i, ttft=x) for i, x in enumerate([0.1, 0.2, 0.3, 0.4, 1.0])]
    out = summarize_pass(s, wall_s=1.0)
    assert out["ttft_p50_ms"] == 300.0 and out["ttft_p95_ms"] == 1000.0


def test_later_turns_p95_leaves_each_users_cold_first_turn_out():
    s = [sample("a", 0, ttft=5.0), sample("a", 1, ttft=0.2), sample("b", 0, ttft=4.0),
         sample("b", 1, ttft=0.3), sample("b", 2, ttft=0.1)]  # fmt: skip
    out = summarize_pass(s, wall_s=1.0)
    assert out["ttft_p95_ms"] == 5000.0 and out["ttft_p95_later_ms"] == 300.0
    assert summarize_pass(s[:1], wall_s=1.0)["ttft_p95_later_ms"] is None


def test_a_pass_with_nothing_answered_has_no_rates_but_counts_failures():
    out = summarize_pass([sample(ok=False, ttft=None)], wall_s=0.0)
    assert out["failed"] == 1 and out["hit_share"] is None and out["ttft_p50_ms"] is None
    assert out["req_s"] is None


def test_medians_over_rounds_skip_missing_figures():
    m = median_of([{"hit_share": 0.2, "ttft_p95_ms": None}, {"hit_share": 0.4, "ttft_p95_ms": 5},
                   {"hit_share": 0.3, "ttft_p95_ms": 7}])  # fmt: skip
    assert m == {"hit_share": 0.3, "ttft_p95_ms": 6.0}
    none = median_of([{"hit_share": None, "errors": ["x"]}, {"hit_share": None, "errors": []}])
    assert none == {"hit_share": None}  # a figure nobody measured is there, as None


def test_the_kill_run_checks_each_users_first_history_turn_after_the_kill():
    s = [
        sample("a", 0, t=0.0), sample("b", 0, t=0.0),
        sample("a", 1, t=5.0, cached=80), sample("b", 1, t=5.5, cached=0),
        sample("b", 2, t=6.0, cached=90),  # too late: b's first turn after the kill missed
        sample("c", 0, t=7.0),  # a first turn has no history to reuse: not counted
        sample("a", 2, ok=False, ttft=None, t=8.0),
        sample("d", 1, ok=False, ttft=None, t=4.5), sample("d", 2, t=6.0, cached=70),
        sample("e", 1, ok=False, ttft=None, t=4.5),  # nothing answered: not reused
    ]  # fmt: skip
    out = kill_summary(s, kill_at=4.0, reference={"a/1": "a", "b/1": "zzz"}, floor=1)
    assert out["failed"] == 3 and out["failed_after_kill"] == 3
    assert out["reused_by_user"] == {"a": True, "b": False, "d": True, "e": False}
    assert out["users_reusing_after_kill"] == 2 and out["users_after_kill"] == 4
    assert out["compared"] == 2 and out["wrong_answers"] == 1 and out["wrong_keys"] == ["b/1"]
    assert out["differing_before_kill"] == 0 and out["differing_without_kill"] == 1


def test_an_answer_finished_before_the_kill_is_not_counted_against_it():
    s = [
        {**sample("a", 0, t=0.0, text="x"), "t_done": 1.0},  # differs, answered before the kill
        {**sample("a", 1, t=1.0, text="y"), "t_done": 5.0},  # its prompt differed: not comparable
        {**sample("b", 0, t=3.0, text="p"), "t_done": 4.5},  # in flight at the kill, differs
        {**sample("c", 0, t=3.0, text="q"), "t_done": 4.5},  # in flight, same answer
    ]
    ref = {"a/0": "x0", "a/1": "y", "b/0": "p0", "c/0": "q"}
    out = kill_summary(s, kill_at=4.0, reference=ref)
    assert out["wrong_keys"] == ["b/0"] and out["differing_before_kill"] == 1
    assert out["not_comparable"] == 1 and out["compared"] == 3


@pytest.mark.parametrize(
    "texts,ref,diff,skipped",
    [
        ({"u/0": "a", "u/1": "b"}, {"u/0": "a", "u/1": "b"}, [], []),
        ({"u/0": "a", "u/1": "b"}, {"u/0": "z", "u/1": "b"}, ["u/0"], ["u/1"]),
        ({"u/0": "a", "u/1": "b", "v/0": "c"}, {"u/0": "a", "u/1": "z", "v/0": "c"}, ["u/1"], []),
        ({"u/10": "a", "u/9": "b"}, {"u/9": "z", "u/10": "a"}, ["u/9"], ["u/10"]),  # turn order
        ({"u/0": "a", "w/0": "b"}, {"u/0": "a"}, [], []),  # not in the reference: not compared
    ],
)
def test_differing_skips_turns_after_a_users_first_difference(texts, ref, diff, skipped):
    assert differing(texts, ref) == (diff, skipped)


def figures(hit, p95):
    return {"hit_share": hit, "ttft_p95_ms": p95}


@pytest.mark.parametrize(
    "kv,ca,rr,want",
    [
        (figures(0.6, 100), figures(0.5, 90), figures(0.1, 250), [True, True]),
        (figures(0.4, 100), figures(0.5, 90), figures(0.1, 150), [False, False]),
        (figures(0.5, 100), figures(0.5, 90), figures(0.1, 200), [True, True]),  # ties pass
        (figures(None, None), figures(0.5, 90), figures(0.1, 200), [None, None]),
    ],
)
def test_routing_targets_from_the_chat_medians(kv, ca, rr, want):
    medians = {"chat": {"kv_aware": kv, "cache_aware": ca, "round_robin": rr}}
    assert [t["pass"] for t in check_targets(medians, None)] == want


def test_routing_targets_are_not_judged_without_their_policies():
    targets = check_targets({"chat": {"round_robin": figures(0.1, 100)}}, None)
    assert [t["pass"] for t in targets] == [None, None]


def test_a_kv_aware_variant_is_judged_beside_the_plain_policy():
    chat = {"kv_aware": figures(0.5, 100), "kv_aware+affinity": figures(0.7, 40),
            "cache_aware": figures(0.6, 100), "round_robin": figures(0.4, 100)}  # fmt: skip
    targets = check_targets({"chat": chat}, None)
    assert [(t["target"].split(":")[1].split()[0], t["pass"]) for t in targets] == [
        ("kv_aware", False),
        ("TTFT", False),
        ("kv_aware+affinity", True),
        ("TTFT", True),
    ]


@pytest.mark.parametrize(
    "failed,wrong,reusing,users,want",
    [(0, 0, 3, 3, [True, True, True]), (1, 0, 3, 3, [False, True, True]),
     (0, 2, 2, 3, [True, False, False]), (0, 0, 0, 0, [True, True, False])],
)  # fmt: skip
def test_kill_targets(failed, wrong, reusing, users, want):
    kill = {"failed": failed, "wrong_answers": wrong, "users_reusing_after_kill": reusing,
            "users_after_kill": users}  # fmt: skip
    assert [t["pass"] for t in check_targets({}, kill)][2:] == want


def test_chat_users_replay_user_turns_cut_to_length():
    users = chat_users(3, 2, 50)
    assert [u.uid for u in users] == ["chat-0", "chat-1", "chat-2"]
    assert all(len(u.turns) == 2 and u.history for u in users)
    assert all(0 < len(t) <= 50 for u in users for t in u.turns)
    with pytest.raises(ValueError, match="dev split only"):
        chat_users(1, 2, 50, split="test")


@pytest.mark.parametrize("chars", [40, 300, 5000])
def test_chat_users_share_one_system_message_of_the_length_asked(chars):
    system = chat_system(chars)
    assert len(system) == chars and system == chat_system(chars)  # deterministic
    assert system.startswith("You are the assistant")
    users = chat_users(3, 2, 50, system=system)
    assert {u.system for u in users} == {system}
    assert all(u.system == "" for u in chat_users(3, 2, 50))  # none by default


def test_rag_users_share_documents_but_never_a_whole_prompt():
    users = rag_users(4, 2, doc_sets=2, docs=2, chars=100)
    prompts = [t for u in users for t in u.turns]
    assert len(set(prompts)) == len(prompts)
    heads = {p.split("\n\nQuestion")[0] for p in prompts}
    assert len(heads) == 2  # two shared document sets, each a byte-equal prefix
    assert not any(u.history for u in users)


def test_router_command_runs_a_variant_as_its_policy_with_its_flags():
    cmd = router_command("r", 9, "kv_aware+affinity", ["http://a"], ["tcp://a:1"], 16, "m")
    assert cmd[cmd.index("--policy") + 1] == "kv_aware"
    assert cmd[cmd.index("--kv-aware-session-affinity-ttl-secs") + 1] == "300"
    assert "--kv-event-source" in cmd


@pytest.mark.parametrize(
    "policy, tail",
    [
        ("consistent_hash", []),
        ("kv_aware", ["--kv-event-block-size", "16", "--kv-event-model", "m",
                      "--kv-event-source", "http://a=tcp://a:1",
                      "--kv-event-source", "http://b=tcp://b:2"]),
    ],
)  # fmt: skip
def test_router_command_has_the_failover_flags(policy, tail):
    cmd = router_command("r", 9, policy, ["http://a", "http://b"], ["tcp://a:1", "tcp://b:2"],
                         16, "m")  # fmt: skip
    head = ["r", "--host", "127.0.0.1", "--port", "9", "--policy", policy, "--worker-urls",
            "http://a", "http://b"]  # fmt: skip
    assert cmd == head + list(ROUTER_FAILOVER) + tail
    flags = dict(zip(ROUTER_FAILOVER[::2], ROUTER_FAILOVER[1::2], strict=True))
    assert flags["--cb-failure-threshold"] == "1"  # the retry must leave the dead worker


def test_cluster_sh_starts_the_router_with_the_same_failover_flags():
    text = (REPO / "scripts" / "cluster.sh").read_text()
    array = re.search(r"^FAILOVER=\((.*?)\)$", text, re.S | re.M)
    assert array is not None
    assert tuple(shlex.split(array.group(1))) == ROUTER_FAILOVER


def test_round_ratios_pair_each_policys_pass_with_round_robins_of_the_same_round():
    passes = {
        "round_robin": [{"p95": 1000.0}, {"p95": 900.0}, {"p95": 1200.0}],
        "kv_aware": [{"p95": 500.0}, {"p95": 600.0}, {"p95": None}],
        "cache_aware": [{"p95": 400.0}],
    }
    assert round_ratios(passes, "p95") == {"kv_aware": [2.0, 1.5, None], "cache_aware": [2.5]}
    assert round_ratios({"kv_aware": [{"p95": 1.0}]}, "p95") == {}  # no baseline, no ratio


@pytest.mark.parametrize(
    "values, want",
    [([3.0, 1.0, 2.0], (1.0, 3.0)), ([5.0], (5.0, 5.0)), ([None, 2.0], (2.0, 2.0)), ([None], None)],
)
def test_bounds_are_the_smallest_and_largest_of_the_rounds(values, want):
    assert bounds([{"k": v} for v in values], "k") == want
