//! One device's part of a reshard on a GPU, as memory copies and NCCL
//! transfers on device addresses. Pure: `backend::cuda::reshard` enqueues
//! what this module describes, and the tests below run it in a model of
//! CUDA copies and NCCL point-to-point matching, against the planner.
//!
//! The *send* program packs each region the device sends (pieces of its
//! source tile, disjoint) into `staging`, an XLA result as large as its
//! tile, and posts every send in one NCCL group, in `(round, id)` order,
//! the order in which each receiver posts its receives from it. The
//! *receive* program receives each region's chunks into its own `staging`
//! (as large as its destination tile), one NCCL group per round, forwards
//! a broadcast chain's chunks from where they arrived, and unpacks the
//! regions into `out`. NCCL pairs the transfers of two ranks in the order
//! each posts them, so both sides list them in plan order.
//!
//! Only meshes without a common device: a device in both would keep pieces
//! across two programs (no NCCL transfer to itself spans two groups) and
//! send to a peer from both programs, whose order NCCL could not pair
//! ([`check_disjoint`]).
#![forbid(unsafe_code)]

use super::{Layout, Move, Plan, Region};
use crate::error::{Error, Result};
use std::collections::BTreeMap;

/// A device buffer: address and length in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Buffer {
    pub addr: u64,
    pub bytes: usize,
}

impl From<crate::xla::DeviceBytes<'_>> for Buffer {
    fn from(b: crate::xla::DeviceBytes<'_>) -> Buffer {
        Buffer { addr: b.addr, bytes: b.bytes }
    }
}

/// One `cuMemcpy2DAsync`: `height` rows of `width` bytes, rows `src_pitch`
/// bytes apart at the source and `dst_pitch` at the destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Copy2d {
    pub dst: u64,
    pub dst_pitch: usize,
    pub src: u64,
    pub src_pitch: usize,
    pub width: usize,
    pub height: usize,
}

impl Copy2d {
    /// Bytes each side spans from its first byte, `(source, destination)`:
    /// `(height - 1) * pitch + width` (`None` when that overflows).
    pub fn spans(&self) -> Option<(usize, usize)> {
        if self.width == 0 || self.height == 0 {
            return Some((0, 0));
        }
        let span = |pitch: usize| (self.height - 1).checked_mul(pitch).and_then(|b| b.checked_add(self.width));
        Some((span(self.src_pitch)?, span(self.dst_pitch)?))
    }
}

/// One NCCL send or receive: `bytes` bytes at `addr`, with the peer of that
/// rank in the union (the communicator's ranks are the union's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transfer {
    pub addr: u64,
    pub bytes: usize,
    pub peer: usize,
}

/// One NCCL group.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Round {
    pub sends: Vec<Transfer>,
    pub recvs: Vec<Transfer>,
}

/// A device's send program: the copies into `staging`, then one group of sends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SendSide {
    pub pack: Vec<Copy2d>,
    pub sends: Vec<Transfer>,
}

/// A device's receive program: its rounds (those with transfers), then the copies into `out`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReceiveSide {
    pub rounds: Vec<Round>,
    pub unpack: Vec<Copy2d>,
}

/// Refuses layouts in which a device is in both meshes (see the module comment).
pub fn check_disjoint(layout: &Layout, devices: &[i64]) -> Result<()> {
    let shared: Vec<i64> = (0..layout.ranks())
        .filter(|&r| layout.src[r].is_some() && layout.dst[r].is_some())
        .map(|r| devices[r])
        .collect();
    if shared.is_empty() {
        return Ok(());
    }
    Err(Error::Unimplemented(format!(
        "reshard on GPUs between meshes that share devices (here {shared:?}); the meshes must not overlap"
    )))
}

/// `rank`'s send program: `x` its source tile, `staging` the send program's result.
pub fn send_side(layout: &Layout, plan: &Plan, rank: usize, x: Buffer, staging: Buffer) -> Result<SendSide> {
    let tile = layout.src[rank].as_ref().ok_or_else(|| not_a_party(rank, "holds no tile of `x`"))?;
    fits("x", x, layout.bytes(tile))?;
    let mut mine: Vec<&Move> = plan.moves.iter().filter(|m| m.from == rank).collect();
    if mine.iter().any(|m| m.forwards.is_some()) || plan.copies.iter().any(|c| c.rank == rank) {
        return Err(Error::Internal(format!("reshard: rank {rank} is in both meshes (checked before)")));
    }
    mine.sort_by_key(|m| (m.round, m.id));
    let (offsets, total) = blocks(layout, mine.iter().map(|m| &m.region));
    fits("staging", staging, total)?;
    let pack = offsets
        .iter()
        .flat_map(|(region, &at)| copies(layout, region, tile, staging.addr + at as u64, x.addr, Way::Pack))
        .collect();
    let sends = mine
        .iter()
        .map(|m| Transfer {
            addr: staging.addr + (offsets[&m.region] + m.bytes.start) as u64,
            bytes: m.bytes.len(),
            peer: m.to,
        })
        .collect();
    Ok(SendSide { pack, sends })
}

