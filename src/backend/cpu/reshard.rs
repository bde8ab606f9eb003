//! `commfuse.reshard` on the CPU backend: one device's part of a
//! `reshard::Plan`, on the same transport as the fused ops (link model,
//! deadlines naming the ranks that did not arrive, failures ending the
//! peers' waits).
//!
//! A reshard is two XLA programs, so that a pipeline's compute can run
//! between them: the *send* program on the source mesh (`send_handler`:
//! operands the device's source tile and the call id, result a one-byte
//! token) posts every piece the device holds and returns at once; the
//! *receive* program on the destination mesh (`receive_handler`: operand
//! the call id, result the device's destination tile) takes its pieces,
//! forwarding the chunks of a broadcast chain as they come. The two meet in
//! one transport session keyed by the call site and the call id, in which
//! each device's send part and receive part are ranks of their own (senders
//! first): a sender leaves once it posted, its messages wait for the
//! receivers. A piece a device keeps (it is in both meshes) goes from its
//! send part to its receive part like any other.
#![forbid(unsafe_code)]

use super::transport::{self, link::LinkModel, Block, Endpoint, LinkPositions, SessionKey, Shared};
use crate::error::{Error, Result};
use crate::exec::Wait;
use crate::plan::{Direction, Tag};
use crate::reshard::attrs::Attrs;
use crate::reshard::{self, Layout, Method, Plan, Region};
use crate::trace::{self, Kind, Value};
use crate::xla::Frame;
use std::collections::hash_map::{Entry, HashMap};
use std::collections::HashSet;
use std::ops::Range;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;

/// Bytes per second and seconds per message assumed for in-process
/// transfers when no link model is set (a memory copy's rate): what `auto`
/// decides on without one.
const UNMODELLED_LINK: (f64, f64) = (10e9, 5e-6);

/// Which program a call belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part {
    Send,
    Receive,
}

impl Part {
    /// The op's name in errors, traces and `activity`.
    fn op(self) -> &'static str {
        match self {
            Part::Send => "reshard send",
            Part::Receive => "reshard receive",
        }
    }
}

/// One device's call of a reshard's send program.
pub fn send_handler(frame: &mut Frame<'_>) -> Result<()> {
    let call = ReshardCall::decode(frame, Part::Send)?;
    let inside = call.enter(frame);
    super::handler::run_off_xla_thread(frame, "commfuse reshard send", &["x", "call_id"], &["sent"], move |a, r| {
        // Left when the work ends, before XLA's future completes.
        let _inside = inside;
        call.run(a, r)
    })
}

/// One device's call of a reshard's receive program.
pub fn receive_handler(frame: &mut Frame<'_>) -> Result<()> {
    let call = ReshardCall::decode(frame, Part::Receive)?;
    let inside = call.enter(frame);
    super::handler::run_off_xla_thread(frame, "commfuse reshard receive", &["call_id"], &["out"], move |a, r| {
        let _inside = inside;
        call.run(a, r)
    })
}

/// The transport's ranks of one reshard: the send part of each device
/// holding a source tile, then the receive part of each device needing a
/// destination tile.
#[derive(Debug, Clone)]
pub struct Parties {
    /// Per rank of the layout: its send part's transport rank, if it has one.
    pub send: Vec<Option<usize>>,
    pub receive: Vec<Option<usize>>,
    /// Per transport rank: its device.
    pub devices: Vec<i64>,
    /// For the link model: the layout's devices, and per transport rank its
    /// device's rank in the layout (both parts of a device share its ports).
    pub positions: Arc<LinkPositions>,
}

impl Parties {
    pub fn new(layout: &Layout, devices: &[i64]) -> Parties {
        let (mut send, mut receive) = (vec![None; devices.len()], vec![None; devices.len()]);
        let mut of_rank = vec![];
        for (part, tiles) in [(&mut send, &layout.src), (&mut receive, &layout.dst)] {
            for (rank, tile) in tiles.iter().enumerate() {
                if tile.is_some() {
                    part[rank] = Some(of_rank.len());
                    of_rank.push(rank);
                }
            }
        }
        Parties {
            send,
            receive,
            devices: of_rank.iter().map(|&r| devices[r]).collect(),
            positions: Arc::new(LinkPositions { devices: devices.to_vec(), of_rank }),
        }
    }

