/* vec.c -- the operations on states that every phase uses: replace, clone, carry to a coarser
 * level, sum.  Each is one callback, skipped on a poisoned rank (frees always run). */
#include "_mgrit.h"

/* Replace the state in *slot by x, freeing the old one.  Frees run even on a poisoned rank so
 * that the application's table empties. */
void mgrit_i_set(mgrit_core *core, mgrit_vec *slot, mgrit_vec x) {
  if (*slot != MGRIT_NONE && *slot != x) core->cb.free(core->app, *slot);
  *slot = x;
}

mgrit_vec mgrit_i_clone(mgrit_core *core, mgrit_vec x) {
  mgrit_vec out = MGRIT_NONE;
  if (x == MGRIT_NONE) return MGRIT_NONE;
  MGRIT_I_CB(core, core->cb.clone(core->app, x, &out));
  return core->err ? MGRIT_NONE : out;
}

/* A new state: x (of level l) carried to level l+1, in space too when the application coarsens. */
mgrit_vec mgrit_i_coarsen(mgrit_core *core, int l, mgrit_vec x) {
  mgrit_vec out = MGRIT_NONE;
  if (x == MGRIT_NONE) return MGRIT_NONE;
  if (!core->cb.coarsen) return mgrit_i_clone(core, x);
  MGRIT_I_CB(core, core->cb.coarsen(core->app, x, l, &out));
  return core->err ? MGRIT_NONE : out;
}

void mgrit_i_sum(mgrit_core *core, double a, mgrit_vec x, double b, mgrit_vec y) {
  if (x == MGRIT_NONE || y == MGRIT_NONE) return;
  MGRIT_I_CB(core, core->cb.sum(core->app, a, x, b, y));
}
