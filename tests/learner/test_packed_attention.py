"""Packed attention: a packed row's log-probs and gradients equal its sequences run alone, with no mask.

On CPU through the learner's own engine (DeepSpeed, gloo, fp32: SDPA per sequence); on a GPU through
FlashAttention's varlen kernel in bf16 (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from services.learner.attention import (
    PACKED_ATTENTION,
    PER_SEQUENCE_ATTENTION,
    VARLEN_ATTENTION,
    packed_kwargs,
    runs_per_sequence,
    uses_varlen_kernel,
)
from services.learner.batching import Sequence_, assign_weights, micro_batches, pack_sequences
from services.learner.config import EngineConfig, ScheduleConfig

LENGTHS = [20, 33, 11, 27]
# fp32 exactness through the engine's CPU path (gloo, per-sequence SDPA); on a GPU the engine trains in bf16 on the
# device, and test_gpu_packed_equals_alone_within_bf16 holds the packed rows to bf16's tolerance instead
cpu_exact = pytest.mark.skipif(torch.cuda.is_available(), reason="fp32 exactness of the CPU path; GPU: the bf16 test")


def _seqs(lengths, seed=0, vocab=5000):
    g = torch.Generator().manual_seed(seed)
    return [
        Sequence_(
            torch.randint(100, vocab, (n,), generator=g).tolist(), [0, 0] + [1] * (n - 2), advantage=0.5 + i, index=i
        )
        for i, n in enumerate(lengths)
    ]


def _weighted(seqs, capacity):
    rows = pack_sequences(seqs, capacity)
    assign_weights(rows, "seq-mean-token-mean")
    return rows


def test_boundaries_of_a_padded_micro_batch():
    seqs = _seqs([5, 3, 4])
    (batch,) = micro_batches(_weighted(seqs, 8), rows_per_batch=2, pad_to_multiple=4)
    # rows [5, 3] and [4] + 4 padding tokens that continue the last sequence's positions
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 2, 3, 4, 5, 6, 7]]
    bounds = packed_kwargs(batch.position_ids)
    assert bounds["cu_seq_lens_q"].tolist() == [0, 5, 8, 16] and bounds["max_length_q"] == 8
    # rows of one sequence each: no boundaries, SDPA's plain causal path
    assert packed_kwargs(torch.arange(6)[None].repeat(2, 1)) == {}


def test_auto_is_its_own_rule_and_builds_the_per_sequence_plans():
    from transformers import AttentionInterface

    mapping = AttentionInterface._global_mapping
    assert mapping[PACKED_ATTENTION] is not mapping[VARLEN_ATTENTION]
    assert mapping[PER_SEQUENCE_ATTENTION] is not mapping[PACKED_ATTENTION]
    assert [s for s in ("auto", "varlen", "varlen-gqa", "per-sequence", "mask") if runs_per_sequence(s)] == [
        "auto",
        "per-sequence",
    ]


@pytest.mark.parametrize(("lengths", "kernel"), [([5000, 3192], "per-sequence"), ([1000] * 8, "varlen")])
def test_auto_picks_the_kernel_by_the_rows_mean_sequence_length(monkeypatch, lengths, kernel):
    """A row of long sequences runs SDPA per sequence, a row of short ones the varlen kernel (where it runs)."""
    from services.learner import attention as att

    called = []
    monkeypatch.setattr(att, "uses_varlen_kernel", lambda q: True)
    monkeypatch.setattr(att, "_varlen", lambda q, *a, **k: called.append("varlen") or q)
    monkeypatch.setattr(
        att, "_per_sequence", lambda m, q, *a, **k: called.append("per-sequence") or q.transpose(1, 2).flatten(0, 1)
    )
    t = sum(lengths)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    q = torch.zeros(1, 2, t, 4)
    out, _ = att.packed_attention(torch.nn.Module(), q, q[:, :1], q[:, :1], None, **packed_kwargs(position_ids))
    assert called == [kernel] and out.shape == (1, t, 2, 4)


def test_varlen_refuses_another_attention_implementation():
    with pytest.raises(ValueError, match="packed_attention: mask"):
        EngineConfig(attn_implementation="eager")
    assert EngineConfig(attn_implementation="eager", packed_attention="mask").attn_implementation == "eager"


@pytest.fixture(scope="module")
def engine(tiny_model):
    from services.learner.engine import PolicyEngine

    return PolicyEngine(
        tiny_model, EngineConfig(micro_batch_tokens=128, zero_stage=0), ScheduleConfig(lr=1e-3), total_steps=10
    )


def _loss_and_grads(engine, batch):
    """Log-probs and the gradient of the batch's weighted log-prob through the engine's own backward."""
    params = [p for p in engine.module.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    logp, _ = engine.logprobs(batch, grad=True)
    engine.backward((logp * batch.weights.flatten()).sum())
    return logp.detach(), [p.grad.detach().clone() for p in params]


@cpu_exact
def test_packed_logprobs_and_gradients_equal_each_sequence_alone(engine):
    assert engine.hf_model.config._attn_implementation == PACKED_ATTENTION
    seqs = _seqs(LENGTHS, seed=3)
    # two rows ([33, 27, 11] and [20]... by first fit) stacked into one padded [2, T] micro-batch
    rows = _weighted(seqs, 80)
    (batch,) = micro_batches(rows, rows_per_batch=2, pad_to_multiple=16)
    assert len(packed_kwargs(batch.position_ids)["cu_seq_lens_q"]) - 1 >= len(seqs)
    packed_logp, packed_grads = _loss_and_grads(engine, batch)

    alone_grads = None
    flat_index = batch.seq_index.flatten()
    for s in seqs:
        (one,) = micro_batches(_weighted([s], 80), rows_per_batch=1)
        # the same loss weight per token as in the packed batch
        one.weights = batch.weights.flatten()[flat_index == s.index][None]
        logp, grads = _loss_and_grads(engine, one)
        assert torch.allclose(packed_logp[flat_index == s.index], logp, atol=1e-5, rtol=0)
        alone_grads = grads if alone_grads is None else [a + g for a, g in zip(alone_grads, grads)]
    for p, a in zip(packed_grads, alone_grads):
        assert torch.allclose(p, a, atol=1e-6, rtol=1e-4), float((p - a).abs().max())
    assert sum(float(g.abs().sum()) for g in packed_grads) > 0


@cpu_exact
def test_padding_each_sequence_to_a_multiple_changes_no_log_prob_or_gradient(engine, monkeypatch):
    """On a GPU per-sequence SDPA pads each sequence (zeros after its end) so cuDNN sees few lengths; forced on
    here, the real tokens' log-probs and gradients stay those of the unpadded pass."""
    from services.learner import attention

    seqs = _seqs(LENGTHS, seed=5)
    (batch,) = micro_batches(_weighted(seqs, 80), rows_per_batch=2, pad_to_multiple=16)
    plain_logp, plain_grads = _loss_and_grads(engine, batch)
    seen = []

    def padded(query, window):
        seen.append(query.shape)
        return 8

    monkeypatch.setattr(attention, "pad_multiple", padded)
    logp, grads = _loss_and_grads(engine, batch)
    assert seen, "per-sequence attention did not run"
    assert torch.allclose(logp, plain_logp, atol=1e-6, rtol=0)
    for p, q in zip(grads, plain_grads):
        assert torch.allclose(p, q, atol=1e-6, rtol=1e-5), float((p - q).abs().max())