    fn of(&self, part: Part, rank: usize) -> Option<usize> {
        match part {
            Part::Send => self.send[rank],
            Part::Receive => self.receive[rank],
        }
    }
}

/// What every device of one reshard works out from the attributes alike.
pub struct Planned {
    layout: Layout,
    method: Method,
    plan: Plan,
    parties: Parties,
    /// The moves whose chunks their receivers forward (broadcast chains).
    forwarded: HashSet<usize>,
}

impl Planned {
    pub fn new(layout: Layout, method: Method, plan: Plan, devices: &[i64]) -> Planned {
        let parties = Parties::new(&layout, devices);
        let forwarded = plan.moves.iter().filter_map(|m| m.forwards).collect();
        Planned { layout, method, plan, parties, forwarded }
    }
}

/// Plans by their attributes (and the link model `auto` decides on): each
/// device of a call, and every later call of the same reshard, finds the
/// plan built once. Emptied when it holds `PLANS_KEPT`.
type PlanKey = (Attrs, Option<(u64, u128)>);
const PLANS_KEPT: usize = 64;

fn plans() -> &'static std::sync::Mutex<HashMap<PlanKey, Arc<Planned>>> {
    static PLANS: std::sync::OnceLock<std::sync::Mutex<HashMap<PlanKey, Arc<Planned>>>> = std::sync::OnceLock::new();
    PLANS.get_or_init(Default::default)
}

struct ReshardCall {
    part: Part,
    planned: Arc<Planned>,
    rank: usize,
    device: i64,
    site: i64,
    link: Option<LinkModel>,
    timeout: std::time::Duration,
    interrupts: u64,
}

/// Checks the attributes and plans the reshard they describe.
fn make_plan(attrs: &Attrs, link: Option<LinkModel>) -> Result<Planned> {
    let link = link.map_or(UNMODELLED_LINK, |l| (l.bytes_per_s, l.latency.as_secs_f64()));
    let (layout, method, plan) = attrs.plan(link)?;
    Ok(Planned::new(layout, method, plan, &attrs.devices))
}

impl ReshardCall {
    fn decode(frame: &Frame<'_>, part: Part) -> Result<ReshardCall> {
        let attrs = Attrs::decode(frame)?;
        let device = i64::from(frame.device_ordinal()?);
        let rank = attrs.rank_of(device)?;
        let link = LinkModel::from_env()?;
        let key: PlanKey = (attrs, link.map(|l| (l.bytes_per_s.to_bits(), l.latency.as_nanos())));
        let cached = crate::sync::lock(plans()).get(&key).cloned();
        let planned = match cached {
            Some(planned) => planned,
            None => {
                let planned = Arc::new(make_plan(&key.0, link)?);
                let mut plans = crate::sync::lock(plans());
                if plans.len() >= PLANS_KEPT {
                    plans.clear();
                }
                plans.insert(key, planned.clone());
                planned
            }
        };
        if planned.parties.of(part, rank).is_none() {
            let what = match part {
                Part::Send => "holds no tile of `x` but runs the send program",
                Part::Receive => "needs no tile of the result but runs the receive program",
            };
            return Err(Error::InvalidArgument(format!("reshard: device {device} {what}")));
        }
        Ok(ReshardCall {
            part,
            planned,
            rank,
            device,
            site: frame.attr_i64("site")?,
            link,
            timeout: crate::config::timeout()?,
            interrupts: crate::config::interrupts(),
        })
    }

    /// Records that this call's device is inside it (`activity`), until
    /// the result is dropped. The session's own run is the call id, an
    /// operand not read yet: the record takes XLA's run id, where it has one.
    fn enter(&self, frame: &Frame<'_>) -> crate::activity::Inside {
        let identity = crate::activity::CallIdentity {
            kind: self.part.op(),
            site: self.site,
            run: frame.run_id().ok(),
            sequence: 0,
        };
        crate::activity::enter(self.device, identity)
    }

