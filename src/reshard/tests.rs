//! Property checks of the resharding planner on random meshes and layouts:
//! every destination byte written exactly once with the right value, every
//! byte sent by a holder of it (or forwarded after it arrived), senders
//! balanced, rounds ordered so nothing can deadlock.

use super::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Tiles of `shape` split `splits[d]` ways along dim d, on `count` of the
/// `ranks` ranks chosen at random (replicas: tile i % tiles); the others hold none.
fn random_tiles(
    rng: &mut StdRng,
    shape: &[usize],
    splits: &[usize],
    ranks: usize,
    count: usize,
) -> Vec<Option<Region>> {
    let tiles: usize = splits.iter().product();
    let mut chosen: Vec<usize> = (0..ranks).collect();
    for i in (1..ranks).rev() {
        chosen.swap(i, rng.random_range(0..=i));
    }
    let mut out = vec![None; ranks];
    for (i, &rank) in chosen.iter().take(count).enumerate() {
        let mut t = i % tiles;
        let (mut start, mut end) = (vec![0; shape.len()], vec![0; shape.len()]);
        for d in (0..shape.len()).rev() {
            let part = shape[d] / splits[d];
            start[d] = (t % splits[d]) * part;
            end[d] = start[d] + part;
            t /= splits[d];
        }
        out[rank] = Some(Region { start, end });
    }
    out
}

pub(crate) fn random_layout(rng: &mut StdRng) -> Layout {
    let ndim = rng.random_range(0..=3);
    let ranks = rng.random_range(1..=10);
    let splits = |rng: &mut StdRng| -> Vec<usize> {
        let mut left = ranks;
        (0..ndim)
            .map(|_| {
                let s = rng.random_range(1..=left.min(4));
                left /= s;
                s
            })
            .collect()
    };
    let (src_splits, dst_splits) = (splits(rng), splits(rng));
    let shape: Vec<usize> = (0..ndim).map(|d| src_splits[d] * dst_splits[d] * rng.random_range(1..=3)).collect();
    let count = |rng: &mut StdRng, splits: &[usize]| {
        let tiles: usize = splits.iter().product();
        tiles * rng.random_range(1..=ranks / tiles)
    };
    let (ns, nd) = (count(rng, &src_splits), count(rng, &dst_splits));
    let src = random_tiles(rng, &shape, &src_splits, ranks, ns);
    let dst = random_tiles(rng, &shape, &dst_splits, ranks, nd);
    Layout::new(shape, [1, 2, 4][rng.random_range(0..3)], src, dst).expect("a valid layout")
}

/// The tile of `rank` filled from the global array whose element i holds
/// bytes derived from i.
pub(crate) fn filled(layout: &Layout, tile: &Region) -> Vec<u8> {
    let whole = Region { start: vec![0; layout.shape.len()], end: layout.shape.clone() };
    let global: Vec<u8> = (0..whole.elements() * layout.itemsize).map(|b| (b % 251) as u8).collect();
    let mut out = vec![0; layout.bytes(tile)];
    pack(tile, &whole, layout.itemsize, 0..out.len(), &global, &mut out).unwrap();
    out
}