@cpu_exact
def test_packed_rows_match_the_block_mask_path(engine, tiny_model):
    """The mask path (transformers' [B, 1, T, T] block mask) is the reference the varlen path replaced."""
    from transformers import AutoModelForCausalLM

    from services.learner.engine import LogprobPolicy, attention_choice

    seqs = _seqs(LENGTHS, seed=4)
    (batch,) = micro_batches(_weighted(seqs, 128), rows_per_batch=1)
    masked = LogprobPolicy(
        AutoModelForCausalLM.from_pretrained(
            tiny_model, dtype=torch.float32, **attention_choice(EngineConfig(packed_attention="mask"))
        ),
        2048,
        "eager",
    )
    masked.load_state_dict(engine.module.state_dict())
    with torch.no_grad():
        ours, _ = engine.logprobs(batch, grad=False)
        theirs, _ = masked(batch.input_ids, batch.position_ids, batch.targets)
    assert masked.lm.config._attn_implementation == "sdpa"
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("implementation", [VARLEN_ATTENTION, PER_SEQUENCE_ATTENTION])
def test_gpu_packed_equals_alone_within_bf16(implementation):
    """bf16 packed and bf16 alone, each against the same sequences alone in fp32: packing adds no error
    beyond bf16's own, and reading the rows across their boundaries would."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from services.learner.engine import LogprobPolicy

    config = Qwen2Config(
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
        num_hidden_layers=2,
        vocab_size=1024,
        initializer_range=0.1,
        attn_implementation=implementation,
    )
    torch.manual_seed(0)
    exact = LogprobPolicy(Qwen2ForCausalLM(config), chunk_tokens=4096, head_kernels="eager").cuda()
    policy = LogprobPolicy(Qwen2ForCausalLM(config), chunk_tokens=4096, head_kernels="eager")
    policy.load_state_dict(exact.state_dict())
    policy = policy.to("cuda", torch.bfloat16)
    seqs = _seqs([700, 300, 513, 129], seed=5, vocab=1024)
    (batch,) = micro_batches(_weighted(seqs, 1024), rows_per_batch=2, pad_to_multiple=64)
    index = batch.seq_index.flatten()

    def run(model, b):
        params = list(model.parameters())
        ids, pos, tgt = (t.cuda() for t in (b.input_ids, b.position_ids, b.targets))
        logp, _ = model(ids, pos, tgt)
        grads = torch.autograd.grad((logp * b.weights.flatten().cuda()).sum(), params)
        return logp.float().detach().cpu(), [g.float() for g in grads]

    def alone(model):
        logps, total = [], None
        for s in seqs:
            (one,) = micro_batches(_weighted([s], 1024), rows_per_batch=1)
            one.weights = batch.weights.flatten()[index == s.index][None]
            logp, grads = run(model, one)
            logps.append((s.index, logp))
            total = grads if total is None else [a + g for a, g in zip(total, grads)]
        return logps, total

    if implementation == VARLEN_ATTENTION:
        assert uses_varlen_kernel(torch.zeros(1, 1, 8, dtype=torch.bfloat16, device="cuda"))
    ref_logps, ref_grads = alone(exact)
    bf16_logps, bf16_grads = alone(policy)
    packed_logp, packed_grads = run(policy, batch)

    def logp_error(pairs):
        return max(float((lp - ref).abs().mean()) for (_, lp), (_, ref) in zip(pairs, ref_logps))

    def grad_error(grads):
        return max(float((g - r).norm() / r.norm().clamp_min(1e-12)) for g, r in zip(grads, ref_grads))

    packed_pairs = [(i, packed_logp[index == i]) for i, _ in ref_logps]
    assert logp_error(packed_pairs) <= 1.5 * logp_error(bf16_logps) + 1e-3, (
        logp_error(packed_pairs),
        logp_error(bf16_logps),
    )
    assert grad_error(packed_grads) <= 1.5 * grad_error(bf16_grads) + 1e-2, (
        grad_error(packed_grads),
        grad_error(bf16_grads),
    )
    # what the tolerance must tell apart: the same rows read as one sequence each, attending across
    batch.position_ids = torch.arange(batch.position_ids.shape[1]).expand_as(batch.position_ids).contiguous()
    leaky_logp, _ = run(policy, batch)
    assert logp_error([(i, leaky_logp[index == i]) for i, _ in ref_logps]) > 5 * logp_error(packed_pairs)


def _sliding_model(implementation: str, window: int = 16):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(
        vocab_size=500,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        sliding_window=window,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=4096,
    )
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=implementation).eval()


@pytest.mark.parametrize("implementation", [PACKED_ATTENTION, PER_SEQUENCE_ATTENTION])
def test_sliding_window_layers_see_only_their_window(implementation):
    """Gemma 3's sliding layers: transformers hands attention functions other than its own the window (no
    mask), so each path applies it: one sequence to a row, and sequences packed in a row, equal the model's
    own eager attention on each sequence alone, past the window."""
    eager = _sliding_model("eager")
    ours = _sliding_model(implementation)
    ours.load_state_dict(eager.state_dict())
    g = torch.Generator().manual_seed(1)
    first, second = torch.randint(0, 500, (1, 70), generator=g), torch.randint(0, 500, (1, 45), generator=g)
    with torch.no_grad():
        alone = [eager(x).logits for x in (first, second)]
        one = ours(first, position_ids=torch.arange(70)[None], use_cache=False).logits
        pos = torch.cat([torch.arange(70), torch.arange(45)])[None]
        row = ours(torch.cat([first, second], 1), position_ids=pos, use_cache=False, **packed_kwargs(pos)).logits
    assert torch.allclose(one, alone[0], atol=1e-5)
    assert torch.allclose(row[:, :70], alone[0], atol=1e-5) and torch.allclose(row[:, 70:], alone[1], atol=1e-5)
    # the window matters here: full causal attention would give other logits
    with torch.no_grad():
        wide = _sliding_model("eager", window=4096)
        wide.load_state_dict(eager.state_dict())
        assert not torch.allclose(wide(first).logits, alone[0], atol=1e-3)
