/* _mgrit.h -- internals of the MGRIT core, shared by the files in src/.  Not installed. */
#ifndef LAYERBRAID__MGRIT_H
#define LAYERBRAID__MGRIT_H

#include "mgrit.h"

#include <stddef.h>

#define MGRIT_NONE ((mgrit_vec)-1)

/* One level of the hierarchy as this rank sees it.  Note [point ownership]: a rank owns level-l
 * point i exactly when it owns fine point i * stride, so every rank's points on every level are
 * one contiguous block, and the blocks of all ranks cover the level in rank order. */
typedef struct mgrit_i_level {
  int64_t npoints; /* points 0 .. npoints-1 */
  int64_t stride;  /* fine points per step of this level */
  int cf;          /* coarsening factor to the next level; 0 on the coarsest */
  int nrelax;
  int64_t lo, hi; /* owned points; lo > hi when none */
  int left, right; /* the ranks owning points lo-1 and hi+1 on this level, or -1 */
  /* The current part's states (Note [parts]): u, v, g indexed by i - lo (g[k] == MGRIT_NONE
   * means zero); *ghost is u[lo - 1] as it was after this rank's last F-sweep of the level. */
  mgrit_vec *u, *v, *g, *ghost;
  mgrit_vec *ubase, *vbase, *gbase, *ghosts; /* every part's: part p's from p * (hi - lo + 1) */
} mgrit_i_level;

typedef struct mgrit_i_opts {
  int max_levels;
  int ncf, nnr;
  int cf[64];
  int nrelax[64];
  int max_iters;
  double tol;
  double rtol; /* relative to the state norm at the measured C-points; 0 = off */
  int skip;
  int cycle;
  int64_t min_coarse;
  int final_fc;
  int trace;
  int store_all; /* keep every level-0 point (default), or only what the cycles read again */
  double timeout; /* seconds a wait may last; 0 = forever */
  double wait_sleep; /* seconds a long wait sleeps between tests; 0 = yield instead */
  int parts; /* microbatches solved in lockstep (Note [parts] in cycle.c); 1 = the whole batch */
} mgrit_i_opts;

/* Note [options fingerprint]: what every rank's solver must agree on, compared across ranks in
 * mgrit_setup (cycle.c), one X(name, value) per scalar; the per-level cf[] and nrelax[] are
 * compared as well.  An option added to mgrit_i_opts that changes the schedule or the stopping
 * goes here too (trace and wait_sleep are each rank's own). */
#define MGRIT_I_FINGERPRINT(X)                                                               \
  X(num_steps, (double)core->nsteps) X(t_start, core->tstart) X(t_stop, core->tstop)         \
  X(max_levels, (double)core->o.max_levels) X(max_iters, (double)core->o.max_iters)          \
  X(tol, core->o.tol) X(rtol, core->o.rtol) X(skip, (double)core->o.skip)                    \
  X(cycle, (double)core->o.cycle) X(min_coarse, (double)core->o.min_coarse)                  \
  X(final_fc, (double)core->o.final_fc) X(cfactor, (double)core->o.ncf)                      \
  X(nrelax, (double)core->o.nnr) X(mirror, (double)core->mirror)                             \
  X(store_all, (double)core->o.store_all) X(timeout, core->o.timeout)                        \
  X(parts, (double)core->o.parts)

/* A pending operation: an MPI request, or the application transport's handle (Note
 * [application transport] in comm.c). */
typedef struct mgrit_i_req {
  MPI_Request mpi;
  int64_t app;
} mgrit_i_req;

typedef struct mgrit_i_pending {
  mgrit_i_req req;
  char *buf;
} mgrit_i_pending;

typedef struct mgrit_i_comm {
  MPI_Comm comm; /* MPI_COMM_NULL when ext */
  int ext;       /* messages go through the application's transport callbacks */
  int rank, size;
  mgrit_i_pending *pending;
  int npending, cap;
} mgrit_i_comm;

struct mgrit_core {
  mgrit_i_comm c;
  mgrit_callbacks cb;
  void *app;
  mgrit_i_opts o;
  int64_t nsteps;
  double tstart, tstop;
  int mirror; /* extra steps go to the last ranks (see grid.c) */
  int virt;   /* a virtual rank: no MPI, no-op states; records the schedule (mgrit_create_virtual) */
  int built;  /* levels built for the current options */
  int nlevels;
  mgrit_i_level *levels;
  int err;         /* MGRIT_OK, or CALLBACK/REMOTE/NOMEM once this rank is poisoned */
  int abandoned;   /* a wait timed out or was interrupted: pending sends are never waited for */
  int failed_rank; /* set when a failure is known globally */
  int built_parts; /* the parts the levels' arrays hold */
  int part;        /* the part whose states the levels' u, v, g and ghost point at */
  double *cnorm2;  /* per owned level-0 C-point: its residual's squared norm summed over parts */
  int iterations;
  double comm_seconds; /* time spent in MPI calls (waiting included) during the last solve */
  double *norms;
  int nnorms, cap_norms;
  double state_norm;        /* at the C-points of the last residual; -1 if none */
  double final_residual;    /* measured by the final C-relaxation; -1 if not */
  double final_state_norm;
  double final_residual_sum; /* the sum of the final residuals' norms */
  mgrit_trace_entry *trace;
  int64_t ntrace, cap_trace;
  char msg[512];
};

