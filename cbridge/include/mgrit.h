/*
 * mgrit.h -- the public API of layerbraid's MGRIT core.
 *
 * The core owns the algorithm (levels, C/F split, FAS right-hand sides, relaxation order,
 * restriction, correction, residual norms, convergence, block distribution of the time steps
 * over the ranks, MPI messages).  It never sees a state: a state is an int64 id into a table
 * that the application keeps, and every operation on states is a callback.  Every callback
 * takes the application pointer first and returns 0 on success; any other value makes the core
 * stop computing, tell the other ranks (through the messages it still has to send and at the
 * next collective), and return MGRIT_ERR_CALLBACK on this rank and MGRIT_ERR_REMOTE on the
 * others.  No rank is left blocked in MPI.
 */
#ifndef LAYERBRAID_MGRIT_H
#define LAYERBRAID_MGRIT_H

#include <stdint.h>
#include <mpi.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Status codes returned by every mgrit_* function. */
#define MGRIT_OK 0
#define MGRIT_ERR_ARG 1      /* a bad argument; mgrit_error_message() says which */
#define MGRIT_ERR_CALLBACK 2 /* a callback on this rank returned nonzero */
#define MGRIT_ERR_REMOTE 3   /* a callback on another rank failed; mgrit_failed_rank() says which */
#define MGRIT_ERR_NAN 4      /* the residual norm is not a number */
#define MGRIT_ERR_MPI 5      /* an MPI call failed */
#define MGRIT_ERR_NOMEM 6
#define MGRIT_ERR_MISMATCH 7 /* the ranks were not given the same problem and options */
#define MGRIT_ERR_TIMEOUT 8  /* a wait for another rank passed the timeout (mgrit_set_timeout) */
#define MGRIT_ERR_INTERRUPT 9 /* the poll callback asked to stop (e.g. Ctrl-C) */

/* Cycles. */
#define MGRIT_CYCLE_V 0
#define MGRIT_CYCLE_F 1

/* Trace operations: the schedule as data.  `index` is the level's point index. */
#define MGRIT_OP_FSTEP 0  /* a step into F-point index during an F-sweep (or a sequential solve) */
#define MGRIT_OP_CSTEP 1  /* a step into C-point index during a C-sweep */
#define MGRIT_OP_RSTEP 2  /* a step into C-point index to form its residual (restriction) */
#define MGRIT_OP_GSTEP 3  /* a coarse step into coarse point index to form its FAS right-hand side */
#define MGRIT_OP_CORRECT 4 /* the correction of coarse point index added to the level above */
#define MGRIT_OP_SEND 5   /* a state of point index sent to rank `peer` */
#define MGRIT_OP_RECV 6   /* a state of point index received from rank `peer` */
#define MGRIT_OP_NORM 7   /* the residual allreduce of an iteration with a stopping test (index = iteration) */
#define MGRIT_OP_INIT 8   /* the initial value or guess of fine point index */
#define MGRIT_OP_SEQSTEP 9 /* a step into point index during the coarsest-level solve */

typedef int64_t mgrit_vec; /* a state: an id into the application's table; -1 = none */

typedef struct mgrit_trace_entry {
  int32_t level;
  int32_t op;
  int64_t index;
  int32_t peer; /* the other rank for SEND/RECV, else -1 */
  int32_t done; /* 1 during the final relaxation */
} mgrit_trace_entry;

