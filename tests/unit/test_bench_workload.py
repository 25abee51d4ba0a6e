"""The AsyncGRPO-shaped workload plan, the oracle, the report and profile helpers."""

from __future__ import annotations

import dataclasses
import math

import pytest

from bench.analysis.report import percentile, table
from bench.harness.oracle import oracle_hits, throughput_ceiling
from bench.harness.simulator import SimConfig, completion_length
from bench.harness.workload import (
    WORKLOADS,
    RequestRecord,
    WorkloadConfig,
    build_plan,
    completion_body,
    final_context_tokens,
    plan_summary,
    working_set_blocks,
)
from bench.runners.profile_proxy import buckets, parse_raw


def test_plan_is_deterministic_in_the_seed() -> None:
    cfg = WorkloadConfig(groups=12)
    assert build_plan(cfg) == build_plan(cfg)
    assert build_plan(cfg) != build_plan(WorkloadConfig(groups=12, seed=1))


def test_groups_share_their_prompt_and_everyone_shares_the_template() -> None:
    cfg = WorkloadConfig(groups=10, group_size=8, template_tokens=40)
    plan = build_plan(cfg)
    assert len(plan) == 80
    template = plan[0].prompt[:40]
    for g in range(10):
        members = [s for s in plan if s.group == g]
        assert len(members) == 8
        assert len({s.prompt for s in members}) == 1
        assert members[0].prompt[:40] == template
    assert len({s.prompt for s in plan}) == 10


