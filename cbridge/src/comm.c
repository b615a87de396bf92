/* comm.c -- MPI: packed state messages (always left to right) and the status allreduce.
 *
 * Note [poisoned messages]: every message starts with an int64 flag.  A rank whose callback
 * failed (or that heard of a failure) stops computing but keeps the schedule: it still sends
 * every message, flagged and without payload, and still receives (and drops) every message.
 * The schedule never depends on the data, so every rank reaches the next collective, where the
 * failure becomes known everywhere.  MPI return codes are checked (mpi4py sets
 * MPI_ERRORS_RETURN) and become MGRIT_ERR_MPI with MPI's message.
 *
 * Note [application transport]: a core made by mgrit_create_app sends, receives and reduces
 * through the application's callbacks (isend, try_recv, iallreduce, test) instead of MPI: this
 * is how a torch.distributed group carries the core's messages.  The application moves the
 * state itself (no pack into a host buffer: on a GPU the state can stay on the device), and the
 * poisoned flag travels beside it.  The core's waits, timeout, poll callback and schedule are
 * the same; only the calls at the bottom differ, one branch per message.  A transport callback
 * that fails (a peer that crashed) abandons the schedule with MGRIT_ERR_MPI. */
#define _POSIX_C_SOURCE 200112L /* nanosleep */
#include "_mgrit.h"

#include <limits.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define HEADER ((int64_t)sizeof(int64_t))

/* A message that carries only the poisoned flag, for a rank that cannot allocate a buffer. */
static const int64_t poisoned_header = 1;

/* 128 tags per part (two per level, 64 levels at most): with MGRIT_MAX_PARTS parts the largest
 * is below 32767, the least MPI_TAG_UB that MPI allows. */
int mgrit_i_tag(const mgrit_core *core, int l, int kind) {
  return 16 + 128 * core->part + 2 * l + kind;
}

int mgrit_i_mpi_error(mgrit_core *core, int rc, const char *call) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) snprintf(text, sizeof text, "code %d", rc);
  snprintf(core->msg, sizeof core->msg, "MPI failed on rank %d in %.100s: %.300s", core->c.rank, call,
           text);
  core->abandoned = 1;
  return MGRIT_ERR_MPI;
}

/* Out of memory where the schedule cannot be kept (a message that must be received): end the
 * job with the cause rather than leave the other ranks waiting. */
static void abort_nomem(mgrit_core *core, const char *what, size_t n) {
  fprintf(stderr, "layerbraid MGRIT core: rank %d is out of memory (%zu bytes for %s); "
                  "aborting the job\n", core->c.rank, n, what);
  fflush(stderr);
  if (core->c.ext) _Exit(1); /* the launcher (torchrun) ends the other ranks */
  MPI_Abort(core->c.comm, 1);
}

static int transport_error(mgrit_core *core, const char *call) {
  snprintf(core->msg, sizeof core->msg, "the transport failed on rank %d in %s", core->c.rank,
           call);
  core->abandoned = 1;
  return MGRIT_ERR_MPI;
}

/* Note [polled waits]: every wait of the core tests its request (or probes) in a loop,
 * yielding the core after a short spin (which oversubscribed ranks need), instead of blocking in
 * MPI; with wait_sleep set, a wait that the short spin did not end sleeps between tests instead
 * of yielding (mgrit_set_wait_sleep: yielding ranks still take turns on the CPU, which ranks that
 * compute then wait for when there are more ranks than cores), a tenth of the time waited so far
 * (between wait_sleep and 1 ms: each test costs CPU too); about every 50 ms it asks the poll
 * callback whether to stop (Ctrl-C) and checks the timeout.  A rank that stops this way abandons
 * the schedule: the job is expected to end (the Python side raises, and the uncaught exception
 * aborts the job).  `what`, `peer`, `l` and `i` name the wait in the timeout's message.  Returns
 * 0 to keep waiting, else the status.
 *
 * The loops test TESTS_PER_WAKE times in a row before they wait again: MPICH's shared-memory
 * progress can need more than one call to complete what arrived during a nap (the first pulls
 * the message in, a later one matches or completes it); with one test per wake, messages and
 * the status allreduce that ends a solve were seen late by about a nap each on an
 * oversubscribed node (bench/scaling_measured.py models these naps).
 *
 * With the application's transport, a wait first offers to sleep in the application's block
 * callback (block_app) and, where it slept, neither spins nor naps: gloo reports completions
 * from a thread of Python's, which a core spinning through Python callbacks starves. */
#define TESTS_PER_WAKE 4

/* The application's block callback, where it has one (mgrit_callbacks.block): sleeps until the
 * message from src (src >= 0) or the operation `handle` progresses, at most until the next
 * check.  Returns 1 where it slept, 0 where the caller spins instead, -1 where it failed. */
