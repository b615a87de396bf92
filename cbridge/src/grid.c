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

/* Allocates level L's states for every part; returns 0 when out of memory. */
static int alloc_parts(mgrit_i_level *L, int parts) {
  size_t count = L->lo <= L->hi ? (size_t)(L->hi - L->lo + 1) : 0, n = count * (size_t)parts;
  L->ghosts = calloc((size_t)parts, sizeof(mgrit_vec));
  if (!L->ghosts) return 0;
  for (int p = 0; p < parts; p++) L->ghosts[p] = MGRIT_NONE;
  if (!count) return 1;
  /* calloc checks n * size for overflow (a huge num_steps) and fails cleanly */
  mgrit_vec **arrays[3] = {&L->ubase, &L->vbase, &L->gbase};
  for (int a = 0; a < 3; a++) {
    mgrit_vec *x = *arrays[a] = calloc(n, sizeof(mgrit_vec));
    if (!x) return 0;
    for (size_t k = 0; k < n; k++) x[k] = MGRIT_NONE;
  }
  return 1;
}

void mgrit_i_select(mgrit_core *core, int p) {
  for (int l = 0; l < core->nlevels; l++) {
    mgrit_i_level *L = &core->levels[l];
    size_t off = L->lo <= L->hi ? (size_t)p * (size_t)(L->hi - L->lo + 1) : 0;
    L->u = L->ubase ? L->ubase + off : NULL;
    L->v = L->vbase ? L->vbase + off : NULL;
    L->g = L->gbase ? L->gbase + off : NULL;
    L->ghost = L->ghosts + p;
  }
  if (core->part != p && core->cb.part) MGRIT_I_CB(core, core->cb.part(core->app, p));
  core->part = p;
}

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
    }
    core->built_parts = core->o.parts;
    if (!alloc_parts(L, core->o.parts)) {
      mgrit_i_free_levels(core); /* frees what was allocated; the states are all NONE */
      snprintf(core->msg, sizeof core->msg, "rank %d is out of memory building level %d",
               core->c.rank, l);
      return MGRIT_ERR_NOMEM;
    }
  }
  core->part = 0;
  mgrit_i_select(core, 0);
  return MGRIT_OK;
}

void mgrit_i_free_level_states(mgrit_core *core, int l) {
  mgrit_i_level *L = &core->levels[l];
  if (L->ghost) mgrit_i_set(core, L->ghost, MGRIT_NONE);
  if (L->lo > L->hi || !L->u || !L->v || !L->g) return; /* nothing (or a failed build) */
  for (int64_t k = 0; k <= L->hi - L->lo; k++) {
    mgrit_i_set(core, &L->u[k], MGRIT_NONE);
    mgrit_i_set(core, &L->v[k], MGRIT_NONE);
    mgrit_i_set(core, &L->g[k], MGRIT_NONE);
  }
}

/* Frees every part's states of level l, the current part selected again afterwards. */
void mgrit_i_free_level_parts(mgrit_core *core, int l) {
  mgrit_i_level *L = &core->levels[l];
  size_t count = L->lo <= L->hi ? (size_t)(L->hi - L->lo + 1) : 0;
  size_t n = count * (size_t)core->built_parts;
  for (int p = 0; L->ghosts && p < core->built_parts; p++) mgrit_i_set(core, &L->ghosts[p], MGRIT_NONE);
  mgrit_vec *arrays[3] = {L->ubase, L->vbase, L->gbase};
  for (int a = 0; a < 3; a++) /* an array that failed to allocate is NULL: nothing to free */
    for (size_t k = 0; arrays[a] && k < n; k++) mgrit_i_set(core, &arrays[a][k], MGRIT_NONE);
}

void mgrit_i_free_levels(mgrit_core *core) {
  if (!core->levels) return;
  for (int l = 0; l < core->nlevels; l++) {
    mgrit_i_free_level_parts(core, l);
    free(core->levels[l].ubase);
    free(core->levels[l].vbase);
    free(core->levels[l].gbase);
    free(core->levels[l].ghosts);
  }
  free(core->levels);
  core->levels = NULL;
  core->nlevels = 0;
}
