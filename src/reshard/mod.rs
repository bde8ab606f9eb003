//! Cross-mesh resharding: moving an array from one set of devices and
//! layout to another (`commfuse.reshard`).
//!
//! Rank i is the i-th device of the union of the two meshes' devices. Each rank holds at most one source tile
//! and needs at most one destination tile (boxes of the global array, as
//! JAX's `devices_indices_map` gives them). A *piece* is the intersection
//! of a distinct destination tile with a distinct source tile; every rank
//! needing that destination tile needs the piece. The planner decides, for
//! every piece and every rank that needs it, where its bytes come from:
//! - a rank that holds the source tile keeps the piece (`Plan::copies`: no
//!   transfer, a memory copy);
//! - `Direct`: otherwise one holder sends it the whole piece (the holder with
//!   the fewest bytes to send so far: senders balanced);
//! - `Broadcast`: the ranks needing the piece are split into as many chains
//!   as there are holders (at most one chain per receiver), each rooted at a
//!   different holder; the piece is cut into chunks and each chunk is
//!   forwarded along its chain as soon as it arrives (a pipelined broadcast),
//!   so a holder sends the piece once per chain instead of once per receiver.
//!
//! Moves are numbered and put in rounds: a rank runs its rounds in order,
//! in each its sends, then its receives. A send in round t carries what the
//! rank held at the start or received in a round before t, and every receive
//! of round t is matched by a send of round t, so the rounds complete one by
//! one and nothing can deadlock (for NCCL: one group per round). Sends that
//! need no receive first (from the holders) may also all be posted at once,
//! ahead of the rounds: the CPU backend's send program does that.
//!
//! Pure code: every rank computes the same plan from the same attributes.
#![forbid(unsafe_code)]

pub mod attrs;
pub mod device;
#[cfg(test)]
pub(crate) mod tests;

use crate::error::{Error, Result};
use std::collections::BTreeMap;
use std::ops::Range;

/// A box of the global array: `start[d] .. end[d]` along each dim.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Region {
    pub start: Vec<usize>,
    pub end: Vec<usize>,
}

impl Region {
    pub fn elements(&self) -> usize {
        self.start.iter().zip(&self.end).map(|(s, e)| e.saturating_sub(*s)).product()
    }

    pub fn intersect(&self, other: &Region) -> Option<Region> {
        let start: Vec<usize> = self.start.iter().zip(&other.start).map(|(a, b)| *a.max(b)).collect();
        let end: Vec<usize> = self.end.iter().zip(&other.end).map(|(a, b)| *a.min(b)).collect();
        start.iter().zip(&end).all(|(s, e)| s < e).then_some(Region { start, end })
    }

    pub(crate) fn contains(&self, other: &Region) -> bool {
        (0..self.start.len())
            .all(|d| self.start[d] <= other.start[d] && other.start[d] <= other.end[d] && other.end[d] <= self.end[d])
    }

    /// The contiguous runs of `self` (inside `tile`) in row-major order:
    /// `(offset in self's packed elements, offset in tile's elements, length)`.
    pub(crate) fn runs(&self, tile: &Region) -> Vec<(usize, usize, usize)> {
        let ndim = self.start.len();
        if ndim == 0 {
            return vec![(0, 0, 1)];
        }
        let tile_dims: Vec<usize> = (0..ndim).map(|d| tile.end[d] - tile.start[d]).collect();
        let run = self.end[ndim - 1] - self.start[ndim - 1];
        let mut index = self.start.clone();
        let mut runs = Vec::with_capacity(self.elements() / run.max(1));
        loop {
            let mut at = 0;
            for d in 0..ndim {
                at = at * tile_dims[d] + (index[d] - tile.start[d]);
            }
            runs.push((runs.len() * run, at, run));
            // Next index of the leading dims (odometer).
            let mut d = ndim - 1;
            loop {
                if d == 0 {
                    return runs;
                }
                d -= 1;
                index[d] += 1;
                if index[d] < self.end[d] {
                    break;
                }
                index[d] = self.start[d];
            }
        }
    }
}

/// Where the array is and where it must go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    pub shape: Vec<usize>,
    pub itemsize: usize,
    /// Per rank: the source tile it holds, if any.
    pub src: Vec<Option<Region>>,
    /// Per rank: the destination tile it needs, if any.
    pub dst: Vec<Option<Region>>,
}

