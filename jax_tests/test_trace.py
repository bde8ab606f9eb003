"""commfuse.trace: the Perfetto file it writes, read back and checked against the plans.

The trace is decoded with the small protobuf wire-format reader below rather
than the ``protobuf`` package: that package would need Perfetto's .proto files
compiled into Python modules (which the repository does not carry), and a
reader written from the wire-format spec checks the field numbers the Rust
encoder uses independently of the prost structs it is built from.
"""

from __future__ import annotations

import collections

import jax
import pytest

import commfuse
from conftest import P, mesh1d, place, rand, sharded_fn

# Perfetto field numbers (protos/perfetto/trace/...).
TRACE_PACKET = 1
PACKET_TIMESTAMP, PACKET_SEQUENCE_ID, PACKET_TRACK_EVENT, PACKET_TRACK_DESCRIPTOR = 8, 10, 11, 60
DESC_UUID, DESC_NAME, DESC_PROCESS, DESC_THREAD, DESC_PARENT = 1, 2, 3, 4, 5
PROCESS_PID, PROCESS_NAME = 1, 6
THREAD_PID, THREAD_TID, THREAD_NAME = 1, 2, 5
EVENT_ANNOTATIONS, EVENT_TYPE, EVENT_TRACK, EVENT_CATEGORIES, EVENT_NAME = 4, 9, 11, 22, 23
ANN_BOOL, ANN_UINT, ANN_INT, ANN_STRING, ANN_NAME = 2, 3, 4, 6, 10
SLICE_BEGIN, SLICE_END = 1, 2


# --------------------------------------------------------------------------
# A protobuf wire-format reader: varints and length-delimited fields
# --------------------------------------------------------------------------
def _varint(buf: bytes, i: int):
    value, shift = 0, 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7


def fields(buf: bytes):
    """{field number: [values]}: ints for varints and fixed, bytes for length-delimited."""
    out = collections.defaultdict(list)
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 1:
            value, i = int.from_bytes(buf[i:i + 8], "little"), i + 8
        elif wire == 2:
            length, i = _varint(buf, i)
            value, i = bytes(buf[i:i + length]), i + length
        elif wire == 5:
            value, i = int.from_bytes(buf[i:i + 4], "little"), i + 4
        else:
            raise ValueError(f"wire type {wire} at byte {i}")
        out[number].append(value)
    assert i == len(buf), "a field runs past its message"
    return out


def _one(f, number, default=None):
    values = f.get(number, [])
    assert len(values) <= 1, f"field {number} repeated"
    return values[0] if values else default


def _annotation(buf: bytes):
    f = fields(buf)
    name = _one(f, ANN_NAME).decode()
    if ANN_STRING in f:
        return name, _one(f, ANN_STRING).decode()
    if ANN_BOOL in f:
        return name, bool(_one(f, ANN_BOOL))
    if ANN_INT in f:
        v = _one(f, ANN_INT)
        return name, v - (1 << 64) if v >= 1 << 63 else v
    return name, _one(f, ANN_UINT)


Slice = collections.namedtuple("Slice", "name category start end depth args")


