"""The MGRIT core's state messages over a point-to-point layer of Python's: what a transport
whose messages go through the core's callbacks (Note [application transport] in
cbridge/src/comm.c) shares, torch.distributed's (_comm/dist.py) and CUDA-aware MPI's
(_comm/mpi.py).

Note [state streams]: the core's messages between two ranks travel as one ordered stream (one
tag), each led by a record that carries the core's tag, and the receiver keeps a message that
arrives before the one it waits for until the core asks for it.  NCCL has no tags (it matches
a pair's messages in the order they were posted), and the core does not always receive in the
order it sends: on a coarse level rank r can send a second state before rank r + 1 takes a
fine-level one sent in between (tests/test_plan.py finds such schedules).  A stream keeps gloo
and NCCL on the same code.

Note [inline records]: where a receive may be larger than its message (gloo and MPI, whose CPU
messages go through a transport with ``oversized_receives``), a record and its state travel as
one message, [tag, flag, header bytes, payload bytes, 0 | header | payload], into a receive of
the stream's capacity: one message and one wait per state instead of two of each, which under
gloo are each a thread's hand-off.  A record larger than the capacity goes as before, its
record first (marked 1 in its last field) and then its header and payload.  Both ends start
at the same capacity and raise it to each record's size after it, so they agree on which way
each record travels without asking.  NCCL's receives must match their messages' sizes: on a
GPU the record always goes first.
"""

from typing import Any, Optional

import numpy as np
import torch

__all__ = ["StateStream"]

_STATE_TAG = 1  # the core's state messages: one stream per pair of ranks
_RECORD = 5  # int64 fields of a record: tag, flag, header bytes, payload bytes, body follows
_FIRST_CAPACITY = 1 << 16  # bytes of a stream's first inline receive (Note [inline records])