    fn run(self, args: &[&[u8]], rets: &mut [&mut [u8]]) -> Result<()> {
        let (input, id, out): (&[u8], &[u8], &mut [u8]) = match (self.part, args, rets) {
            (Part::Send, [x, id], [sent]) => (x, id, sent),
            (Part::Receive, [id], [out]) => (&[], id, out),
            _ => return Err(Error::InvalidArgument("reshard: unexpected operands or results".into())),
        };
        let call_id = <[u8; 4]>::try_from(id).map(u32::from_ne_bytes).map_err(|_| {
            Error::InvalidArgument(format!("reshard: operand `call_id` must be one uint32, got {} bytes", id.len()))
        })?;
        let parties = &self.planned.parties;
        let party = parties.of(self.part, self.rank).expect("checked by decode");
        let op = self.part.op();
        let key = SessionKey { group: parties.devices.clone(), site: self.site, run: call_id.into(), sequence: 0 };
        let participant =
            transport::Participant { op, rank: party, timeout: self.timeout, interrupts: self.interrupts };
        let endpoint =
            Endpoint::join(key, participant).with_link(self.link).with_link_positions(parties.positions.clone());
        let method = match self.planned.method {
            Method::Direct => "direct".to_string(),
            Method::Broadcast { chunk_bytes } => format!("broadcast ({chunk_bytes}-byte chunks)"),
        };
        let args =
            vec![("site", Value::I(self.site)), ("call_id", Value::U(call_id.into())), ("method", Value::S(method))];
        let mut log =
            TransferLog { trace: trace::Transfers::begin(self.device, party, op, args), devices: &parties.devices };
        // A panic fails the peers at once too, instead of leaving them to the deadline.
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match self.part {
            Part::Send => {
                send_part(&self.planned, self.rank, input, &endpoint, &mut log)?;
                out.fill(1);
                Ok(())
            }
            Part::Receive => receive_part(&self.planned, self.rank, out, &endpoint, &mut log),
        }))
        .unwrap_or_else(|_| Err(Error::Internal("panic in commfuse reshard".into())));
        if let Err(e) = &result {
            endpoint.fail(e);
            if matches!(e, Error::DeadlineExceeded(_)) {
                eprintln!("{e}");
            }
        }
        result
    }
}

/// One call's transfers in the trace (when a trace is being recorded).
pub struct TransferLog<'p> {
    trace: Option<trace::Transfers>,
    /// Per transport rank, its device (`Parties::devices`).
    devices: &'p [i64],
}

impl TransferLog<'_> {
    fn record(&mut self, kind: Kind, peer: usize, id: Tag, bytes: usize, started: Instant) {
        if let Some(trace) = &mut self.trace {
            let args = vec![
                ("peer_device", Value::I(self.devices[peer])),
                ("piece", Value::S(format!("{:?}#{}", id.direction, id.step).to_lowercase())),
                ("bytes", Value::U(bytes as u64)),
            ];
            trace.transfer(kind, started, Instant::now(), args);
        }
    }
}

/// A move's tag; a kept piece (`Plan::copies`) is tagged by its index.
fn move_tag(id: usize) -> Tag {
    Tag { direction: Direction::Forward, step: id }
}

fn kept_tag(index: usize) -> Tag {
    Tag { direction: Direction::Backward, step: index }
}

fn too_small(name: &str, rank: usize, have: usize, layout: &Layout, tile: &Region) -> Error {
    Error::InvalidArgument(format!(
        "reshard: `{name}` of rank {rank} has {have} bytes, its tile needs {}",
        layout.bytes(tile)
    ))
}

fn plan_error(rank: usize, what: &str) -> Error {
    Error::Internal(format!("reshard plan error: rank {rank} {what}"))
}

/// `rank`'s send part: packs and posts every piece it sends from its source
/// tile (`input`), the pieces it keeps included, and returns without
/// waiting for anyone. A piece going to several receivers is packed once.
pub fn send_part(
    planned: &Planned,
    rank: usize,
    input: &[u8],
    endpoint: &Endpoint,
    log: &mut TransferLog<'_>,
) -> Result<()> {
    let Planned { layout, plan, parties, .. } = planned;
    let tile = layout.src[rank].as_ref().ok_or_else(|| plan_error(rank, "sends without a source tile"))?;
    if layout.bytes(tile) > input.len() {
        return Err(too_small("x", rank, input.len(), layout, tile));
    }
    let receiver = |to: usize| parties.receive[to].ok_or_else(|| plan_error(to, "receives without a tile"));
    let mut packed: HashMap<(Region, Range<usize>), Shared> = HashMap::new();
    let mut post = |region: &Region, bytes: &Range<usize>, to: usize, tag: Tag| -> Result<()> {
        let started = Instant::now();
        let block = match packed.entry((region.clone(), bytes.clone())) {
            Entry::Occupied(block) => block.get().clone(),
            Entry::Vacant(slot) => {
                let mut block = Block::new(bytes.len());
                endpoint.compute(|| {
                    reshard::pack(region, tile, layout.itemsize, bytes.clone(), input, block.bytes_mut())
                })?;
                slot.insert(Arc::new(block)).clone()
            }
        };
        endpoint.send(to, tag, block, started);
        log.record(Kind::Send, to, tag, bytes.len(), started);
        Ok(())
    };
    // The kept pieces first: the receive part takes them first.
    for (index, kept) in plan.copies.iter().enumerate().filter(|(_, c)| c.rank == rank) {
        post(&kept.region, &(0..layout.bytes(&kept.region)), receiver(rank)?, kept_tag(index))?;
    }
    let mut mine: Vec<&reshard::Move> = plan.moves.iter().filter(|m| m.from == rank && m.forwards.is_none()).collect();
    mine.sort_by_key(|m| (m.round, m.id));
    for m in mine {
        post(&m.region, &m.bytes, receiver(m.to)?, move_tag(m.id))?;
    }
    Ok(())
}

