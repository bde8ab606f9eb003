//! `commfuse.reshard` on the CPU backend: one device's part of a
//! `reshard::Plan`, on the same transport as the fused ops (link model,
//! deadlines naming the ranks that did not arrive, failures ending the
//! peers' waits).
//!
//! The call has one operand and one result, each a flat buffer: the
//! device's source tile (row-major, then padding) and its destination tile.
//! Devices of the union that hold no source tile pass padding only; those
//! that need no destination tile get theirs back untouched.
#![forbid(unsafe_code)]

use super::transport::{self, link::LinkModel, Block, Endpoint, SessionKey, Shared};
use crate::error::{Error, Result};
use crate::exec::Wait;
use crate::plan::{Direction, Tag};
use crate::reshard::{self, Layout, Method, Plan, Region};
use crate::xla::Frame;
use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

/// The attribute `method`: how Python names the methods.
pub const DIRECT: i64 = 0;
pub const BROADCAST: i64 = 1;
/// The cost model's pick (`reshard::choose`) on the link model's bandwidth
/// and latency, or on `UNMODELLED_LINK` without one.
pub const AUTO: i64 = 2;
/// Bytes per second and seconds per message assumed for in-process
/// transfers when no link model is set (a memory copy's rate).
const UNMODELLED_LINK: (f64, f64) = (10e9, 5e-6);

/// One device's call of `commfuse.reshard`.
pub fn handler(frame: &mut Frame<'_>) -> Result<()> {
    let call = ReshardCall::decode(frame)?;
    super::handler::run_off_xla_thread(frame, "commfuse reshard", &["x"], &["out"], move |args, rets| {
        call.run(args, rets)
    })
}

struct ReshardCall {
    layout: Layout,
    plan: Plan,
    rank: usize,
    key: SessionKey,
    link: Option<LinkModel>,
    timeout: std::time::Duration,
    interrupts: u64,
}

/// Tiles as Python writes them: per rank `2 * ndim` values, start then end,
/// or all -1 for a rank without a tile.
fn tiles(name: &str, flat: &[i64], ranks: usize, ndim: usize) -> Result<Vec<Option<Region>>> {
    let per = 2 * ndim;
    if flat.len() != ranks * per {
        return Err(Error::InvalidArgument(format!(
            "reshard: attribute `{name}` has {} values, expected {ranks} ranks x {per}",
            flat.len()
        )));
    }
    (0..ranks)
        .map(|r| {
            let t = &flat[r * per..(r + 1) * per];
            if ndim > 0 && t.iter().all(|&v| v == -1) {
                return Ok(None);
            }
            let dims = t.iter().map(|&v| usize::try_from(v)).collect::<std::result::Result<Vec<_>, _>>();
            let dims =
                dims.map_err(|_| Error::InvalidArgument(format!("reshard: `{name}` of rank {r} is negative")))?;
            Ok(Some(Region { start: dims[..ndim].to_vec(), end: dims[ndim..].to_vec() }))
        })
        .collect()
}

