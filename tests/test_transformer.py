"""A GPT-shaped decoder as a layer-parallel network (layerbraid.nn.TransformerStep as the step
layers, TokenEmbedding open, LMHead close, dt = 1): with one level it is the serial pre-LN
stack exactly (float64, outputs and every gradient, 1-4 ranks, both transports); converged
MGRIT reaches it; TransformerStep is the usual pre-LN block; dropout is refused."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import layerbraid
from layerbraid.nn import LMHead, TokenEmbedding, TransformerStep
from nets import assert_gradients_match
from tolerances import CONVERGED, ROUNDOFF
from transports import WORLD

VOCAB, WIDTH, HEADS, LENGTH = 11, 16, 2, 6


@pytest.fixture(autouse=True)
def _all_float64(float64):
    pass


class TinyGPT(layerbraid.LayerParallelModule):
    def __init__(self, comm, layers=6, **options):
        super().__init__(num_steps=layers, t_final=float(layers), comm=comm, **options)
        self.open = TokenEmbedding(VOCAB, WIDTH, LENGTH)
        self.close = LMHead(WIDTH, VOCAB)

    def step_layer(self, index):
        return TransformerStep(WIDTH, HEADS, d_ff=2 * WIDTH)


def tokens(seed=0, n=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n, LENGTH + 1), generator=g)


def lm_loss(logits, ids):
    """Next-token cross-entropy: position t predicts token t + 1."""
    return F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def compare(model, tol):
    serial = model.to_serial()
    ids = tokens()
    out = model(ids[:, :-1])
    lm_loss(out, ids).backward()
    ref = serial(ids[:, :-1])
    lm_loss(ref, ids).backward()
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    assert_gradients_match(model, serial, tol, WORLD)


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([1, 2, 3, 4])
def test_one_level_is_the_serial_decoder_to_round_off():
    torch.manual_seed(0)
    compare(TinyGPT(WORLD), ROUNDOFF)


@pytest.mark.shared_job
@pytest.mark.parallel([1, 3])
def test_converged_mgrit_reaches_the_serial_decoder():
    converged = layerbraid.MGRITOptions(max_levels=3, cfactor=2, max_iters=30, tol=1e-14)
    torch.manual_seed(0)
    compare(TinyGPT(WORLD, layers=8, forward_options=converged, backward_options=converged),
            CONVERGED)


@pytest.mark.parallel([1])
def test_a_step_of_size_one_is_the_pre_ln_block():
    """x + f(x) is the usual pre-LN block: x + SA(LN1 x), then + MLP(LN2 of that), causal."""
    torch.manual_seed(0)
    step = TransformerStep(WIDTH, HEADS, d_ff=2 * WIDTH)
    x = torch.randn(3, LENGTH, WIDTH)
    h = step.ln1(x)
    mask = nn.Transformer.generate_square_subsequent_mask(LENGTH) != 0
    a = step.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
    y = x + a
    want = y + step.mlp(step.ln2(y))
    torch.testing.assert_close(x + step(x), want, rtol=1e-14, atol=1e-14)
    # causal: changing the last position changes no earlier position's increment
    x2 = x.clone()
    x2[:, -1] += 1.0
    torch.testing.assert_close(step(x2)[:, :-1], step(x)[:, :-1], rtol=0, atol=0)


@pytest.mark.parallel([1])
def test_bad_settings_are_clear_errors():
    with pytest.raises(ValueError, match=r"dropout=0.1\): dropout is not supported"):
        TransformerStep(WIDTH, HEADS, dropout=0.1)
    with pytest.raises(ValueError, match="d_model=10 is not a multiple of n_heads=4"):
        TransformerStep(10, 4)
    with pytest.raises(ValueError, match="a sequence of 9 tokens is longer than the 6"):
        TokenEmbedding(VOCAB, WIDTH, LENGTH)(torch.zeros(2, 9, dtype=torch.long))