def read_trace(path):
    """(tracks, slices): {uuid: descriptor dict}, {thread uuid: [Slice]} from a trace file."""
    data = open(path, "rb").read()
    tracks, slices, open_ = {}, collections.defaultdict(list), collections.defaultdict(list)
    sequences, last_ts = set(), 0
    for packet in fields(data)[TRACE_PACKET]:
        p = fields(packet)
        sequences.add(_one(p, PACKET_SEQUENCE_ID))
        if PACKET_TRACK_DESCRIPTOR in p:
            d = fields(_one(p, PACKET_TRACK_DESCRIPTOR))
            desc = {"name": _one(d, DESC_NAME, b"").decode(), "parent": _one(d, DESC_PARENT)}
            if DESC_PROCESS in d:
                pr = fields(_one(d, DESC_PROCESS))
                desc.update(pid=_one(pr, PROCESS_PID), process_name=_one(pr, PROCESS_NAME).decode())
            if DESC_THREAD in d:
                th = fields(_one(d, DESC_THREAD))
                desc.update(pid=_one(th, THREAD_PID), tid=_one(th, THREAD_TID),
                            thread_name=_one(th, THREAD_NAME).decode())
            tracks[_one(d, DESC_UUID)] = desc
            continue
        e = fields(_one(p, PACKET_TRACK_EVENT))
        ts = _one(p, PACKET_TIMESTAMP)
        assert ts >= last_ts, "packets are in time order"
        last_ts = ts
        track = _one(e, EVENT_TRACK)
        assert track in tracks, "an event's track is described before it"
        kind = _one(e, EVENT_TYPE)
        if kind == SLICE_BEGIN:
            args = dict(_annotation(a) for a in e.get(EVENT_ANNOTATIONS, []))
            category = b",".join(e.get(EVENT_CATEGORIES, [])).decode()
            open_[track].append((_one(e, EVENT_NAME).decode(), category, ts, args))
        else:
            assert kind == SLICE_END, kind
            name, category, start, args = open_[track].pop()
            slices[track].append(Slice(name, category, start, ts, len(open_[track]), args))
    assert not any(open_.values()), "every slice ends"
    assert len(sequences) <= 1 and None not in sequences, "one trusted packet sequence"
    return tracks, slices


def lanes_by_device(path):
    """{device: {lane name: [Slice sorted by start]}} with the process names."""
    tracks, slices = read_trace(path)
    out, names = collections.defaultdict(dict), {}
    for uuid, desc in tracks.items():
        if "thread_name" not in desc:
            continue
        process = tracks[desc["parent"]]
        assert process["pid"] == desc["pid"], "a lane's thread belongs to its device's process"
        device = process["pid"] - 1
        names[device] = process["process_name"]
        out[device][desc["thread_name"]] = sorted(slices[uuid], key=lambda s: (s.start, s.depth))
    return out, names


# --------------------------------------------------------------------------
# Running ops under a trace
# --------------------------------------------------------------------------
def _run_all_gather_matmul(n, schedule, m=8, k=16, f=12):
    mesh = mesh1d(n)
    specs = (P("x", None), P(None, "x"))
    fn = sharded_fn(lambda x, w: commfuse.all_gather_matmul(x, w, "x", schedule=schedule), mesh, specs)
    x, w = rand((n * m, k), seed=1), rand((k, n * f), seed=2)
    args = [place(a, mesh, s) for a, s in zip((x, w), specs)]
    return fn, args, m * k * 4


def _run_matmul_reduce_scatter(n, schedule, m=8, k=16, f=12):
    mesh = mesh1d(n)
    specs = (P(None, "x"), P("x", None))
    fn = sharded_fn(lambda x, w: commfuse.matmul_reduce_scatter(x, w, "x", schedule=schedule), mesh, specs)
    x, w = rand((n * m, n * k), seed=3), rand((n * k, f), seed=4)
    args = [place(a, mesh, s) for a, s in zip((x, w), specs)]
    return fn, args, m * f * 4


def _traced(tmp_path, fn, args, name="step.pftrace"):
    jax.block_until_ready(fn(*args))  # compile outside the trace
    path = tmp_path / name
    with commfuse.trace(path) as written:
        jax.block_until_ready(fn(*args))
    assert written == str(path)
    return path


