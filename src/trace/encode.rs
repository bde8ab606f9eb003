//! Events → Perfetto `Trace` bytes: a process track per device, a thread
//! track per (device, lane), and a begin/end pair of track events per slice,
//! properly nested per track and in timestamp order overall.

use super::proto::{
    DebugAnnotation, EventType, ProcessDescriptor, ThreadDescriptor, Trace, TracePacket, TrackDescriptor, TrackEvent,
    SEQ_INCREMENTAL_STATE_CLEARED,
};
use super::{Event, Value};
use crate::plan::Lane;
use prost::Message;
use std::collections::{BTreeMap, BTreeSet};

/// The one packet sequence the file uses.
pub const SEQUENCE_ID: u32 = 0x00c0_ffee;

fn lane_index(lane: Lane) -> i32 {
    match lane {
        Lane::Compute => 0,
        Lane::Comm => 1,
    }
}

fn lane_name(lane: Lane) -> &'static str {
    match lane {
        Lane::Compute => "compute",
        Lane::Comm => "comm",
    }
}

/// Perfetto pid of a device (pid 0 means the idle task to Perfetto).
fn pid(device: i64) -> i32 {
    i32::try_from(device.saturating_add(1)).unwrap_or(i32::MAX)
}

fn tid(device: i64, lane: Lane) -> i32 {
    pid(device).saturating_mul(16).saturating_add(lane_index(lane) + 1)
}

fn process_uuid(device: i64) -> u64 {
    0x7000_0000_0000_0000 | (device as u64 & 0xffff_ffff) << 8
}

fn thread_uuid(device: i64, lane: Lane) -> u64 {
    process_uuid(device) | (lane_index(lane) as u64 + 1)
}

fn annotation(name: &str, value: &Value) -> DebugAnnotation {
    let mut a = DebugAnnotation { name: Some(name.to_string()), ..Default::default() };
    match value {
        Value::U(v) => a.uint_value = Some(*v),
        Value::I(v) => a.int_value = Some(*v),
        Value::S(v) => a.string_value = Some(v.clone()),
        Value::B(v) => a.bool_value = Some(*v),
    }
    a
}

fn packet(timestamp: Option<u64>) -> TracePacket {
    TracePacket { timestamp, trusted_packet_sequence_id: Some(SEQUENCE_ID), ..Default::default() }
}

/// The track descriptors of every device and lane in `events`.
fn descriptors(events: &[Event]) -> Vec<TracePacket> {
    let mut ranks: BTreeMap<i64, BTreeSet<usize>> = BTreeMap::new();
    let mut lanes: BTreeSet<(i64, Lane)> = BTreeSet::new();
    for e in events {
        ranks.entry(e.device).or_default().insert(e.rank);
        lanes.insert((e.device, e.lane));
    }
    let mut packets = Vec::new();
    for (&device, ranks) in &ranks {
        let name = match ranks.iter().collect::<Vec<_>>()[..] {
            [rank] => format!("device {device} (rank {rank})"),
            _ => format!("device {device}"),
        };
        let process = ProcessDescriptor { pid: Some(pid(device)), process_name: Some(name.clone()) };
        let track = TrackDescriptor {
            uuid: Some(process_uuid(device)),
            name: Some(name),
            process: Some(process),
            ..Default::default()
        };
        packets.push(TracePacket { track_descriptor: Some(track), ..packet(None) });
    }
    for &(device, lane) in &lanes {
        let thread = ThreadDescriptor {
            pid: Some(pid(device)),
            tid: Some(tid(device, lane)),
            thread_name: Some(lane_name(lane).to_string()),
        };
        let track = TrackDescriptor {
            uuid: Some(thread_uuid(device, lane)),
            name: Some(lane_name(lane).to_string()),
            thread: Some(thread),
            parent_uuid: Some(process_uuid(device)),
            ..Default::default()
        };
        packets.push(TracePacket { track_descriptor: Some(track), ..packet(None) });
    }
    packets
}

