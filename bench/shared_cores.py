"""The schedule of layerbraid.plan on a machine with fewer cores than ranks (a model of the host
that bench/scaling_measured.py emulates many ranks on).

layerbraid.plan.simulate gives every rank a core of its own.  Here P ranks share `cores` cores:

- a step action is `cpu` seconds of work that needs a core, then the rest of its cost without
  one (the emulated layer sleeps, as a layer on an accelerator leaves its CPU idle);
- the CPU parts run in the order the ranks ask, at most `cores` at a time, each to its end (a
  burst of a fraction of a millisecond is shorter than the scheduler's time slice);
- a rank that waits (for a message, or for the other ranks of an allreduce) polls, asking for
  `wait_cpu` of a core; with no more ranks than cores it spins on a core of its own.  While the
  running CPU parts and the polling ask for more than `cores` cores, the running parts slow down
  in proportion;
- with more ranks than cores the core's waits nap between tests (Note [polled waits] in
  cbridge/src/comm.c), a tenth of the time waited so far, 0.1 ms to 1 ms: a message that arrives
  during a nap is seen half a nap later on average, plus `seen_late` (what the machine adds:
  bench/scaling_measured.py measures it by handing a state from rank to rank).

With `cores` >= P this is exactly plan.simulate (the report checks it on every configuration).
"""
import math

from layerbraid.plan import OPS, STEP_OPS

NAP_MIN, NAP_MAX, SPIN_SECONDS = 1e-4, 1e-3, 2e-4  # comm.c's keep_waiting


def simulate(traces, step_cost, done_cost, message_seconds, latency, *, cores, cpu, wait_cpu,
             seen_late=0.0):
    """Seconds until the last rank finishes, the ranks of `traces` (plan.schedule) sharing
    `cores` cores; a step costs `step_cost` (`done_cost` in the final relaxation), `cpu` of it on
    a core.  Returns (seconds, CPU seconds of all ranks)."""
    step_codes = {OPS.index(op) for op in STEP_OPS}
    send, recv, norm = OPS.index("send"), OPS.index("recv"), OPS.index("norm")
    p = len(traces)
    over = p > cores
    columns = [(t["op"], t["level"], t["index"], t["peer"], t["done"], len(t)) for t in traces]
    pos = [0] * p
    # per rank: ("cpu", work left, seconds after it) | ("off", until) | ("recv", key, since)
    # | ("sync",) | ("done",)
    state = [None] * p
    arrivals = {}
    in_cpu = []  # ranks in a CPU part, in the order they asked: the first `cores` run
    now, cpu_used = 0.0, 0.0
    allreduce = latency * max(1.0, math.ceil(math.log2(p))) if p > 1 else 0.0

    def advance(r):
        """Runs rank r's actions from pos[r] at `now` until one takes time."""
        op, level, index, peer, done, n = columns[r]
        a = pos[r]
        while a < n:
            o = op[a]
            if o in step_codes:
                cost = done_cost if done[a] else step_cost
                work = min(cpu, cost)
                state[r], pos[r] = ("cpu", work, cost - work), a + 1
                in_cpu.append(r)
                return
            if o == send:
                arrivals.setdefault((r, int(peer[a]), int(level[a]), int(index[a])), []).append(
                    now + latency + message_seconds)
                if latency > 0:
                    state[r], pos[r] = ("off", now + latency), a + 1
                    return
            elif o == recv:
                key = (int(peer[a]), r, int(level[a]), int(index[a]))
                queue = arrivals.get(key)
                if not queue or queue[0] > now:
                    state[r], pos[r] = ("recv", key, now), a
                    return
                queue.pop(0)
            elif o == norm:
                state[r], pos[r] = ("sync",), a + 1
                return
            a += 1
        state[r], pos[r] = ("done",), a

    def seen(r):
        """When rank r's awaited message is seen (inf: not sent yet)."""
        _, key, since = state[r]
        queue = arrivals.get(key)
        if not queue:
            return math.inf
        t = max(queue[0], since)
        waited = t - since
        if over and waited > SPIN_SECONDS:
            t += min(max(waited / 10, NAP_MIN), NAP_MAX) / 2 + seen_late
        return t

    for r in range(p):
        advance(r)
    while True:
        kinds = [s[0] for s in state]
        if all(k == "done" for k in kinds):
            return now, cpu_used
        if all(k in ("sync", "done") for k in kinds):
            if "done" in kinds:
                raise RuntimeError("ranks disagree on the number of allreduces")
            now += allreduce
            for r in range(p):
                advance(r)
            continue
        running = set(in_cpu[:cores])
        computing = len(running)
        waiting = kinds.count("recv") + kinds.count("sync")
        asked = computing + (wait_cpu if over else 1.0) * waiting
        rate = 1.0 if asked <= cores else cores / asked
        nxt = math.inf
        for r, k in enumerate(kinds):
            if k == "cpu" and r in running:
                nxt = min(nxt, now + state[r][1] / rate)
            elif k == "off":
                nxt = min(nxt, state[r][1])
            elif k == "recv":
                nxt = min(nxt, seen(r))
        if nxt == math.inf:
            raise RuntimeError("a rank waits for a message that no rank sends")
        dt = nxt - now
        cpu_used += dt * min(asked, cores)
        now = nxt
        for r, k in enumerate(kinds):
            s = state[r]
            if k == "cpu" and r in running:
                left = s[1] - rate * dt
                if left <= 1e-12 * (1 + now):
                    in_cpu.remove(r)
                    if s[2] > 0:
                        state[r] = ("off", now + s[2])
                    else:
                        advance(r)
                else:
                    state[r] = ("cpu", left, s[2])
            elif k == "off" and s[1] <= now:
                advance(r)
            elif k == "recv" and seen(r) <= now:
                arrivals[s[1]].pop(0)
                pos[r] += 1
                advance(r)
