"""scripts/cpu_trainer.py: the CPU stand-in for FlashAttention's varlen kernel, and the TRL patches
``make demo`` and the trainer e2e test run under."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from scripts import cpu_trainer  # noqa: E402  (after the torch check)


def _reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: list[int],
    cu_k: list[int],
    window: tuple[int, int] = (-1, -1),
    causal: bool = True,
) -> torch.Tensor:
    """Per segment, torch's own SDPA with an explicit bottom-right-aligned mask."""
    out = []
    for s in range(len(cu_q) - 1):
        qi = q[cu_q[s] : cu_q[s + 1]].transpose(0, 1)
        ki = k[cu_k[s] : cu_k[s + 1]].transpose(0, 1)
        vi = v[cu_k[s] : cu_k[s + 1]].transpose(0, 1)
        lq, lk = qi.shape[1], ki.shape[1]
        pos = torch.arange(lq).unsqueeze(1) + lk - lq
        cols = torch.arange(lk).unsqueeze(0)
        keep = torch.ones(lq, lk, dtype=torch.bool)
        if causal:
            keep &= cols <= pos
        if window[0] >= 0:
            keep &= cols >= pos - window[0]
        if window[1] >= 0:
            keep &= cols <= pos + window[1]
        o = torch.nn.functional.scaled_dot_product_attention(
            qi, ki, vi, attn_mask=keep, enable_gqa=True
        )
        out.append(o.transpose(0, 1))
    return torch.cat(out, 0)


def _inputs(
    lens_q: list[int], lens_k: list[int], heads: int = 4, kv_heads: int = 2, dim: int = 8
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lens_q), heads, dim, generator=gen)
    k = torch.randn(sum(lens_k), kv_heads, dim, generator=gen)
    v = torch.randn(sum(lens_k), kv_heads, dim, generator=gen)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize(
    ("lens_q", "lens_k"),
    [
        ([5, 3, 7], [5, 3, 7]),  # plain packed sequences
        ([2, 4], [9, 4]),  # tree packing: a branch's queries see its shared prefix's keys
        ([1], [6]),  # one decode-like query
    ],
)
def test_matches_sdpa_with_a_bottom_right_causal_mask_and_gqa(
    lens_q: list[int], lens_k: list[int]
) -> None:
    q, k, v, cu_q, cu_k = _inputs(lens_q, lens_k)
    got = cpu_trainer.varlen_attention(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k))
    want = _reference(q, k, v, cu_q.tolist(), cu_k.tolist())
    assert got.shape == q.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_sliding_window_and_non_causal() -> None:
    q, k, v, cu_q, cu_k = _inputs([6, 4], [6, 7])
    got = cpu_trainer.varlen_attention(q, k, v, cu_q, cu_k, 6, 7, window_size=(2, 0))
    torch.testing.assert_close(got, _reference(q, k, v, [0, 6, 10], [0, 6, 13], (2, 0)))
    got = cpu_trainer.varlen_attention(q, k, v, cu_q, cu_k, 6, 7, causal=False)
    torch.testing.assert_close(got, _reference(q, k, v, [0, 6, 10], [0, 6, 13], causal=False))


def test_softmax_scale_and_dtype_follow_flash_attention() -> None:
    q, k, v, cu_q, cu_k = _inputs([4], [4])
    scaled = cpu_trainer.varlen_attention(q, k, v, cu_q, cu_k, 4, 4, softmax_scale=0.1)
    torch.testing.assert_close(scaled, _reference(q * (0.1 / 8**-0.5), k, v, [0, 4], [0, 4]))
    half = cpu_trainer.varlen_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), cu_q, cu_k, 4, 4)
    assert half.dtype == torch.bfloat16


def test_queries_with_no_visible_key_get_zeros() -> None:
    # 3 queries over 1 key, bottom-right aligned: only the last query sees the key.
    q, k, v, cu_q, cu_k = _inputs([3], [1])
    out = cpu_trainer.varlen_attention(q, k, v, cu_q, cu_k, 3, 1)
    assert torch.equal(out[:2], torch.zeros_like(out[:2]))
    torch.testing.assert_close(out[2], v[0].repeat_interleave(2, dim=0))


def test_bad_shapes_are_refused() -> None:
    q, k, v, cu_q, cu_k = _inputs([4], [4], heads=3, kv_heads=2)
    with pytest.raises(ValueError, match="not a multiple"):
        cpu_trainer.varlen_attention(q, k, v, cu_q, cu_k, 4, 4)
    q, k, v, cu_q, cu_k = _inputs([4], [4])
    with pytest.raises(ValueError, match="tokens, heads, dim"):
        cpu_trainer.varlen_attention(q[None], k, v, cu_q, cu_k, 4, 4)
    with pytest.raises(ValueError, match="different numbers of segments"):
        cpu_trainer.varlen_attention(q, k, v, cu_q, cu_k[:1], 4, 4)


@pytest.fixture
def trl_modules(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """TRL's modules, with every attribute apply() replaces restored after the test."""
    from trl.experimental.async_grpo import async_grpo_trainer, async_rollout_worker, packing

    for module, name in (
        (async_rollout_worker, "is_vllm_available"),
        (async_grpo_trainer, "get_peak_flops_per_device"),
        (packing, "_flash_attn"),
    ):
        monkeypatch.setattr(module, name, getattr(module, name))
    monkeypatch.setattr(os, "rename", os.rename)
    return SimpleNamespace(worker=async_rollout_worker, trainer=async_grpo_trainer, packing=packing)


def test_apply_routes_trls_tree_attention_through_the_torch_kernel(
    trl_modules: SimpleNamespace,
) -> None:
    cpu_trainer.apply()
    assert trl_modules.worker.is_vllm_available() is True
    assert trl_modules.trainer.get_peak_flops_per_device("cpu") is None
    # TRL's own tree_attention, called as transformers calls an attention function.
    lens_q, lens_k = [3, 2], [3, 5]
    q, k, v, cu_q, cu_k = _inputs(lens_q, lens_k)
    module = torch.nn.Module()
    module.config = SimpleNamespace()  # type: ignore[assignment]
    module.proj = torch.nn.Linear(2, 2)
    out, weights = trl_modules.packing.tree_attention(
        module,
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        None,
        tree_kv_index=torch.arange(k.shape[0]),
        tree_cu_seqlens_q=cu_q,
        tree_cu_seqlens_k=cu_k,
        tree_max_seqlen_q=3,
        tree_max_seqlen_k=5,
    )
    assert weights is None
    torch.testing.assert_close(out[0], _reference(q, k, v, cu_q.tolist(), cu_k.tolist()))


def test_apply_records_renames_when_asked(trl_modules: SimpleNamespace, tmp_path: Path) -> None:
    log = tmp_path / "logs" / "renames.jsonl"
    cpu_trainer.apply(log)
    (tmp_path / "a").write_text("x")
    os.rename(tmp_path / "a", tmp_path / "b")
    [entry] = [json.loads(line) for line in log.read_text().splitlines()]
    assert (entry["src"], entry["dst"]) == (str(tmp_path / "a"), str(tmp_path / "b"))
    assert (tmp_path / "b").read_text() == "x"


def test_apply_names_what_another_trl_release_lacks(
    trl_modules: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(trl_modules.packing, "_flash_attn")
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # main() sets it; restored after the test
    with pytest.raises(RuntimeError, match=r"packing\._flash_attn.*trl==1\.16\.0"):
        cpu_trainer.apply()
    assert cpu_trainer.main(["--help"]) == 2  # the launcher refuses before the trainer runs