/* The callbacks.  `app` is handed back unchanged. */
typedef struct mgrit_callbacks {
  /* u(t) at fine point `index`: the initial value at index 0, the initial guess elsewhere. */
  int (*init)(void *app, double t, int64_t index, mgrit_vec *out);
  int (*clone)(void *app, mgrit_vec x, mgrit_vec *out);
  int (*free)(void *app, mgrit_vec x);
  /* y <- alpha x + beta y (the application may rebind y's slot to a new object). */
  int (*sum)(void *app, double alpha, mgrit_vec x, double beta, mgrit_vec y);
  /* The spatial 2-norm of x. */
  int (*norm)(void *app, mgrit_vec x, double *out);
  /* out <- Phi(u) from tstart to tstop on `level`.  `index` is the global fine index of the
   * step's start point (the fine layer that a coarse step injects).  `done` is 1 in the final
   * relaxation.  u must not be modified. */
  int (*step)(void *app, mgrit_vec u, double tstart, double tstop, int level, int64_t index,
              int done, mgrit_vec *out);
  int (*bufsize)(void *app, mgrit_vec x, int64_t *nbytes);
  int (*pack)(void *app, mgrit_vec x, void *buf, int64_t nbytes);
  int (*unpack)(void *app, void *buf, int64_t nbytes, mgrit_vec *out);
  /* Optional spatial transfers (NULL: states keep their size on every level).  coarsen maps a
   * state of level `level` to level+1 (the restriction of states and FAS residuals); refine maps
   * a correction of level `level` to level-1 (the interpolation). */
  int (*coarsen)(void *app, mgrit_vec x, int level, mgrit_vec *out);
  int (*refine)(void *app, mgrit_vec x, int level, mgrit_vec *out);
  /* Optional (NULL: never called): called about every 50 ms while this rank waits for another
   * (a message, an allreduce); nonzero stops the wait and the solve with MGRIT_ERR_INTERRUPT,
   * without finishing the schedule (the job is expected to end).  This is where an application
   * notices Ctrl-C while the core waits. */
  int (*poll)(void *app);
  /* Optional (NULL: the core calls step once per point).  A run of n >= 2 consecutive steps of
   * `level` in one call: from u, the state at point i0 - 1, through points i0 .. i0 + n - 1,
   * whose states go to out[0 .. n-1].  t[0 .. n] are the times of points i0 - 1 .. i0 + n - 1;
   * `index` is the global fine index of the first step's start point, and step k starts at fine
   * index index + k * stride.  It must equal n calls of step (the same arguments, done
   * included); the core calls it for F-intervals (and the sequential coarsest solve) where no
   * FAS right-hand side enters between the steps: level 0 always, a coarse level before its
   * first restriction.  With keep 0 the core reads only out[n-1] (it keeps only the last state
   * of a run: see mgrit_set_store_all), and the others may be left -1.  This is where an
   * application runs an interval through one fused kernel instead of n calls. */
  int (*step_interval)(void *app, mgrit_vec u, const double *t, int level, int64_t index,
                       int64_t stride, int64_t n, int done, int keep, mgrit_vec *out);
  /* Optional (NULL: never called): called once at the end of a solve that went well on this
   * rank, when every state this rank sends has been received and only the status allreduce that
   * ends the solve is left, for which this rank would wait on the others.  Work the application
   * can finish outside the schedule goes here (Note [idle work] in cbridge/src/cycle.c);
   * nonzero fails the solve like any callback. */
  int (*idle)(void *app);
  /* The application's transport: set all four in a core made by mgrit_create_app (its messages
   * and allreduces go through them instead of MPI), none in one made by mgrit_create.  Each is
   * non-blocking; the core waits by calling test (or try_recv) in its polled loop, so the
   * timeout and the poll callback hold as they do under MPI.  A nonzero return is a failure of
   * the transport (a peer that crashed): the core abandons the schedule and returns
   * MGRIT_ERR_MPI, and the application raises its own error.
   * isend: start sending state x to rank dest with tag; flag 1 marks a poisoned message (Note
   * [poisoned messages] in comm.c), which carries no state (x is -1).  *handle names the send
   * for test.
   * try_recv: the message from rank src with tag, if it has arrived: *found 1, *flag its
   * poison flag and *out its state (-1 when flagged); else *found 0 (called again later).
   * iallreduce: start reducing the n doubles of in over the ranks (op 0 sum, 1 min, 2 max)
   * into out, which the core keeps until test says done.
   * test: *done 1 once the send or allreduce `handle` has completed. */
  int (*isend)(void *app, int dest, int tag, int64_t flag, mgrit_vec x, int64_t *handle);
  int (*try_recv)(void *app, int src, int tag, int *found, int64_t *flag, mgrit_vec *out);
  int (*iallreduce)(void *app, const double *in, double *out, int n, int op, int64_t *handle);
  int (*test)(void *app, int64_t handle, int *done);
  /* Optional with one part, required with more (mgrit_set_parts): the callbacks that follow act
   * on microbatch `part` until the next call; init's state at fine point 0 is that part's
   * initial value, and its idle callback comes once per part. */
  int (*part)(void *app, int part);
  /* Optional, with the application's transport (NULL: the core spins, then yields or naps,
   * between tests).  Waits at most `seconds` for the message from rank src (src >= 0) or for
   * the send or allreduce `handle` (src -1) to progress, sleeping on what the transport's
   * completion signals; *blocked 0 where the transport has nothing to sleep on (the core then
   * spins and naps as without it).  Returning early is harmless: the core tests again.  Where
   * a thread reports the transport's completions (gloo), a core that spins through Python
   * callbacks keeps that thread from running, and each message waits for it. */
  int (*block)(void *app, int src, int64_t handle, double seconds, int *blocked);
} mgrit_callbacks;

