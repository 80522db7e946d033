"""The DeepSpeed policy on CPU (gloo, fp32) with the tiny Qwen2: packing, SFT, RL, export."""

from __future__ import annotations

import pytest
import torch

from services.learner.batching import Sequence_, chat_to_sequence, lr_lambda, pack_sequences, rl_sequences
from services.learner.config import EngineConfig, FilterConfig, ScheduleConfig
from services.learner.steps import rl_step, sft_step
from services.weights.files import load_into, write_version
from services.weights.manifest import WeightsError, check_version

from .conftest import scored_batch


@pytest.fixture(scope="module")
def engine_factory(tiny_model):
    from services.learner.engine import PolicyEngine

    def make(lr: float = 1e-3, **kw) -> PolicyEngine:
        return PolicyEngine(
            tiny_model, EngineConfig(micro_batch_tokens=64, **kw), ScheduleConfig(lr=lr), total_steps=100
        )

    return make


def _seqs(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        Sequence_(torch.randint(100, 5000, (n,), generator=g).tolist(), [0, 0] + [1] * (n - 2), index=i)
        for i, n in enumerate(lengths)
    ]


def test_packed_rows_score_like_separate_sequences(engine_factory):
    engine = engine_factory()
    seqs = _seqs([20, 30])
    (row,) = pack_sequences(seqs, 64)
    together, _ = engine.logprobs(row, grad=False)
    for s, start in ((seqs[0], 0), (seqs[1], 20)):
        (alone_row,) = pack_sequences([s], 64)
        alone, _ = engine.logprobs(alone_row, grad=False)
        assert torch.allclose(together[start : start + len(s)], alone, atol=1e-5)
    # and a packed row of the second sequence is not the same as reading it after the first unpacked
    joined = Sequence_(seqs[0].token_ids + seqs[1].token_ids, [1] * 50)
    (j,) = pack_sequences([joined], 64)
    cont, _ = engine.logprobs(j, grad=False)
    assert not torch.allclose(cont[20:49], together[20:49], atol=1e-3)


def test_sft_loss_falls_on_a_fixed_batch(engine_factory):
    engine = engine_factory(lr=2e-3)
    seqs = _seqs([24, 40, 16, 33], seed=1)
    losses = [sft_step(engine, seqs).metrics["loss"] for _ in range(6)]
    assert losses[-1] < losses[0] - 0.5, losses
    assert all(b < a for a, b in zip(losses, losses[1:])), losses


def test_rl_step_moves_probability_towards_positive_advantages(engine_factory, tiny_model):
    engine = engine_factory(lr=1e-3)
    trajs = scored_batch(tiny_model, groups=2, group_size=4)
    batch = rl_sequences(trajs, FilterConfig(), learner_version=0)

    def seq_logp():
        out = []
        for s in batch.sequences:
            (row,) = pack_sequences([s], 64)
            lp, _ = engine.logprobs(row, grad=False)
            out.append(float((lp * row.mask).sum()))
        return out

    before = seq_logp()
    first = rl_step(engine, batch.sequences, eps_low=0.2, eps_high=0.28).metrics
    # the rollout logprobs came from the same weights: ratio 1, no mismatch, nothing clipped
    assert first["mismatch_kl_k3"] < 1e-8 and first["mismatch_logp_max_abs"] < 1e-4
    assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-4) and first["clip_fraction"] == 0.0
    assert first["loss_tokens"] == 8 * 18 and first["entropy"] > 5.0 and first["grad_norm"] > 0
    for _ in range(3):
        later = rl_step(engine, batch.sequences, eps_low=0.2, eps_high=0.28).metrics
    after = seq_logp()
    delta = [a - b for a, b in zip(after, before)]
    up = [d for d, a in zip(delta, batch.advantages) if a > 0]
    down = [d for d, a in zip(delta, batch.advantages) if a < 0]
    assert min(up) > max(down), (delta, batch.advantages)
    # the policy moved away from the behaviour logprobs, so ratios now differ from 1 and clip
    assert later["mismatch_kl_k3"] > first["mismatch_kl_k3"]
    assert later["clip_fraction"] > 0.0


