"""The fused vocabulary head: the same log-probs, entropy and gradients as the plain head over full logits."""

import pytest
import torch

from services.learner.vocab_head import chunk_logit_grad, chunk_stats, use_compiled, vocab_logprobs


def plain_head(hidden, weight, targets, temperature):
    logits = hidden @ weight.t()
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    logp_all = torch.log_softmax(logits, -1)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def case(n=37, d=16, vocab=101, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g, dtype=dtype, requires_grad=True)
    weight = torch.randn(vocab, d, generator=g, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, vocab, (n,), generator=g)
    upstream = torch.randn(n, generator=g, dtype=torch.float32)
    return hidden, weight, targets, upstream


@pytest.mark.parametrize("chunk,temperature", [(8, 1.0), (37, 0.7), (100, 1.3)])
def test_logprobs_entropy_and_gradients_equal_the_plain_head(chunk, temperature):
    hidden, weight, targets, upstream = case()
    logp, entropy = vocab_logprobs(hidden, weight, targets, chunk=chunk, temperature=temperature)
    (logp * upstream).sum().backward()
    fused_grads = hidden.grad.clone(), weight.grad.clone()

    hidden.grad = weight.grad = None
    ref_logp, ref_entropy = plain_head(hidden, weight, targets, temperature)
    (ref_logp * upstream).sum().backward()

    torch.testing.assert_close(logp, ref_logp, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(entropy, ref_entropy, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(fused_grads[0], hidden.grad, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(fused_grads[1], weight.grad, rtol=1e-10, atol=1e-10)
    assert not entropy.requires_grad


def test_gradient_check_in_double_precision():
    hidden, weight, targets, _ = case(n=6, d=4, vocab=9)
    assert torch.autograd.gradcheck(
        lambda h, w: vocab_logprobs(h, w, targets, chunk=4, temperature=0.9)[0], (hidden, weight)
    )


def test_without_grad_and_without_entropy():
    hidden, weight, targets, _ = case()
    with torch.no_grad():
        logp, entropy = vocab_logprobs(hidden, weight, targets, chunk=10, with_entropy=False)
    ref_logp, _ = plain_head(hidden.detach(), weight.detach(), targets, 1.0)
    torch.testing.assert_close(logp, ref_logp)
    assert torch.count_nonzero(entropy) == 0 and not logp.requires_grad


def test_bf16_logits_are_read_in_fp32():
    """In bf16 the head's arithmetic is the plain head's on the same bf16 logits, cast to fp32."""
    hidden, weight, targets, upstream = case(dtype=torch.bfloat16)
    logits = (hidden @ weight.t()).detach()
    logz, logp, entropy = chunk_stats(logits, targets, 1.0, True)
    ref = torch.log_softmax(logits.float(), -1)
    torch.testing.assert_close(logp, ref.gather(-1, targets[:, None]).squeeze(-1))
    torch.testing.assert_close(entropy, -(ref.exp() * ref).sum(-1), rtol=1e-4, atol=1e-4)
    grad = chunk_logit_grad(logits, targets, logz, upstream, 1.0)
    assert grad.dtype == torch.bfloat16
    expected = (torch.nn.functional.one_hot(targets, logits.shape[-1]) - ref.exp()) * upstream[:, None]
    torch.testing.assert_close(grad.float(), expected, rtol=1e-2, atol=1e-2)


def test_bad_shapes_are_refused_and_kernels_follow_the_device():
    hidden, weight, targets, _ = case()
    with pytest.raises(ValueError, match=r"\[n, d\]"):
        vocab_logprobs(hidden[None], weight, targets, chunk=8)
    with pytest.raises(ValueError, match=r"targets \[n\]"):
        vocab_logprobs(hidden, weight, targets[:-1], chunk=8)
    assert not use_compiled("auto", torch.device("cpu"))
    assert use_compiled("auto", torch.device("cuda", 0)) and use_compiled("compiled", torch.device("cpu"))
    assert not use_compiled("eager", torch.device("cuda", 0))


def test_compiled_kernels_agree_with_eager():
    """The element-wise functions as Inductor compiles them (as on GPU) give the eager results."""
    hidden, weight, targets, upstream = case(n=50, d=16, vocab=301, dtype=torch.float32, seed=1)
    results = []
    for kernels in ("compiled", "eager"):
        hidden.grad = weight.grad = None
        logp, entropy = vocab_logprobs(hidden, weight, targets, chunk=16, temperature=0.8, head_kernels=kernels)
        (logp * upstream).sum().backward()
        results.append((logp, entropy, hidden.grad.clone(), weight.grad.clone()))
    for compiled, eager in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
