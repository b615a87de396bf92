"""The training loop shared by the examples: plain PyTorch on every rank, output on rank 0.
Python puts a script's folder first on sys.path, so the examples import it by name; copy it
into your own project as a starting point.

Progress bar (tqdm) on rank 0; per epoch: training loss, test accuracy, time per batch, the
MGRIT iterations of the forward and adjoint solves, the audits' true gradient error and, where
MGRIT runs more than one level, the probe's estimate of it (the residuals' calibrated estimate
instead with --lp-target-error or --lp-probe-every 0); at the end a metrics JSON (every solve
statistic, audit and probe) and a training-curve PNG; checkpoint after every epoch and resume.
"""
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset, TensorDataset

import layerbraid
from layerbraid import cli
from layerbraid.data import LayerParallelLoader


def make_optimizer(args, params):
    if args.optimizer == "adam":
        return torch.optim.Adam(params, lr=args.lr)
    return torch.optim.SGD(params, lr=args.lr, momentum=0.9)


def evaluate(model, dataset, device, batch_size=500, prepare=None):
    """Accuracy on ``dataset``, read in order (the same batches on every rank): the fraction of
    labels predicted right (one per sample, or one per position: a language model's)."""
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for xb, yb in DataLoader(dataset, batch_size):
            xb = prepare(xb) if prepare else xb
            out = model(xb.to(device))
            correct += int((out.argmax(1).cpu() == yb).sum())
            total += yb.numel()
    model.train()
    return correct / max(total, 1)


class SerialReference:
    """Plain PyTorch beside the layer-parallel model: the model's serial copy (``to_serial()``,
    collective) from the same initial weights, trained on the first rank alone on the same
    batches with the same optimizer; what a layer-parallel run should match.  Its steps are
    timed, so that the epoch's time can leave them out (the other ranks wait meanwhile)."""

    def __init__(self, model, args, rank):
        serial = model.to_serial()  # every rank takes part; the first keeps it
        self.model = serial if rank == 0 else None
        self.optimizer = make_optimizer(args, serial.parameters()) if rank == 0 else None
        self.smoothness = getattr(args, "lp_smoothness", 0.0)
        self.losses, self.seconds = [], 0.0

    def step(self, xb, yb):
        if self.model is None:
            return
        t0 = time.perf_counter()
        self.optimizer.zero_grad()
        loss = F.cross_entropy(self.model(xb), yb)
        total = loss + self.smoothness * self.model.depth_smoothness() if self.smoothness else loss
        total.backward()
        self.optimizer.step()
        self.losses.append(loss.item())
        self.seconds += time.perf_counter() - t0

    def epoch_end(self, test_set, device, prepare):
        """{"losses", "test_accuracy"} of the epoch on the first rank (None elsewhere); resets."""
        if self.model is None:
            return None
        out = {"losses": self.losses, "test_accuracy": evaluate(self.model, test_set, device,
                                                                prepare=prepare)}
        self.losses, self.seconds = [], 0.0
        return out


