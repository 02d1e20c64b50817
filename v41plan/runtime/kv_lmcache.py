"""``kv_transfer=lmcache_mp``: PAGE units and checkpoint images on an LMCache multiprocess server.

A client of the LMCache MP server (pinned: ``LMCACHE_VERSION``) through its token-keyed chunk
API, with the server's ``chunk_size`` equal to the PAGE (``page_tokens``): one chunk of a token
sequence is one PAGE unit. The engine copies planes to host staging tensors registered with the
server (``lmcache_driven`` transfers: the server reads and writes them in shared memory), so the
server never needs CUDA.

- **Units**: every plane of a unit (``Pools.kv_transfer_tensors``: the main PAGE, then each
  index plane, in ``StateCopies`` order) is one registered staging tensor ``[blocks, page_tokens,
  ceil(plane_bytes / page_tokens)]``, plus a meta plane holding the unit's checksum and the
  layout's digest; keys are the request's token ids under model name ``v41plan/<layout id>``.
- **Images** are ``units_per_image`` unit-shaped chunks keyed by token ids drawn from the block
  hash the image ends at (31-bit ids, almost surely outside any vocabulary, so images have a key
  space of their own, the role a separate ``cache_salt`` plays; the hash chains the whole
  prefix). The unit stores an image depends on are confirmed before the image is stored.
- **Faults**: a lookup the server does not answer within ``timeout_s`` is a miss; a store while
  the server is unhealthy is dropped (counted); a retrieve that fails, times out or returns
  bytes whose checksum or layout digest is wrong fails its ``Prefetch``, and the scheduler
  recomputes. No call waits longer than ``timeout_s``.

Block 0 of every staging tensor is the server's null block and never used.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from contextlib import contextmanager

import numpy as np

from v41plan.runtime.kv_connector import ConnectorError, KVConnector, Prefetch, checksum

LMCACHE_VERSION = "0.5.6"
META_BYTES = 32  # 16 of checksum, 16 of layout digest
STAGING_BYTES = 256 << 20
"""Host staging registered with the server (per connector); a retrieve larger than half of it
runs as several."""


def _quiet_env() -> None:
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")


def _import_lmcache():
    """The LMCache client modules, or ``ConnectorError`` naming the extra to install."""
    _quiet_env()
    try:
        import lmcache
        import torch  # noqa: F401 - the adapters register torch tensors
        import zmq
        from lmcache.integration.atom.multi_process_adapter import (
            AtomMPParallelConfig,
            AtomMPSchedulerAdapter,
            AtomMPTransferSpec,
            AtomMPWorkerAdapter,
        )
        from lmcache.v1.multiprocess.group_view import EngineGroupInfo
        from lmcache.v1.platform.devices.cpu.stub_cpu_device import StubEvent
    except ImportError as exc:
        raise ConnectorError(
            f"lmcache_mp needs the LMCache client ({exc}); install lmcache=={LMCACHE_VERSION} "
            "(see the README's KV offload section)"
        ) from None
    version = getattr(lmcache, "__version__", LMCACHE_VERSION)
    if not str(version).startswith(LMCACHE_VERSION):
        raise ConnectorError(f"lmcache_mp is pinned to LMCache {LMCACHE_VERSION}, found {version}")
    return {
        "zmq": zmq,
        "Par": AtomMPParallelConfig,
        "Sched": AtomMPSchedulerAdapter,
        "Spec": AtomMPTransferSpec,
        "Worker": AtomMPWorkerAdapter,
        "Group": EngineGroupInfo,
        "Event": StubEvent,
    }


class _Namespace:
    """One LMCache model name: a scheduler adapter (lookups), a worker adapter (transfers) and
    registered host staging planes of ``widths`` bytes per token."""

    def __init__(
        self, lm, url: str, name: str, page_tokens: int, plane_bytes, timeout_s: float, blocks: int
    ):
        import torch

        self.lm, self.P, self.timeout_s = lm, page_tokens, timeout_s
        _probe(url, timeout_s)
        self.ctx = _context(lm)
        par = lm["Par"](world_size=1, worker_id=0, tp_size=1)
        try:
            self.sched = lm["Sched"](url, self.ctx, name, page_tokens, par, mq_timeout=timeout_s)
        except (TimeoutError, OSError) as exc:
            raise ConnectorError(f"no LMCache server answered at {url} within {timeout_s:g} s "
                                 f"({type(exc).__name__})") from None  # fmt: skip
        chunk = self.sched.lmcache_tokens_per_chunk
        if chunk != page_tokens:
            self.sched.shutdown()
            raise ConnectorError(
                f"the LMCache server at {url} has chunk_size {chunk}; this pool's PAGE is "
                f"{page_tokens} tokens (start it with --chunk-size {page_tokens})"
            )
        self.worker = lm["Worker"](
            url, self.ctx, name, page_tokens, par, mq_timeout=timeout_s,
            heartbeat_interval=1.0, transfer_mode="lmcache_driven",
        )  # fmt: skip
        self.plane_bytes = list(plane_bytes) + [META_BYTES]
        self.planes = {
            f"plane{i}": torch.zeros(blocks + 1, page_tokens, -(-n // page_tokens),
                                     dtype=torch.uint8)
            for i, n in enumerate(self.plane_bytes)
        }  # fmt: skip
        # the server groups planes of one shape into one kernel group: one info per group
        by_shape: dict[tuple, list[int]] = {}
        for i, t in enumerate(self.planes.values()):
            by_shape.setdefault(tuple(t.shape), []).append(i)
        groups = [
            lm["Group"](engine_group_id=0, layer_indices=tuple(ix)) for ix in by_shape.values()
        ]
        self.worker.register_kv_caches(self.planes, engine_group_infos=groups)
        # registration moved the storage into shared memory: only these views see it
        self.views = [p.view(blocks + 1, -1) for p in self.planes.values()]
        self.free = list(range(1, blocks + 1))
        self.blocks = blocks
        self.lock = threading.Lock()

    def event(self):
        ev = self.lm["Event"](interprocess=True)
        ev.record()
        return ev

    def take_blocks(self, n: int) -> list[int] | None:
        with self.lock:
            if len(self.free) < n:
                return None
            out, self.free = self.free[:n], self.free[n:]
            return out

    def give_blocks(self, blocks) -> None:
        with self.lock:
            self.free.extend(blocks)

    def write(self, blocks, rows: np.ndarray, meta: np.ndarray) -> None:
        """Stage ``rows [n, sum(plane bytes)]`` (plane segments end to end) and ``meta``."""
        import torch

        lo = 0
        idx = torch.as_tensor(blocks)
        for view, n in zip(self.views[:-1], self.plane_bytes[:-1], strict=True):
            view[idx, :n] = torch.from_numpy(np.ascontiguousarray(rows[:, lo : lo + n]))
            lo += n
        self.views[-1][idx, :META_BYTES] = torch.from_numpy(meta)

    def read(self, blocks) -> tuple[np.ndarray, np.ndarray]:
        import torch

        idx = torch.as_tensor(blocks)
        parts = [v[idx, :n].numpy() for v, n in zip(self.views[:-1], self.plane_bytes[:-1])]
        return np.concatenate(parts, axis=1), self.views[-1][idx, :META_BYTES].numpy().copy()

    def lookup(self, tokens: list[int]) -> tuple[int, str | None]:
        """Matched tokens of ``tokens`` and the lookup's request id (its locks held), or
        ``(0, None)`` when the server does not answer in time."""
        rid = f"v41-{uuid.uuid4().hex[:12]}"
        got = None
        with contextlib.suppress(Exception):  # a dead or dying server is a miss
            self.sched.maybe_submit_lookup_request(rid, tokens)
            t0 = time.perf_counter()
            while got is None and time.perf_counter() - t0 <= self.timeout_s:
                got = self.sched.check_lookup_result(rid)
                if got is None:
                    time.sleep(0.001)
        if got is not None:
            return int(got), rid
        self.release(rid, tokens, 0)
        return 0, None

    def release(self, rid: str | None, tokens, matched: int) -> None:
        """Free a lookup's locks and its session (best effort: a dead server is fine)."""
        if rid is None:
            return
        with contextlib.suppress(Exception):  # a dead server must not fail the step
            if matched:
                self.sched.free_lookup_locks(tokens, 0, matched, rid)
            self.sched.cleanup_lookup_result(rid)
            self.sched.end_session(rid)

    def close(self) -> None:
        done = threading.Event()

        def stop():
            try:
                self.worker.shutdown()
                self.sched.shutdown()
            finally:
                done.set()

        threading.Thread(target=stop, daemon=True).start()
        done.wait(self.timeout_s)  # a dead server's pending future must not hang us