/* grid.c */
int64_t mgrit_i_owner(const mgrit_core *core, int64_t fine_point);
void mgrit_i_fine_range(const mgrit_core *core, int rank, int64_t *lo, int64_t *hi);
int mgrit_i_build_levels(mgrit_core *core);
/* Frees the current part's states of level l (Note [parts] in cycle.c). */
void mgrit_i_free_level_states(mgrit_core *core, int l);
/* Frees every part's states of level l. */
void mgrit_i_free_level_parts(mgrit_core *core, int l);
/* Points the levels' states at part p's and tells the application (its part callback). */
void mgrit_i_select(mgrit_core *core, int p);
void mgrit_i_free_levels(mgrit_core *core);
double mgrit_i_time(const mgrit_core *core, int l, int64_t i);
int mgrit_i_is_c(const mgrit_core *core, int l, int64_t i);

/* vec.c */
void mgrit_i_set(mgrit_core *core, mgrit_vec *slot, mgrit_vec x);
mgrit_vec mgrit_i_clone(mgrit_core *core, mgrit_vec x);
mgrit_vec mgrit_i_coarsen(mgrit_core *core, int l, mgrit_vec x);
void mgrit_i_sum(mgrit_core *core, double a, mgrit_vec x, double b, mgrit_vec y);

/* relax.c */
mgrit_vec mgrit_i_step(mgrit_core *core, int l, int64_t i, mgrit_vec u, int done, int op,
                      int add_g);
mgrit_vec mgrit_i_before(const mgrit_i_level *L, int64_t i);
int mgrit_i_fsweep(mgrit_core *core, int l, int done);
int mgrit_i_csweep(mgrit_core *core, int l, int done, double *sums);

/* restrict.c */
int mgrit_i_restrict(mgrit_core *core, int l, double *sums);
int mgrit_i_inject(mgrit_core *core, int l);

/* interp.c */
int mgrit_i_correct(mgrit_core *core, int l);

/* comm.c */
int mgrit_i_send(mgrit_core *core, int dest, int tag, int l, int64_t i, mgrit_vec x);
int mgrit_i_recv(mgrit_core *core, int src, int tag, int l, int64_t i, mgrit_vec *out);
int mgrit_i_wait_sends(mgrit_core *core);
/* Waits for one request by polling (Note [polled waits] in comm.c); names `what` on a stall. */
int mgrit_i_poll_wait(mgrit_core *core, mgrit_i_req *req, const char *what);
/* Starts reducing n doubles over the ranks (MGRIT_I_SUM, MIN or MAX) into out; wait on req. */
enum { MGRIT_I_SUM = 0, MGRIT_I_MIN = 1, MGRIT_I_MAX = 2 };
int mgrit_i_iallreduce(mgrit_core *core, const double *in, double *out, int n, int op,
                       mgrit_i_req *req);
int mgrit_i_allreduce_status(mgrit_core *core, double *sums, int n);
/* The tag of a message of level l (kind 0 an F-sweep's state, 1 a restriction's v) of the
 * current part. */
int mgrit_i_tag(const mgrit_core *core, int l, int kind);

int mgrit_i_mpi_error(mgrit_core *core, int rc, const char *call);

/* Checks an MPI return code (mpi4py sets MPI_ERRORS_RETURN): on failure, MGRIT_ERR_MPI with
 * MPI's message. */
#define MGRIT_I_MPI(core, call)                                         \
  do {                                                                 \
    int _rc = (call);                                                  \
    if (_rc != MPI_SUCCESS) return mgrit_i_mpi_error((core), _rc, #call); \
  } while (0)

/* trace.c */
void mgrit_i_trace(mgrit_core *core, int l, int op, int64_t i, int peer, int done);

/* Callbacks run only while this rank is healthy; a failure poisons it. */
#define MGRIT_I_CB(core, call)                                \
  do {                                                       \
    if ((core)->err == MGRIT_OK && (call) != 0)              \
      (core)->err = MGRIT_ERR_CALLBACK;                      \
  } while (0)

#endif
