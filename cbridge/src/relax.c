/* relax.c -- steps, F-sweeps (and the sequential coarsest solve), C-sweeps. */
#include "_mgrit.h"

#include <stdio.h>
#include <stdlib.h>


/* The step of level l into point i from state u (the value at i-1), plus the FAS right-hand side
 * g_i on coarse levels when add_g.  Returns a new state, or MGRIT_NONE on a poisoned rank. */
mgrit_vec mgrit_i_step(mgrit_core *core, int l, int64_t i, mgrit_vec u, int done, int op,
                      int add_g) {
  mgrit_i_level *L = &core->levels[l];
  mgrit_i_trace(core, l, op, i, -1, done);
  if (core->err || u == MGRIT_NONE) return MGRIT_NONE;
  mgrit_vec out = MGRIT_NONE;
  double t0 = mgrit_i_time(core, l, i - 1), t1 = mgrit_i_time(core, l, i);
  MGRIT_I_CB(core, core->cb.step(core->app, u, t0, t1, l, (i - 1) * L->stride, done, &out));
  if (core->err) return MGRIT_NONE;
  if (add_g && l > 0 && i >= L->lo && i <= L->hi) mgrit_i_sum(core, 1.0, L->g[i - L->lo], 1.0, out);
  return out;
}

/* Whether any of out[0 .. n-1] is missing. */
static int any_missing(const mgrit_vec *out, int64_t n) {
  for (int64_t k = 0; k < n; k++)
    if (out[k] == MGRIT_NONE) return 1;
  return 0;
}

/* Steps a..b of level l in one step_interval call, when no FAS right-hand side enters between
 * them (Note [fused intervals]); returns 0, having done nothing, when one does (or no memory
 * for the call's arrays), and run() steps one point at a time instead.
 *
 * Note [fused intervals]: the schedule is the same either way: every step is traced as if it
 * ran alone, so the trace, the work model that replays it (layerbraid.plan) and the states the
 * core keeps do not depend on whether the application fuses.  With release (level 0 without
 * store_all) only the last state of the run is kept, which is what the one-step path keeps once
 * the run is over; the application may then skip making the others (keep = 0). */
static int run_interval(mgrit_core *core, int l, int64_t a, int64_t b, mgrit_vec prev, int done,
                        int op, int release) {
  mgrit_i_level *L = &core->levels[l];
  int64_t n = b - a + 1;
  if (l > 0)
    for (int64_t i = a; i <= b; i++)
      if (i >= L->lo && i <= L->hi && L->g[i - L->lo] != MGRIT_NONE) return 0;
  mgrit_vec *out = calloc((size_t)n, sizeof *out);
  double *t = calloc((size_t)n + 1, sizeof *t);
  if (!out || !t) {
    free(out);
    free(t);
    return 0;
  }
  for (int64_t k = 0; k < n; k++) out[k] = MGRIT_NONE;
  for (int64_t k = 0; k <= n; k++) t[k] = mgrit_i_time(core, l, a - 1 + k);
  for (int64_t i = a; i <= b; i++) mgrit_i_trace(core, l, op, i, -1, done);
  if (!core->err && prev != MGRIT_NONE) {
    MGRIT_I_CB(core, core->cb.step_interval(core->app, prev, t, l, (a - 1) * L->stride,
                                           L->stride, n, done, !release, out));
    if (!core->err && (out[n - 1] == MGRIT_NONE ||
                       (!release && any_missing(out, n)))) {
      snprintf(core->msg, sizeof core->msg, "the step_interval callback of level %d, points "
               "%lld..%lld, left a state it must return", l, (long long)a, (long long)b);
      core->err = MGRIT_ERR_CALLBACK;
    }
  }
  for (int64_t i = a; i <= b; i++) {
    mgrit_vec x = core->err ? MGRIT_NONE : out[i - a];
    if (core->err && out[i - a] != MGRIT_NONE) core->cb.free(core->app, out[i - a]);
    if (release && i < b) {
      if (x != MGRIT_NONE) core->cb.free(core->app, x);
      x = MGRIT_NONE;
    }
    mgrit_i_set(core, &L->u[i - L->lo], x);
  }
  free(out);
  free(t);
  return 1;
}

/* Steps a..b (F-points) in order, starting from prev = u[a-1].  Without store_all, a level-0
 * F-point is released as soon as the next step has read it: only the F-points just before a
 * C-point (read by C-sweeps and residuals) and the last owned point (sent right) stay. */
static void run(mgrit_core *core, int l, int64_t a, int64_t b, mgrit_vec prev, int done, int op) {
  mgrit_i_level *L = &core->levels[l];
  int release = l == 0 && !core->o.store_all;
  if (core->cb.step_interval && b > a && run_interval(core, l, a, b, prev, done, op, release))
    return;
  for (int64_t i = a; i <= b; i++) {
    mgrit_vec out = mgrit_i_step(core, l, i, prev, done, op, 1);
    mgrit_i_set(core, &L->u[i - L->lo], out);
    if (release && i > a) mgrit_i_set(core, &L->u[i - 1 - L->lo], MGRIT_NONE);
    prev = out;
  }
}