@pytest.mark.slow
def test_kl_to_the_reference_holds_the_policy_near_its_start(engine_factory, tiny_model):
    trajs = scored_batch(tiny_model, groups=2, group_size=4)
    batch = rl_sequences(trajs, FilterConfig(), learner_version=0)
    drift = {}
    for kl_coef in (0.0, 2.0):
        engine = engine_factory(lr=1e-3)
        reference = engine.reference_policy()
        assert not any(p.requires_grad for p in reference.parameters())
        kl = [
            rl_step(
                engine, batch.sequences, eps_low=0.2, eps_high=0.28, kl_coef=kl_coef, reference=reference
            ).metrics.get("kl_ref")
            for _ in range(4)
        ]
        if kl_coef:
            assert kl[0] == pytest.approx(0.0, abs=1e-6) and kl[-1] > kl[0]  # it starts at the reference
        else:
            assert kl == [None] * 4  # KL-free: not computed
        (row,) = pack_sequences([batch.sequences[0]], 64)
        now, _ = engine.logprobs(row, grad=False)
        then, _ = reference(row.input_ids[None], row.position_ids[None], row.targets[None], False)
        drift[kl_coef] = float(((now - then).abs() * row.mask).sum())
    assert 0.0 < drift[2.0] < drift[0.0], drift


def test_kl_metrics_show_what_the_cap_hides_from_the_loss(engine_factory, tiny_model):
    """kl_ref is the capped loss term; kl_ref_k3 the estimate itself. Against a reference that puts
    every sampled token 15 nats lower, k3 is e^-15 + 14 per token: the loss sees the cap of 10."""
    from services.learner.algorithms import KL_PENALTY_CAP

    class Lowered(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, *args):
            logp, rest = self.inner(*args)
            return logp - 15.0, rest

    trajs = scored_batch(tiny_model, groups=2, group_size=4)
    batch = rl_sequences(trajs, FilterConfig(), learner_version=0)
    engine = engine_factory(lr=1e-6)
    same = rl_step(
        engine, batch.sequences, eps_low=0.2, eps_high=0.28, kl_coef=0.1, reference=engine.reference_policy()
    ).metrics
    assert same["kl_ref_k3"] == pytest.approx(same["kl_ref"], abs=1e-9)  # under the cap they agree
    far = rl_step(
        engine, batch.sequences, eps_low=0.2, eps_high=0.28, kl_coef=0.1, reference=Lowered(engine.reference_policy())
    ).metrics
    assert far["kl_ref"] == pytest.approx(KL_PENALTY_CAP, rel=1e-6)
    assert far["kl_ref_k3"] == pytest.approx(14.0, abs=0.01)


def test_checkpoints_keep_the_newest_tags_and_resume_from_the_last(engine_factory, tmp_path):
    """RL checkpoints every step; without pruning the tags (optimizer state included) fill the disk."""
    engine = engine_factory(keep_checkpoints=2)
    seqs = _seqs([24, 40], seed=3)
    for _ in range(4):
        sft_step(engine, seqs)
        engine.save_checkpoint(tmp_path, {"kind": "sft"})
    tags = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert tags == ["step0000003", "step0000004"]
    assert (tmp_path / "latest").read_text().strip() == "step0000004"
    fresh = engine_factory(keep_checkpoints=2)
    assert fresh.load_checkpoint(tmp_path)["step"] == 4
    assert fresh.step_count == 4


