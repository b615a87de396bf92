/* core.c -- creation, options, destruction and the results of a solve. */
#include "_mgrit.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BAD(core, ...)                                          \
  do {                                                          \
    snprintf((core)->msg, sizeof (core)->msg, __VA_ARGS__);     \
    return MGRIT_ERR_ARG;                                       \
  } while (0)

/* The problem, and XBraid's defaults for the options. */
static void defaults(mgrit_core *core, int64_t num_steps, double tstart, double tstop,
                     const mgrit_callbacks *callbacks, void *app) {
  core->cb = *callbacks;
  core->app = app;
  core->nsteps = num_steps;
  core->tstart = tstart;
  core->tstop = tstop;
  core->failed_rank = -1;
  core->o.max_levels = 1;
  core->o.ncf = core->o.nnr = 1;
  core->o.cf[0] = 2;
  core->o.nrelax[0] = 1;
  core->o.max_iters = 100;
  core->o.tol = 1e-9;
  core->o.cycle = MGRIT_CYCLE_V;
  core->o.min_coarse = 2;
  core->o.store_all = 1;
  core->o.parts = 1;
  core->state_norm = core->final_residual = core->final_state_norm = -1.0;
  core->final_residual_sum = -1.0;
}

static char create_error[512];

const char *mgrit_create_error(void) { return create_error; }

int mgrit_create(MPI_Comm *comm, int64_t num_steps, double tstart, double tstop,
                 const mgrit_callbacks *callbacks, void *app, mgrit_core **out) {
  *out = NULL;
  create_error[0] = 0;
  if (num_steps < 1 || !(tstop > tstart) || !callbacks) {
    snprintf(create_error, sizeof create_error,
             "bad problem: num_steps=%lld, tstart=%g, tstop=%g", (long long)num_steps, tstart,
             tstop);
    return MGRIT_ERR_ARG;
  }
  mgrit_core *core = calloc(1, sizeof *core);
  if (!core) return MGRIT_ERR_NOMEM;
  int rc = MPI_Comm_dup(*comm, &core->c.comm);
  if (rc == MPI_SUCCESS) rc = MPI_Comm_rank(core->c.comm, &core->c.rank);
  if (rc == MPI_SUCCESS) rc = MPI_Comm_size(core->c.comm, &core->c.size);
  if (rc != MPI_SUCCESS) {
    char text[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) snprintf(text, sizeof text, "code %d", rc);
    snprintf(create_error, sizeof create_error,
             "MPI could not duplicate the communicator (too many communicators? free unused "
             "models): %.300s", text);
    free(core);
    return MGRIT_ERR_MPI;
  }
  defaults(core, num_steps, tstart, tstop, callbacks, app);
  *out = core;
  return MGRIT_OK;
}

int mgrit_create_app(int rank, int size, int64_t num_steps, double tstart, double tstop,
                     const mgrit_callbacks *callbacks, void *app, mgrit_core **out) {
  *out = NULL;
  create_error[0] = 0;
  if (num_steps < 1 || !(tstop > tstart) || !callbacks || size < 1 || rank < 0 ||
      rank >= size) {
    snprintf(create_error, sizeof create_error,
             "bad problem: num_steps=%lld, tstart=%g, tstop=%g, rank %d of %d",
             (long long)num_steps, tstart, tstop, rank, size);
    return MGRIT_ERR_ARG;
  }
  if (!callbacks->isend || !callbacks->try_recv || !callbacks->iallreduce || !callbacks->test) {
    snprintf(create_error, sizeof create_error,
             "a solver over the application's transport needs all four of its callbacks "
             "(isend, try_recv, iallreduce, test)");
    return MGRIT_ERR_ARG;
  }
  mgrit_core *core = calloc(1, sizeof *core);
  if (!core) return MGRIT_ERR_NOMEM;
  core->c.comm = MPI_COMM_NULL;
  core->c.ext = 1;
  core->c.rank = rank;
  core->c.size = size;
  defaults(core, num_steps, tstart, tstop, callbacks, app);
  *out = core;
  return MGRIT_OK;
}

int mgrit_destroy(mgrit_core *core) {
  if (!core) return MGRIT_OK;
  mgrit_i_wait_sends(core);
  mgrit_i_free_levels(core);
  free(core->c.pending);
  free(core->norms);
  free(core->trace);
  free(core->cnorm2);
  if (!core->virt && !core->c.ext) {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&core->c.comm);
  }
  free(core);
  return MGRIT_OK;
}

