/* restrict.c -- FAS restriction with the residual at the C-points, and the skipped descent. */
#include "_mgrit.h"

#include <math.h>

/* Restrict level l to level l+1: an F-sweep, then at each C-point c >= cf the residual
 * r_c = Phi_l(u_{c-1}) (+ g_c) - u_c; coarse values v_k = u_{k cf}; coarse right-hand side
 * g_k = r_{k cf} + v_k - Phi_{l+1}(v_{k-1}); the coarse unknowns start at v.  With spatial
 * transfers, v and r are coarsened in space too (the application's coarsen).  On level 0 the
 * squared residual norms are added to sums[0], the squared norms of the states u_c to sums[1]
 * (sums has 3 entries, see mgrit_i_allreduce_status). */
int mgrit_i_restrict(mgrit_core *core, int l, double *sums) {
  mgrit_i_level *L = &core->levels[l], *C = &core->levels[l + 1];
  int64_t cf = L->cf;
  int rc;
  /* C-values do not change in an F-sweep: v can be formed, and its ghost sent, up front. */
  for (int64_t k = C->lo; k <= C->hi; k++)
    mgrit_i_set(core, &C->v[k - C->lo], mgrit_i_coarsen(core, l, L->u[k * cf - L->lo]));
  if (C->lo <= C->hi &&
      (rc = mgrit_i_send(core, C->right, mgrit_i_tag(core, l + 1, 1), l + 1, C->hi, C->v[C->hi - C->lo])))
    return rc;
  if ((rc = mgrit_i_fsweep(core, l, 0))) return rc;

  for (int64_t k = C->lo < 1 ? 1 : C->lo; k <= C->hi; k++) {
    int64_t c = k * cf;
    mgrit_vec r = mgrit_i_step(core, l, c, mgrit_i_before(L, c), 0, MGRIT_OP_RSTEP, 1);
    mgrit_i_sum(core, -1.0, L->u[c - L->lo], 1.0, r);
    if (l == 0 && !core->err) {
      double nrm = 0.0, unrm = 0.0;
      MGRIT_I_CB(core, core->cb.norm(core->app, r, &nrm));
      MGRIT_I_CB(core, core->cb.norm(core->app, L->u[c - L->lo], &unrm));
      sums[0] += nrm * nrm;
      sums[1] += unrm * unrm;
    }
    if (core->cb.coarsen) { /* the residual moves to the coarse grid like the states */
      mgrit_vec rc = mgrit_i_coarsen(core, l, r);
      mgrit_i_set(core, &r, MGRIT_NONE);
      r = rc;
    }
    mgrit_i_set(core, &C->g[k - C->lo], r);
  }
  if (C->lo > C->hi) return MGRIT_OK;

  mgrit_vec vghost = MGRIT_NONE;
  if (C->lo > 0 &&
      (rc = mgrit_i_recv(core, C->left, mgrit_i_tag(core, l + 1, 1), l + 1, C->lo - 1, &vghost)))
    return rc;
  for (int64_t k = C->lo < 1 ? 1 : C->lo; k <= C->hi; k++) {
    mgrit_vec vprev = k - 1 >= C->lo ? C->v[k - 1 - C->lo] : vghost;
    mgrit_vec p = mgrit_i_step(core, l + 1, k, vprev, 0, MGRIT_OP_GSTEP, 0);
    mgrit_vec g = C->g[k - C->lo];
    mgrit_i_sum(core, 1.0, C->v[k - C->lo], 1.0, g);
    mgrit_i_sum(core, -1.0, p, 1.0, g);
    mgrit_i_set(core, &p, MGRIT_NONE);
  }
  mgrit_i_set(core, &vghost, MGRIT_NONE);
  for (int64_t k = C->lo; k <= C->hi; k++)
    mgrit_i_set(core, &C->u[k - C->lo], mgrit_i_clone(core, C->v[k - C->lo]));
  return MGRIT_OK;
}

/* The skipped first descent: level l+1 takes the injected values of level l as u and v, g = 0. */
int mgrit_i_inject(mgrit_core *core, int l) {
  mgrit_i_level *L = &core->levels[l], *C = &core->levels[l + 1];
  for (int64_t k = C->lo; k <= C->hi; k++) {
    mgrit_i_set(core, &C->v[k - C->lo], mgrit_i_coarsen(core, l, L->u[k * L->cf - L->lo]));
    mgrit_i_set(core, &C->u[k - C->lo], mgrit_i_clone(core, C->v[k - C->lo]));
    mgrit_i_set(core, &C->g[k - C->lo], MGRIT_NONE);
  }
  return MGRIT_OK;
}
