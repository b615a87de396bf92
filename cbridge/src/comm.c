/* comm.c -- MPI: packed state messages (always left to right) and the status allreduce.
 *
 * Note [poisoned messages]: every message starts with an int64 flag.  A rank whose callback
 * failed (or that heard of a failure) stops computing but keeps the schedule: it still sends
 * every message, flagged and without payload, and still receives (and drops) every message.
 * The schedule never depends on the data, so every rank reaches the next collective, where the
 * failure becomes known everywhere.  MPI errors themselves keep MPI's default handler, which
 * aborts the whole job with MPI's message rather than leave ranks waiting. */
#include "_mgrit.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define HEADER ((int64_t)sizeof(int64_t))

int _mgrit_tag(int l, int kind) { return 16 + 2 * l + kind; }

int _mgrit_send(mgrit_core *core, int dest, int tag, int l, int64_t i, mgrit_vec x) {
  if (dest < 0) return MGRIT_OK;
  _mgrit_trace(core, l, MGRIT_OP_SEND, i, dest, 0);
  if (core->virt) return MGRIT_OK;
  int64_t n = 0;
  if (x == MGRIT_NONE && !core->err) core->err = MGRIT_ERR_CALLBACK;
  _MGRIT_CB(core, core->cb.bufsize(core->app, x, &n));
  if (!core->err && (n < 0 || n > INT_MAX - HEADER)) {
    snprintf(core->msg, sizeof core->msg, "a state of %lld bytes is too large for one message",
             (long long)n);
    core->err = MGRIT_ERR_CALLBACK;
  }
  char *buf = malloc((size_t)(HEADER + (core->err ? 0 : n)));
  if (!buf) return MGRIT_ERR_NOMEM;
  _MGRIT_CB(core, core->cb.pack(core->app, x, buf + HEADER, n));
  int64_t flag = core->err ? 1 : 0;
  if (flag) n = 0;
  memcpy(buf, &flag, sizeof flag);
  _mgrit_comm *c = &core->c;
  if (c->npending == c->cap) {
    int cap = c->cap ? 2 * c->cap : 16;
    _mgrit_pending *p = realloc(c->pending, (size_t)cap * sizeof(*p));
    if (!p) {
      free(buf);
      return MGRIT_ERR_NOMEM;
    }
    c->pending = p;
    c->cap = cap;
  }
  _mgrit_pending *s = &c->pending[c->npending++];
  s->buf = buf;
  MPI_Isend(buf, (int)(HEADER + n), MPI_BYTE, dest, tag, c->comm, &s->req);
  return MGRIT_OK;
}

int _mgrit_recv(mgrit_core *core, int src, int tag, int l, int64_t i, mgrit_vec *out) {
  *out = MGRIT_NONE;
  if (src < 0) return MGRIT_OK;
  if (core->virt) {
    _mgrit_trace(core, l, MGRIT_OP_RECV, i, src, 0);
    *out = 0;
    return MGRIT_OK;
  }
  MPI_Status st;
  int count = 0;
  double t0 = MPI_Wtime();
  MPI_Probe(src, tag, core->c.comm, &st);
  MPI_Get_count(&st, MPI_BYTE, &count);
  char *buf = malloc((size_t)count);
  if (!buf) return MGRIT_ERR_NOMEM;
  MPI_Recv(buf, count, MPI_BYTE, src, tag, core->c.comm, MPI_STATUS_IGNORE);
  core->comm_seconds += MPI_Wtime() - t0;
  _mgrit_trace(core, l, MGRIT_OP_RECV, i, src, 0);
  int64_t flag;
  memcpy(&flag, buf, sizeof flag);
  if (flag && !core->err) core->err = MGRIT_ERR_REMOTE;
  _MGRIT_CB(core, core->cb.unpack(core->app, buf + HEADER, count - HEADER, out));
  free(buf);
  return MGRIT_OK;
}

int _mgrit_wait_sends(mgrit_core *core) {
  _mgrit_comm *c = &core->c;
  if (core->virt) return MGRIT_OK;
  double t0 = MPI_Wtime();
  for (int k = 0; k < c->npending; k++) {
    MPI_Wait(&c->pending[k].req, MPI_STATUS_IGNORE);
    free(c->pending[k].buf);
  }
  c->npending = 0;
  core->comm_seconds += MPI_Wtime() - t0;
  return MGRIT_OK;
}

/* Collective: sums *sumsq over the ranks and learns whether any rank failed (and the lowest
 * rank whose own callback failed).  Returns MGRIT_OK, or this rank's error status. */
int _mgrit_allreduce_status(mgrit_core *core, double *sumsq) {
  if (core->virt) return MGRIT_OK;
  _mgrit_wait_sends(core);
  double local[2] = {core->err ? 0.0 : *sumsq, core->err ? 1.0 : 0.0}, global[2];
  double t0 = MPI_Wtime();
  MPI_Allreduce(local, global, 2, MPI_DOUBLE, MPI_SUM, core->c.comm);
  core->comm_seconds += MPI_Wtime() - t0;
  *sumsq = global[0];
  if (global[1] == 0.0) return MGRIT_OK;
  int mine = core->err == MGRIT_ERR_CALLBACK ? core->c.rank : core->c.size, first;
  MPI_Allreduce(&mine, &first, 1, MPI_INT, MPI_MIN, core->c.comm);
  core->failed_rank = first;
  if (!core->err) core->err = MGRIT_ERR_REMOTE;
  return core->err;
}