def test_rollouts_are_issued_group_by_group() -> None:
    plan = build_plan(WorkloadConfig(groups=4, group_size=8))
    assert [s.index for s in plan] == list(range(32))
    assert [s.group for s in plan] == [i // 8 for i in range(32)]
    assert [s.member for s in plan] == [i % 8 for i in range(32)]


def test_versions_advance_every_k_rollouts() -> None:
    plan = build_plan(WorkloadConfig(groups=8, group_size=8, rollouts_per_version=16))
    assert [s.version for s in plan] == [i // 16 for i in range(64)]


def test_multi_turn_share_and_shape() -> None:
    cfg = WorkloadConfig(groups=400, multi_turn_fraction=0.25, max_extra_turns=2)
    plan = build_plan(cfg)
    multi_groups = {s.group for s in plan if len(s.turns) > 1}
    assert 0.18 < len(multi_groups) / 400 < 0.32
    for s in plan:
        assert 1 <= len(s.turns) <= 3
        assert s.turns[-1].tool_tokens == ()  # the final answer has no tool call after it
        assert s.turns[-1].max_tokens == cfg.max_tokens
        for t in s.turns[:-1]:
            assert t.tool_tokens and t.max_tokens == cfg.turn_max_tokens
    # A group is a tool task or not; its members' trajectories may differ in length.
    for g in multi_groups:
        assert all(len(s.turns) > 1 for s in plan if s.group == g)


def test_single_turn_only_when_fraction_is_zero() -> None:
    plan = build_plan(WorkloadConfig(groups=20, multi_turn_fraction=0.0))
    assert all(len(s.turns) == 1 for s in plan)


def test_prompt_lengths_look_like_math_problems() -> None:
    cfg = WorkloadConfig(groups=500)
    lengths = sorted(len(s.prompt) for s in build_plan(cfg)[:: cfg.group_size])
    median = lengths[len(lengths) // 2]
    assert 130 <= median <= 170  # template 40 + problem median 110
    assert lengths[0] >= 40 + cfg.problem_min_tokens
    assert lengths[-1] <= 40 + cfg.problem_max_tokens


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"groups": 0}, "groups"),
        ({"multi_turn_fraction": 1.5}, "multi_turn_fraction"),
        ({"problem_min_tokens": 50, "problem_max_tokens": 10}, "problem_min_tokens"),
        ({"problem_max_tokens": 4090}, "room to generate"),
        ({"max_inflight": 0}, "max_inflight"),
    ],
)
def test_bad_workload_config_is_refused(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        WorkloadConfig(**kwargs)  # type: ignore[arg-type]


def test_request_body_is_trls() -> None:
    body = completion_body("trl-policy-v3", [5, 6, 7], 100, 42, "ids")
    assert body["prompt"] == [5, 6, 7]
    assert body["return_token_ids"] is True and body["logprobs"] == 0 and body["n"] == 1
    assert completion_body("m", [5, 6, 7], 1, 1, "text")["prompt"] == "5 6 7"


def test_summary_counts() -> None:
    plan = build_plan(WorkloadConfig(groups=6, rollouts_per_version=16))
    summary = plan_summary(plan)
    assert summary["rollouts"] == 48 and summary["groups"] == 6 and summary["versions"] == 3
    assert summary["planned_requests"] >= 48


# -- named workloads ---------------------------------------------------------------------------


def test_agentic_shape_is_the_issues() -> None:
    w = WORKLOADS["agentic"]
    plan = build_plan(w.workload)
    firsts = [len(s.prompt) for s in plan]
    assert min(firsts) >= 1000 and max(firsts) <= 4000
    assert all(4 <= len(s.turns) <= 10 for s in plan)
    tools = [len(t.tool_tokens) for s in plan for t in s.turns[:-1]]
    assert min(tools) >= 100 and max(tools) <= 1000
    assert not any(s.turns[-1].tool_tokens for s in plan)
    assert all(t.max_tokens == 500 for s in plan for t in s.turns)
    # Turns of 100-500 generated tokens (the simulator's draw, capped by max_tokens).
    lengths = [completion_length(w.sim, t.seed, t.max_tokens) for s in plan for t in s.turns]
    assert max(lengths) == 500
    assert sum(100 <= n <= 500 for n in lengths) / len(lengths) >= 0.9
    # Contexts grow to several thousand tokens.
    finals = sorted(final_context_tokens(s, w.workload, w.sim) for s in plan)
    assert finals[len(finals) // 2] > 4000
    assert max(finals) <= w.workload.max_model_len


def test_final_context_replays_the_drivers_loop() -> None:
    w = WORKLOADS["agentic"]
    spec = build_plan(w.workload)[0]
    prompt = len(spec.prompt)
    for turn in spec.turns:
        expected = prompt + completion_length(w.sim, turn.seed, turn.max_tokens)
        prompt = expected + len(turn.tool_tokens)
    assert final_context_tokens(spec, w.workload, w.sim) == expected
    # A rollout that fills the context stops where the driver stops it.
    short = dataclasses.replace(
        w.workload,
        max_model_len=len(spec.prompt) + 10,
        problem_max_tokens=len(spec.prompt) - w.workload.template_tokens,
    )
    assert final_context_tokens(spec, short, w.sim) == len(spec.prompt) + 10


def test_tight_holds_a_quarter_of_the_working_set_when_it_can() -> None:
    tight, agentic = WORKLOADS["tight"], WORKLOADS["agentic"]
    assert tight.workload == agentic.workload
    ws = working_set_blocks(tight.workload, tight.sim)
    floor = tight.sim.max_model_len // tight.sim.block_size
    for n in (2, 4, 8, 16):
        blocks = tight.sim_for(n).kv_blocks
        assert blocks == max(math.ceil(ws * 0.25 / n), floor)
        assert tight.kv_fraction(n) == pytest.approx(blocks * n / ws)
    assert tight.kv_fraction(2) == pytest.approx(0.25, rel=0.01)
    # Without a share, the replicas keep their configured cache.
    assert agentic.sim_for(8) == agentic.sim


def test_every_workload_is_a_valid_config() -> None:
    assert set(WORKLOADS) == {"grpo", "agentic", "tight"}
    for w in WORKLOADS.values():
        assert w.workload.max_model_len <= w.sim.max_model_len
        assert plan_summary(build_plan(w.workload))["versions"] >= 2  # a weight sync per run


# -- oracle ----------------------------------------------------------------------------------


def _rec(t: float, prompt: list[int], completion: list[int], model: str = "m") -> RequestRecord:
    return RequestRecord(0, 0, model, "/p", t, t + 0.5, prompt, completion, 200)


def test_oracle_hits_a_repeated_prompt_up_to_vllms_cap() -> None:
    prompt = list(range(64))  # 4 blocks; cap (64-1)//16 = 3
    recs = [_rec(0.0, prompt, [1] * 16), _rec(0.1, prompt, [2] * 16)]
    result = oracle_hits(recs, [], capacity_blocks=100, block_size=16)
    assert result.per_request == (0, 48)
    assert result.query_tokens == 128
    assert math.isclose(result.hit_rate, 48 / 128)


def test_oracle_caches_completions_for_the_next_turn() -> None:
    prompt, completion = list(range(32)), list(range(100, 132))
    turn2 = prompt + completion + [7] * 10
    recs = [_rec(0.0, prompt, completion), _rec(1.0, turn2, [3])]
    assert oracle_hits(recs, [], capacity_blocks=100, block_size=16).per_request == (0, 64)


def test_oracle_is_cleared_by_a_pause_and_keys_by_adapter() -> None:
    prompt = list(range(48))
    recs = [_rec(0.0, prompt, [1]), _rec(2.0, prompt, [1])]
    assert oracle_hits(recs, [1.0], capacity_blocks=100, block_size=16).per_request == (0, 0)
    other = [_rec(0.0, prompt, [1], "a"), _rec(2.0, prompt, [1], "b")]
    assert oracle_hits(other, [], capacity_blocks=100, block_size=16).per_request == (0, 0)


def test_oracle_capacity_is_lru() -> None:
    a, b = list(range(48)), list(range(100, 148))
    recs = [_rec(0.0, a, []), _rec(1.0, b, []), _rec(2.0, a, [])]
    assert oracle_hits(recs, [], capacity_blocks=3, block_size=16).per_request == (0, 0, 0)
    assert oracle_hits(recs, [], capacity_blocks=6, block_size=16).per_request == (0, 0, 32)


def test_oracle_ignores_failed_requests() -> None:
    bad = _rec(0.0, list(range(48)), [])
    bad.error = "HTTP 500"
    result = oracle_hits(
        [bad, _rec(1.0, list(range(48)), [])], [], capacity_blocks=9, block_size=16
    )
    assert result.per_request == (0,)


def test_throughput_ceiling_is_balanced_decode_plus_oracle_prefill() -> None:
    sim = SimConfig(prefill_us_per_token=1000.0, decode_step_base_ms=10.0, decode_step_per_seq_ms=1)
    # 4 in flight on 2 replicas: batch 2, a step of 12 ms -> 2/0.012 tok/s per replica.
    # Prefill: 200 - 96 oracle hits = 104 tokens at 1 ms, split over the 2 replicas.
    seconds = (104 * 1e-3 + 100 / (2 / 0.012)) / 2
    got = throughput_ceiling([100, 100], [50, 50], [0, 96], replicas=2, concurrency=4, sim=sim)
    assert got == pytest.approx(100 / seconds)
    # The batch never exceeds the slots; more replicas than requests run fractional batches.
    slots = dataclasses.replace(sim, max_num_seqs=1)
    one = throughput_ceiling([100, 100], [50, 50], [0, 96], replicas=2, concurrency=4, sim=slots)
    assert one == pytest.approx(100 / ((104 * 1e-3 + 100 / (1 / 0.011)) / 2))
    assert math.isnan(throughput_ceiling([1], [0], [0], replicas=2, concurrency=4, sim=sim))
    with pytest.raises(ValueError):
        throughput_ceiling([100], [50, 50], [0], replicas=2, concurrency=4, sim=sim)


# -- report helpers ----------------------------------------------------------------------------


def test_percentile_interpolates() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_table_rejects_ragged_rows() -> None:
    assert table(["a", "b"], [["1", "2"]]).splitlines()[2] == "| 1 | 2 |"
    with pytest.raises(ValueError):
        table(["a", "b"], [["1"]])


# -- profile parsing -------------------------------------------------------------------------


def test_profile_parser_counts_self_and_inclusive_time() -> None:
    raw = (
        "main (a.py);handle (starlette/routing.py);loads (json/decoder.py) 3\n"
        "main (a.py);handle (starlette/routing.py);emit (logging/__init__.py) 1\n"
        "main (a.py);record (proxy/core/prefix_index.py) 2\n"
        "garbage line\n"
    )
    self_c, incl, total = parse_raw(raw)
    assert total == 6
    assert self_c["loads (json/decoder.py)"] == 3
    assert incl["main (a.py)"] == 6 and incl["handle (starlette/routing.py)"] == 4
    by, n = buckets(raw)
    assert n == 6
    assert by["JSON / body handling in proxy.core.extract"] == 3
    assert by["logging (log records, formatting, stream writes)"] == 1
    assert by["hashing + prefix index + policy (proxy.core)"] == 2
