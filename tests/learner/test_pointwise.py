"""Fused point-wise functions: the model computes what transformers' eager code computes."""

from __future__ import annotations

import logging
import sys

import pytest
import torch

from services.learner.engine import recompute_mlps
from services.learner.pointwise import fuse_pointwise


@pytest.mark.slow
def test_fused_pointwise_keeps_logits_gradients_and_names(tiny_model, monkeypatch):
    from transformers import AutoModelForCausalLM

    ids = torch.randint(100, 4000, (1, 40), generator=torch.Generator().manual_seed(5))
    calls: list[str] = []

    def run(fused: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        lm = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
        names = [n for n, _ in lm.named_parameters()]
        if fused:
            modeling = sys.modules[type(lm.get_decoder().layers[0].self_attn).__module__]
            monkeypatch.setattr(modeling, "apply_rotary_pos_emb", modeling.apply_rotary_pos_emb)  # restored after
            layers = lm.config.num_hidden_layers
            assert fuse_pointwise(lm) == {"rms_norm": 2 * layers + 1, "swiglu": layers, "rotary": 1}
            recompute_mlps(lm)  # wraps the fused MLP forward, as the engine orders them
            lm.get_decoder().layers[0].mlp.up_proj.register_forward_hook(lambda *_: calls.append("up"))
        assert [n for n, _ in lm.named_parameters()] == names
        out = lm(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.logits.detach(), {n: p.grad.clone() for n, p in lm.named_parameters()}

    plain_logits, plain = run(False)
    fused_logits, fused = run(True)
    assert calls == ["up", "up"]  # the fused MLP ran, and again when recomputed in backward
    torch.testing.assert_close(fused_logits, plain_logits, rtol=1e-5, atol=1e-5)
    for name, g in plain.items():
        torch.testing.assert_close(fused[name], g, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("name", ["qwen3", "mistral", "gemma3"])
def test_fusions_only_for_proven_model_types(name, monkeypatch, caplog):
    """Qwen3 and Mistral are fused and compute what their own code computes; Gemma 3 (`1 + weight`
    norms, scaled embeddings) keeps its own code, said once in the log."""
    from transformers import AutoModelForCausalLM

    from services.learner.pointwise import FUSED_MODEL_TYPES
    from services.model_families import FamilyUnavailable, tiny_family_model

    try:
        folder = tiny_family_model(name)
    except FamilyUnavailable as exc:
        pytest.skip(str(exc))
    ids = torch.randint(100, 4000, (1, 32), generator=torch.Generator().manual_seed(2))
    lm = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        plain = lm(input_ids=ids).logits
    decoder = lm.get_decoder()
    modeling = sys.modules[type(decoder.layers[0].self_attn).__module__]
    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", modeling.apply_rotary_pos_emb)  # restored after
    with caplog.at_level(logging.INFO, logger="services.learner.pointwise"):
        counts = fuse_pointwise(lm)
        fuse_pointwise(lm)
    fused = lm.config.model_type in FUSED_MODEL_TYPES
    assert (counts["rotary"], counts["swiglu"] > 0) == ((1, True) if fused else (0, False))
    said = [r for r in caplog.records if "off for model type" in r.getMessage()]
    assert len(said) == (0 if fused else 1)
    with torch.no_grad():
        torch.testing.assert_close(lm(input_ids=ids).logits, plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["qwen2.5", "qwen3", "llama3", "mistral", "smollm2", "gemma3"])
def test_learner_logprobs_equal_the_models_own_on_cpu(name):
    """The learner's log-probs (fused head where it fits, the model's own logits elsewhere) equal
    log_softmax of the model's own logits, what a transformers engine samples from."""
    from transformers import AutoModelForCausalLM

    from services.learner.engine import LogprobPolicy
    from services.model_families import FamilyUnavailable, tiny_family_model

    try:
        folder = tiny_family_model(name)
    except FamilyUnavailable as exc:
        pytest.skip(str(exc))
    lm = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = torch.randint(10, 40_000, (1, 48), generator=torch.Generator().manual_seed(1))
    inputs, targets, positions = ids[:, :-1], ids[:, 1:], torch.arange(47)[None]
    with torch.no_grad():
        logits = lm(input_ids=inputs, position_ids=positions).logits
        own = torch.log_softmax(logits, -1)[0].gather(-1, targets[0, :, None]).squeeze(-1)
        policy = LogprobPolicy(lm, chunk_tokens=16, head_kernels="eager")
        logp, _ = policy(inputs, positions, targets)
    if lm.config.model_type == "gemma3_text":  # the model's own head: the same arithmetic, bit for bit
        assert not policy.fused_head and torch.equal(logp, own)
    else:  # the fused head: logsumexp in its own order, a rounding step or two at |log p| ~ 12
        assert policy.fused_head
        torch.testing.assert_close(logp, own, rtol=0, atol=4e-6)


@pytest.mark.parametrize("name", ["qwen2.5", "llama3"])
def test_learner_scores_what_the_transformers_engine_sampled(name):
    """The rollout engine's reported log-probs of its own samples (temperature 1) and the learner's
    log-probs of the same ids, on CPU in fp32."""
    from services.model_families import engine_report

    report = engine_report(name)
    assert report["engine_tokens"] == 24
    assert report["engine_logprob_max_abs_diff"] < 4e-6


def test_learner_training_path_scores_what_an_engine_sampled_through_the_template():
    """bench/model_families.py's check on CPU: the transformers engine samples agent turns through
    Qwen2.5's template (tool turns appended by the template), and the learner's training path
    (PolicyEngine) scores exactly those ids; fp32, so equal to rounding."""
    import asyncio

    from services.model_families import learner_against_engine, sample_agent_turns, tiny_family_model
    from services.rollout.engines.hf import TransformersEngine

    folder = tiny_family_model("qwen2.5")
    engine = TransformersEngine(folder, max_batch=1, max_model_len=4096)

    async def sample():
        try:
            return await sample_agent_turns(engine, "qwen2.5", turns=2, max_tokens=8)
        finally:
            await engine.close()

    sample_ = asyncio.run(sample())
    assert sample_["sampled_tokens"] == 16 and sample_["loss_mask"].count(1) == 16
    tok = engine.tokenizer
    text = tok.decode(sample_["token_ids"])
    assert "<tool_response>" in text and "City\nChicago" in text  # the template's tool turn, Qwen2.5's form
    report = learner_against_engine(folder, sample_)
    assert report["compared_tokens"] == 16 and report["learner_precision"] == "fp32"
    assert report["logprob_max_abs_diff"] < 1e-5
