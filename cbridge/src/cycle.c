/* cycle.c -- the MGRIT driver: V- and F-cycles, convergence, the final relaxation. */
#include "_mgrit.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int push_norm(mgrit_core *core, double r) {
  if (core->nnorms == core->cap_norms) {
    int cap = core->cap_norms ? 2 * core->cap_norms : 32;
    double *p = realloc(core->norms, (size_t)cap * sizeof(double));
    if (!p) return MGRIT_ERR_NOMEM;
    core->norms = p;
    core->cap_norms = cap;
  }
  core->norms[core->nnorms++] = r;
  return MGRIT_OK;
}

/* Note [parts]: with parts > 1 (mgrit_set_parts) the batch is solved as that many microbatches
 * in lockstep: each level keeps every part's states, and each phase below (a relaxation, a
 * restriction, the coarsest solve, a correction) runs part after part before the next phase.
 * A sweep that passes a state from rank to rank sends each part's state as soon as that part
 * is stepped, so the next rank steps part p while this one steps part p + 1: the coarsest
 * solve, sequential over the ranks with one batch, becomes a pipeline (GPipe's schedule).  Each
 * part's messages have their own tags (mgrit_i_tag).  Nothing couples the parts but the
 * residual sums, which add up over parts exactly as over the batch's samples; the sum of the
 * final residuals' norms is taken per C-point over the parts first (cnorm2), so that it too is
 * the whole batch's.  The application's part callback (mgrit_i_select) says which part its
 * other callbacks act on. */
static int fsweeps(mgrit_core *core, int l, int done) {
  int rc;
  for (int p = 0; p < core->o.parts; p++) {
    mgrit_i_select(core, p);
    if ((rc = mgrit_i_fsweep(core, l, done))) return rc;
  }
  return MGRIT_OK;
}

static int csweeps(mgrit_core *core, int l, int done, double *sums) {
  int rc;
  for (int p = 0; p < core->o.parts; p++) {
    mgrit_i_select(core, p);
    if ((rc = mgrit_i_csweep(core, l, done, sums))) return rc;
  }
  return MGRIT_OK;
}

/* nrelax (F, C) sweeps of every part, the pre-smoothing before a restriction. */
static int relax(mgrit_core *core, int l) {
  int rc;
  for (int s = 0; s < core->levels[l].nrelax; s++) {
    if ((rc = fsweeps(core, l, 0))) return rc;
    if ((rc = csweeps(core, l, 0, NULL))) return rc;
  }
  return MGRIT_OK;
}

/* The descent from level l to l+1 of every part: relax and restrict, or (skip) inject. */
static int descend(mgrit_core *core, int l, int skip, double *sums) {
  int rc;
  if (!skip && (rc = relax(core, l))) return rc;
  for (int p = 0; p < core->o.parts; p++) {
    mgrit_i_select(core, p);
    if ((rc = skip ? mgrit_i_inject(core, l) : mgrit_i_restrict(core, l, sums))) return rc;
  }
  return MGRIT_OK;
}

static int correct(mgrit_core *core, int l) {
  int rc;
  for (int p = 0; p < core->o.parts; p++) {
    mgrit_i_select(core, p);
    if ((rc = mgrit_i_correct(core, l))) return rc;
  }
  return MGRIT_OK;
}

/* The final relaxation of every part: an F-sweep, and with final_fc a C-sweep that measures
 * the residual into final (Note [parts]: each C-point's norm over the parts). */
static int final_relax(mgrit_core *core, double *final) {
  int rc = fsweeps(core, 0, 1);
  if (rc || !core->o.final_fc) return rc;
  mgrit_i_level *L = &core->levels[0];
  int64_t n = L->lo <= L->hi ? L->hi - L->lo + 1 : 0;
  if (core->o.parts > 1 && n) {
    core->cnorm2 = calloc((size_t)n, sizeof(double));
    if (!core->cnorm2) return MGRIT_ERR_NOMEM;
  }
  rc = csweeps(core, 0, 1, final);
  if (core->cnorm2) {
    for (int64_t k = 0; k < n; k++) final[2] += sqrt(core->cnorm2[k]);
    free(core->cnorm2);
    core->cnorm2 = NULL;
  }
  return rc;
}

