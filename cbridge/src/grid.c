/* grid.c -- the levels of the hierarchy and the block distribution of steps over ranks. */
#include "_mgrit.h"

#include <stdio.h>
#include <stdlib.h>

/* Steps (not points) are distributed: step s moves fine point s to s+1 and belongs, with point
 * s+1, to the rank whose block holds s.  Point 0 (the initial value) belongs to rank 0.  The first
 * N % P ranks get one step more; with `mirror` the last N % P ranks do, so that a solve backward in
 * time on the reversed communicator gives every rank the mirror image of its forward steps. */
static int64_t block_first(const mgrit_core *core, int64_t rank) {
  int64_t n = core->nsteps, p = core->c.size;
  int64_t quo = n / p, rem = n % p;
  if (!core->mirror) return rank * quo + (rank < rem ? rank : rem);
  int64_t extra_from = p - rem;
  return rank * quo + (rank > extra_from ? rank - extra_from : 0);
}

void mgrit_i_fine_range(const mgrit_core *core, int rank, int64_t *lo, int64_t *hi) {
  int64_t first = block_first(core, rank), next = block_first(core, rank + 1);
  *lo = rank == 0 ? 0 : first + 1;
  *hi = next;
}

int64_t mgrit_i_owner(const mgrit_core *core, int64_t point) {
  int64_t n = core->nsteps, p = core->c.size;
  int64_t quo = n / p, rem = n % p;
  if (point <= 0) return 0;
  int64_t s = point - 1;
  if (!core->mirror) {
    int64_t big = rem * (quo + 1);
    if (s < big) return s / (quo + 1);
    return rem + (s - big) / quo;
  }
  int64_t small = (p - rem) * quo;
  if (s < small) return s / quo;
  return (p - rem) + (s - small) / (quo + 1);
}

double mgrit_i_time(const mgrit_core *core, int l, int64_t i) {
  int64_t fine = i * core->levels[l].stride;
  if (fine == core->nsteps) return core->tstop;
  return core->tstart + (core->tstop - core->tstart) * ((double)fine / (double)core->nsteps);
}

/* C-points of level l; the coarsest level is solved sequentially, so only point 0 is "C". */
int mgrit_i_is_c(const mgrit_core *core, int l, int64_t i) {
  if (l == core->nlevels - 1) return i == 0;
  return i % core->levels[l].cf == 0;
}

static int option_at(const int *values, int n, int l) { return values[l < n ? l : n - 1]; }

int mgrit_i_build_levels(mgrit_core *core) {
  mgrit_i_free_levels(core);
  int cap = core->o.max_levels;
  core->levels = calloc((size_t)cap, sizeof(mgrit_i_level));
  if (!core->levels) return MGRIT_ERR_NOMEM;
  int64_t n = core->nsteps, stride = 1;
  int64_t min_coarse = core->o.min_coarse > 1 ? core->o.min_coarse : 1;
  int nl = 0;
  for (;;) {
    mgrit_i_level *L = &core->levels[nl];
    L->npoints = n + 1;
    L->stride = stride;
    L->nrelax = option_at(core->o.nrelax, core->o.nnr, nl);
    L->ghost = MGRIT_NONE;
    nl++;
    int cf = option_at(core->o.cf, core->o.ncf, nl - 1);
    if (nl == cap || n / cf < min_coarse) break;
    L->cf = cf;
    n /= cf;
    stride *= cf;
  }
  core->nlevels = nl;
  core->levels[nl - 1].cf = 0;
  for (int l = 0; l < nl; l++) core->levels[l].lo = 1, core->levels[l].hi = 0; /* none yet */

  int64_t flo, fhi;
  mgrit_i_fine_range(core, core->c.rank, &flo, &fhi);
  for (int l = 0; l < nl; l++) {
    mgrit_i_level *L = &core->levels[l];
    int64_t m = L->stride;
    L->lo = (flo + m - 1) / m;
    L->hi = fhi / m;
    if (L->hi > L->npoints - 1) L->hi = L->npoints - 1;
    L->left = L->right = -1;
    if (L->lo <= L->hi) {
      if (L->lo > 0) L->left = (int)mgrit_i_owner(core, (L->lo - 1) * m);
      if (L->hi < L->npoints - 1) L->right = (int)mgrit_i_owner(core, (L->hi + 1) * m);
      size_t count = (size_t)(L->hi - L->lo + 1);
      /* calloc checks count * size for overflow (a huge num_steps) and fails cleanly */
      L->u = calloc(count, sizeof(mgrit_vec));
      L->v = calloc(count, sizeof(mgrit_vec));
      L->g = calloc(count, sizeof(mgrit_vec));
      if (!L->u || !L->v || !L->g) {
        mgrit_i_free_levels(core); /* frees what was allocated; the states are all NONE */
        snprintf(core->msg, sizeof core->msg, "rank %d is out of memory building level %d",
                 core->c.rank, l);
        return MGRIT_ERR_NOMEM;
      }
      for (size_t k = 0; k < count; k++) L->u[k] = L->v[k] = L->g[k] = MGRIT_NONE;
    }
  }
  return MGRIT_OK;
}

void mgrit_i_free_level_states(mgrit_core *core, int l) {
  mgrit_i_level *L = &core->levels[l];
  if (L->lo > L->hi || !L->u || !L->v || !L->g) return; /* nothing (or a failed build) */
  for (int64_t k = 0; k <= L->hi - L->lo; k++) {
    mgrit_i_set(core, &L->u[k], MGRIT_NONE);
    mgrit_i_set(core, &L->v[k], MGRIT_NONE);
    mgrit_i_set(core, &L->g[k], MGRIT_NONE);
  }
  mgrit_i_set(core, &L->ghost, MGRIT_NONE);
}

void mgrit_i_free_levels(mgrit_core *core) {
  if (!core->levels) return;
  for (int l = 0; l < core->nlevels; l++) {
    mgrit_i_free_level_states(core, l);
    free(core->levels[l].u);
    free(core->levels[l].v);
    free(core->levels[l].g);
  }
  free(core->levels);
  core->levels = NULL;
  core->nlevels = 0;
}