impl Layout {
    /// Checks that the tiles fit the shape and that the distinct source tiles
    /// cover the array exactly once (errors name the argument).
    pub fn new(shape: Vec<usize>, itemsize: usize, src: Vec<Option<Region>>, dst: Vec<Option<Region>>) -> Result<Self> {
        let invalid = |m: String| Err(Error::InvalidArgument(format!("reshard: {m}")));
        if itemsize == 0 {
            return invalid("the item size must be positive".into());
        }
        if src.len() != dst.len() || src.is_empty() {
            return invalid(format!(
                "{} source and {} destination ranks; both must be the union's size",
                src.len(),
                dst.len()
            ));
        }
        let whole = Region { start: vec![0; shape.len()], end: shape.clone() };
        // Every byte count below is at most the whole array's.
        let total = shape.iter().try_fold(itemsize, |acc, &d| acc.checked_mul(d));
        if !total.is_some_and(|t| t <= isize::MAX as usize) {
            return invalid(format!("x: shape {shape:?} of {itemsize}-byte items is too large to address"));
        }
        for (name, tiles) in [("x", &src), ("sharding", &dst)] {
            for (rank, tile) in tiles.iter().enumerate() {
                if let Some(t) = tile {
                    if t.start.len() != shape.len() || t.end.len() != shape.len() || !whole.contains(t) {
                        return invalid(format!("{name}: rank {rank}'s tile {t:?} is not inside the shape {shape:?}"));
                    }
                }
            }
        }
        // Replicas hold equal tiles; distinct tiles of a NamedSharding partition the array.
        for (name, tiles) in [("x", &src), ("sharding", &dst)] {
            let distinct: Vec<&Region> = distinct_tiles(tiles).into_keys().collect();
            // Each tile is at most the (checked) whole; their sum may still overflow.
            let covered = distinct.iter().try_fold(0usize, |acc, t| acc.checked_add(t.elements()));
            let overlap =
                distinct.iter().enumerate().any(|(i, a)| distinct[i + 1..].iter().any(|b| a.intersect(b).is_some()));
            if covered != Some(whole.elements()) || overlap {
                return invalid(format!("{name}: the tiles do not cover the array exactly once"));
            }
        }
        Ok(Layout { shape, itemsize, src, dst })
    }

    pub fn ranks(&self) -> usize {
        self.src.len()
    }

    /// Bytes of `region` packed.
    pub fn bytes(&self, region: &Region) -> usize {
        region.elements() * self.itemsize
    }
}

/// Distinct tiles and the ranks holding each, in tile order.
fn distinct_tiles(tiles: &[Option<Region>]) -> BTreeMap<&Region, Vec<usize>> {
    let mut map: BTreeMap<&Region, Vec<usize>> = BTreeMap::new();
    for (rank, tile) in tiles.iter().enumerate() {
        if let Some(t) = tile {
            map.entry(t).or_default().push(rank);
        }
    }
    map
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// Each rank receives each piece it needs from one holder.
    Direct,
    /// Pipelined chains rooted at the holders, in chunks of at most `chunk_bytes`.
    Broadcast { chunk_bytes: usize },
}

/// One message: bytes `bytes` of `region` packed row-major.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Move {
    /// The message's tag; moves are numbered in plan order.
    pub id: usize,
    pub round: usize,
    pub from: usize,
    pub to: usize,
    pub region: Region,
    pub bytes: Range<usize>,
    /// The move that brought these bytes to `from` (a forward), or `None`
    /// when `from` packs them from its source tile.
    pub forwards: Option<usize>,
}

/// A piece a rank copies from its own source tile into its destination tile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalCopy {
    pub rank: usize,
    pub region: Region,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub moves: Vec<Move>,
    pub copies: Vec<LocalCopy>,
    pub rounds: usize,
}

impl Plan {
    /// Bytes each rank sends.
    pub fn sent_bytes(&self, ranks: usize) -> Vec<usize> {
        let mut sent = vec![0; ranks];
        for m in &self.moves {
            sent[m.from] += m.bytes.len();
        }
        sent
    }
}

/// The plan of `layout` under `method` (see the module comment).
pub fn plan(layout: &Layout, method: Method) -> Plan {
    let sources = distinct_tiles(&layout.src);
    let mut load = vec![0usize; layout.ranks()];
    let mut plan = Plan { moves: vec![], copies: vec![], rounds: 0 };
    for (dst_tile, needers) in distinct_tiles(&layout.dst) {
        for (src_tile, holders) in &sources {
            let Some(piece) = dst_tile.intersect(src_tile) else { continue };
            let bytes = layout.bytes(&piece);
            let mut receivers = vec![];
            for &rank in &needers {
                if holders.contains(&rank) {
                    plan.copies.push(LocalCopy { rank, region: piece.clone() });
                } else {
                    receivers.push(rank);
                }
            }
            if receivers.is_empty() {
                continue;
            }
            let least_loaded = |load: &[usize], count: usize| {
                let mut by_load = holders.clone();
                by_load.sort_by_key(|&h| (load[h], h));
                by_load.truncate(count);
                by_load
            };
            match method {
                Method::Direct => {
                    for to in receivers {
                        let from = least_loaded(&load, 1)[0];
                        load[from] += bytes;
                        push(&mut plan, 0, from, to, &piece, 0..bytes, None);
                    }
                }
                Method::Broadcast { chunk_bytes } => {
                    let roots = least_loaded(&load, receivers.len().min(holders.len()));
                    let chunks = chunk_ranges(bytes, chunk_bytes.max(1), layout.itemsize);
                    let per_chain = receivers.len().div_ceil(roots.len());
                    for (root, chain) in roots.iter().zip(receivers.chunks(per_chain)) {
                        load[*root] += bytes;
                        for (c, range) in chunks.iter().enumerate() {
                            let mut from = (*root, None);
                            for (hop, &to) in chain.iter().enumerate() {
                                let id = push(&mut plan, c + hop, from.0, to, &piece, range.clone(), from.1);
                                from = (to, Some(id));
                            }
                        }
                    }
                }
            }
        }
    }
    plan
}