/// Runs the plan round by round (sends, then receives, as every rank does)
/// and checks the destination tiles and the write counts.
fn check(layout: &Layout, plan: &Plan, label: &str) {
    let n = layout.ranks();
    let src: Vec<Option<Vec<u8>>> = layout.src.iter().map(|t| t.as_ref().map(|t| filled(layout, t))).collect();
    let mut dst: Vec<Option<Vec<u8>>> =
        layout.dst.iter().map(|t| t.as_ref().map(|t| vec![0; layout.bytes(t)])).collect();
    let mut writes: Vec<Vec<u32>> = dst.iter().map(|d| vec![0; d.as_ref().map_or(0, |d| d.len())]).collect();
    let mark = |rank: usize, region: &Region, range: Range<usize>, writes: &mut Vec<Vec<u32>>| {
        let tile = layout.dst[rank].as_ref().unwrap();
        let data = vec![1u8; range.len()];
        let mut hits = vec![0u8; layout.bytes(tile)];
        unpack(region, tile, layout.itemsize, range, &data, &mut hits).unwrap();
        for (w, h) in writes[rank].iter_mut().zip(hits) {
            *w += h as u32;
        }
    };
    for c in &plan.copies {
        let tile =
            layout.src[c.rank].as_ref().unwrap_or_else(|| panic!("{label}: rank {} copies without a source", c.rank));
        let bytes = layout.bytes(&c.region);
        // The CPU backend packs a kept piece and unpacks it like any other.
        let mut data = vec![0; bytes];
        pack(&c.region, tile, layout.itemsize, 0..bytes, src[c.rank].as_ref().unwrap(), &mut data).unwrap();
        let to = layout.dst[c.rank].as_ref().unwrap();
        unpack(&c.region, to, layout.itemsize, 0..bytes, &data, dst[c.rank].as_mut().unwrap()).unwrap();
        mark(c.rank, &c.region, 0..bytes, &mut writes);
    }
    let mut arrived: Vec<Option<Vec<u8>>> = vec![None; plan.moves.len()];
    for round in 0..plan.rounds {
        let moves: Vec<&Move> = plan.moves.iter().filter(|m| m.round == round).collect();
        let mut sent = vec![];
        for m in &moves {
            let data = match m.forwards {
                None => {
                    let tile = layout.src[m.from]
                        .as_ref()
                        .unwrap_or_else(|| panic!("{label}: rank {} sends without a source", m.from));
                    let mut data = vec![0; m.bytes.len()];
                    pack(&m.region, tile, layout.itemsize, m.bytes.clone(), src[m.from].as_ref().unwrap(), &mut data)
                        .unwrap();
                    data
                }
                Some(id) => {
                    let before = &plan.moves[id];
                    assert_eq!(
                        (before.to, &before.region, &before.bytes),
                        (m.from, &m.region, &m.bytes),
                        "{label}: forward"
                    );
                    arrived[id]
                        .clone()
                        .unwrap_or_else(|| panic!("{label}: move {} forwards move {id} before it arrived", m.id))
                }
            };
            sent.push((m.id, data));
        }
        for (id, data) in sent {
            let m = &plan.moves[id];
            assert_ne!(m.from, m.to, "{label}: a rank sends to itself");
            let tile = layout.dst[m.to].as_ref().unwrap_or_else(|| panic!("{label}: rank {} needs nothing", m.to));
            unpack(&m.region, tile, layout.itemsize, m.bytes.clone(), &data, dst[m.to].as_mut().unwrap()).unwrap();
            mark(m.to, &m.region, m.bytes.clone(), &mut writes);
            arrived[id] = Some(data);
        }
    }
    for rank in 0..n {
        if let Some(tile) = &layout.dst[rank] {
            assert_eq!(dst[rank].as_ref().unwrap(), &filled(layout, tile), "{label}: rank {rank}'s tile");
            assert!(
                writes[rank].iter().all(|&w| w == 1),
                "{label}: rank {rank} has bytes written {:?} times",
                writes[rank].iter().max()
            );
        }
    }
}

/// Holders of one source tile send (as roots) bytes within one piece of each other.
fn check_balance(layout: &Layout, plan: &Plan, label: &str) {
    let mut origin = vec![0usize; layout.ranks()];
    let mut largest = 0;
    for m in plan.moves.iter().filter(|m| m.forwards.is_none()) {
        origin[m.from] += m.bytes.len();
        largest = largest.max(layout.bytes(&m.region));
    }
    for holders in distinct_tiles(&layout.src).into_values() {
        let loads: Vec<usize> = holders.iter().map(|&h| origin[h]).collect();
        let spread = loads.iter().max().unwrap() - loads.iter().min().unwrap();
        assert!(spread <= largest, "{label}: holders {holders:?} send {loads:?}");
    }
}

#[test]
fn every_random_layout_is_moved_exactly_and_balanced() {
    let mut rng = StdRng::seed_from_u64(15);
    for case in 0..600 {
        let layout = random_layout(&mut rng);
        for method in [
            Method::Direct,
            Method::Broadcast { chunk_bytes: 1 + case % 13 },
            Method::Broadcast { chunk_bytes: 1 << 20 },
        ] {
            let label = format!("case {case} {method:?} {layout:?}");
            let p = plan(&layout, method);
            check(&layout, &p, &label);
            check_balance(&layout, &p, &label);
        }
    }
}