static int block_app(mgrit_core *core, int src, int64_t handle, double next) {
  if (!core->c.ext || !core->cb.block) return 0;
  double left = next - MPI_Wtime();
  int blocked = 0;
  if (core->cb.block(core->app, src, handle, left > 1e-4 ? left : 1e-4, &blocked)) return -1;
  return blocked != 0;
}

/* The CPU seconds this process's threads spent in the core's waits beyond their first tests
 * (mgrit_wait_cpu_seconds): what a rank's waiting costs the machine's cores, which a rank's
 * CPU time otherwise mixes with its work.  One counter for the process: cores solve on one
 * thread at a time (the interpreter's). */
static double wait_cpu_total;

static double thread_cpu(void) {
  struct timespec ts;
  if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts) != 0) return 0.0;
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Ends a wait that reached keep_waiting (cpu0 >= 0: the thread's CPU time when it first did). */
static void count_wait(double cpu0) {
  if (cpu0 >= 0) wait_cpu_total += thread_cpu() - cpu0;
}

double mgrit_wait_cpu_seconds(void) { return wait_cpu_total; }

/* `slept`: the wait already slept in the application's block callback (no spin or nap).
 * *cpu0 < 0 on a wait's first call: it becomes the thread's CPU time (count_wait). */
static int keep_waiting(mgrit_core *core, double t0, double *next, long *spins, int slept,
                        double *cpu0, const char *what, int peer, int l, int64_t i) {
  if (*cpu0 < 0) *cpu0 = thread_cpu();
  double now = MPI_Wtime();
  if (!slept && ++*spins > 200) {
    if (core->o.wait_sleep > 0) {
      /* a tenth of the time waited so far, at least wait_sleep, at most a millisecond: a
       * test costs CPU that many waiting ranks add up, and a long wait is late by little */
      double s = (now - t0) / 10;
      s = s < core->o.wait_sleep ? core->o.wait_sleep : s > 1e-3 ? 1e-3 : s;
      struct timespec nap = {0, (long)(s * 1e9)};
      nanosleep(&nap, NULL);
    } else {
      sched_yield();
    }
  }
  if (now < *next) return MGRIT_OK;
  *next = now + 0.05;
  if (core->cb.poll && core->cb.poll(core->app) != 0) {
    snprintf(core->msg, sizeof core->msg, "rank %d was interrupted while waiting for %s",
             core->c.rank, what);
    core->abandoned = 1;
    return MGRIT_ERR_INTERRUPT;
  }
  if (core->o.timeout > 0 && now - t0 > core->o.timeout) {
    if (peer >= 0)
      snprintf(core->msg, sizeof core->msg,
               "rank %d waited %.0f s for %s from rank %d (level %d, point %lld): rank %d has "
               "not sent it (it stopped, or runs a different number of solves)",
               core->c.rank, now - t0, what, peer, l, (long long)i, peer);
    else
      snprintf(core->msg, sizeof core->msg,
               "rank %d waited %.0f s in %s: a rank of the communicator has not joined it "
               "(it stopped, or runs a different number of solves)",
               core->c.rank, now - t0, what);
    core->abandoned = 1;
    return MGRIT_ERR_TIMEOUT;
  }
  return MGRIT_OK;
}

/* One test of a pending operation. */
static int test_req(mgrit_core *core, mgrit_i_req *req, int *done) {
  if (core->c.ext)
    return core->cb.test(core->app, req->app, done) ? transport_error(core, "test") : MGRIT_OK;
  MGRIT_I_MPI(core, MPI_Test(&req->mpi, done, MPI_STATUS_IGNORE));
  return MGRIT_OK;
}

int mgrit_i_poll_wait(mgrit_core *core, mgrit_i_req *req, const char *what) {
  double t0 = MPI_Wtime(), next = t0 + 0.05, cpu0 = -1;
  long spins = 0;
  for (;;) {
    int done = 0, rc;
    if ((rc = test_req(core, req, &done))) return rc;
    for (int k = 1; k < TESTS_PER_WAKE && !done; k++)
      if ((rc = test_req(core, req, &done))) return rc;
    if (done) {
      count_wait(cpu0);
      return MGRIT_OK;
    }
    int slept = core->c.ext ? block_app(core, -1, req->app, next) : 0;
    if (slept < 0) return transport_error(core, "block");
    if ((rc = keep_waiting(core, t0, &next, &spins, slept, &cpu0, what, -1, -1, -1))) return rc;
  }
}

/* A new entry of the list of pending sends. */
static mgrit_i_pending *new_pending(mgrit_core *core) {
  mgrit_i_comm *c = &core->c;
  if (c->npending == c->cap) {
    int cap = c->cap ? 2 * c->cap : 16;
    mgrit_i_pending *p = realloc(c->pending, (size_t)cap * sizeof(*p));
    if (!p) abort_nomem(core, "the list of pending sends", (size_t)cap * sizeof(*p));
    c->pending = p;
    c->cap = cap;
  }
  mgrit_i_pending *s = &c->pending[c->npending++];
  s->buf = NULL;
  return s;
}

int mgrit_i_send(mgrit_core *core, int dest, int tag, int l, int64_t i, mgrit_vec x) {
  if (dest < 0) return MGRIT_OK;
  mgrit_i_trace(core, l, MGRIT_OP_SEND, i, dest, 0);
  if (core->virt) return MGRIT_OK;
  if (x == MGRIT_NONE && !core->err) core->err = MGRIT_ERR_CALLBACK;
  if (core->c.ext) { /* Note [application transport] */
    mgrit_i_pending *s = new_pending(core);
    int64_t flag = core->err ? 1 : 0;
    if (core->cb.isend(core->app, dest, tag, flag, flag ? MGRIT_NONE : x, &s->req.app)) {
      core->c.npending--;
      return transport_error(core, "isend");
    }
    return MGRIT_OK;
  }
  int64_t n = 0;
  MGRIT_I_CB(core, core->cb.bufsize(core->app, x, &n));
  if (!core->err && (n < 0 || n > INT_MAX - HEADER)) {
    snprintf(core->msg, sizeof core->msg, "a state of %lld bytes is too large for one message",
             (long long)n);
    core->err = MGRIT_ERR_CALLBACK;
  }
  mgrit_i_comm *c = &core->c;
  char *buf = malloc((size_t)(HEADER + (core->err ? 0 : n)));
  if (!buf && !core->err) { /* poison this rank; the message still goes, flagged */
    snprintf(core->msg, sizeof core->msg, "rank %d is out of memory (%lld bytes for a message)",
             core->c.rank, (long long)(HEADER + n));
    core->err = MGRIT_ERR_NOMEM;
  }
  if (buf) MGRIT_I_CB(core, core->cb.pack(core->app, x, buf + HEADER, n));
  int64_t flag = core->err ? 1 : 0;
  if (flag) n = 0;
  mgrit_i_pending *s = new_pending(core);
  s->buf = buf; /* NULL: the static poisoned header is sent */
  if (buf) memcpy(buf, &flag, sizeof flag);
  MGRIT_I_MPI(core, MPI_Isend(buf ? (void *)buf : (void *)&poisoned_header, (int)(HEADER + n),
                             MPI_BYTE, dest, tag, c->comm, &s->req.mpi));
  return MGRIT_OK;
}

/* mgrit_i_recv through the application's transport (Note [application transport]). */
static int recv_app(mgrit_core *core, int src, int tag, int l, int64_t i, mgrit_vec *out,
                    double t0) {
  double next = t0 + 0.05, cpu0 = -1;
  long spins = 0;
  int found = 0, rc;
  int64_t flag = 0;
  for (;;) {
    for (int k = 0; k < TESTS_PER_WAKE && !found; k++)
      if (core->cb.try_recv(core->app, src, tag, &found, &flag, out))
        return transport_error(core, "try_recv");
    if (found) break;
    int slept = block_app(core, src, -1, next);
    if (slept < 0) return transport_error(core, "block");
    if ((rc = keep_waiting(core, t0, &next, &spins, slept, &cpu0, "a state", src, l, i)))
      return rc;
  }
  count_wait(cpu0);
  core->comm_seconds += MPI_Wtime() - t0;
  mgrit_i_trace(core, l, MGRIT_OP_RECV, i, src, 0);
  if (flag && !core->err) core->err = MGRIT_ERR_REMOTE;
  if (core->err && *out != MGRIT_NONE) { /* a poisoned rank computes nothing */
    core->cb.free(core->app, *out);
    *out = MGRIT_NONE;
  }
  return MGRIT_OK;
}

int mgrit_i_recv(mgrit_core *core, int src, int tag, int l, int64_t i, mgrit_vec *out) {
  *out = MGRIT_NONE;
  if (src < 0) return MGRIT_OK;
  if (core->virt) {
    mgrit_i_trace(core, l, MGRIT_OP_RECV, i, src, 0);
    *out = 0;
    return MGRIT_OK;
  }
  MPI_Status st;
  int count = 0, rc;
  double t0 = MPI_Wtime();
  if (core->c.ext) return recv_app(core, src, tag, l, i, out, t0);
  /* Probe by polling (Note [polled waits]). */
  double next = t0 + 0.05, cpu0 = -1;
  long spins = 0;
  for (;;) {
    int found = 0;
    MGRIT_I_MPI(core, MPI_Iprobe(src, tag, core->c.comm, &found, &st));
    for (int k = 1; k < TESTS_PER_WAKE && !found; k++)
      MGRIT_I_MPI(core, MPI_Iprobe(src, tag, core->c.comm, &found, &st));
    if (found) break;
    if ((rc = keep_waiting(core, t0, &next, &spins, 0, &cpu0, "a state", src, l, i))) return rc;
  }
  count_wait(cpu0);
  MGRIT_I_MPI(core, MPI_Get_count(&st, MPI_BYTE, &count));
  char *buf = malloc((size_t)count);
  if (!buf) abort_nomem(core, "a received state", (size_t)count);
  rc = MPI_Recv(buf, count, MPI_BYTE, src, tag, core->c.comm, MPI_STATUS_IGNORE);
  if (rc != MPI_SUCCESS) {
    free(buf);
    return mgrit_i_mpi_error(core, rc, "MPI_Recv");
  }
  core->comm_seconds += MPI_Wtime() - t0;
  mgrit_i_trace(core, l, MGRIT_OP_RECV, i, src, 0);
  int64_t flag;
  memcpy(&flag, buf, sizeof flag);
  if (flag && !core->err) core->err = MGRIT_ERR_REMOTE;
  MGRIT_I_CB(core, core->cb.unpack(core->app, buf + HEADER, count - HEADER, out));
  free(buf);
  return MGRIT_OK;
}

int mgrit_i_wait_sends(mgrit_core *core) {
  mgrit_i_comm *c = &core->c;
  if (core->virt || core->abandoned) return MGRIT_OK; /* abandoned: never completes */
  double t0 = MPI_Wtime();
  int rc = MGRIT_OK;
  for (int k = 0; k < c->npending; k++) {
    if (rc == MGRIT_OK)
      rc = mgrit_i_poll_wait(core, &c->pending[k].req, "a receive of this rank's state");
    if (rc != MGRIT_OK) return rc; /* the remaining buffers stay with their requests */
    free(c->pending[k].buf);
  }
  c->npending = 0;
  core->comm_seconds += MPI_Wtime() - t0;
  return MGRIT_OK;
}

/* Collective: sums the n entries of sums over the ranks and learns whether any rank failed (and
 * the lowest rank whose own callback failed, or that ran out of memory).  sums holds triples:
 * squared residual and state norms and the sum of residual norms, one triple per iteration whose
 * allreduce was deferred (Note [deferred status]) and one for the measured sweep, summed with a
 * poison flag in one message.  Returns MGRIT_OK, or this rank's error status. */
int mgrit_i_allreduce_status(mgrit_core *core, double *sums, int n) {
  if (core->virt) return MGRIT_OK;
  int rc;
  if ((rc = mgrit_i_wait_sends(core))) return rc;
  double small[16], *local = n + 1 <= 8 ? small : malloc(2 * (size_t)(n + 1) * sizeof(double));
  if (!local) abort_nomem(core, "the status allreduce", 2 * (size_t)(n + 1) * sizeof(double));
  double *global = local + n + 1;
  for (int k = 0; k < n; k++) local[k] = core->err ? 0.0 : sums[k];
  local[n] = core->err ? 1.0 : 0.0;
  double t0 = MPI_Wtime();
  mgrit_i_req req;
  rc = mgrit_i_iallreduce(core, local, global, n + 1, MGRIT_I_SUM, &req);
  if (!rc) rc = mgrit_i_poll_wait(core, &req, "the residual allreduce");
  /* after a failed wait the request may still write global: it is leaked with the core's
   * abandoned schedule rather than freed */
  if (rc) return rc;
  core->comm_seconds += MPI_Wtime() - t0;
  for (int k = 0; k < n; k++) sums[k] = global[k];
  int poisoned = global[n] != 0.0;
  if (local != small) free(local);
  if (!poisoned) return MGRIT_OK;
  int own = core->err == MGRIT_ERR_CALLBACK || core->err == MGRIT_ERR_NOMEM;
  double mine = own ? core->c.rank : core->c.size, first;
  if ((rc = mgrit_i_iallreduce(core, &mine, &first, 1, MGRIT_I_MIN, &req))) return rc;
  if ((rc = mgrit_i_poll_wait(core, &req, "the failure allreduce"))) return rc;
  core->failed_rank = (int)first;
  if (!core->err) core->err = MGRIT_ERR_REMOTE;
  return core->err;
}

int mgrit_i_iallreduce(mgrit_core *core, const double *in, double *out, int n, int op,
                       mgrit_i_req *req) {
  if (core->c.ext)
    return core->cb.iallreduce(core->app, in, out, n, op, &req->app)
               ? transport_error(core, "iallreduce")
               : MGRIT_OK;
  MPI_Op mop = op == MGRIT_I_SUM ? MPI_SUM : op == MGRIT_I_MIN ? MPI_MIN : MPI_MAX;
  MGRIT_I_MPI(core, MPI_Iallreduce(in, out, n, MPI_DOUBLE, mop, core->c.comm, &req->mpi));
  return MGRIT_OK;
}