impl ReshardCall {
    fn decode(frame: &Frame<'_>) -> Result<ReshardCall> {
        let devices = frame.attr_i64_array("devices")?.to_vec();
        let device = i64::from(frame.device_ordinal()?);
        let rank = devices.iter().position(|&d| d == device).ok_or_else(|| {
            Error::InvalidArgument(format!("reshard: device {device} is not among the devices {devices:?}"))
        })?;
        let shape = frame.attr_i64_array("shape")?;
        let shape: Vec<usize> = shape
            .iter()
            .map(|&d| usize::try_from(d))
            .collect::<std::result::Result<_, _>>()
            .map_err(|_| Error::InvalidArgument(format!("reshard: negative dim in shape {shape:?}")))?;
        let itemsize = usize::try_from(frame.attr_i64("itemsize")?)
            .map_err(|_| Error::InvalidArgument("reshard: negative itemsize".into()))?;
        let ranks = devices.len();
        if (1..ranks).any(|i| devices[..i].contains(&devices[i])) {
            return Err(Error::InvalidArgument(format!("reshard: attribute `devices` repeats a device: {devices:?}")));
        }
        let src = tiles("src", frame.attr_i64_array("src")?, ranks, shape.len())?;
        let dst = tiles("dst", frame.attr_i64_array("dst")?, ranks, shape.len())?;
        let layout = Layout::new(shape, itemsize, src, dst)?;
        let chunk_bytes = usize::try_from(frame.attr_i64("chunk_bytes")?)
            .ok()
            .filter(|&c| c > 0)
            .ok_or_else(|| Error::InvalidArgument("reshard: chunk_bytes must be positive".into()))?;
        let link = LinkModel::from_env()?;
        let plan = match frame.attr_i64("method")? {
            DIRECT => reshard::plan(&layout, Method::Direct),
            BROADCAST => reshard::plan(&layout, Method::Broadcast { chunk_bytes }),
            AUTO => {
                let (rate, latency) = link.map_or(UNMODELLED_LINK, |l| (l.bytes_per_s, l.latency.as_secs_f64()));
                reshard::choose(&layout, chunk_bytes, rate, latency).1
            }
            other => return Err(Error::InvalidArgument(format!("reshard: unknown method {other}"))),
        };
        let site = frame.attr_i64("site")?;
        let run = frame.run_id()?;
        let key = SessionKey { sequence: transport::next_sequence(device, site, run), group: devices, site, run };
        Ok(ReshardCall {
            layout,
            plan,
            rank,
            key,
            link,
            timeout: crate::config::timeout()?,
            interrupts: crate::config::interrupts(),
        })
    }