typedef struct mgrit_core mgrit_core; /* opaque */

/* Create a solver for `num_steps` steps on [tstart, tstop], distributed in contiguous blocks of
 * steps over the ranks of *comm (which is duplicated).  Collective. */
int mgrit_create(MPI_Comm *comm, int64_t num_steps, double tstart, double tstop,
                 const mgrit_callbacks *callbacks, void *app, mgrit_core **out);
/* A solver whose messages and allreduces go through the application's transport callbacks
 * (isend, try_recv, iallreduce, test: all four must be set) instead of MPI: this rank is `rank`
 * of `size` in the application's group.  Collective (through the transport) in mgrit_setup. */
int mgrit_create_app(int rank, int size, int64_t num_steps, double tstart, double tstop,
                     const mgrit_callbacks *callbacks, void *app, mgrit_core **out);
/* Why the last mgrit_create on this thread failed (e.g. MPI's message when the duplicate of the
 * communicator could not be made). */
const char *mgrit_create_error(void);
int mgrit_destroy(mgrit_core *core);
/* A virtual rank `rank` of `size`: no communicator, no application, states that are no-ops.
 * mgrit_solve on it records (mgrit_trace) exactly the schedule that rank would run, every
 * iteration up to max_iters; this is what the work model (layerbraid.plan) simulates. */
int mgrit_create_virtual(int64_t num_steps, double tstart, double tstop, int rank, int size,
                         mgrit_core **out);

/* Options; each returns MGRIT_ERR_ARG for a bad value. */
int mgrit_set_max_levels(mgrit_core *core, int max_levels);
/* cfactors[l] coarsens level l to level l+1; n values, the last repeated for deeper levels. */
int mgrit_set_cfactors(mgrit_core *core, int n, const int *cfactors);
/* nrelax[l]: (F, C) sweeps before the restriction of level l; the last repeated. */
int mgrit_set_nrelax(mgrit_core *core, int n, const int *nrelax);
int mgrit_set_max_iters(mgrit_core *core, int max_iters);
int mgrit_set_tol(mgrit_core *core, double tol);
/* Also stop when the residual norm is below rtol times the state norm at the same points (the
 * level-0 C-points from cfactor on, where the residual is measured): a relative tolerance.
 * 0 (the default) turns it off.  rtol and skip may change between solves without a new setup
 * (every rank must set the same values). */
int mgrit_set_rtol(mgrit_core *core, double rtol);
int mgrit_set_skip(mgrit_core *core, int skip);
int mgrit_set_cycle(mgrit_core *core, int cycle);
int mgrit_set_min_coarse(mgrit_core *core, int64_t min_coarse);
int mgrit_set_final_fc(mgrit_core *core, int final_fc);
int mgrit_set_trace(mgrit_core *core, int on);
/* Keep every level-0 point (1, the default), or (0) only the C-points, the F-points just before
 * them and each rank's last point: the others are released as soon as the sweep has used them,
 * and mgrit_state returns -1 for them. */
int mgrit_set_store_all(mgrit_core *core, int store_all);
/* With mirror set, the N % P ranks that get one step more are the last ones instead of the
 * first: a solve backward in time on the reversed communicator then gives each rank exactly the
 * steps it owns forward (the adjoint of training). */
int mgrit_set_mirror(mgrit_core *core, int mirror);
/* Seconds a rank may wait for another (a message, an allreduce) before the solve stops with
 * MGRIT_ERR_TIMEOUT and a message naming what it waited for and from which rank; 0 (the
 * default) waits forever.  The waits poll, so that a stalled job is noticed (see Note [polled
 * waits] in comm.c). */