#[test]
fn broadcast_sends_each_piece_once_per_chain_and_direct_once_per_receiver() {
    // 2 sources of a replicated array, 8 destinations replicated: direct
    // sends 4 copies from each source, broadcast 1 (two chains of 4).
    let whole = Region { start: vec![0], end: vec![64] };
    let src: Vec<Option<Region>> = (0..10).map(|r| (r < 2).then(|| whole.clone())).collect();
    let dst: Vec<Option<Region>> = (0..10).map(|r| (r >= 2).then(|| whole.clone())).collect();
    let layout = Layout::new(vec![64], 4, src, dst).unwrap();
    let direct = plan(&layout, Method::Direct);
    assert_eq!(direct.sent_bytes(10)[..2], [4 * 256, 4 * 256]);
    let broadcast = plan(&layout, Method::Broadcast { chunk_bytes: 64 });
    let sent = broadcast.sent_bytes(10);
    assert_eq!(sent[..2], [256, 256]);
    assert_eq!(sent.iter().sum::<usize>(), 8 * 256, "every destination receives the tile once");
    assert_eq!(broadcast.rounds, 4 + 3, "4 chunks pipelined over chains of 4");
    // A chunk size too small for the piece is raised to MAX_CHUNKS chunks.
    let fine = plan(&layout, Method::Broadcast { chunk_bytes: 1 });
    assert_eq!(fine.rounds, 64 + 3, "one 4-byte item per chunk, 64 of them");
    let (t_direct, t_broadcast) =
        (predicted_seconds(&direct, 10, 1e9, 0.0), predicted_seconds(&broadcast, 10, 1e9, 0.0));
    assert!(t_broadcast < t_direct / 2.0, "{t_broadcast} vs {t_direct}");
    let (picked, picked_plan) = choose(&layout, 64, 1e9, 0.0);
    assert_eq!((picked, &picked_plan), (Method::Broadcast { chunk_bytes: 64 }, &broadcast));
    // Tiny pieces on links where latency dominates: one round of direct sends wins.
    assert_eq!(choose(&layout, 64, 1e9, 1e-5), (Method::Direct, direct));
}

#[test]
fn a_rank_holding_what_it_needs_copies_it_locally() {
    let tile = |a, b| Some(Region { start: vec![a], end: vec![b] });
    let layout = Layout::new(vec![8], 4, vec![tile(0, 4), tile(4, 8)], vec![tile(0, 8), tile(0, 8)]).unwrap();
    let p = plan(&layout, Method::Direct);
    assert_eq!(p.copies.len(), 2);
    assert_eq!(p.moves.len(), 2);
    check(&layout, &p, "two ranks, rows to replicated");
}

#[test]
fn tiles_that_do_not_partition_the_array_are_refused_naming_the_argument() {
    let tile = |a, b| Some(Region { start: vec![a], end: vec![b] });
    let err = Layout::new(vec![8], 4, vec![tile(0, 4), tile(2, 8)], vec![tile(0, 8), None]).unwrap_err();
    assert!(err.to_string().contains("x:"), "{err}");
    let err = Layout::new(vec![8], 4, vec![tile(0, 8), None], vec![tile(0, 4), tile(0, 6)]).unwrap_err();
    assert!(err.to_string().contains("sharding:"), "{err}");
    let err = Layout::new(vec![8], 4, vec![tile(0, 9), None], vec![tile(0, 8), None]).unwrap_err();
    assert!(err.to_string().contains("not inside"), "{err}");
    let inverted = Some(Region { start: vec![6], end: vec![2] });
    let err = Layout::new(vec![8], 4, vec![tile(0, 8), None], vec![inverted, tile(0, 8)]).unwrap_err();
    assert!(err.to_string().contains("not inside"), "{err}");
    let huge = Region { start: vec![0, 0], end: vec![1 << 40, 1 << 40] };
    let err = Layout::new(vec![1 << 40, 1 << 40], 4, vec![Some(huge.clone())], vec![Some(huge)]).unwrap_err();
    assert!(err.to_string().contains("too large to address"), "{err}");
}