/// `rank`'s receive part: takes every piece of its destination tile
/// (`out`), in rounds, and forwards the chunks it passes on in a broadcast
/// chain (the very blocks it received, no copy).
pub fn receive_part(
    planned: &Planned,
    rank: usize,
    out: &mut [u8],
    endpoint: &Endpoint,
    log: &mut TransferLog<'_>,
) -> Result<()> {
    let Planned { layout, plan, parties, forwarded, .. } = planned;
    let tile = layout.dst[rank].as_ref().ok_or_else(|| plan_error(rank, "receives without a tile"))?;
    if layout.bytes(tile) > out.len() {
        return Err(too_small("out", rank, out.len(), layout, tile));
    }
    let cancelled = AtomicBool::new(false);
    let wait = Wait::unwatched(&cancelled);
    let take =
        |from: usize, tag: Tag, region: &Region, bytes: Range<usize>, out: &mut [u8], log: &mut TransferLog<'_>| {
            let started = Instant::now();
            let (block, _) = endpoint.recv(from, tag, bytes.len(), &wait)?;
            endpoint.compute(|| reshard::unpack(region, tile, layout.itemsize, bytes.clone(), block.bytes(), out))?;
            log.record(Kind::Recv, from, tag, bytes.len(), started);
            Ok::<_, Error>(block)
        };
    let sender = |part: Option<usize>, rank: usize| part.ok_or_else(|| plan_error(rank, "sends without a tile"));
    for (index, kept) in plan.copies.iter().enumerate().filter(|(_, c)| c.rank == rank) {
        let bytes = 0..layout.bytes(&kept.region);
        take(sender(parties.send[rank], rank)?, kept_tag(index), &kept.region, bytes, out, log)?;
    }
    let mut kept: HashMap<usize, Shared> = HashMap::new();
    let mut mine: Vec<&reshard::Move> =
        plan.moves.iter().filter(|m| m.to == rank || (m.from == rank && m.forwards.is_some())).collect();
    // By round; in a round the forwards first (each receive of the round is
    // matched by a send of it, and a forward needs only earlier rounds).
    mine.sort_by_key(|m| (m.round, m.from != rank, m.id));
    for m in mine {
        if m.from == rank {
            let started = Instant::now();
            let id = m.forwards.expect("filtered");
            let block = kept.remove(&id).ok_or_else(|| plan_error(rank, "forwards a chunk it did not receive"))?;
            let to = parties.receive[m.to].ok_or_else(|| plan_error(m.to, "receives without a tile"))?;
            endpoint.send(to, move_tag(m.id), block, started);
            log.record(Kind::Send, to, move_tag(m.id), m.bytes.len(), started);
        } else {
            let from = match m.forwards {
                Some(_) => sender(parties.receive[m.from], m.from)?,
                None => sender(parties.send[m.from], m.from)?,
            };
            let block = take(from, move_tag(m.id), &m.region, m.bytes.clone(), out, log)?;
            if forwarded.contains(&m.id) {
                kept.insert(m.id, block);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Rows split over ranks 0 and 1, needed whole by ranks 1..n (rank 1
    /// keeps its own rows and receives the others).
    fn layout(n: usize) -> Layout {
        let tile = |a, b| Some(Region { start: vec![a, 0], end: vec![b, 4] });
        let src = (0..n).map(|r| match r {
            0 => tile(0, 8),
            1 => tile(8, 16),
            _ => None,
        });
        let dst = (0..n).map(|r| if r >= 1 { tile(0, 16) } else { None });
        Layout::new(vec![16, 4], 4, src.collect(), dst.collect()).unwrap()
    }

    /// Runs the send parts of the ranks in `present` (in turn, each leaving
    /// before the next), then their receive parts on threads; returns each
    /// receiver's output or error, by rank.
    fn run(n: usize, method: Method, present: &[usize], site: i64) -> Vec<(usize, Result<Vec<u8>>)> {
        let layout = layout(n);
        let plan = reshard::plan(&layout, method);
        let devices: Vec<i64> = (0..n as i64).map(|d| 700 + d).collect();
        let planned = Planned::new(layout, method, plan, &devices);
        let parties = &planned.parties;
        let global: Vec<u8> = (0..16 * 4 * 4).map(|b| (b % 251) as u8).collect();
        let join = |part: Part, rank: usize| {
            let key = SessionKey { group: parties.devices.clone(), site, run: 5, sequence: 0 };
            let info = transport::Participant {
                op: "reshard",
                rank: parties.of(part, rank).unwrap(),
                timeout: Duration::from_millis(300),
                interrupts: crate::config::interrupts(),
            };
            Endpoint::join(key, info)
        };
        std::thread::scope(|scope| {
            for &rank in present.iter().filter(|&&r| r < 2) {
                let endpoint = join(Part::Send, rank);
                let input = &global[rank * 128..(rank + 1) * 128];
                let mut log = TransferLog { trace: None, devices: &parties.devices };
                send_part(&planned, rank, input, &endpoint, &mut log).unwrap();
            }
            let handles: Vec<_> = present
                .iter()
                .filter(|&&r| r >= 1)
                .map(|&rank| {
                    let (planned, join) = (&planned, &join);
                    let handle = scope.spawn(move || {
                        let mut out = vec![0u8; 256];
                        let endpoint = join(Part::Receive, rank);
                        let mut log = TransferLog { trace: None, devices: &planned.parties.devices };
                        let result = receive_part(planned, rank, &mut out, &endpoint, &mut log);
                        if let Err(e) = &result {
                            endpoint.fail(e);
                        }
                        result.map(|()| out)
                    });
                    (rank, handle)
                })
                .collect();
            handles.into_iter().map(|(rank, h)| (rank, h.join().unwrap())).collect()
        })
    }

    #[test]
    fn senders_post_and_leave_before_receivers_come_and_every_receiver_gets_the_whole_array() {
        let global: Vec<u8> = (0..256).map(|b| (b % 251) as u8).collect();
        for (i, method) in [Method::Direct, Method::Broadcast { chunk_bytes: 24 }].into_iter().enumerate() {
            let outs = run(6, method, &[0, 1, 2, 3, 4, 5], 8100 + i as i64);
            assert_eq!(outs.len(), 5);
            for (rank, out) in outs {
                assert_eq!(out.unwrap(), global, "{method:?} rank {rank}");
            }
        }
    }

    #[test]
    fn parties_are_the_senders_then_the_receivers() {
        let parties = Parties::new(&layout(4), &[10, 11, 12, 13]);
        assert_eq!(parties.devices, vec![10, 11, 11, 12, 13]);
        assert_eq!(parties.send, vec![Some(0), Some(1), None, None]);
        assert_eq!(parties.receive, vec![None, Some(2), Some(3), Some(4)]);
    }

    #[test]
    fn a_destination_that_never_arrives_ends_in_a_deadline_error_naming_it() {
        // Rank 3 never runs: in the broadcast chains 1 -> 2 -> 3 -> 4 rank 4
        // waits for chunks it never forwards.
        let outs = run(5, Method::Broadcast { chunk_bytes: 32 }, &[0, 1, 2, 4], 8200);
        let errors: Vec<String> = outs.into_iter().filter_map(|(_, r)| r.err()).map(|e| e.to_string()).collect();
        assert!(!errors.is_empty());
        assert!(
            errors.iter().any(|e| e.contains("deadline exceeded")
                && e.contains("ranks [4] (devices [703]) never arrived: device 703 has not entered any commfuse call")),
            "{errors:?}"
        );
    }
}