int mgrit_set_timeout(mgrit_core *core, double seconds);
/* How a wait that a short spin did not end lets the others run: 0 (the default) yields the
 * core between tests, the right choice with a core per rank; a positive value (at most 1 ms)
 * sleeps between tests instead, at least that long and up to a tenth of the time waited so far
 * (at most 1 ms), so that more ranks than cores (an emulation, a laptop) leave the CPU to the
 * ranks that compute.  A local setting: ranks may differ. */
int mgrit_set_wait_sleep(mgrit_core *core, double seconds);

/* Solve `parts` microbatches in lockstep (1, the default: the state is one batch).  Each
 * operation of the schedule runs on every part before the next operation starts, and the
 * messages of a sweep that passes a state from rank to rank (the coarsest level's solve, the
 * F-sweeps' boundary values) go out part by part, so that a rank steps one part while the next
 * rank steps the part before: a pipeline.  With a norm that is the 2-norm over the batch, the
 * residuals, stopping tests and results equal the solve of the whole batch's state to
 * round-off.  The application's part callback says which part the other callbacks act on. */
#define MGRIT_MAX_PARTS 254
int mgrit_set_parts(mgrit_core *core, int parts);
/* The state of part `part` at fine point i (mgrit_state is part 0's). */
mgrit_vec mgrit_state_part(const mgrit_core *core, int64_t index, int part);

/* Check that all ranks were given the same problem and options, and build the levels, so that
 * mgrit_owned and mgrit_level_stride can be asked before a solve.  Collective.  mgrit_solve does
 * it itself when needed. */
int mgrit_setup(mgrit_core *core);

/* Solve.  Collective.  All ranks return the same status except CALLBACK (this rank) vs REMOTE. */
int mgrit_solve(mgrit_core *core);

/* Results of the last solve. */
int mgrit_num_levels(const mgrit_core *core);
int mgrit_iterations(const mgrit_core *core);
int mgrit_num_norms(const mgrit_core *core);
const double *mgrit_norms(const mgrit_core *core);
/* The residual of the returned solution, measured by the final C-relaxation (final_fc, 2+
 * levels): the 2-norm over the level-0 C-points of what that relaxation changed.  It is the
 * residual the next iteration would have started from; -1 when not measured. */
double mgrit_final_residual(const mgrit_core *core);
double mgrit_final_state_norm(const mgrit_core *core);
/* The sum of the norms of those residuals, the last point's left out (the relaxation removes
 * it): at least the norm of their vector sum over the chain, which is the error they leave at
 * the last point when the steps neither amplify nor damp (layerbraid's error estimate), and the
 * same on any number of ranks. */
double mgrit_final_residual_sum(const mgrit_core *core);
/* The level-0 points this rank owns, [*lo, *hi], and the id of the state at fine point i. */
void mgrit_owned(const mgrit_core *core, int level, int64_t *lo, int64_t *hi);
mgrit_vec mgrit_state(const mgrit_core *core, int64_t index);
/* Frees every state the last solve left in the core (mgrit_state answers MGRIT_NONE after it):
 * for an application that has taken what it needs and would otherwise hold the solution until
 * the next solve.  Local. */
int mgrit_release_states(mgrit_core *core);
/* The number of points of `level` (intervals + 1), and the fine steps in one of its steps. */
int64_t mgrit_level_points(const mgrit_core *core, int level);
int64_t mgrit_level_stride(const mgrit_core *core, int level);
int mgrit_failed_rank(const mgrit_core *core);
/* Seconds this rank spent in MPI calls (receives, waits, allreduces) during the last solve. */
double mgrit_comm_seconds(const mgrit_core *core);
/* CPU seconds this process has spent in the waits of all its cores (their polling, beyond
 * each wait's first tests) since it started: a rank's CPU time less this is its work's. */
double mgrit_wait_cpu_seconds(void);
const char *mgrit_error_message(const mgrit_core *core);
int64_t mgrit_trace_length(const mgrit_core *core);
const mgrit_trace_entry *mgrit_trace(const mgrit_core *core);

#ifdef __cplusplus
}
#endif
#endif