class StateStream:
    """isend_state, try_recv_state and test for a transport that provides ``device`` (where
    its messages' tensors live), ``_start_p2p(send, tensor, peer, tag)`` (a non-blocking send
    or receive of a whole tensor) and ``_done(work)`` (whether it completed; raises the
    transport's failure), and calls ``_stream_init()`` in its constructor."""

    device: Any
    oversized_receives = False  # whether a receive may be larger than its message

    def _start_p2p(self, send: bool, t: torch.Tensor, peer: int, tag: int) -> Any:
        raise NotImplementedError

    def _done(self, work: Any) -> bool:
        raise NotImplementedError

    def _stream_init(self) -> None:
        self._next = 0
        self._pending: dict[int, tuple] = {}
        self._readers: dict[int, dict] = {}
        self._mail: dict[tuple[int, int], list] = {}
        # Note [inline records]: each stream's capacity, as its sender and its receiver see it
        self._send_capacity: dict[int, int] = {}
        self._recv_capacity: dict[int, int] = {}

    def _inline(self) -> bool:
        return self.oversized_receives and self.device.type == "cpu"

    def _handle(self, entry: tuple) -> int:
        self._next += 1
        self._pending[self._next] = entry
        return self._next

    def isend_state(self, dest: int, tag: int, flag: int, head: bytes, payload: Any) -> int:
        """Starts sending a state on the pair's stream: its record [tag, flag, header bytes,
        payload bytes, body follows], then (not poisoned) the header and the payload, as one
        message when the payload is on the CPU; record and all in one message where it fits
        the stream's capacity (Note [inline records])."""
        n = 0 if flag else payload.numel()
        if self._inline():
            size = 8 * _RECORD + len(head) + n
            capacity = self._send_capacity.get(dest, _FIRST_CAPACITY)
            self._send_capacity[dest] = max(capacity, size)
            if size <= capacity:
                meta = torch.tensor([tag, flag, len(head), n, 0], dtype=torch.int64)
                parts = [meta.view(torch.uint8)]
                if not flag:
                    parts += [
                        torch.frombuffer(bytearray(head), dtype=torch.uint8),
                        payload.reshape(-1).to("cpu"),
                    ]
                whole = torch.cat(parts)
                work = self._start_p2p(True, whole, dest, _STATE_TAG)
                return self._handle(("send", [work], [whole]))
        meta = torch.tensor([tag, flag, len(head), n, 1], dtype=torch.int64, device=self.device)
        if self._inline():  # into the receiver's bytes of the stream's capacity
            meta = meta.view(torch.uint8)
        keep = [meta]
        works = [self._start_p2p(True, meta, dest, _STATE_TAG)]
        if not flag:
            headt = torch.frombuffer(bytearray(head), dtype=torch.uint8)
            if self.device.type == "cpu":
                body = torch.cat([headt, payload.reshape(-1).to("cpu")])
                keep.append(body)
                works.append(self._start_p2p(True, body, dest, _STATE_TAG))
            else:
                headt, body = headt.to(self.device), payload.reshape(-1).to(self.device)
                keep += [headt, body]
                works.append(self._start_p2p(True, headt, dest, _STATE_TAG))
                works.append(self._start_p2p(True, body, dest, _STATE_TAG))
        return self._handle(("send", works, keep))

    def try_recv_state(self, src: int, tag: int) -> Optional[tuple[int, bytes, Any]]:
        """The state message from ``src`` with ``tag`` once it is complete: (flag, header
        bytes, payload as a flat uint8 tensor on the message device); None until then.
        Messages of other tags that arrive first are kept for their own call."""
        while True:
            box = self._mail.get((src, tag))
            if box:
                return box.pop(0)
            if not self._read(src):
                return None

    def _read(self, src: int) -> bool:
        """Advances the reader of ``src``'s stream by what has completed; True when it
        delivered a message into the mailbox."""
        r = self._readers.get(src)
        if r is None:
            if self._inline():
                capacity = self._recv_capacity.get(src, _FIRST_CAPACITY)
                record = torch.empty(capacity, dtype=torch.uint8)
                meta = record[: 8 * _RECORD].view(torch.int64)
            else:
                meta = record = torch.zeros(_RECORD, dtype=torch.int64, device=self.device)
            r = {
                "meta": meta,
                "record": record,
                "works": [self._start_p2p(False, record, src, _STATE_TAG)],
            }
            self._readers[src] = r
        if not all(self._done(w) for w in r["works"]):
            return False
        if "body" not in r:
            tag, flag, hlen, n, follows = (int(v) for v in r["meta"].cpu().tolist())
            r.update(tag=tag, hlen=hlen)
            if self._inline():  # both ends raise the capacity alike (Note [inline records])
                size = 8 * _RECORD + hlen + n
                self._recv_capacity[src] = max(self._recv_capacity.get(src, _FIRST_CAPACITY), size)
            if flag:
                return self._deliver(src, r, (1, b"", None))
            if not follows:
                body = r["record"][8 * _RECORD : 8 * _RECORD + hlen + n]
                if 2 * body.numel() < r["record"].numel():  # do not keep a large buffer alive
                    body = body.clone()
                return self._deliver(src, r, (0, bytes(body[:hlen].numpy()), body[hlen:]))
            if self.device.type == "cpu":
                r["body"] = torch.empty(hlen + n, dtype=torch.uint8)
                r["works"] = [self._start_p2p(False, r["body"], src, _STATE_TAG)]
            else:
                r["head"] = torch.empty(hlen, dtype=torch.uint8, device=self.device)
                r["body"] = torch.empty(n, dtype=torch.uint8, device=self.device)
                r["works"] = [
                    self._start_p2p(False, r["head"], src, _STATE_TAG),
                    self._start_p2p(False, r["body"], src, _STATE_TAG),
                ]
            return False
        hlen, body = r["hlen"], r["body"]
        if self.device.type == "cpu":
            return self._deliver(src, r, (0, bytes(body[:hlen].numpy()), body[hlen:]))
        return self._deliver(src, r, (0, bytes(r["head"].cpu().numpy()), body))

    def _deliver(self, src: int, r: dict, message: tuple) -> bool:
        del self._readers[src]
        self._mail.setdefault((src, r["tag"]), []).append(message)
        return True

    def waited_on(self, src: int, handle: int) -> list:
        """The works that the MGRIT core waits on: the reader of ``src``'s stream (``src`` >=
        0; what try_recv_state posted) or the send or allreduce ``handle``."""
        if src >= 0:
            return list(self._readers.get(src, {}).get("works", []))
        entry = self._pending.get(handle)
        return [] if entry is None else list(entry[1])

    def test(self, handle: int) -> Optional[Any]:
        """None while the send or allreduce ``handle`` is pending; then True (a send) or the
        reduced values (a numpy array)."""
        kind, works, keep = self._pending[handle]
        if not all(self._done(w) for w in works):
            return None
        del self._pending[handle]
        if kind != "reduce":
            return True
        return keep.cpu().numpy() if torch.is_tensor(keep) else np.asarray(keep)
