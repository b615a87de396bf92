/* trace.c -- the schedule as data: every step, message and norm, in the order it happened. */
#include "_mgrit.h"

#include <stdlib.h>

void mgrit_i_trace(mgrit_core *core, int l, int op, int64_t i, int peer, int done) {
  if (!core->o.trace) return;
  if (core->ntrace == core->cap_trace) {
    int64_t cap = core->cap_trace ? 2 * core->cap_trace : 1024;
    mgrit_trace_entry *t = realloc(core->trace, (size_t)cap * sizeof(*t));
    if (!t) { /* out of memory: stop tracing rather than fail the solve */
      core->o.trace = 0;
      return;
    }
    core->trace = t;
    core->cap_trace = cap;
  }
  mgrit_trace_entry *e = &core->trace[core->ntrace++];
  e->level = l;
  e->op = op;
  e->index = i;
  e->peer = peer;
  e->done = done;
}

int64_t mgrit_trace_length(const mgrit_core *core) { return core->ntrace; }
const mgrit_trace_entry *mgrit_trace(const mgrit_core *core) { return core->trace; }