_CONTEXTS: list = []
"""Every ZMQ context made here, kept until the interpreter exits: the adapters' threads own
sockets of them, so a context collected earlier would wait in ``term()`` for sockets nobody
closes (pyzmq skips that wait only at exit)."""


def _context(lm):
    ctx = lm["zmq"].Context()
    _CONTEXTS.append(ctx)
    return ctx


def _probe(url: str, timeout_s: float) -> None:
    """A TCP connect to the server first: a server that is not there refuses at once, before
    any ZMQ state exists."""
    host, port = url.removeprefix("tcp://").rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as exc:
        raise ConnectorError(
            f"no LMCache server answered at {url} ({exc.strerror or exc})"
        ) from None


def key_tokens(key: bytes, page_tokens: int) -> list[int]:
    """``page_tokens`` token ids drawn from a block hash (an image's LMCache key)."""
    out: list[int] = []
    i = 0
    while len(out) < page_tokens:
        d = hashlib.sha256(key + i.to_bytes(4, "little")).digest()
        out.extend(int.from_bytes(d[j : j + 4], "little") & 0x7FFFFFFF for j in range(0, 32, 4))
        i += 1
    return out[:page_tokens]


class LMCacheConnector(KVConnector):
    """The ``lmcache_mp`` connector (see the module docstring)."""

    name = "lmcache_mp"

    def __init__(
        self,
        layout_id: str,
        unit_bytes: int,
        units_per_image: int,
        *,
        host: str,
        port: int,
        page_tokens: int,
        plane_bytes: tuple[int, ...],
        timeout_s: float = 5.0,
        staging_bytes: int = STAGING_BYTES,
    ) -> None:
        super().__init__(layout_id, unit_bytes, units_per_image)
        if sum(plane_bytes) != unit_bytes:
            raise ValueError(f"plane bytes {plane_bytes} do not add up to a unit ({unit_bytes})")
        lm = _import_lmcache()
        self.url = f"tcp://{host}:{port}"
        self.P = page_tokens
        self.timeout_s = timeout_s
        self.digest = hashlib.sha256(layout_id.encode()).digest()[:16]
        blocks = max(4 * units_per_image, staging_bytes // (unit_bytes + META_BYTES))
        self.units = _Namespace(
            lm, self.url, f"v41plan/{layout_id}", page_tokens, plane_bytes, timeout_s, blocks
        )
        self.max_retrieve = blocks // 2
        self.images = self.units  # one registration: images live in their own key space
        self._stores: list[tuple[object, list[int], _Namespace]] = []

    # ---- helpers ---------------------------------------------------------------------------
    def _meta(self, rows: np.ndarray) -> np.ndarray:
        return np.stack([np.frombuffer(checksum(r) + self.digest, np.uint8) for r in rows])

    def _reap(self, wait: bool = False) -> None:
        """Give back the staging blocks of finished stores (``wait``: all of them, bounded)."""
        keep = []
        deadline = time.perf_counter() + self.timeout_s
        for fut, blocks, ns in self._stores:
            done = fut.query()
            while wait and not done and time.perf_counter() < deadline:
                time.sleep(0.001)
                done = fut.query()
            if done or (wait and time.perf_counter() >= deadline):
                ns.give_blocks(blocks)
            else:
                keep.append((fut, blocks, ns))
        self._stores = keep

    def _store(self, ns: _Namespace, tokens, start_block: int, rows: np.ndarray) -> bool:
        self._reap()
        blocks = ns.take_blocks(len(rows))
        if blocks is None:
            return False
        ns.write(blocks, rows, self._meta(rows))
        spec = ns.lm["Spec"](list(tokens), [blocks], start_block * self.P, len(tokens))
        try:
            fut = ns.worker.submit_store_request(f"v41s-{uuid.uuid4().hex[:12]}", spec, ns.event())
        except Exception:  # noqa: BLE001 - a dying server: the save is dropped, nothing else
            fut = None
        if fut is None:
            ns.give_blocks(blocks)
            return False
        self._stores.append((fut, blocks, ns))
        return True

    # ---- scheduler side --------------------------------------------------------------------
    def lookup(self, token_ids, hashes, first: int = 0) -> int:
        self.stats.lookups += 1
        tokens = list(token_ids[: len(hashes) * self.P])
        matched, rid = self.units.lookup(tokens)
        self.units.release(rid, tokens, matched)
        n = max(0, matched // self.P - first)
        self.stats.hit_blocks += n
        return n

    def _image_tokens(self, key: bytes) -> list[int]:
        return key_tokens(key, self.units_per_image * self.P)

    def has_image(self, token_ids, key) -> bool:
        tokens = self._image_tokens(key)
        matched, rid = self.images.lookup(tokens)
        self.images.release(rid, tokens, matched)
        return matched >= len(tokens)

    def prefetch(self, token_ids, hashes, first, count, image_block) -> Prefetch:
        handle = Prefetch(tuple(hashes[first : first + count]),
                          None if image_block is None else hashes[image_block])  # fmt: skip
        self._reap(wait=True)  # finished stores give their staging back first
        jobs = []
        for lo in range(first, first + count, self.max_retrieve):
            n = min(self.max_retrieve, first + count - lo)
            jobs.append(self._retrieve(self.units, list(token_ids[: (lo + n) * self.P]), lo, n))
            if jobs[-1] is None:
                break
        if image_block is not None:
            tokens = self._image_tokens(hashes[image_block])
            jobs.append(self._retrieve(self.images, tokens, 0, self.units_per_image))
        handle.extra["jobs"] = jobs
        if any(j is None for j in jobs):
            self._drop_jobs([j for j in jobs if j is not None])
            return self._fail(handle, "the server has not got it (or did not answer)")
        return handle

    def _drop_jobs(self, jobs) -> None:
        """Release retrieves that will not be read (their blocks once the server is done)."""
        deadline = time.perf_counter() + self.timeout_s
        for j in jobs:
            while not j["fut"].query() and time.perf_counter() < deadline:
                time.sleep(0.001)
            if j["fut"].query():
                j["ns"].give_blocks(j["blocks"])
            j["ns"].release(j["rid"], j["tokens"], 0)

    def _retrieve(self, ns: _Namespace, tokens, first: int, count: int):
        matched, rid = ns.lookup(tokens)
        if matched < (first + count) * self.P:
            ns.release(rid, tokens, matched)
            return None
        if first:  # only [first, first + count) is read: unlock what precedes it
            with contextlib.suppress(Exception):
                ns.sched.free_lookup_locks(tokens, 0, first * self.P, rid)
        blocks = ns.take_blocks(count)
        if blocks is None:
            ns.release(rid, tokens, 0)
            return None
        spec = ns.lm["Spec"](tokens, [blocks], first * self.P, (first + count) * self.P)
        try:
            fut = ns.worker.submit_retrieve_request(rid, spec, ns.event())
        except Exception:  # noqa: BLE001
            fut = None
        if fut is None:
            ns.give_blocks(blocks)
            ns.release(rid, tokens, 0)
            return None
        return {"ns": ns, "fut": fut, "blocks": blocks, "rid": rid, "tokens": tokens,
                "t0": time.perf_counter()}  # fmt: skip

    def ready(self, handle: Prefetch) -> bool:
        if handle.done:
            return True
        jobs = handle.extra["jobs"]
        now = time.perf_counter()
        if not all(j["fut"].query() or now - j["t0"] > self.timeout_s for j in jobs):
            return False
        why = None
        out = []
        for j in jobs:
            ok = False
            if j["fut"].query():
                try:
                    ok = bool(j["fut"].result(timeout=0))
                except Exception:  # noqa: BLE001
                    ok = False
            if ok:
                rows, meta = j["ns"].read(j["blocks"])
                good = all(
                    meta[i, 16:].tobytes() == self.digest and meta[i, :16].tobytes() == checksum(r)
                    for i, r in enumerate(rows)
                )
                if not good:
                    why = "checksum or layout mismatch"
                out.append(rows)
            else:
                why = why or "retrieve failed or timed out"
            if j["fut"].query():  # a timed-out retrieve may still write: keep its blocks
                j["ns"].give_blocks(j["blocks"])
            j["ns"].release(j["rid"], j["tokens"], 0)
        if why is not None:
            self._fail(handle, why)
            return True
        if handle.image_key is not None:
            handle.image = out.pop().reshape(self.units_per_image, self.unit_bytes)
            self.stats.loaded_images += 1
        if handle.keys:
            handle.units = np.concatenate(out)
            self.stats.loaded_units += len(handle.keys)
        if handle.units is None:
            handle.units = np.zeros((0, self.unit_bytes), dtype=np.uint8)
        handle.done = True
        return True

    def _fail(self, handle: Prefetch, why: str) -> Prefetch:
        handle.done, handle.failed = True, why
        handle.units = handle.image = None
        self.stats.failed_retrieves += 1
        return handle

    # ---- runner side -----------------------------------------------------------------------
    def save_units(self, keys, token_ids, data) -> None:
        first = len(token_ids) // self.P - len(keys)
        data = np.asarray(data)
        for lo in range(0, len(keys), self.max_retrieve):  # pieces the staging can hold
            n = min(self.max_retrieve, len(keys) - lo)
            tokens = token_ids[: (first + lo + n) * self.P]
            if not self._store(self.units, tokens, first + lo, data[lo : lo + n]):
                self._reap(wait=True)  # staging full: wait for the stores in flight, once
                if not self._store(self.units, tokens, first + lo, data[lo : lo + n]):
                    self.stats.dropped_saves += 1
                    return  # the later blocks would not be reachable by a lookup anyway
            self.stats.saved_units += n

    def save_image(self, key, token_ids, data) -> None:
        self._reap(wait=True)  # the units this image depends on are confirmed first
        rows = np.asarray(data).reshape(self.units_per_image, self.unit_bytes)
        if self._store(self.images, self._image_tokens(key), 0, rows):
            self.stats.saved_images += 1
        else:
            self.stats.dropped_saves += 1

    def close(self) -> None:
        self._reap(wait=True)
        self.units.close()

    def describe(self) -> str:
        return f"LMCache {LMCACHE_VERSION} MP server at {self.url} (chunk = PAGE = {self.P} tokens)"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def lmcache_server(page_tokens: int, *, l1_gb: float = 1.0, ready_s: float = 90.0, log=None):
    """An LMCache MP server on a free 127.0.0.1 port with ``chunk_size = page_tokens``, for
    tests and benchmarks: yields ``(host, port, process)``; stopped on exit."""
    _quiet_env()
    port = _free_port()
    cmd = [sys.executable, "-m", "lmcache.v1.multiprocess.server", "--host", "127.0.0.1",
           "--port", str(port), "--chunk-size", str(page_tokens), "--l1-size-gb", str(l1_gb),
           "--eviction-policy", "LRU", "--supported-transfer-mode", "lmcache_driven",
           "--disable-observability", "--prometheus-port", str(_free_port())]  # fmt: skip
    out = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_ready(port, proc, ready_s)
        yield "127.0.0.1", port, proc
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        if log:
            out.close()


def _wait_ready(port: int, proc: subprocess.Popen, limit_s: float) -> None:
    lm = _import_lmcache()
    from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

    ctx = _context(lm)
    client = RequestClientFactory.create(f"tcp://127.0.0.1:{port}", context=ctx)
    t0 = time.perf_counter()
    try:
        while True:
            if proc.poll() is not None:
                raise ConnectorError(f"the LMCache server exited at start (rc {proc.returncode})")
            try:
                client.get_chunk_size().result(timeout=0.5)
                return
            except TimeoutError:
                if time.perf_counter() - t0 > limit_s:
                    raise ConnectorError(f"the LMCache server did not start in {limit_s:g} s")
    finally:
        client.close()
