use super::proto::{EventType, Trace, TracePacket};
use super::*;
use crate::exec::{Backend, Wait};
use crate::plan::{self, Pattern, Schedule};
use prost::Message;
use std::collections::HashMap;
use std::time::Instant;

/// The recorder is global: these tests take turns.
static SERIAL: Mutex<()> = Mutex::new(());

fn event(device: i64, lane: Lane, kind: Kind, step: Option<usize>, start_ns: u64, end_ns: u64) -> Event {
    Event {
        device,
        rank: device as usize,
        lane,
        kind,
        op: "all_gather_matmul",
        call: 7,
        step,
        start_ns,
        end_ns,
        args: vec![("bytes", Value::U(4096)), ("src", Value::S("slot0".into())), ("accumulate", Value::B(false))],
    }
}

fn annotations(p: &TracePacket) -> HashMap<String, String> {
    let e = p.track_event.as_ref().unwrap();
    e.debug_annotations
        .iter()
        .map(|a| {
            let v = (a.uint_value.map(|v| v.to_string()))
                .or(a.int_value.map(|v| v.to_string()))
                .or(a.string_value.clone())
                .or(a.bool_value.map(|v| v.to_string()))
                .unwrap();
            (a.name.clone().unwrap(), v)
        })
        .collect()
}

