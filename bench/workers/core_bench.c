/* core_bench.c -- the MGRIT core's own time per step, with C callbacks on scalar states.
 *
 * States are doubles in a table of this program; the step is u / (1 + dt) (u' = -u, backward
 * Euler), so nearly all the time measured is the core's: bookkeeping, sweeps, messages.
 * Usage: core_bench N LEVELS CFACTOR ITERS REPEATS   (prints JSON on rank 0) */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mgrit.h"

typedef struct {
  double *v;
  int64_t *free_ids;
  int64_t n, cap, nfree, steps;
} table;

static int64_t put(table *t, double x) {
  int64_t id;
  if (t->nfree) {
    id = t->free_ids[--t->nfree];
  } else {
    if (t->n == t->cap) {
      t->cap = t->cap ? 2 * t->cap : 1024;
      t->v = realloc(t->v, t->cap * sizeof(double));
      t->free_ids = realloc(t->free_ids, t->cap * sizeof(int64_t));
    }
    id = t->n++;
  }
  t->v[id] = x;
  return id;
}

static int cb_init(void *a, double t, int64_t i, mgrit_vec *o) { *o = put(a, t == 0 ? 1.0 : 0.456); return 0; }
static int cb_clone(void *a, mgrit_vec x, mgrit_vec *o) { table *t = a; *o = put(t, t->v[x]); return 0; }
static int cb_free(void *a, mgrit_vec x) { table *t = a; t->free_ids[t->nfree++] = x; return 0; }
static int cb_sum(void *a, double al, mgrit_vec x, double be, mgrit_vec y) {
  table *t = a; t->v[y] = al * t->v[x] + be * t->v[y]; return 0;
}
static int cb_norm(void *a, mgrit_vec x, double *o) { table *t = a; *o = t->v[x] < 0 ? -t->v[x] : t->v[x]; return 0; }
static int cb_step(void *a, mgrit_vec u, double t0, double t1, int l, int64_t i, int done, mgrit_vec *o) {
  table *t = a; t->steps++; *o = put(t, t->v[u] / (1.0 + (t1 - t0))); return 0;
}
static int cb_bufsize(void *a, mgrit_vec x, int64_t *n) { *n = sizeof(double); return 0; }
static int cb_pack(void *a, mgrit_vec x, void *b, int64_t n) { table *t = a; memcpy(b, &t->v[x], 8); return 0; }
static int cb_unpack(void *a, void *b, int64_t n, mgrit_vec *o) { double x; memcpy(&x, b, 8); *o = put(a, x); return 0; }

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int64_t n = argc > 1 ? atoll(argv[1]) : 4096;
  int levels = argc > 2 ? atoi(argv[2]) : 3, cf = argc > 3 ? atoi(argv[3]) : 4;
  int iters = argc > 4 ? atoi(argv[4]) : 5, repeats = argc > 5 ? atoi(argv[5]) : 5;
  int rank;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  table t = {0};
  mgrit_callbacks cb = {cb_init, cb_clone, cb_free, cb_sum, cb_norm, cb_step, cb_bufsize, cb_pack, cb_unpack};
  mgrit_core *core;
  MPI_Comm world = MPI_COMM_WORLD;
  mgrit_create(&world, n, 0.0, 0.5 * n, &cb, &t, &core);
  mgrit_set_max_levels(core, levels);
  mgrit_set_cfactors(core, 1, &cf);
  mgrit_set_max_iters(core, iters);
  mgrit_set_tol(core, 0.0);
  if (repeats < 1 || repeats > 64) repeats = 5;
  double times[64];
  int64_t steps = 0;
  for (int r = 0; r < repeats; r++) {
    t.steps = 0;
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = MPI_Wtime();
    if (mgrit_solve(core) != MGRIT_OK) MPI_Abort(MPI_COMM_WORLD, 1);
    double dt = MPI_Wtime() - t0;
    MPI_Allreduce(&dt, &times[r], 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    steps = t.steps;
  }
  int64_t max_steps;
  MPI_Allreduce(&steps, &max_steps, 1, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0) {
    int size;
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    printf("{\"ranks\": %d, \"steps\": %lld, \"levels\": %d, \"cfactor\": %d, \"iterations\": %d, "
           "\"steps_run_max_rank\": %lld, \"seconds\": [",
           size, (long long)n, mgrit_num_levels(core), cf, mgrit_iterations(core),
           (long long)max_steps);
    for (int r = 0; r < repeats; r++) printf("%s%.6e", r ? ", " : "", times[r]);
    printf("]}\n");
  }
  mgrit_destroy(core);
  MPI_Finalize();
  return 0;
}