/* Virtual ranks: every state is id 0 and every operation a no-op.  The schedule does not depend
 * on the data, so a virtual rank records exactly the trace that the real rank would run. */
static int v_init(void *a, double t, int64_t i, mgrit_vec *o) { *o = 0; return 0; }
static int v_clone(void *a, mgrit_vec x, mgrit_vec *o) { *o = 0; return 0; }
static int v_free(void *a, mgrit_vec x) { return 0; }
static int v_sum(void *a, double al, mgrit_vec x, double be, mgrit_vec y) { return 0; }
static int v_norm(void *a, mgrit_vec x, double *o) { *o = 0.0; return 0; }
static int v_step(void *a, mgrit_vec u, double t0, double t1, int l, int64_t i, int d,
                  mgrit_vec *o) { *o = 0; return 0; }
static int v_bufsize(void *a, mgrit_vec x, int64_t *n) { *n = 0; return 0; }
static int v_pack(void *a, mgrit_vec x, void *b, int64_t n) { return 0; }
static int v_unpack(void *a, void *b, int64_t n, mgrit_vec *o) { *o = 0; return 0; }

int mgrit_create_virtual(int64_t num_steps, double tstart, double tstop, int rank, int size,
                         mgrit_core **out) {
  static const mgrit_callbacks none = {v_init, v_clone, v_free, v_sum, v_norm, v_step,
                                       v_bufsize, v_pack, v_unpack, NULL, NULL, NULL};
  *out = NULL;
  if (num_steps < 1 || !(tstop > tstart) || size < 1 || rank < 0 || rank >= size)
    return MGRIT_ERR_ARG;
  mgrit_core *core = calloc(1, sizeof *core);
  if (!core) return MGRIT_ERR_NOMEM;
  core->virt = 1;
  core->c.rank = rank;
  core->c.size = size;
  defaults(core, num_steps, tstart, tstop, &none, NULL);
  core->o.trace = 1;
  *out = core;
  return MGRIT_OK;
}

int mgrit_set_wait_sleep(mgrit_core *core, double seconds) {
  if (!(seconds >= 0) || seconds > 1e-3)
    BAD(core, "wait_sleep must be between 0 and 0.001 seconds, got %g", seconds);
  core->o.wait_sleep = seconds;
  return MGRIT_OK;
}

int mgrit_set_timeout(mgrit_core *core, double seconds) {
  if (!(seconds >= 0) || seconds > 1e9) BAD(core, "timeout must be >= 0 seconds, got %g", seconds);
  core->o.timeout = seconds;
  return MGRIT_OK;
}

int mgrit_set_max_levels(mgrit_core *core, int v) {
  core->built = 0;
  if (v < 1 || v > 64) BAD(core, "max_levels must be in 1..64, got %d", v);
  core->o.max_levels = v;
  return MGRIT_OK;
}

int mgrit_set_cfactors(mgrit_core *core, int n, const int *cf) {
  core->built = 0;
  if (n < 1 || n > 64) BAD(core, "between 1 and 64 cfactors are needed, got %d", n);
  for (int k = 0; k < n; k++)
    if (cf[k] < 2) BAD(core, "cfactor[%d] must be at least 2, got %d", k, cf[k]);
  core->o.ncf = n;
  memcpy(core->o.cf, cf, (size_t)n * sizeof(int));
  return MGRIT_OK;
}

int mgrit_set_nrelax(mgrit_core *core, int n, const int *nr) {
  core->built = 0;
  if (n < 1 || n > 64) BAD(core, "between 1 and 64 nrelax values are needed, got %d", n);
  for (int k = 0; k < n; k++)
    if (nr[k] < 0) BAD(core, "nrelax[%d] must be at least 0, got %d", k, nr[k]);
  core->o.nnr = n;
  memcpy(core->o.nrelax, nr, (size_t)n * sizeof(int));
  return MGRIT_OK;
}

int mgrit_set_max_iters(mgrit_core *core, int v) {
  core->built = 0;
  if (v < 1) BAD(core, "max_iters must be at least 1, got %d", v);
  core->o.max_iters = v;
  return MGRIT_OK;
}

int mgrit_set_tol(mgrit_core *core, double v) {
  core->built = 0;
  if (!(v >= 0.0)) BAD(core, "tol must be a number >= 0, got %g", v);
  core->o.tol = v;
  return MGRIT_OK;
}