/// Per track uuid: (name, start, end, depth) of each slice, from begin/end pairs.
fn slices(trace: &Trace) -> HashMap<u64, Vec<(String, u64, u64, usize)>> {
    let mut open: HashMap<u64, Vec<(String, u64)>> = HashMap::new();
    let mut done: HashMap<u64, Vec<(String, u64, u64, usize)>> = HashMap::new();
    let mut last = 0;
    for p in &trace.packet {
        let Some(e) = &p.track_event else { continue };
        let ts = p.timestamp.unwrap();
        assert!(ts >= last, "packets in time order");
        last = ts;
        let track = e.track_uuid.unwrap();
        let stack = open.entry(track).or_default();
        match EventType::try_from(e.r#type.unwrap()).unwrap() {
            EventType::SliceBegin => stack.push((e.name.clone().unwrap(), ts)),
            EventType::SliceEnd => {
                let (name, start) = stack.pop().expect("an end matches a begin");
                done.entry(track).or_default().push((name, start, ts, stack.len()));
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(open.values().all(Vec::is_empty), "every slice ends");
    done
}

#[test]
fn encoder_round_trips_through_prost() {
    let events = vec![
        event(0, Lane::Compute, Kind::Call, None, 100, 1000),
        event(0, Lane::Compute, Kind::Matmul, Some(1), 100, 400),
        event(0, Lane::Compute, Kind::Wait, Some(3), 400, 600),
        event(0, Lane::Compute, Kind::Matmul, Some(3), 600, 1000),
        event(0, Lane::Comm, Kind::Call, None, 100, 600),
        event(0, Lane::Comm, Kind::Send, Some(0), 110, 120),
        event(0, Lane::Comm, Kind::Recv, Some(0), 120, 600),
        event(0, Lane::Comm, Kind::Exchange, Some(0), 110, 600),
        event(3, Lane::Compute, Kind::Call, None, 50, 60),
        event(3, Lane::Compute, Kind::Add, Some(2), 60, 60),
    ];
    let bytes = encode(&events);
    let trace = Trace::decode(&bytes[..]).expect("decodes");
    assert_eq!(trace.encode_to_vec(), bytes, "re-encodes to the same bytes");

    // Descriptors: a process per device, a thread per (device, lane) under it.
    let descriptors: Vec<_> = trace.packet.iter().filter_map(|p| p.track_descriptor.as_ref()).collect();
    let processes: Vec<_> = descriptors.iter().filter(|d| d.process.is_some()).collect();
    let threads: Vec<_> = descriptors.iter().filter(|d| d.thread.is_some()).collect();
    assert_eq!(processes.len(), 2);
    assert_eq!(threads.len(), 3);
    assert_eq!(processes[0].process.as_ref().unwrap().process_name.as_deref(), Some("device 0 (rank 0)"));
    for t in &threads {
        let parent = processes.iter().find(|p| p.uuid == t.parent_uuid).expect("a thread's parent is a process");
        assert_eq!(parent.process.as_ref().unwrap().pid, t.thread.as_ref().unwrap().pid);
    }
    assert!(trace.packet.iter().all(|p| p.trusted_packet_sequence_id == Some(encode::SEQUENCE_ID)));
    assert_eq!(trace.packet[0].sequence_flags, Some(proto::SEQ_INCREMENTAL_STATE_CLEARED));

    // Slices come back with their times, names and nesting.
    let by_track = slices(&trace);
    let compute0 = threads.iter().find(|t| t.name.as_deref() == Some("compute")).unwrap().uuid.unwrap();
    let mut got = by_track[&compute0].clone();
    got.sort_by_key(|s| (s.1, s.3));
    let want =
        [("all_gather_matmul", 100, 1000, 0), ("matmul", 100, 400, 1), ("wait", 400, 600, 1), ("matmul", 600, 1000, 1)];
    assert_eq!(got, want.map(|(n, s, e, d)| (n.to_string(), s, e, d)).to_vec());
    let comm0 = threads.iter().find(|t| t.name.as_deref() == Some("comm")).unwrap().uuid.unwrap();
    let mut got = by_track[&comm0].clone();
    got.sort_by_key(|s| (s.1, s.3));
    let want =
        [("all_gather_matmul", 100, 600, 0), ("exchange", 110, 600, 1), ("send", 110, 120, 2), ("recv", 120, 600, 2)];
    assert_eq!(got, want.map(|(n, s, e, d)| (n.to_string(), s, e, d)).to_vec());

    // Arguments and categories ride on the begin event.
    let matmul =
        trace.packet.iter().find(|p| p.track_event.as_ref().is_some_and(|e| e.name.as_deref() == Some("matmul")));
    let matmul = matmul.unwrap();
    assert_eq!(matmul.track_event.as_ref().unwrap().categories, ["compute"]);
    let args = annotations(matmul);
    assert_eq!(args["step"], "1");
    assert_eq!(args["bytes"], "4096");
    assert_eq!(args["src"], "slot0");
    assert_eq!(args["accumulate"], "false");
    assert_eq!(args["op"], "all_gather_matmul");
}

#[test]
fn empty_trace_is_valid() {
    let trace = Trace::decode(&encode(&[])[..]).unwrap();
    assert!(trace.packet.is_empty());
}

/// Sleeps instead of working, so waits show.
struct Sleepy;

impl Backend for Sleepy {
    fn matmul(&self, _: usize, _: Buf, _: Buf, _: Buf, _: bool) -> Result<()> {
        std::thread::sleep(Duration::from_millis(2));
        Ok(())
    }
    fn sum(&self, _: &[Buf], _: Buf) -> Result<()> {
        Ok(())
    }
    fn exchange(&self, sends: &[Transfer], recvs: &[Transfer], wait: &Wait) -> Result<Instant> {
        for t in sends {
            wait.transferred(Direction::Send, t, Instant::now(), Instant::now());
        }
        for t in recvs {
            let posted = Instant::now();
            std::thread::sleep(Duration::from_millis(5));
            wait.transferred(Direction::Recv, t, posted, Instant::now());
        }
        Ok(Instant::now())
    }
}

#[test]
fn executor_records_every_step_in_plan_order() {
    let _serial = crate::sync::lock(&SERIAL);
    let n = 4;
    let plan = plan::plan(Pattern::Gather { accumulate: false }, Schedule::Ring, n, 2);
    let label = CallLabel {
        device: 902,
        rank: 2,
        op: "trace_test",
        site: 5,
        transport: "host",
        slot_bytes: vec![64, 64],
        x_bytes: 64,
        w_bytes: 48,
        x_block_bytes: vec![16; 4],
    };

    // Off: nothing is recorded, and the label is never made.
    assert!(Recording::begin(&plan, || unreachable!("recording is off")).is_none());
    assert!(drain().iter().all(|e| e.op != "trace_test"));

    start().unwrap();
    assert!(start().is_err(), "one recording at a time");
    let recording = Recording::begin(&plan, || label).expect("recording is on");
    crate::exec::run(&plan, &Sleepy, Some(&recording)).unwrap();
    drop(recording);
    let events: Vec<Event> = drain().into_iter().filter(|e| e.op == "trace_test").collect();
    assert!(!enabled());

    let lane = |lane: Lane, kind: Kind| {
        let mut v: Vec<&Event> = events.iter().filter(|e| e.lane == lane && e.kind == kind).collect();
        v.sort_by_key(|e| e.start_ns);
        v
    };
    let products = lane(Lane::Compute, Kind::Matmul);
    let exchanges = lane(Lane::Comm, Kind::Exchange);
    let planned = |l: Lane, matmul: bool| -> Vec<usize> {
        plan.lane_steps(l).filter(|s| matches!(s.action, Action::Matmul { .. }) == matmul).map(|s| s.id).collect()
    };
    assert_eq!(products.iter().map(|e| e.step.unwrap()).collect::<Vec<_>>(), planned(Lane::Compute, true));
    assert_eq!(exchanges.iter().map(|e| e.step.unwrap()).collect::<Vec<_>>(), planned(Lane::Comm, false));
    assert_eq!((products.len(), exchanges.len()), (n, n - 1));
    assert_eq!(lane(Lane::Comm, Kind::Send).len(), n - 1);
    assert_eq!(lane(Lane::Comm, Kind::Recv).len(), n - 1);
    assert_eq!(lane(Lane::Compute, Kind::Call).len(), 1);
    // Each product after the exchanges it depends on; the compute lane waited for them.
    let end_of = |id: usize| events.iter().find(|e| e.step == Some(id) && e.kind == Kind::Exchange).unwrap().end_ns;
    for p in &products {
        let step = &plan.steps[p.step.unwrap()];
        for &d in &step.deps {
            if matches!(plan.steps[d].action, Action::Exchange { .. }) {
                assert!(p.start_ns >= end_of(d), "step {} starts after exchange {d} ends", step.id);
            }
        }
    }
    assert!(!lane(Lane::Compute, Kind::Wait).is_empty(), "the compute lane waits for the 5 ms transfers");
    let recv = lane(Lane::Comm, Kind::Recv)[0];
    assert!(recv.args.contains(&("bytes", Value::U(64))), "{:?}", recv.args);
    assert_eq!(recv.args.iter().find(|a| a.0 == "peer").map(|a| &a.1), Some(&Value::U(1)));

    let trace = Trace::decode(&encode(&events)[..]).unwrap();
    let tracks = slices(&trace);
    assert_eq!(tracks.len(), 2, "one track per lane of the one device");
    assert_eq!(tracks.values().map(Vec::len).sum::<usize>(), events.len());

    // The same slices as a Chrome trace: one complete event each, the
    // device as the process, the lane as the thread, microseconds.
    let json: serde_json::Value = serde_json::from_slice(&encode_json(&events)).unwrap();
    let slices = json["traceEvents"].as_array().unwrap();
    assert_eq!(slices.len(), events.len());
    let matmuls: Vec<_> = slices.iter().filter(|e| e["cat"] == "matmul").collect();
    assert_eq!(matmuls.len(), n);
    assert!(matmuls
        .iter()
        .all(|e| e["ph"] == "X" && e["pid"] == 902 && e["tid"] == 0 && e["dur"].as_f64() >= Some(0.0)));
    let recvs: Vec<_> = slices.iter().filter(|e| e["cat"] == "recv").collect();
    assert!(recvs.iter().all(|e| e["tid"] == 1 && e["args"]["bytes"] == 64), "{recvs:?}");
    let first = events.iter().map(|e| e.start_ns).min().unwrap();
    let starts: Vec<f64> = slices.iter().map(|e| e["ts"].as_f64().unwrap()).collect();
    assert!(starts.iter().all(|&t| t >= 0.0) && starts.contains(&0.0), "times from the first slice ({first} ns)");
}

/// Notes every backend call of each lane, in order.
#[derive(Default)]
struct Calls(Mutex<Vec<(std::thread::ThreadId, String)>>);

impl Backend for Calls {
    fn matmul(&self, block: usize, src: Buf, _: Buf, dst: Buf, _: bool) -> Result<()> {
        crate::sync::lock(&self.0).push((std::thread::current().id(), format!("matmul {block} {src} {dst}")));
        Ok(())
    }
    fn sum(&self, terms: &[Buf], dst: Buf) -> Result<()> {
        crate::sync::lock(&self.0).push((std::thread::current().id(), format!("sum {} {dst}", terms.len())));
        Ok(())
    }
    fn exchange(&self, sends: &[Transfer], recvs: &[Transfer], wait: &Wait) -> Result<Instant> {
        let call = format!("exchange {sends:?} {recvs:?}");
        crate::sync::lock(&self.0).push((std::thread::current().id(), call));
        for t in sends {
            wait.transferred(Direction::Send, t, Instant::now(), Instant::now());
        }
        Ok(Instant::now())
    }
}

impl Calls {
    /// Each lane's calls, lanes in a fixed order.
    fn by_lane(self) -> Vec<Vec<String>> {
        let mut lanes: Vec<(std::thread::ThreadId, Vec<String>)> = Vec::new();
        for (thread, call) in self.0.into_inner().unwrap() {
            match lanes.iter_mut().find(|(t, _)| *t == thread) {
                Some((_, calls)) => calls.push(call),
                None => lanes.push((thread, vec![call])),
            }
        }
        let mut lanes: Vec<Vec<String>> = lanes.into_iter().map(|(_, c)| c).collect();
        lanes.sort();
        lanes
    }
}

#[test]
fn a_traced_run_makes_the_same_backend_calls_as_an_untraced_one() {
    let _serial = crate::sync::lock(&SERIAL);
    for pattern in [Pattern::Gather { accumulate: false }, Pattern::Scatter, Pattern::MatmulThenExchange] {
        for schedule in [Schedule::Ring, Schedule::Bidirectional, Schedule::Tiled { tiles: 2 }, Schedule::Sequential] {
            if schedule.cuts_blocks() && pattern == Pattern::MatmulThenExchange {
                continue;
            }
            let plan = plan::plan(pattern, schedule, 4, 1);
            let untraced = Calls::default();
            crate::exec::run(&plan, &untraced, None).unwrap();
            start().unwrap();
            let traced = Calls::default();
            let recording = Recording::begin(&plan, || CallLabel {
                device: 903,
                rank: 1,
                op: "same_calls",
                site: 0,
                transport: "host",
                slot_bytes: Vec::new(),
                x_bytes: 0,
                w_bytes: 0,
                x_block_bytes: Vec::new(),
            });
            crate::exec::run(&plan, &traced, recording.as_ref().map(|r| r as &dyn crate::exec::Observer)).unwrap();
            drop(recording);
            let events: Vec<Event> = drain().into_iter().filter(|e| e.op == "same_calls").collect();
            assert_eq!(untraced.by_lane(), traced.by_lane(), "{pattern:?} {schedule}");
            // Every step recorded once; every send inside its exchange's slice.
            assert_eq!(
                events.iter().filter(|e| e.step.is_some() && e.kind.depth() == 1 && e.kind != Kind::Wait).count(),
                plan.steps.len()
            );
            for send in events.iter().filter(|e| e.kind == Kind::Send) {
                let exchange = events.iter().find(|e| e.kind == Kind::Exchange && e.step == send.step).unwrap();
                assert!(exchange.start_ns <= send.start_ns && send.end_ns <= exchange.end_ns);
            }
        }
    }
}