    fn run(self, args: &[&[u8]], rets: &mut [&mut [u8]]) -> Result<()> {
        let ([input], [out]) = (args, rets) else {
            return Err(Error::InvalidArgument("reshard: the call has one operand and one result".into()));
        };
        let participant = transport::Participant {
            op: "reshard",
            rank: self.rank,
            timeout: self.timeout,
            interrupts: self.interrupts,
        };
        let endpoint = Endpoint::join(self.key.clone(), participant).with_link(self.link);
        // A panic fails the peers at once too, instead of leaving them to the deadline.
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            run_rank(&self.layout, &self.plan, self.rank, input, out, &endpoint)
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

/// Runs `rank`'s part of `plan`: its local copies, then its rounds (sends,
/// then receives); a received chunk that this rank forwards later is kept
/// and handed on as it is (no copy).
pub fn run_rank(
    layout: &Layout,
    plan: &Plan,
    rank: usize,
    input: &[u8],
    out: &mut [u8],
    endpoint: &Endpoint,
) -> Result<()> {
    let itemsize = layout.itemsize;
    let src_tile = layout.src[rank].as_ref();
    let dst_tile = layout.dst[rank].as_ref();
    let too_small = |name: &str, have: usize, tile: &Region| {
        Error::InvalidArgument(format!(
            "reshard: `{name}` of rank {rank} has {have} bytes, its tile needs {}",
            layout.bytes(tile)
        ))
    };
    if let Some(t) = src_tile.filter(|t| layout.bytes(t) > input.len()) {
        return Err(too_small("x", input.len(), t));
    }
    if let Some(t) = dst_tile.filter(|t| layout.bytes(t) > out.len()) {
        return Err(too_small("out", out.len(), t));
    }
    let no_tile = |what: &str| Error::Internal(format!("reshard plan error: rank {rank} {what} without a tile"));
    for copy in plan.copies.iter().filter(|c| c.rank == rank) {
        let (from, to) = (src_tile.ok_or_else(|| no_tile("copies"))?, dst_tile.ok_or_else(|| no_tile("receives"))?);
        endpoint.compute(|| reshard::copy_local(&copy.region, itemsize, (from, input), (to, &mut *out)))?;
    }
    let forwarded: std::collections::HashSet<usize> = plan.moves.iter().filter_map(|m| m.forwards).collect();
    let mut kept: HashMap<usize, Shared> = HashMap::new();
    let cancelled = AtomicBool::new(false);
    let tag = |id: usize| Tag { direction: Direction::Forward, step: id };
    let mut mine: Vec<&reshard::Move> = plan.moves.iter().filter(|m| m.from == rank || m.to == rank).collect();
    // By round; in a round the sends first (each receive of the round is matched by a send of it).
    mine.sort_by_key(|m| (m.round, m.from != rank, m.id));
    for m in mine {
        if m.from == rank {
            let block = match m.forwards {
                Some(id) => kept.remove(&id).ok_or_else(|| no_tile("forwards a chunk it did not receive"))?,
                None => {
                    let from = src_tile.ok_or_else(|| no_tile("sends"))?;
                    let mut block = Block::new(m.bytes.len());
                    endpoint.compute(|| {
                        reshard::pack(&m.region, from, itemsize, m.bytes.clone(), input, block.bytes_mut())
                    })?;
                    Arc::new(block)
                }
            };
            endpoint.send(m.to, tag(m.id), block, std::time::Instant::now());
        } else {
            let to = dst_tile.ok_or_else(|| no_tile("receives"))?;
            let wait = Wait::unwatched(&cancelled);
            let (block, _) = endpoint.recv(m.from, tag(m.id), m.bytes.len(), &wait)?;
            endpoint.compute(|| reshard::unpack(&m.region, to, itemsize, m.bytes.clone(), block.bytes(), out))?;
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

    /// Rows split over ranks 0 and 1, needed whole by ranks 2..n.
    fn layout(n: usize) -> Layout {
        let tile = |a, b| Some(Region { start: vec![a, 0], end: vec![b, 4] });
        let src = (0..n).map(|r| match r {
            0 => tile(0, 8),
            1 => tile(8, 16),
            _ => None,
        });
        let dst = (0..n).map(|r| if r >= 2 { tile(0, 16) } else { None });
        Layout::new(vec![16, 4], 4, src.collect(), dst.collect()).unwrap()
    }

    /// Runs the ranks in `present` on threads; returns each one's output or error.
    fn run(n: usize, method: Method, present: &[usize], site: i64) -> Vec<Result<Vec<u8>>> {
        let layout = layout(n);
        let plan = reshard::plan(&layout, method);
        let global: Vec<u8> = (0..16 * 4 * 4).map(|b| (b % 251) as u8).collect();
        std::thread::scope(|scope| {
            let handles: Vec<_> = present
                .iter()
                .map(|&rank| {
                    let (layout, plan, global) = (&layout, &plan, &global);
                    scope.spawn(move || {
                        let input = match rank {
                            0 => global[..128].to_vec(),
                            1 => global[128..].to_vec(),
                            _ => vec![0; 128],
                        };
                        let mut out = vec![0u8; 256];
                        let key =
                            SessionKey { group: (0..n as i64).map(|d| 700 + d).collect(), site, run: -3, sequence: 0 };
                        let info = transport::Participant {
                            op: "reshard",
                            rank,
                            timeout: Duration::from_millis(300),
                            interrupts: crate::config::interrupts(),
                        };
                        let endpoint = Endpoint::join(key, info);
                        let result = run_rank(layout, plan, rank, &input, &mut out, &endpoint);
                        if let Err(e) = &result {
                            endpoint.fail(e);
                        }
                        result.map(|()| out)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn every_destination_gets_the_whole_array_by_either_method() {
        let global: Vec<u8> = (0..256).map(|b| (b % 251) as u8).collect();
        for (i, method) in [Method::Direct, Method::Broadcast { chunk_bytes: 24 }].into_iter().enumerate() {
            let outs = run(6, method, &[0, 1, 2, 3, 4, 5], 8100 + i as i64);
            for (rank, out) in outs.into_iter().enumerate().skip(2) {
                assert_eq!(out.unwrap(), global, "{method:?} rank {rank}");
            }
        }
    }

    #[test]
    fn a_destination_that_never_arrives_ends_in_a_deadline_error_naming_it() {
        // Rank 3 never runs: in a broadcast chain 2 -> 3 -> 4 the ranks after
        // it wait for chunks it never forwards.
        let outs = run(5, Method::Broadcast { chunk_bytes: 32 }, &[0, 1, 2, 4], 8200);
        let errors: Vec<String> = outs.into_iter().filter_map(|r| r.err()).map(|e| e.to_string()).collect();
        assert!(!errors.is_empty());
        assert!(
            errors
                .iter()
                .any(|e| e.contains("deadline exceeded") && e.contains("ranks [3] (devices [703]) never arrived")),
            "{errors:?}"
        );
    }
}