/* Down from level `top` to the coarsest, solve there, and correct back up to `top`. */
static int vcycle(mgrit_core *core, int top, double *sums) {
  int rc, last = core->nlevels - 1;
  for (int l = top; l < last; l++)
    if ((rc = descend(core, l, 0, sums))) return rc;
  if ((rc = fsweeps(core, last, 0))) return rc;
  for (int l = last; l > top; l--)
    if ((rc = correct(core, l))) return rc;
  return MGRIT_OK;
}

/* One iteration: a V-cycle, or an F-cycle, which after each coarse level l has received its
 * correction runs one more V-cycle from l before correcting level l-1. */
static int iterate(mgrit_core *core, int skip, double *sums) {
  int rc, last = core->nlevels - 1;
  for (int l = 0; l < last; l++)
    if ((rc = descend(core, l, skip, sums))) return rc;
  if ((rc = fsweeps(core, last, 0))) return rc;
  for (int l = last; l >= 1; l--) {
    if (core->o.cycle == MGRIT_CYCLE_F && l < last && (rc = vcycle(core, l, sums))) return rc;
    if ((rc = correct(core, l))) return rc;
  }
  return MGRIT_OK;
}

/* An iteration's summed residual: its norm joins the history (but the skipped first iteration's,
 * which measures nothing) and must be finite.  Returns MGRIT_OK or MGRIT_ERR_NAN. */
static int record(mgrit_core *core, int iter, int skip, const double *sums) {
  if (skip) return MGRIT_OK;
  double r = sqrt(sums[0]);
  core->state_norm = sqrt(sums[1]);
  int rc = push_norm(core, r);
  if (rc) return rc;
  if (!isfinite(r)) {
    snprintf(core->msg, sizeof core->msg,
             "the residual norm is %g at iteration %d: the solve diverged or a step "
             "produced NaN/Inf",
             r, iter);
    core->err = MGRIT_ERR_NAN;
    return MGRIT_ERR_NAN;
  }
  return MGRIT_OK;
}

/* The end of a solve: the status allreduce, which also sums the final C-relaxation's residual
 * (`final`, when measured) and the residuals of the iterations whose allreduce was deferred
 * (Note [deferred status]: `ndeferred` triples in `deferred`, the iterations from `first`).
 *
 * Note [idle work]: before it, a rank whose part went well waits until its sends are received
 * (so that no message waits on this rank's MPI progress) and then calls the idle callback:
 * the allreduce would otherwise make it wait for the slowest rank, and work that needs no
 * other rank can run in that wait instead of after the solve (the adjoint's deferred
 * parameter gradients, Note [deferred parameter gradients] in layerbraid/_layer_steps.py).  A
 * failing idle callback poisons the allreduce like any callback. */