def _check_dependencies(lanes, rank):
    """Per call: every step starts after the steps it depends on (the `deps`
    argument) end, and each lane runs its steps in plan order."""
    for call in {s.args["call"] for lane in lanes.values() for s in lane}:
        mine = {name: [s for s in lane if s.args["call"] == call] for name, lane in lanes.items()}
        steps = {s.args["step"]: s for lane in mine.values() for s in lane if s.depth == 1 and s.name != "wait"}
        for s in steps.values():
            for d in filter(None, s.args["deps"].split(",")):
                dep = steps[int(d)]
                assert s.start >= dep.end, \
                    f"rank {rank}: step {s.args['step']} ({s.name}) begins before step {d} ({dep.name}) ends"
        for name, lane in mine.items():
            ids = [s.args["step"] for s in lane if s.depth == 1 and s.name != "wait"]
            assert ids == sorted(ids), f"rank {rank}: the {name} lane runs its steps in plan order"
            waits = [s for s in lane if s.name == "wait"]
            assert all(w.args["step"] in ids for w in waits), "a wait belongs to a step of its lane"


def test_all_gather_matmul_ring_follows_the_plan(tmp_path):
    n = 4
    fn, args, block_bytes = _run_all_gather_matmul(n, "ring")
    lanes, names = lanes_by_device(_traced(tmp_path, fn, args))
    assert sorted(lanes) == list(range(n)), "a process per device"
    for r in range(n):
        assert names[r] == f"device {r} (rank {r})"
        assert set(lanes[r]) == {"compute", "comm"}, "a thread per lane"
        compute, comm = lanes[r]["compute"], lanes[r]["comm"]
        # One call slice per lane, holding every step.
        for lane in (compute, comm):
            calls = [s for s in lane if s.depth == 0]
            assert [c.name for c in calls] == ["all_gather_matmul"]
            assert calls[0].args["schedule"] == "ring" and calls[0].args["n"] == n
            assert all(calls[0].start <= s.start and s.end <= calls[0].end for s in lane)
            assert all(s.args["rank"] == r for s in lane)
        products = [s for s in compute if s.name == "matmul"]
        exchanges = [s for s in comm if s.name == "exchange"]
        assert [p.args["block"] for p in products] == [(r - s) % n for s in range(n)], \
            f"rank {r}: products in the plan's order"
        assert all(p.category == "compute" and p.args["op"] == "all_gather_matmul" for p in products)
        assert len(exchanges) == n - 1
        for s, p in enumerate(products[1:], start=1):
            assert p.start >= exchanges[s - 1].end, \
                f"rank {r}: the product of block {p.args['block']} starts after the exchange that received it"
        assert products[0].args["deps"] == "", "step 0 multiplies local data: nothing waits at the head"
        # Each exchange: one send to next, one receive from prev, a block each.
        sends = [s for s in comm if s.name == "send"]
        recvs = [s for s in comm if s.name == "recv"]
        assert len(sends) == len(recvs) == n - 1
        for e, snd, rcv in zip(exchanges, sends, recvs):
            assert snd.depth == rcv.depth == 2
            assert e.start <= snd.start <= snd.end <= rcv.start <= rcv.end <= e.end
            assert (snd.args["peer"], rcv.args["peer"]) == ((r + 1) % n, (r - 1) % n)
            assert snd.args["bytes"] == rcv.args["bytes"] == block_bytes
            assert e.args["bytes"] == 2 * block_bytes and e.args["step"] == snd.args["step"]
        # Waits are slices of their own, before the step that waited.
        for w in (s for s in compute + comm if s.name == "wait"):
            assert w.category == "wait" and w.depth == 1
        # Blocks are handed over, not copied: the own block once, out of XLA's buffer.
        call = next(s for s in compute if s.depth == 0)
        assert (call.args["copies"], call.args["copied_bytes"]) == (1, block_bytes)
        _check_dependencies(lanes[r], r)