/// `rank`'s receive program: `out` its destination tile, `staging` the
/// receive program's scratch result.
pub fn receive_side(layout: &Layout, plan: &Plan, rank: usize, out: Buffer, staging: Buffer) -> Result<ReceiveSide> {
    let tile = layout.dst[rank].as_ref().ok_or_else(|| not_a_party(rank, "needs no tile of the result"))?;
    fits("out", out, layout.bytes(tile))?;
    if plan.copies.iter().any(|c| c.rank == rank) || layout.src[rank].is_some() {
        return Err(Error::Internal(format!("reshard: rank {rank} is in both meshes (checked before)")));
    }
    let (offsets, total) = blocks(layout, plan.moves.iter().filter(|m| m.to == rank).map(|m| &m.region));
    fits("staging", staging, total)?;
    let mut rounds: BTreeMap<usize, Round> = BTreeMap::new();
    // Plan order is id order: within a round, both sides of every pair list
    // their transfers in it.
    for m in plan.moves.iter().filter(|m| m.to == rank || m.from == rank) {
        let at = offsets
            .get(&m.region)
            .ok_or_else(|| Error::Internal(format!("reshard: rank {rank} forwards move {} it never received", m.id)))?;
        let addr = staging.addr + (at + m.bytes.start) as u64;
        let round = rounds.entry(m.round).or_default();
        if m.to == rank {
            round.recvs.push(Transfer { addr, bytes: m.bytes.len(), peer: m.from });
        } else {
            round.sends.push(Transfer { addr, bytes: m.bytes.len(), peer: m.to });
        }
    }
    let unpack = offsets
        .iter()
        .flat_map(|(region, &at)| copies(layout, region, tile, staging.addr + at as u64, out.addr, Way::Unpack))
        .collect();
    Ok(ReceiveSide { rounds: rounds.into_values().collect(), unpack })
}

fn not_a_party(rank: usize, what: &str) -> Error {
    Error::InvalidArgument(format!("reshard: rank {rank} {what} but runs its program"))
}

fn fits(name: &str, buffer: Buffer, needed: usize) -> Result<()> {
    if buffer.bytes < needed {
        return Err(Error::InvalidArgument(format!("reshard: `{name}` has {} bytes, needs {needed}", buffer.bytes)));
    }
    Ok(())
}

/// Each distinct region packed once, one after another: offset by region, total bytes.
fn blocks<'a>(layout: &Layout, regions: impl Iterator<Item = &'a Region>) -> (BTreeMap<Region, usize>, usize) {
    let mut offsets = BTreeMap::new();
    for region in regions {
        offsets.entry(region.clone()).or_insert(0);
    }
    let mut total = 0;
    for (region, at) in offsets.iter_mut() {
        *at = total;
        total += layout.bytes(region);
    }
    (offsets, total)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Way {
    /// Tile to packed region.
    Pack,
    /// Packed region to tile.
    Unpack,
}

/// The copies moving `region` between `tile`'s row-major buffer at `tile_addr`
/// and its packed form at `packed`: its contiguous runs, those a constant
/// pitch apart on both sides merged into one 2-D copy, and a 2-D copy of
/// contiguous rows made one row.
fn copies(layout: &Layout, region: &Region, tile: &Region, packed: u64, tile_addr: u64, way: Way) -> Vec<Copy2d> {
    let item = layout.itemsize;
    let mut out: Vec<Copy2d> = Vec::new();
    for (p, t, len) in region.runs(tile) {
        let (p, t, width) = ((p * item) as u64, (t * item) as u64, len * item);
        let (src, dst) = match way {
            Way::Pack => (tile_addr + t, packed + p),
            Way::Unpack => (packed + p, tile_addr + t),
        };
        if let Some(c) = out.last_mut().filter(|c| c.width == width) {
            if c.height == 1 && src >= c.src + width as u64 && dst >= c.dst + width as u64 {
                (c.src_pitch, c.dst_pitch, c.height) = ((src - c.src) as usize, (dst - c.dst) as usize, 2);
                continue;
            }
            let next = c.height as u64;
            if c.height > 1 && src == c.src + next * c.src_pitch as u64 && dst == c.dst + next * c.dst_pitch as u64 {
                c.height += 1;
                continue;
            }
        }
        out.push(Copy2d { dst, dst_pitch: width, src, src_pitch: width, width, height: 1 });
    }
    for c in &mut out {
        if c.src_pitch == c.width && c.dst_pitch == c.width {
            (c.width, c.height) = (c.width * c.height, 1);
            (c.src_pitch, c.dst_pitch) = (c.width, c.width);
        }
    }
    out
}

#[cfg(test)]
mod tests;