static int finish_deferred(mgrit_core *core, int rc, double *final, double *deferred,
                           int ndeferred, int first) {
  int n = 3 * ndeferred + (final ? 3 : 0);
  if (rc == MGRIT_OK && !core->err && !core->virt && core->cb.idle) {
    rc = mgrit_i_wait_sends(core);
    for (int p = 0; rc == MGRIT_OK && p < core->o.parts; p++) {
      mgrit_i_select(core, p);
      MGRIT_I_CB(core, core->cb.idle(core->app));
    }
  }
  if (rc == MGRIT_OK || rc == MGRIT_ERR_NAN) {
    if (final) memcpy(deferred + 3 * ndeferred, final, 3 * sizeof(double));
    int status = n ? mgrit_i_allreduce_status(core, deferred, n)
                   : mgrit_i_allreduce_status(core, (double[3]){0.0, 0.0, 0.0}, 3);
    if (rc == MGRIT_OK) rc = status;
    for (int k = 0; k < ndeferred && rc == MGRIT_OK; k++)
      rc = record(core, first + k, core->o.skip && first + k == 0, deferred + 3 * k);
    if (rc == MGRIT_OK && final) {
      final = deferred + 3 * ndeferred;
      core->final_residual = sqrt(final[0]);
      core->final_state_norm = sqrt(final[1]);
      core->final_residual_sum = final[2];
    }
  } else {
    mgrit_i_wait_sends(core);
  }
  for (int l = 1; l < core->nlevels; l++) mgrit_i_free_level_parts(core, l);
  if (rc == MGRIT_ERR_CALLBACK && !core->msg[0])
    snprintf(core->msg, sizeof core->msg, "a callback failed on rank %d", core->c.rank);
  if (rc == MGRIT_ERR_REMOTE)
    snprintf(core->msg, sizeof core->msg, "a callback failed on rank %d; rank %d stopped",
             core->failed_rank, core->c.rank);
  return rc;
}

static int finish(mgrit_core *core, int rc, double *final) {
  double buf[3];
  return finish_deferred(core, rc, final, buf, 0, 0);
}

static int check_same_everywhere(mgrit_core *core) {
  /* A cheap fingerprint of the problem and the options (Note [options fingerprint] in
   * _mgrit.h), compared across ranks. */
  static const char *names[] = {
#define NAME(name, value) #name,
      MGRIT_I_FINGERPRINT(NAME)
#undef NAME
  };
  enum { NSCALAR = sizeof names / sizeof *names, N = NSCALAR + 2 * 64 };
  double f[N] = {
#define VALUE(name, value) value,
      MGRIT_I_FINGERPRINT(VALUE)
#undef VALUE
  };
  for (int k = 0; k < core->o.ncf; k++) f[NSCALAR + k] = core->o.cf[k];
  for (int k = 0; k < core->o.nnr; k++) f[NSCALAR + 64 + k] = core->o.nrelax[k];
  double lo[N], hi[N];
  mgrit_i_req req;
  int rc;
  if ((rc = mgrit_i_iallreduce(core, f, lo, N, MGRIT_I_MIN, &req))) return rc;
  if ((rc = mgrit_i_poll_wait(core, &req, "the options check at setup"))) return rc;
  if ((rc = mgrit_i_iallreduce(core, f, hi, N, MGRIT_I_MAX, &req))) return rc;
  if ((rc = mgrit_i_poll_wait(core, &req, "the options check at setup"))) return rc;
  for (int k = 0; k < N; k++) {
    if (lo[k] != hi[k]) {
      const char *name = k < NSCALAR ? names[k] : k < NSCALAR + 64 ? "cfactor" : "nrelax";
      snprintf(core->msg, sizeof core->msg,
               "the ranks were given different problems or options: %s ranges from %g to %g",
               name, lo[k], hi[k]);
      return MGRIT_ERR_MISMATCH;
    }
  }
  return MGRIT_OK;
}

int mgrit_setup(mgrit_core *core) {
  int rc;
  core->msg[0] = 0;
  if (core->built) return MGRIT_OK;
  if (!core->virt && (rc = check_same_everywhere(core))) return rc;
  if (core->nsteps < core->c.size) {
    snprintf(core->msg, sizeof core->msg,
             "num_steps=%lld is smaller than the number of ranks (%d): every rank needs a step",
             (long long)core->nsteps, core->c.size);
    return MGRIT_ERR_ARG;
  }
  if ((rc = mgrit_i_build_levels(core))) return rc;
  core->built = 1;
  return MGRIT_OK;
}