fn push(
    plan: &mut Plan,
    round: usize,
    from: usize,
    to: usize,
    region: &Region,
    bytes: Range<usize>,
    forwards: Option<usize>,
) -> usize {
    let id = plan.moves.len();
    plan.moves.push(Move { id, round, from, to, region: region.clone(), bytes, forwards });
    plan.rounds = plan.rounds.max(round + 1);
    id
}

/// The most chunks a piece is cut into (a smaller `chunk_bytes` is raised).
pub const MAX_CHUNKS: usize = 1 << 12;

/// `total` bytes cut into ranges of at most `chunk` bytes (at most
/// `MAX_CHUNKS` of them), on item boundaries.
fn chunk_ranges(total: usize, chunk: usize, itemsize: usize) -> Vec<Range<usize>> {
    let chunk = chunk.max(total.div_ceil(MAX_CHUNKS));
    let chunk = chunk.div_ceil(itemsize).max(1) * itemsize;
    (0..total.div_ceil(chunk)).map(|c| c * chunk..((c + 1) * chunk).min(total)).collect()
}

/// The predicted time of `plan` on links of `bytes_per_s` and `latency_s`
/// per message, each rank having one outgoing and one incoming port (the
/// link model's `switch`): rounds run one after another, each as long as its
/// busiest port. `auto` takes the method with the smaller prediction.
pub fn predicted_seconds(plan: &Plan, ranks: usize, bytes_per_s: f64, latency_s: f64) -> f64 {
    let mut total = 0.0;
    let mut by_round: BTreeMap<usize, (Vec<usize>, Vec<usize>)> = BTreeMap::new();
    for m in &plan.moves {
        let (out, inn) = by_round.entry(m.round).or_insert_with(|| (vec![0; ranks], vec![0; ranks]));
        out[m.from] += m.bytes.len();
        inn[m.to] += m.bytes.len();
    }
    for (out, inn) in by_round.values() {
        let busiest = out.iter().chain(inn).copied().max().unwrap_or(0);
        total += busiest as f64 / bytes_per_s + latency_s;
    }
    total
}

/// The method `auto` runs, and its plan: the one predicted faster (ties:
/// direct, the simpler).
pub fn choose(layout: &Layout, chunk_bytes: usize, bytes_per_s: f64, latency_s: f64) -> (Method, Plan) {
    let time = |p: &Plan| predicted_seconds(p, layout.ranks(), bytes_per_s, latency_s);
    let direct = plan(layout, Method::Direct);
    let broadcast = Method::Broadcast { chunk_bytes };
    let chained = plan(layout, broadcast);
    if time(&chained) < time(&direct) {
        (broadcast, chained)
    } else {
        (Method::Direct, direct)
    }
}

/// Copies bytes `range` of `region` packed out of `tile`'s row-major buffer
/// (`tile_bytes`) into `out` (`unpack` is the reverse).
pub fn pack(
    region: &Region,
    tile: &Region,
    itemsize: usize,
    range: Range<usize>,
    tile_bytes: &[u8],
    out: &mut [u8],
) -> Result<()> {
    for_runs(region, tile, itemsize, range, tile_bytes.len(), out.len(), |packed, at, len| {
        out[packed..packed + len].copy_from_slice(&tile_bytes[at..at + len]);
    })
}

/// The reverse of `pack`: `data` (bytes `range` of `region` packed) into `tile_bytes`.
pub fn unpack(
    region: &Region,
    tile: &Region,
    itemsize: usize,
    range: Range<usize>,
    data: &[u8],
    tile_bytes: &mut [u8],
) -> Result<()> {
    let tile_len = tile_bytes.len();
    for_runs(region, tile, itemsize, range, tile_len, data.len(), |packed, at, len| {
        tile_bytes[at..at + len].copy_from_slice(&data[packed..packed + len]);
    })
}

/// Calls `copy(offset in the range's data, offset in the tile, length)` for
/// each contiguous run, in bytes, after checking every offset is in bounds.
fn for_runs(
    region: &Region,
    tile: &Region,
    itemsize: usize,
    range: Range<usize>,
    tile_len: usize,
    data_len: usize,
    mut copy: impl FnMut(usize, usize, usize),
) -> Result<()> {
    if !tile.contains(region)
        || tile.elements() * itemsize > tile_len
        || range.len() > data_len
        || range.end > region.elements() * itemsize
    {
        return Err(Error::Internal(format!(
            "reshard: {region:?} bytes {range:?} do not fit tile {tile:?} ({tile_len} bytes)"
        )));
    }
    for (packed, at, len) in region.runs(tile) {
        let (packed, at, len) = (packed * itemsize, at * itemsize, len * itemsize);
        let lo = packed.max(range.start);
        let hi = (packed + len).min(range.end);
        if lo < hi {
            copy(lo - range.start, at + (lo - packed), hi - lo);
        }
    }
    Ok(())
}