class Depths:
    """Training over depths around the loop (--lp-nested-levels, --lp-mgopt-levels): which
    network trains at each epoch, refined into the next depth where a shallower stage ends
    (layerbraid.depth.refine, the optimizer's state included), and, at full depth, MG/Opt's
    hierarchy (layerbraid.depth.mgopt.MGOpt).  ``build(steps)`` makes the network at a depth."""

    def __init__(self, args, model, build, rank):
        self.args, self.full, self.build, self.rank = args, model, build, rank
        nested = build is not None and getattr(args, "lp_nested_levels", 1) > 1
        self.schedule = layerbraid.cli.depth_schedule(args) if nested else [(None, args.epochs)]
        self.starts = [sum(e for _, e in self.schedule[:k]) for k in range(len(self.schedule))]
        self.model = build(self.schedule[0][0]) if nested else model
        self.mgopt = None
        if nested and rank == 0:
            print("nested iteration: " + ", then ".join(
                f"{e} epoch(s) at {n} steps" for n, e in self.schedule), flush=True)

    def epoch(self, epoch, optimizer):
        """(model, optimizer) for ``epoch``; refines or builds MG/Opt's hierarchy on the way."""
        stage = max(k for k, start in enumerate(self.starts) if start <= epoch)
        if stage and epoch == self.starts[stage]:
            last = stage == len(self.schedule) - 1
            finer = self.full if last else self.build(self.schedule[stage][0])
            finer_opt = make_optimizer(self.args, finer.parameters())
            layerbraid.depth.refine(self.model, finer, self.args.lp_depth_interp,
                                    (optimizer, finer_opt))
            layerbraid.depth.free(self.model)
            freeze = getattr(self.args, "lp_nested_freeze", False)
            if freeze:  # the inherited steps of the freed network are gone with it
                factor = self.schedule[stage][0] // self.schedule[stage - 1][0]
                layerbraid.depth.freeze_inherited(finer, factor)
            if self.rank == 0:
                print(f"nested iteration: refined to {self.schedule[stage][0]} steps "
                      f"({self.args.lp_depth_interp}{', inherited steps frozen' if freeze else ''}"
                      f"), for {self.schedule[stage][1]} epoch(s)", flush=True)
            self.model, optimizer = finer, finer_opt
        k = getattr(self.args, "lp_mgopt_levels", 1)
        if self.mgopt is None and k > 1 and self.model is self.full:
            self.mgopt = self._hierarchy(k, optimizer)
        return self.model, optimizer

    def _hierarchy(self, levels, optimizer):
        from layerbraid.depth.mgopt import MGOpt

        steps = layerbraid.depth.depths(self.args.steps, levels, self.args.lp_depth_factor)
        coarse = [self.build(n) for n in reversed(steps[:-1])]
        pre, post, last = self.args.lp_mgopt_relax
        if self.rank == 0:
            print(f"MG/Opt over {', '.join(map(str, reversed(steps)))} steps: {pre} / {post} "
                  f"optimizer steps before / after each coarse correction, {last} on the "
                  f"coarsest, line search {self.args.lp_mgopt_line_search}, coarse optimizer "
                  f"state {self.args.lp_mgopt_state}", flush=True)
        return MGOpt([self.full, *coarse],
                     [optimizer, *(make_optimizer(self.args, m.parameters()) for m in coarse)],
                     pre_relax=pre, post_relax=post, coarse_relax=last,
                     interpolate=self.args.lp_depth_interp,
                     line_search=self.args.lp_mgopt_line_search,
                     state=self.args.lp_mgopt_state)


def _curve(losses, epoch, per_epoch, window):
    """[(epoch, mean loss of a window of batches)] for the training curve."""
    return [(epoch + (k + len(losses[k:k + window])) / per_epoch,
             sum(losses[k:k + window]) / len(losses[k:k + window]))
            for k in range(0, len(losses), window)]


def _datasets(data):
    """(train, test) datasets from {"train", "test"} datasets or {"train_x", ...} tensors."""
    if "train" in data:
        return data["train"], data["test"]
    return (TensorDataset(data["train_x"], data["train_y"]),
            TensorDataset(data["test_x"], data["test_y"]))


def _last_stats(model):
    """(forward, backward) SolveStats of the last solves of the first layer-parallel part of
    ``model`` (an RNN keeps one per layer: the last layer's)."""
    for m in model.modules():
        f, b = getattr(m, "forward_stats", None), getattr(m, "backward_stats", None)
        if isinstance(f, list):
            f, b = (f[-1] if f else None), (b[-1] if b else None)
        if f is not None:
            return f, b
    return None, None