int mgrit_solve(mgrit_core *core) {
  int rc;
  core->err = MGRIT_OK;
  core->failed_rank = -1;
  core->nnorms = 0;
  core->iterations = 0;
  core->ntrace = 0;
  core->comm_seconds = 0.0;
  core->state_norm = core->final_residual = core->final_state_norm = -1.0;
  core->final_residual_sum = -1.0;
  if ((rc = mgrit_setup(core))) return rc;
  for (int l = 0; l < core->nlevels; l++) mgrit_i_free_level_parts(core, l);

  /* Only point 0 and the level-0 C-points need a value before the first sweep: every F-point
   * (and, on one level, every point) is written by an F-sweep before it is read. */
  mgrit_i_level *F = &core->levels[0];
  for (int p = 0; p < core->o.parts; p++) {
    mgrit_i_select(core, p);
    for (int64_t i = F->lo; i <= F->hi; i++) {
      if (i > 0 && (core->nlevels == 1 || !mgrit_i_is_c(core, 0, i))) continue;
      mgrit_vec x = MGRIT_NONE;
      mgrit_i_trace(core, 0, MGRIT_OP_INIT, i, -1, 0);
      MGRIT_I_CB(core, core->cb.init(core->app, mgrit_i_time(core, 0, i), i, &x));
      mgrit_i_set(core, &F->u[i - F->lo], x);
    }
  }

  if (core->nlevels == 1) { /* sequential stepping across the ranks */
    rc = fsweeps(core, 0, 1);
    if (!rc && core->o.max_levels > 1) {
      core->iterations = 1;
      rc = push_norm(core, 0.0);
    }
    return finish(core, rc, NULL);
  }

  /* Note [deferred status]: nothing waits on the residual norm of an iteration after which the
   * solve goes on whatever it is: every iteration of a solve with no stopping test (tol and
   * rtol 0, as with a fixed iteration count), and the last allowed iteration of any solve.
   * Such an iteration's sums are kept and reduced with the final ones in the allreduce that
   * ends the solve.  An allreduce after each iteration made every rank wait for the slowest
   * (rank 0, whose coarse steps come first, for the last rank's) before it could start its
   * next relaxation; without it, a rank goes on as soon as its own part of the coarse solve is
   * done, which layerbraid.plan's work model (virtual ranks) sees as well.  A failure still
   * reaches every rank: a failed rank keeps the schedule with poisoned messages (Note
   * [poisoned messages], comm.c), so the ranks after it stop computing at their next receive
   * and every rank learns who failed at the end of the solve, one solve later at most than
   * with an allreduce per iteration; a diverged solve is reported at the end, after its
   * remaining iterations ran on NaN. */
  int defer = core->o.tol <= 0 && core->o.rtol <= 0;
  double few[6], *deferred = few;
  if (defer && core->o.max_iters > 1) {
    deferred = calloc(3 * ((size_t)core->o.max_iters + 1), sizeof(double));
    if (!deferred) return finish(core, MGRIT_ERR_NOMEM, NULL);
  }
  int ndeferred = 0;
  for (int iter = 0;; iter++) {
    int skip = core->o.skip && iter == 0, last = iter + 1 >= core->o.max_iters;
    double sums[3] = {0.0, 0.0, 0.0};
    if ((rc = iterate(core, skip, sums))) break;
    core->iterations = iter + 1;
    if (defer || last) {
      memcpy(deferred + 3 * ndeferred++, sums, sizeof sums);
      if (last) break;
      continue;
    }
    mgrit_i_trace(core, 0, MGRIT_OP_NORM, iter, -1, 0);
    if ((rc = mgrit_i_allreduce_status(core, sums, 3))) break;
    if ((rc = record(core, iter, skip, sums))) break;
    /* virtual ranks run max_iters */
    if (!skip && !core->virt && (sqrt(sums[0]) < core->o.tol ||
                                 sqrt(sums[0]) < core->o.rtol * core->state_norm))
      break;
  }
  double final[3] = {0.0, 0.0, 0.0};
  if (!rc) rc = final_relax(core, final);
  rc = finish_deferred(core, rc, !rc && core->o.final_fc ? final : NULL, deferred, ndeferred,
                       core->iterations - ndeferred);
  if (deferred != few) free(deferred);
  return rc;
}