fn begin(e: &Event) -> TracePacket {
    let mut annotations = vec![annotation("rank", &Value::U(e.rank as u64)), annotation("call", &Value::U(e.call))];
    if let Some(step) = e.step {
        annotations.push(annotation("step", &Value::U(step as u64)));
        annotations.push(annotation("op", &Value::S(e.op.to_string())));
    }
    annotations.extend(e.args.iter().map(|(n, v)| annotation(n, v)));
    let event = TrackEvent {
        debug_annotations: annotations,
        r#type: Some(EventType::SliceBegin as i32),
        track_uuid: Some(thread_uuid(e.device, e.lane)),
        categories: vec![e.kind.category().to_string()],
        name: Some(e.name().to_string()),
    };
    TracePacket { track_event: Some(event), ..packet(Some(e.start_ns)) }
}

fn end(e: &Event) -> TracePacket {
    let event = TrackEvent {
        r#type: Some(EventType::SliceEnd as i32),
        track_uuid: Some(thread_uuid(e.device, e.lane)),
        ..Default::default()
    };
    TracePacket { track_event: Some(event), ..packet(Some(e.end_ns)) }
}

/// One track's slices as begin/end packets, each slice ended before a later
/// sibling begins and after its children end.
fn track_packets(mut slices: Vec<&Event>, out: &mut Vec<TracePacket>) {
    slices.sort_by_key(|e| (e.start_ns, std::cmp::Reverse(e.end_ns), e.kind.depth()));
    let mut open: Vec<&Event> = Vec::new();
    for e in slices {
        while let Some(top) = open.last() {
            let contains = top.end_ns > e.start_ns || (top.end_ns == e.start_ns && top.kind.depth() < e.kind.depth());
            if contains {
                break;
            }
            out.push(end(top));
            open.pop();
        }
        out.push(begin(e));
        open.push(e);
    }
    while let Some(top) = open.pop() {
        out.push(end(top));
    }
}

/// The trace of `events` as the bytes of a Perfetto `Trace` message.
pub fn encode(events: &[Event]) -> Vec<u8> {
    let mut packets = descriptors(events);
    if let Some(first) = packets.first_mut() {
        first.sequence_flags = Some(SEQ_INCREMENTAL_STATE_CLEARED);
    }
    let mut tracks: BTreeMap<(i64, Lane), Vec<&Event>> = BTreeMap::new();
    for e in events {
        tracks.entry((e.device, e.lane)).or_default().push(e);
    }
    let mut timed = Vec::with_capacity(events.len() * 2);
    for slices in tracks.into_values() {
        track_packets(slices, &mut timed);
    }
    // Stable: each track's own order (already by time) survives the merge.
    timed.sort_by_key(|p| p.timestamp);
    packets.append(&mut timed);
    Trace { packet: packets }.encode_to_vec()
}

/// `events` as a Chrome trace (JSON, which Perfetto opens too, and which
/// `scripts/plot_timeline.py` draws): one complete ("X") event per slice, a
/// process per device and a thread per lane (0 compute, 1 comm), times in
/// microseconds from the first slice.
pub fn encode_json(events: &[Event]) -> Vec<u8> {
    use serde_json::{json, Map, Value as Json};
    let first = events.iter().map(|e| e.start_ns).min().unwrap_or(0);
    let slices: Vec<Json> = events
        .iter()
        .map(|e| {
            let mut args = Map::new();
            args.insert("rank".into(), json!(e.rank));
            args.insert("call".into(), json!(e.call));
            if let Some(step) = e.step {
                args.insert("step".into(), json!(step));
            }
            for (k, v) in &e.args {
                let v = match v {
                    Value::U(u) => json!(u),
                    Value::I(i) => json!(i),
                    Value::S(s) => json!(s),
                    Value::B(b) => json!(b),
                };
                args.insert((*k).into(), v);
            }
            json!({
                "name": e.name(),
                "cat": e.kind.name(),
                "ph": "X",
                "ts": (e.start_ns - first) as f64 / 1e3,
                "dur": (e.end_ns.saturating_sub(e.start_ns)) as f64 / 1e3,
                "pid": e.device,
                "tid": match e.lane { Lane::Compute => 0, Lane::Comm => 1 },
                "args": Json::Object(args),
            })
        })
        .collect();
    serde_json::to_vec(&json!({ "traceEvents": slices, "displayTimeUnit": "ns" })).unwrap_or_default()
}