class _SolveLog:
    """The MGRIT statistics of an epoch's batches: iterations and error estimates per solve."""

    def __init__(self):
        self.rows = {"fwd": [], "bwd": []}
        self.missed = []  # (estimate, target) of solves that did not meet their target

    def add(self, model):
        f, b = _last_stats(model)
        for name, st in (("fwd", f), ("bwd", b)):
            if st is not None:
                self.rows[name].append((st.iterations, st.error_estimate))
                if st.target_met is False:
                    self.missed.append((name, st.error_estimate, st.target))

    def missed_line(self, args):
        """The once-per-epoch warning for solves whose estimate did not reach their share of
        --lp-target-error within the iteration caps; None when all did."""
        if not self.missed:
            return None
        n = sum(len(r) for r in self.rows.values())
        worst = max(self.missed, key=lambda m: m[1] / m[2])
        return (f"  warning: {len(self.missed)} of {n} solves ended above their share of "
                f"--lp-target-error {args.lp_target_error:g} (worst: {worst[0]} estimate "
                f"{worst[1]:.1e} for {worst[2]:.1e}) at the iteration caps "
                f"(--lp-fwd-iters {args.lp_fwd_iters}, --lp-bwd-iters {args.lp_bwd_iters}): "
                "raise them to reach the target")

    def summary(self):
        """{fwd_iters, fwd_error_estimate, fwd_error_estimate_max, bwd_...}: means over the
        epoch's batches (and the largest estimate); {} for a serial model."""
        out = {}
        for name, rows in self.rows.items():
            if not rows:
                continue
            est = [e for _, e in rows if e is not None]
            out[f"{name}_iters"] = sum(i for i, _ in rows) / len(rows)
            out[f"{name}_error_estimate"] = sum(est) / len(est) if est else None
            out[f"{name}_error_estimate_max"] = max(est) if est else None
        return out


PROBE_EVERY = 20  # the probes' spacing where MGRIT runs more than one level, unless told


def _multilevel(model, args):
    """Whether a layer-parallel part of ``model`` runs MGRIT on more than one level (with one,
    the solves are exact and there is no error to show)."""
    levels = [max(m.mgrit_levels()) for m in model.modules() if hasattr(m, "mgrit_levels")]
    if levels:
        return max(levels) > 1
    return getattr(args, "lp_levels", 1) != 1  # an RNN's levels form with its first sequence


def _mgrit_line(s, estimates, multilevel=True):
    """' | MGRIT fwd 2.0 it, bwd 1.0 it' for the epoch line; with ``estimates``, each with its
    calibrated estimate: ' | MGRIT fwd 2.0 it, est. error 3.1e-03 (max 5.2e-03), bwd ...';
    ' | exact solves (one MGRIT level)' where no solve iterates."""
    if not multilevel and "fwd_iters" in s:
        return " | exact solves (one MGRIT level)"

    def part(name):
        if f"{name}_iters" not in s:
            return None
        text = f"{name} {s[f'{name}_iters']:.1f} it"
        est, top = s.get(f"{name}_error_estimate"), s.get(f"{name}_error_estimate_max")
        if estimates and est is not None:
            text += f", est. error {est:.1e} (max {top:.1e})"
        return text
    parts = [p for p in (part("fwd"), part("bwd")) if p]
    return " | MGRIT " + ", ".join(parts) if parts else ""


def _depth_smoothness(model):
    """The depth-smoothness penalty of every chain of ``model`` (layer-parallel or serial)."""
    return sum(m.depth_smoothness() for m in model.modules() if hasattr(m, "depth_smoothness"))


def run_summary(model, args, comm):
    """'1 data-parallel x 2 layer-parallel rank(s), 2 MGRIT level(s), cfactor [4], 1 forward /
    1 backward iterations' (or 'serial PyTorch') for an example's header."""
    if args.serial:
        return "serial PyTorch"
    solve = mgrit_summary(model, args)
    if "(exact)" not in solve:  # iterations mean nothing at one level
        solve += f", {args.lp_fwd_iters} forward / {args.lp_bwd_iters} backward iterations"
    return (f"{args.dp_size} data-parallel x {comm.size // args.dp_size} layer-parallel rank(s), "
            f"{solve}")