static int recv_ghost(mgrit_core *core, int l) {
  mgrit_i_level *L = &core->levels[l];
  mgrit_vec x = MGRIT_NONE;
  int rc = mgrit_i_recv(core, L->left, mgrit_i_tag(core, l, 0), l, L->lo - 1, &x);
  mgrit_i_set(core, L->ghost, x);
  return rc;
}

/* F-sweep of level l: every F-point from the C-point (or the sequence of F-points) before it.
 * C-points are not touched, so the C-values "as they were before the sweep" come for free.
 * Order matters for parallelism: the interval that continues on the right rank is computed and
 * sent first, then the interval that continues from the left rank (which waits for its message),
 * then the intervals in between.  On the coarsest level every point but 0 is an F-point, which
 * makes this the sequential solve, pipelined across ranks.  Afterwards *L->ghost holds u[lo-1]. */
int mgrit_i_fsweep(mgrit_core *core, int l, int done) {
  mgrit_i_level *L = &core->levels[l];
  if (L->lo > L->hi) return MGRIT_OK;
  int coarsest = l == core->nlevels - 1;
  int op = coarsest ? MGRIT_OP_SEQSTEP : MGRIT_OP_FSTEP;
  int rc;
  int64_t first_c = -1, last_c = -1;
  if (coarsest) {
    if (L->lo == 0) first_c = last_c = 0;
  } else {
    int64_t cf = L->cf;
    first_c = (L->lo + cf - 1) / cf * cf;
    last_c = L->hi / cf * cf;
    if (first_c > L->hi) first_c = last_c = -1;
  }
  if (first_c < 0) { /* no C-point here: one piece of an interval that spans ranks */
    if ((rc = recv_ghost(core, l))) return rc;
    run(core, l, L->lo, L->hi, *L->ghost, done, op);
    return mgrit_i_send(core, L->right, mgrit_i_tag(core, l, 0), l, L->hi, L->u[L->hi - L->lo]);
  }
  run(core, l, last_c + 1, L->hi, L->u[last_c - L->lo], done, op);
  if ((rc = mgrit_i_send(core, L->right, mgrit_i_tag(core, l, 0), l, L->hi, L->u[L->hi - L->lo])))
    return rc;
  if (L->lo < first_c) {
    if ((rc = recv_ghost(core, l))) return rc;
    run(core, l, L->lo, first_c - 1, *L->ghost, done, op);
  }
  if (!coarsest) {
    for (int64_t c = first_c; c < last_c; c += L->cf)
      run(core, l, c + 1, c + L->cf - 1, L->u[c - L->lo], done, op);
  }
  if (L->lo == first_c && L->lo > 0) return recv_ghost(core, l);
  return MGRIT_OK;
}

/* The value at point i-1 (owned, or the ghost). */
mgrit_vec mgrit_i_before(const mgrit_i_level *L, int64_t i) {
  return i - 1 >= L->lo ? L->u[i - 1 - L->lo] : *L->ghost;
}

/* C-sweep of level l: each C-point c >= cf from the F-value just before it.  Needs the ghost of
 * the preceding F-sweep, no messages.  With sums (level 0), the squared norms of what the sweep
 * changes (the residual r_c, after an F-sweep) and of the old states are added to sums[0] and
 * sums[1], and the norms of the r_c to sums[2] (a bound on the norm of their vector sum that
 * does not depend on how the points are split over ranks), except the last point's: the sweep
 * removes that residual entirely, with no later point to carry it. */
int mgrit_i_csweep(mgrit_core *core, int l, int done, double *sums) {
  mgrit_i_level *L = &core->levels[l];
  if (L->lo > L->hi) return MGRIT_OK;
  int64_t cf = L->cf;
  int64_t c = (L->lo + cf - 1) / cf * cf;
  if (c == 0) c = cf;
  for (; c <= L->hi; c += cf) {
    mgrit_vec out = mgrit_i_step(core, l, c, mgrit_i_before(L, c), done, MGRIT_OP_CSTEP, 1);
    if (sums && !core->err && out != MGRIT_NONE && L->u[c - L->lo] != MGRIT_NONE) {
      mgrit_vec d = mgrit_i_clone(core, out);
      double nrm = 0.0, unrm = 0.0;
      mgrit_i_sum(core, -1.0, L->u[c - L->lo], 1.0, d);
      if (!core->err) MGRIT_I_CB(core, core->cb.norm(core->app, d, &nrm));
      if (!core->err) MGRIT_I_CB(core, core->cb.norm(core->app, L->u[c - L->lo], &unrm));
      mgrit_i_set(core, &d, MGRIT_NONE);
      sums[0] += nrm * nrm;
      sums[1] += unrm * unrm;
      if (c * L->stride != core->nsteps && core->cnorm2) /* Note [parts] in cycle.c */
        core->cnorm2[c - L->lo] += nrm * nrm;
      else if (c * L->stride != core->nsteps)
        sums[2] += nrm;
    }
    mgrit_i_set(core, &L->u[c - L->lo], out);
  }
  return MGRIT_OK;
}
