/* interp.c -- the coarse-grid correction of level l-1 from level l. */
#include "_mgrit.h"

/* F-relax level l from its corrected C-points (the coarsest level was solved already), then add
 * e_k = u_k - v_k at every point k >= 1 of level l, F-points included, to point k cf of level l-1
 * (without spatial transfers: replace that point's value by u_k, Note [injected correction]).
 * Each point's coarse states are released as soon as its correction is added, the others at the
 * end: the next descent rebuilds them. */
int mgrit_i_correct(mgrit_core *core, int l) {
  mgrit_i_level *C = &core->levels[l], *F = &core->levels[l - 1];
  int rc;
  if (l != core->nlevels - 1 && (rc = mgrit_i_fsweep(core, l, 0))) return rc;
  for (int64_t k = C->lo < 1 ? 1 : C->lo; k <= C->hi; k++) {
    mgrit_i_trace(core, l, MGRIT_OP_CORRECT, k, -1, 0);
    if (!core->cb.coarsen && !core->cb.refine) {
      /* Note [injected correction]: without spatial transfers v_k is the fine value u_{k cf}
       * itself (the restriction cloned it, and nothing changes level l-1's C-points between
       * that restriction and this correction), so u_{k cf} + (u_k - v_k) is u_k: the coarse
       * value moves up, exactly, with no pass over the states. */
      mgrit_vec u = C->u[k - C->lo];
      C->u[k - C->lo] = MGRIT_NONE;
      mgrit_i_set(core, &C->v[k - C->lo], MGRIT_NONE);
      mgrit_i_set(core, &F->u[k * F->cf - F->lo], u);
      continue;
    }
    mgrit_vec e = C->u[k - C->lo];
    mgrit_i_sum(core, -1.0, C->v[k - C->lo], 1.0, e);
    /* v_k is spent.  Released now, the fine state it may share (an injection) goes as soon as
     * the sum below replaces it, instead of living on to the end of the correction. */
    mgrit_i_set(core, &C->v[k - C->lo], MGRIT_NONE);
    if (core->cb.refine) { /* interpolate the correction back to the finer grid */
      mgrit_vec ef = MGRIT_NONE;
      MGRIT_I_CB(core, core->cb.refine(core->app, e, l, &ef));
      mgrit_i_sum(core, 1.0, ef, 1.0, F->u[k * F->cf - F->lo]);
      mgrit_i_set(core, &ef, MGRIT_NONE);
    } else {
      mgrit_i_sum(core, 1.0, e, 1.0, F->u[k * F->cf - F->lo]);
    }
    mgrit_i_set(core, &C->u[k - C->lo], MGRIT_NONE); /* e, spent too */
  }
  mgrit_i_free_level_states(core, l);
  return MGRIT_OK;
}