def mgrit_summary(model, args):
    """'2 MGRIT levels (cfactor [4])' for an example's header: the levels that formed, with
    what was asked when fewer formed."""
    levels = [m.mgrit_levels() for m in model.modules() if hasattr(m, "mgrit_levels")]
    if not levels:
        return "serial PyTorch"
    fwd, bwd = max(f for f, _ in levels), max(b for _, b in levels)
    text = (f"{fwd} MGRIT level(s)" if fwd == bwd else
            f"{fwd} forward / {bwd} adjoint MGRIT level(s)")
    text += " (exact)" if max(fwd, bwd) == 1 else f", cfactor {args.lp_cfactor}"
    if max(fwd, bwd) < args.lp_levels:
        text += f" [asked for {args.lp_levels} levels, cfactor {args.lp_cfactor}]"
    return text


def _audit_line(audits, seconds):
    """'  audits: true gradient error ... ' for the epoch's audits."""
    import statistics

    errors = sorted(a["error"] for a in audits)
    ratios = sorted(a["estimate"] / a["error"] for a in audits
                    if a["calibrated"] and a["estimate"] and a["error"])
    text = (f"  audits ({len(audits)}): true gradient error median "
            f"{statistics.median(errors):.1e} "
            f"(max {errors[-1]:.1e})")
    if ratios:
        text += f", calibrated estimate / true {ratios[0]:.2f}-{ratios[-1]:.2f}"
    share = sum(a["seconds"] for a in audits) / max(seconds, 1e-9)
    return text + f"; they took {100 * share:.0f}% on top of the epoch's training time"


def _probe_line(probes, seconds):
    """'  probes: the gradients' change with one more iteration ...' for the epoch's probes."""
    import statistics

    changes = sorted(p["change"] for p in probes)
    share = sum(p["seconds"] for p in probes) / max(seconds, 1e-9)
    text = (f"  probes ({len(probes)}): the gradients change by {statistics.median(changes):.1e} "
            f"(median; max {changes[-1]:.1e}) with one more MGRIT iteration, an estimate of "
            f"their true error")
    if changes[-1] == 0:  # one more iteration reproduced them bit for bit
        text += " (none at all: the solves are converged, to round-off)"
    tuned = probes[-1].get("tuned")
    if tuned is None:
        return text + (f"; the probes took {100 * share:.0f}% on top of the epoch's training "
                       "time")
    counts = ", ".join("exact" if its is None else f"{its[0]}/{its[1]}" for its in tuned)
    return text + (f"; --lp-tune-error set the iterations to {counts} (forward/adjoint), "
                   f"aiming the probe at {probes[-1]['aim']:.1e}, its probes "
                   f"{100 * share:.0f}% of the epoch's training time")


def _say(bar, line):
    """A line above the progress bar (or plain, without one)."""
    if bar is not None:
        bar.write(line)
    else:
        print(line, flush=True)