def test_pruning_spares_the_tag_latest_names(tmp_path):
    """A tag newer than `latest` (a save cut short) does not push out the one resume would read."""
    from services.learner.engine import prune_checkpoints

    for n in (1, 2, 3, 4):
        (tmp_path / f"step{n:07d}").mkdir()
    (tmp_path / "latest").write_text("step0000002")
    assert prune_checkpoints(tmp_path, keep=1) == ["step0000001", "step0000003"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step0000002", "step0000004"]
    assert prune_checkpoints(tmp_path, keep=2) == []


def test_hf_export_loads_in_transformers(engine_factory, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    engine = engine_factory()
    sft_step(engine, _seqs([30, 12], seed=3))
    buckets = engine.iter_weight_buckets(bucket_bytes=8 * 2**20)  # several shards + an index
    folder, digest, _, _, size = write_version(
        tmp_path, 1, buckets, config=engine.lm_config, source_dir=engine.model_dir
    )
    manifest = check_version(folder, digest)
    assert manifest["version"] == 1 and size > 0
    assert (folder / "model.safetensors.index.json").is_file()
    assert {"config.json", "tokenizer.json"} <= set(manifest["files"])
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    trained = dict(engine.hf_model.named_parameters())
    for name, p in loaded.named_parameters():
        assert torch.equal(p, trained[name].detach()), name
    assert AutoTokenizer.from_pretrained(folder).convert_tokens_to_ids("<|im_end|>") == 151645
    # a rollout-side reload into a live model, then tampering is caught
    fresh = AutoModelForCausalLM.from_pretrained(engine.model_dir, dtype=torch.float32)
    assert load_into(fresh, folder, sha256=digest) > 0
    assert torch.equal(fresh.model.norm.weight, trained["model.norm.weight"].detach())
    with pytest.raises(WeightsError, match="announced sha256"):
        check_version(folder, "0" * 64)
    shard = sorted(folder.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-1] + b"\0")
    with pytest.raises(WeightsError, match="does not match its sha256"):
        check_version(folder, digest)


def test_chat_loss_mask_covers_assistant_turns_only():
    from services.models import qwen_tokenizer

    tok = qwen_tokenizer()
    chat = [
        {"role": "system", "content": "You plan trips."},
        {"role": "user", "content": "Go to Rockford"},
        {"role": "assistant", "content": '<think>a</think><tool_call>{"name": "SearchCity"}</tool_call>'},
        {"role": "user", "content": "<tool_response>\nRockford</tool_response>"},
        {"role": "assistant", "content": "<think>b</think><answer>Day 1</answer>"},
    ]
    seq = chat_to_sequence(tok, chat)
    assert tok.decode(seq.token_ids) == tok.apply_chat_template(chat, tokenize=False)
    trained = tok.decode([i for i, m in zip(seq.token_ids, seq.loss_mask) if m])
    assert trained == (
        '<think>a</think><tool_call>{"name": "SearchCity"}</tool_call><|im_end|>'
        "<think>b</think><answer>Day 1</answer><|im_end|>"
    )
    assert len(chat_to_sequence(tok, chat, max_len=10).token_ids) == 10
    with pytest.raises(ValueError, match="'role' and 'content'"):
        chat_to_sequence(tok, [{"role": "user"}])


def test_schedules_by_hand():
    f = lr_lambda(ScheduleConfig(lr=1.0, warmup_ratio=0.1, schedule="cosine"), 100)
    assert [round(f(s), 4) for s in (0, 9, 10, 55, 99)] == [0.1, 1.0, 1.0, 0.5, 0.0003]
    g = lr_lambda(ScheduleConfig(lr=1.0, warmup_ratio=0.0, schedule="linear"), 10)
    assert [g(s) for s in (0, 5, 10)] == [1.0, 0.5, 0.0]
    c = lr_lambda(ScheduleConfig(lr=1.0, warmup_ratio=0.5, schedule="constant"), 4)
    assert [c(s) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]


def test_gradient_checkpointing_recomputes_each_layer_in_backward(engine_factory):
    """The policy trains in training mode (from_pretrained hands over an eval-mode model, and HF
    recomputes layers only in training mode): with gradient checkpointing each decoder layer's forward
    runs again in backward; without it, once."""
    seqs = [Sequence_(list(range(10, 40)), [0] * 5 + [1] * 25, None, advantage=1.0)]
    (row,) = pack_sequences(seqs, 64)
    calls = {}
    for checkpointing in (True, False):
        engine = engine_factory(gradient_checkpointing=checkpointing)
        assert engine.hf_model.training
        layer = engine.hf_model.model.layers[0]
        count = [0]
        # a pre-hook: the recomputation stops early, once it has what backward needs, so a post-hook misses it
        handle = layer.register_forward_pre_hook(lambda *_: count.__setitem__(0, count[0] + 1))
        logp, _ = engine.logprobs(row, grad=True)
        engine.backward((logp * row.mask.flatten()).sum())
        handle.remove()
        calls[checkpointing] = count[0]
        engine.close()
    assert calls == {True: 2, False: 1}
