"""Train a small GPT-shaped language model, layer-parallel over its transformer layers.

    mpiexec -n 2 python examples/transformer.py                 # layer-parallel on 2 ranks (exact)
    torchrun --standalone --nproc-per-node 2 examples/transformer.py
    python examples/transformer.py --serial                     # the same network, plain PyTorch
    mpiexec -n 2 python examples/transformer.py --steps 16 --lp-levels 2 --lp-cfactor 4

A byte-level decoder: token and position embeddings (the open layer), N pre-LayerNorm
transformer layers with causal attention as the steps (layerbraid.nn.TransformerStep: the
layer's increment f, stepped as x + dt f(x) with dt = 1, which is the usual pre-LN block), a
final LayerNorm and the logits (the close layer).  The text is the Python standard library's own
source (real text that ships with every Python), cut into windows of --context bytes; each
position predicts the next byte.  Test accuracy is the fraction of next bytes predicted right.
At the end the model writes a sample, continuing a prompt.
"""
import argparse
import os
from pathlib import Path

import torch
from mpi4py import MPI
from torch import nn

import layerbraid
from layerbraid import cli
from layerbraid.launch import world
from layerbraid.nn import TokenEmbedding, TransformerStep

import common  # examples/common.py, beside this script
from training_loop import run_summary, train  # examples/training_loop.py, beside this script

VOCAB = 256  # bytes


class ClassLogits(nn.Module):
    """The close layer: a final LayerNorm and the logits, classes second ((batch, vocab,
    positions)), as cross_entropy and the examples' accuracy take them."""

    def __init__(self, width):
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.out = nn.Linear(width, VOCAB)

    def forward(self, x):
        return self.out(self.ln(x)).transpose(1, 2)


class TinyGPT(layerbraid.LayerParallelModule):
    def __init__(self, comm, steps, width, heads, context, t_final, forward_options,
                 backward_options, warm_start, target_error=None):
        super().__init__(num_steps=steps, t_final=t_final, comm=comm,
                         forward_options=forward_options, backward_options=backward_options,
                         warm_start=warm_start, target_error=target_error)
        self.width, self.heads = width, heads
        self.open = TokenEmbedding(VOCAB, width, context)
        self.close = ClassLogits(width)

    def step_layer(self, index):
        return TransformerStep(self.width, self.heads, causal=True)


def standard_library_text(limit):
    """Up to ``limit`` bytes of the standard library's own .py files, in name order."""
    home = Path(os.__file__).parent
    out = bytearray()
    for path in sorted(home.glob("*.py")):
        out += path.read_bytes()
        if len(out) >= limit:
            break
    if len(out) < 10_000:
        raise OSError(f"found only {len(out)} bytes of Python source under {home}")
    return bytes(out[:limit])


def windows(text, context):
    """{"train_x", ...}: non-overlapping windows of ``context`` bytes and the next byte of each
    position; the last tenth of the text is the test set."""
    ids = torch.tensor(list(text), dtype=torch.long)
    n = (len(ids) - 1) // context
    x = ids[: n * context].view(n, context)
    y = ids[1: n * context + 1].view(n, context)
    cut = n - max(n // 10, 1)
    return {"train_x": x[:cut], "train_y": y[:cut], "test_x": x[cut:], "test_y": y[cut:]}


def sample(model, prompt, count, context, seed):
    """``count`` bytes continuing ``prompt``, drawn from the model's distribution at
    temperature 0.8; collective (every rank runs the forwards and draws the same bytes: the
    logits are the same on every rank, and so is the generator)."""
    g = torch.Generator().manual_seed(seed)
    ids = list(prompt.encode())
    model.eval()
    with torch.no_grad():
        for _ in range(count):
            x = torch.tensor([ids[-context:]])
            logits = model(x)[0, :, -1] / 0.8
            ids.append(int(torch.multinomial(torch.softmax(logits, 0), 1, generator=g)))
    model.train()
    return bytes(ids).decode("utf-8", errors="replace")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    # t_final None: the number of steps, dt = 1, so that the steps are the usual pre-LN blocks
    common.add_training_arguments(parser, steps=8, channels=64, t_final=None, batch_size=32,
                                  epochs=1, lr=3e-3, optimizer="adam", log_interval=20)
    cli.add_lp_arguments(parser, levels=1)
    parser.add_argument("--heads", type=cli.positive_int, default=4,
                        help="attention heads; --channels (the width) must be a multiple "
                             "(default 4)")
    parser.add_argument("--context", type=cli.positive_int, default=64,
                        help="bytes per window: the positions the model sees (default 64)")
    parser.add_argument("--text-bytes", type=cli.positive_int, default=2_000_000,
                        help="bytes of the standard library's source to read (default 2000000)")
    parser.add_argument("--sample-bytes", type=cli.nonneg_int, default=120,
                        help="bytes of text to generate at the end (default 120)")
    parser.add_argument("--serial-reference", action=argparse.BooleanOptionalAction,
                        default=True,
                        help="train plain PyTorch beside the run on the first rank, from the "
                             "same weights on the same batches (default: on)")
    parser.add_argument("--compare-batches", type=cli.nonneg_int, default=10,
                        help="after training, time this many batches layer-parallel and on the "
                             "serial copy, in the same job (0: do not; default 10)")
    args = common.parse_args(parser, argv)
    if args.channels % args.heads:
        parser.error(f"--channels {args.channels} is not a multiple of --heads {args.heads}")
    args.t_final = float(args.steps) if args.t_final is None else args.t_final
    comm = world()  # mpiexec's COMM_WORLD, or torchrun's process group
    common.check_run(parser, args, comm)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # one core per rank

    try:
        data = windows(standard_library_text(args.text_bytes), args.context)
    except OSError as exc:
        parser.error(str(exc))
    fwd, bwd = cli.mgrit_options(args)
    grid = None if args.serial else layerbraid.ProcessGrid(comm, data_parallel=args.dp_size)

    def build(steps):
        return TinyGPT(MPI.COMM_SELF if args.serial else grid, steps, args.channels, args.heads,
                       args.context, args.t_final, fwd, bwd, args.lp_warm_start,
                       args.lp_target_error).to(args.device)

    model = build(args.steps)
    if args.serial:
        model = model.to_serial()
    if comm.rank == 0:
        kind = run_summary(model, args, comm)
        print(f"transformer: {len(data['train_x'])} training, {len(data['test_x'])} test "
              f"windows of {args.context} bytes of Python source; {args.steps} layers of width "
              f"{args.channels}, {args.heads} heads; {kind}", flush=True)
    train(args, model, data, comm=comm, rank=comm.rank, name="transformer", grid=grid,
          build=build)
    if args.sample_bytes:
        text = sample(model, "def ", args.sample_bytes, args.context, args.seed)
        if comm.rank == 0:
            print("sample:", repr(text), flush=True)


if __name__ == "__main__":
    main()