/* skip and rtol do not change the levels: no new setup (see mgrit.h). */
int mgrit_set_skip(mgrit_core *core, int v) {
  core->o.skip = v != 0;
  return MGRIT_OK;
}

int mgrit_set_rtol(mgrit_core *core, double v) {
  if (!(v >= 0.0)) BAD(core, "rtol must be a number >= 0, got %g", v);
  core->o.rtol = v;
  return MGRIT_OK;
}

int mgrit_set_cycle(mgrit_core *core, int v) {
  core->built = 0;
  if (v != MGRIT_CYCLE_V && v != MGRIT_CYCLE_F) BAD(core, "cycle must be V (0) or F (1), got %d", v);
  core->o.cycle = v;
  return MGRIT_OK;
}

int mgrit_set_min_coarse(mgrit_core *core, int64_t v) {
  core->built = 0;
  if (v < 1) BAD(core, "min_coarse must be at least 1, got %lld", (long long)v);
  core->o.min_coarse = v;
  return MGRIT_OK;
}

int mgrit_set_final_fc(mgrit_core *core, int v) {
  core->built = 0;
  core->o.final_fc = v != 0;
  return MGRIT_OK;
}

int mgrit_set_trace(mgrit_core *core, int v) {
  core->o.trace = v != 0;
  return MGRIT_OK;
}

int mgrit_set_parts(mgrit_core *core, int v) {
  if (v < 1 || v > MGRIT_MAX_PARTS) BAD(core, "parts must be in 1..%d, got %d", MGRIT_MAX_PARTS, v);
  if (v > 1 && !core->virt && !core->cb.part)
    BAD(core, "parts=%d needs the part callback, which this solver's application lacks", v);
  if (v != core->o.parts) core->built = 0;
  core->o.parts = v;
  return MGRIT_OK;
}

int mgrit_set_store_all(mgrit_core *core, int v) {
  core->o.store_all = v != 0;
  return MGRIT_OK;
}

int mgrit_set_mirror(mgrit_core *core, int v) {
  core->built = 0;
  core->mirror = v != 0;
  return MGRIT_OK;
}

int mgrit_num_levels(const mgrit_core *core) { return core->nlevels; }
int mgrit_iterations(const mgrit_core *core) { return core->iterations; }
int mgrit_num_norms(const mgrit_core *core) { return core->nnorms; }
const double *mgrit_norms(const mgrit_core *core) { return core->norms; }
double mgrit_final_residual(const mgrit_core *core) { return core->final_residual; }
double mgrit_final_state_norm(const mgrit_core *core) { return core->final_state_norm; }
double mgrit_final_residual_sum(const mgrit_core *core) { return core->final_residual_sum; }
double mgrit_comm_seconds(const mgrit_core *core) { return core->comm_seconds; }
int mgrit_failed_rank(const mgrit_core *core) { return core->failed_rank; }
const char *mgrit_error_message(const mgrit_core *core) { return core->msg; }

void mgrit_owned(const mgrit_core *core, int level, int64_t *lo, int64_t *hi) {
  *lo = 0;
  *hi = -1;
  if (level < 0 || level >= core->nlevels) return;
  *lo = core->levels[level].lo;
  *hi = core->levels[level].hi;
}

int64_t mgrit_level_points(const mgrit_core *core, int level) {
  if (level < 0 || level >= core->nlevels) return 0;
  return core->levels[level].npoints;
}

int64_t mgrit_level_stride(const mgrit_core *core, int level) {
  if (level < 0 || level >= core->nlevels) return 0;
  return core->levels[level].stride;
}

mgrit_vec mgrit_state_part(const mgrit_core *core, int64_t i, int part) {
  if (core->nlevels == 0 || part < 0 || part >= core->built_parts) return MGRIT_NONE;
  const mgrit_i_level *L = &core->levels[0];
  if (i < L->lo || i > L->hi) return MGRIT_NONE;
  return L->ubase[(size_t)part * (size_t)(L->hi - L->lo + 1) + (size_t)(i - L->lo)];
}

mgrit_vec mgrit_state(const mgrit_core *core, int64_t i) { return mgrit_state_part(core, i, 0); }

int mgrit_release_states(mgrit_core *core) {
  if (!core) return MGRIT_ERR_ARG;
  for (int l = 0; l < core->nlevels; l++) mgrit_i_free_level_parts(core, l);
  return MGRIT_OK;
}