def train(args, model, data, *, comm, rank, name, prepare=None, synthetic=False, grid=None,
          build=None):
    """Trains ``model`` on ``data`` = {"train", "test"} datasets (or {"train_x", "train_y",
    "test_x", "test_y"} tensors); every rank runs this same loop.  ``prepare`` maps a raw batch
    of images to the network's input.  With a ProcessGrid, each data group trains on its shard
    of every batch.  ``build(steps)`` makes the network at another depth, for training over
    depths (``Depths``); ``model`` is the full-depth one, trained last."""
    depths = Depths(args, model, build, rank)
    if getattr(args, "lp_mgopt_levels", 1) > 1:
        args.lp_audit_every = args.lp_probe_every = 0  # MG/Opt takes several gradients a batch
    data_size = grid.data_size if grid is not None else 1
    audit_every = 0 if args.serial else getattr(args, "lp_audit_every", 0)
    probe_every = getattr(args, "lp_probe_every", 0)
    if probe_every is None:  # the examples' default: the probe is the error they show
        probe_every = PROBE_EVERY if _multilevel(model, args) else 0
    probe_every = 0 if args.serial else probe_every
    # the residuals' calibrated estimate is shown where it acts (--lp-target-error) or where
    # no probe measures the error
    estimates = not probe_every or getattr(args, "lp_target_error", None) is not None
    tune = None if args.serial else getattr(args, "lp_tune_error", None)
    def make_tuner(model):
        return (layerbraid.accuracy.IterationTuner(model, tune, every=probe_every,
                                                   margin=getattr(args, "lp_tune_margin", 2.0))
                if tune else None)
    guard_window = 0 if args.serial else getattr(args, "lp_bias_guard", 0)
    guard_events = []
    def make_guard(model, bar_of):  # bar_of(): the progress bar the guard's lines go above
        if not guard_window or getattr(args, "lp_mgopt_levels", 1) > 1:
            return None
        return layerbraid.accuracy.BiasGuard(
            model, window=guard_window, max_error=args.lp_bias_guard_error,
            max_iterations=10, log=lambda line: _say(bar_of(), line))
    smoothness = getattr(args, "lp_smoothness", 0.0)
    device = torch.device(args.device)
    optimizer = make_optimizer(args, depths.model.parameters())
    history, start_epoch = [], 0
    resume_from = args.resume
    if not resume_from and args.checkpoint and os.environ.get("TORCHELASTIC_RESTART_COUNT",
                                                              "0") != "0":
        resume_from = args.checkpoint  # torchrun restarted the job: on from its last epoch
    extra = layerbraid.checkpoint.resume(model, resume_from, optimizer) if resume_from else None
    if extra is not None:
        start_epoch, history = extra["epoch"], extra["history"]
        if rank == 0:
            print(f"resumed from {resume_from} after epoch {start_epoch}")
    out_dir = Path(args.out_dir or f"runs/{name}")
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
    # Every rank of a layer group gets the same batches, each data group its shard of every
    # global batch of --batch-size.
    train_set, test_set = _datasets(data)
    loader = LayerParallelLoader(train_set, max(args.batch_size // data_size, 1),
                                 comm=grid if grid is not None else comm, seed=args.seed)
    per_epoch = len(loader)
    if args.max_batches:
        per_epoch = min(per_epoch, args.max_batches)
    # plain PyTorch beside the run: from the same weights, so not after a resume; and on the
    # whole batch, so not with data groups (each trains on its shard)
    reference = None
    if getattr(args, "serial_reference", False) and not args.serial and not args.resume \
            and data_size == 1:
        reference = SerialReference(model, args, rank)
    tuner, tuned, guard = None, None, None
    bar = None
    for epoch in range(start_epoch, args.epochs):
        model, optimizer = depths.epoch(epoch, optimizer)
        if tuned is not model:  # a tuner and a guard follow one network's solves
            tuner, tuned, guard = make_tuner(model), model, make_guard(model, lambda: bar)
        bar = None
        if rank == 0:
            from tqdm import tqdm

            bar = tqdm(total=per_epoch, desc=f"epoch {epoch + 1}/{args.epochs}", unit="batch",
                       dynamic_ncols=True, leave=True, mininterval=0.5 if sys.stderr.isatty() else 10)
        losses, t0 = [], time.perf_counter()
        multilevel = _multilevel(model, args)  # one level: no iterations to show
        solves, audits, probes, alphas = _SolveLog(), [], [], []
        loader.set_epoch(epoch)
        for b, (xb, yb) in enumerate(loader):
            if b >= per_epoch:
                break
            xb = prepare(xb) if prepare else xb
            xb, yb = xb.to(device), yb.to(device)
            chosen = cli.choose_microbatches(args, model, xb)  # --lp-microbatches auto, once
            if chosen and rank == 0:
                _say(bar, chosen)
            optimizer.zero_grad()

            def objective(net=model):
                loss = F.cross_entropy(net(xb), yb)
                return loss, loss + smoothness * _depth_smoothness(net) if smoothness else loss

            if depths.mgopt is not None:  # a V-cycle over the depths, its optimizer steps too
                loss = torch.tensor(depths.mgopt.step(lambda net: objective(net)[1]))
                alphas.append(depths.mgopt.stats.alphas[0])
            else:
                loss, total = objective()
                total.backward()
                # the true gradient error, on the side (batches counted over the whole run)
                if layerbraid.accuracy.audit_due(epoch * per_epoch + b, audit_every):
                    a = layerbraid.accuracy.audit_gradients(model, lambda: objective()[1])
                    audits.append({"batch": b, "error": a.error, "estimate": a.estimate,
                                   "raw_estimate": a.raw_estimate, "calibration": a.calibration,
                                   "calibrated": a.calibrated, "seconds": a.seconds})
                if tuner is not None:  # its probe is the batch's probe
                    t = tuner(lambda: objective()[1], epoch * per_epoch + b)
                    if t is not None:
                        probes.append({"batch": b, "change": t.change, "iterations": t.ran,
                                       "lower_change": t.lower_change, "tuned": t.iterations,
                                       "aim": t.aim, "seconds": t.seconds})
                elif layerbraid.accuracy.audit_due(epoch * per_epoch + b, probe_every):
                    p = layerbraid.accuracy.probe_gradients(model, lambda: objective()[1])
                    probes.append({"batch": b, "change": p.change, "iterations": p.iterations,
                                   "seconds": p.seconds})
                if guard is not None:  # a stalled loss and a large audited error: better solves
                    event = guard(loss, epoch * per_epoch + b, lambda: objective()[1])
                    if event is not None:
                        guard_events.append(vars(event) | {"epoch": epoch})
                optimizer.step()
            if reference is not None:
                reference.step(xb, yb)
            solves.add(model)
            if data_size > 1:  # report the whole batch's loss, not this group's shard
                losses.append(grid.data_comm.allreduce(loss.item()) / data_size)
            else:
                losses.append(loss.item())
            if bar is not None:
                bar.update(1)
                if (b + 1) % args.log_interval == 0 or b + 1 == per_epoch:
                    # the last batch's postfix is drawn once, by close() (not twice in a log)
                    bar.set_postfix(refresh=b + 1 < per_epoch,
                                    loss=f"{sum(losses[-args.log_interval:]) / len(losses[-args.log_interval:]):.4f}",
                                    **{k: f"{v:.1f}" for k, v in solves.summary().items()
                                       if k.endswith("iters") and multilevel})
        audit_seconds = sum(a["seconds"] for a in audits)
        # a tuner's probes are part of training (they set its iterations); others are not
        probe_seconds = sum(p["seconds"] for p in probes if "tuned" not in p)
        tune_seconds = sum(p["seconds"] for p in probes if "tuned" in p)
        seconds = time.perf_counter() - t0 - audit_seconds - probe_seconds
        if reference is not None:  # its steps (on the first rank) are not the run's time
            seconds -= reference.seconds
        if bar is not None:
            bar.close()
        m = min(args.test_limit or len(test_set), len(test_set))
        acc = evaluate(model, Subset(test_set, range(m)), device, prepare=prepare)
        curve = _curve(losses, epoch, per_epoch, args.log_interval)
        serial = reference.epoch_end(Subset(test_set, range(m)), device, prepare) \
            if reference is not None else None
        if serial is not None:
            serial = {"loss_curve": _curve(serial["losses"], epoch, per_epoch, args.log_interval),
                      "train_loss": sum(serial["losses"]) / len(serial["losses"]),
                      "test_accuracy": serial["test_accuracy"]}
        record = {"epoch": epoch + 1, "train_loss": sum(losses) / len(losses), "loss_curve": curve,
                  "serial_reference": serial,
                  "test_accuracy": acc, "seconds_per_batch": seconds / len(losses),
                  "batches": len(losses), "first_losses": losses[:5], "last_losses": losses[-5:],
                  **solves.summary(), "audits": audits, "audit_seconds": audit_seconds,
                  "probes": probes, "probe_seconds": probe_seconds, "tune_seconds": tune_seconds,
                  "mgopt_alphas": alphas}
        history.append(record)
        if rank == 0:
            s = record
            print(f"epoch {s['epoch']}: loss {s['train_loss']:.4f} | test accuracy "
                  f"{100 * acc:.2f}% | {1000 * s['seconds_per_batch']:.1f} ms/batch"
                  f"{_mgrit_line(s, estimates, multilevel)}", flush=True)
            if audits:
                print(_audit_line(audits, seconds), flush=True)
            if probes:
                print(_probe_line(probes, seconds), flush=True)
            if alphas:
                taken = [a for a in alphas if a > 0]
                print(f"  MG/Opt: the line search took the coarse correction at {len(taken)} of "
                      f"{len(alphas)} batches (mean step {sum(alphas) / len(alphas):.2f})",
                      flush=True)
            if serial is not None:
                same = "at full depth from scratch" if depths.schedule[0][0] else \
                    "the same initial weights"
                print(f"  serial reference (plain PyTorch, {same}, the same batches):"
                      f" loss {serial['train_loss']:.4f} | test accuracy "
                      f"{100 * serial['test_accuracy']:.2f}%", flush=True)
            missed = solves.missed_line(args)
            if missed:
                print(missed, flush=True)
            if (epoch == start_epoch and estimates and s.get("fwd_error_estimate") is not None
                    and _multilevel(model, args)):
                print("  (it: MGRIT iterations per batch; est. error: the estimated relative "
                      "error of the forward's output and of the adjoint's input gradient, "
                      "layerbraid.stats.SolveStats.error_estimate, calibrated by the audits, whose "
                      "line gives the true gradient error; --lp-target-error or --lp-tune-error adapt the "
                      "iterations to a target)", flush=True)
            elif epoch == start_epoch and probes:
                print("  (it: MGRIT iterations per batch; probes: how much one more MGRIT "
                      "iteration in every solve changes the gradients, an estimate of their "
                      "true error that needs no calibration (layerbraid.accuracy.probe_gradients), "
                      f"at the batches layerbraid.accuracy.audit_due(batch, {probe_every}) names (--lp-probe-every); "
                      "the audits' line gives the true error; --lp-tune-error sets the "
                      "iterations from the probe)", flush=True)
        if args.checkpoint:  # one file, atomic, loadable on any number of ranks
            layerbraid.save_checkpoint(model, args.checkpoint, optimizer,
                                       extra={"epoch": epoch + 1, "history": history})
    comparison = None
    if not args.serial and getattr(args, "compare_batches", 0):
        comparison = compare_with_serial(model, loader, device, prepare, comm, rank,
                                         args.compare_batches)
    if rank == 0:
        meta = {"example": name, "ranks": comm.Get_size() if comm is not None else 1,
                "data_parallel": data_size, "serial_comparison": comparison,
                "serial": bool(args.serial), "synthetic": synthetic,
                "args": {k: v for k, v in vars(args).items()}, "history": history,
                "bias_guard": guard_events}
        (out_dir / "metrics.json").write_text(json.dumps(meta, indent=1, default=str))
        _plot(history, out_dir / "training_curve.png", name, synthetic)
        print(f"wrote {out_dir / 'metrics.json'} and {out_dir / 'training_curve.png'}")
    return history


def _timed_batch(model, xb, yb):
    """Seconds of one batch's forward + backward (gradients zeroed, no optimizer step)."""
    model.zero_grad()
    t0 = time.perf_counter()
    F.cross_entropy(model(xb), yb).backward()
    seconds = time.perf_counter() - t0
    model.zero_grad()
    return seconds


def compare_with_serial(model, loader, device, prepare, comm, rank, count):
    """Times ``count`` batches' forward + backward on the layer-parallel model (every rank) and
    on its serial copy (the first rank, while the others wait), in pairs: each batch runs on
    both, one right after the other, which first alternating, so that both timings of a pair
    see the machine in the same state (separate stretches of batches see it in different
    ones, and on a shared machine that difference was larger than the one measured).  Prints
    both times and the pairs' speedups, median [min-max], and returns them on the first rank.
    One more pair first warms both up and is not counted."""
    batches = []
    for xb, yb in loader:
        xb = prepare(xb) if prepare else xb
        batches.append((xb.to(device), yb.to(device)))
        if len(batches) == count + 1:
            break
    if len(batches) < 2:
        return None  # too few batches to time after the warm-up (the same on every rank)
    model.train()
    serial_model = model.to_serial()  # collective; the weights do not change below
    parallel, serial = [], []

    def on_serial(xb, yb):  # the first rank times; the others wait for it (with the deadline)
        took = _timed_batch(serial_model, xb, yb) if rank == 0 else None
        serial.append(comm.bcast(took, root=0))

    for k, (xb, yb) in enumerate(batches):
        if k % 2:
            on_serial(xb, yb)
        took = _timed_batch(model, xb, yb)
        parallel.append(max(comm.allgather(took)))  # the batch ends on its slowest rank
        if not k % 2:
            on_serial(xb, yb)
    parallel, serial = parallel[1:], serial[1:]
    if rank != 0:
        return None
    med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    ratios = [s / p for s, p in zip(serial, parallel)]
    lp, sp, speedup = med(parallel), med(serial), med(ratios)
    print(f"time per batch, forward + backward, {len(parallel)} pairs (median [min-max]): "
          f"layer-parallel {1e3 * lp:.1f} [{1e3 * min(parallel):.1f}-{1e3 * max(parallel):.1f}] ms, "
          f"serial PyTorch on one rank {1e3 * sp:.1f} [{1e3 * min(serial):.1f}-"
          f"{1e3 * max(serial):.1f}] ms: speedup {speedup:.2f} [{min(ratios):.2f}-"
          f"{max(ratios):.2f}] (> 1: layer-parallel is faster)", flush=True)
    return {"layer_parallel_seconds": parallel, "serial_seconds": serial, "speedup": speedup,
            "pair_speedups": ratios}


def _plot(history, path, name, synthetic):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [h["epoch"] for h in history]
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.5))
    curve = [pt for h in history for pt in h.get("loss_curve", [])]
    ax[0].plot([c[0] for c in curve], [c[1] for c in curve], "o-", markersize=3, label="this run")
    ax[1].plot(epochs, [100 * h["test_accuracy"] for h in history], "o-", label="this run")
    serial = [h["serial_reference"] for h in history if h.get("serial_reference")]
    if len(serial) == len(history):  # plain PyTorch, trained beside the run
        ref = [pt for r in serial for pt in r["loss_curve"]]
        ax[0].plot([c[0] for c in ref], [c[1] for c in ref], "--", color="k",
                   label="serial PyTorch")
        ax[1].plot(epochs, [100 * r["test_accuracy"] for r in serial], "--", color="k",
                   marker="s", fillstyle="none", label="serial PyTorch")
        ax[0].legend()
        ax[1].legend()
    ax[0].set_xlabel("epoch")
    ax[0].set_ylabel("training loss (window mean)")
    ax[0].set_yscale("log")
    ax[1].set_xlabel("epoch")
    ax[1].set_ylabel("test accuracy (%)")
    fig.suptitle(name + (" (SYNTHETIC random data: timing only)" if synthetic else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