@pytest.mark.parametrize("schedule", ["ring", "bidirectional"])
def test_matmul_reduce_scatter_follows_the_plan(tmp_path, schedule):
    n = 4
    fn, args, partial_bytes = _run_matmul_reduce_scatter(n, schedule)
    lanes, _ = lanes_by_device(_traced(tmp_path, fn, args))
    assert sorted(lanes) == list(range(n))
    fwd, bwd = (n - 1, 0) if schedule == "ring" else (n // 2, (n - 1) // 2)
    for r in range(n):
        compute, comm = lanes[r]["compute"], lanes[r]["comm"]
        products = [s for s in compute if s.name == "matmul"]
        adds = [s for s in compute if s.name == "add"]
        exchanges = [s for s in comm if s.name == "exchange"]
        # One exchange per chain step: the two chains' transfers go separately.
        assert len(products) == n and len(exchanges) == fwd + bwd
        assert products[-1].args["block"] == r, "the own block's partial comes last"
        # The compute lane adds only the result: the ring adds on the comm
        # lane (its GEMMs run ahead), bidirectional inside its GEMMs.
        assert [a.args["dst"] for a in adds] == ["out"]
        assert adds[-1].start >= exchanges[-1].end, "the result adds what the last exchange received"
        comm_adds = [s for s in comm if s.name == "add"]
        accumulating = [p for p in products if p.args["accumulate"] in (True, "true")]
        if schedule == "ring":
            assert (len(comm_adds), len(accumulating)) == (n - 2, 0)
        else:
            assert (len(comm_adds), len(accumulating)) == (0, n - 3)
        assert len([s for s in comm if s.name == "send"]) == fwd + bwd
        for t in (s for s in comm if s.name in ("send", "recv")):
            assert t.args["bytes"] == partial_bytes
        call = next(s for s in compute if s.depth == 0)
        assert (call.args["copies"], call.args["copied_bytes"]) == (0, 0), "partial sums travel without copies"
        _check_dependencies(lanes[r], r)


def test_two_calls_and_a_sequential_schedule(tmp_path):
    n = 2
    fn, args, _ = _run_all_gather_matmul(n, "sequential")
    jax.block_until_ready(fn(*args))
    path = tmp_path / "two.pftrace"
    with commfuse.trace(path):
        jax.block_until_ready(fn(*args))
        jax.block_until_ready(fn(*args))
    lanes, _ = lanes_by_device(path)
    for r in range(n):
        calls = [s for s in lanes[r]["compute"] if s.depth == 0]
        assert len(calls) == 2 and calls[0].end <= calls[1].start
        assert len({c.args["call"] for c in calls}) == 2
        # Sequential: the products wait for the whole gather.
        exchanges = [s for s in lanes[r]["comm"] if s.name == "exchange"]
        products = [s for s in lanes[r]["compute"] if s.name == "matmul"]
        assert len(products) == 2 * n
        _check_dependencies(lanes[r], r)
        assert exchanges


def test_nothing_recorded_outside_a_trace(tmp_path):
    fn, args, _ = _run_all_gather_matmul(2, "ring")
    jax.block_until_ready(fn(*args))  # runs while no trace is on
    path = tmp_path / "empty.pftrace"
    with commfuse.trace(path):
        pass
    tracks, slices = read_trace(path)
    assert tracks == {} and not slices
    assert path.stat().st_size == 0


def test_one_trace_at_a_time(tmp_path):
    with commfuse.trace(tmp_path / "outer.pftrace"):
        with pytest.raises(RuntimeError, match="already"):
            with commfuse.trace(tmp_path / "inner.pftrace"):
                pass
    assert not (tmp_path / "inner.pftrace").exists()


def test_unwritable_path_is_an_error(tmp_path):
    with pytest.raises(OSError, match="writing the trace"):
        with commfuse.trace(tmp_path / "no" / "such" / "dir" / "t.pftrace"):
            pass


def test_wire_reader():
    # field 1 varint 150; field 2 "hi"; field 3 fixed64 7
    data = bytes([0x08, 0x96, 0x01, 0x12, 0x02]) + b"hi" + bytes([0x19]) + (7).to_bytes(8, "little")
    f = fields(data)
    assert f[1] == [150] and f[2] == [b"hi"] and f[3] == [7]
