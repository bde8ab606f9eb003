//! The device lowering run in a model of CUDA and NCCL: each rank's memory
//! a byte array, a 2-D copy as `cuMemcpy2DAsync` defines it, an NCCL group
//! as posting its sends, then completing once every receive has a message
//! from its peer (per pair of ranks, first in first out, as NCCL pairs
//! point-to-point calls, sizes equal) and every send was received. Every
//! send program runs first, then the receive programs, round by round: the
//! order the pipeline's host issues them in. No group may be left
//! incomplete, and the destination tiles must equal the planner's.

use super::*;
use crate::reshard::tests::{filled, random_layout};
use crate::reshard::{plan, Method};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::{HashMap, VecDeque};
use std::ops::Range;

/// The same tiles on disjoint ranks: the sources first, then the destinations.
fn disjoint(layout: &Layout) -> Layout {
    let n = layout.ranks();
    let src = layout.src.iter().cloned().chain(std::iter::repeat_n(None, n)).collect();
    let dst = std::iter::repeat_n(None, n).chain(layout.dst.iter().cloned()).collect();
    Layout::new(layout.shape.clone(), layout.itemsize, src, dst).unwrap()
}

/// A rank's memory: `x` or `out` at `TILE`, `staging` at `STAGING`
/// (odd offsets, so a lost base address shows).
const TILE: u64 = 24;
fn staging_at(layout: &Layout) -> u64 {
    TILE + layout.bytes(&Region { start: vec![0; layout.shape.len()], end: layout.shape.clone() }) as u64 + 40
}

fn apply(memory: &mut [u8], copies: &[Copy2d], allowed: Range<u64>) {
    for c in copies {
        assert!(c.src_pitch >= c.width && c.dst_pitch >= c.width && c.height >= 1, "{c:?}");
        for row in 0..c.height as u64 {
            let (src, dst) = (c.src + row * c.src_pitch as u64, c.dst + row * c.dst_pitch as u64);
            assert!(allowed.start <= dst && dst + c.width as u64 <= allowed.end, "{c:?} writes outside {allowed:?}");
            let src = src as usize;
            memory.copy_within(src..src + c.width, dst as usize);
        }
    }
}

/// Per pair of ranks (from, to), the messages in flight: (id, bytes).
type Queues = HashMap<(usize, usize), VecDeque<(usize, Vec<u8>)>>;

/// Runs every rank's programs of `plan`; returns each destination's tile bytes.
fn run(layout: &Layout, plan: &Plan) -> Vec<Option<Vec<u8>>> {
    let n = layout.ranks();
    let staging = staging_at(layout);
    let size = (2 * staging) as usize;
    let mut memory: Vec<Vec<u8>> = (0..n).map(|_| vec![0xee; size]).collect();
    let buffer = |addr: u64, bytes: usize| Buffer { addr, bytes };
    let mut queues: Queues = HashMap::new();
    let mut taken: Vec<bool> = vec![];
    let post = |queues: &mut Queues, taken: &mut Vec<bool>, from: usize, to: usize, data| {
        taken.push(false);
        queues.entry((from, to)).or_default().push_back((taken.len() - 1, data));
        taken.len() - 1
    };
    let mut send_groups: Vec<Vec<usize>> = vec![];
    for (rank, memory) in memory.iter_mut().enumerate() {
        let Some(tile) = &layout.src[rank] else { continue };
        let x = filled(layout, tile);
        memory[TILE as usize..TILE as usize + x.len()].copy_from_slice(&x);
        let side = send_side(layout, plan, rank, buffer(TILE, x.len()), buffer(staging, x.len())).unwrap();
        apply(memory, &side.pack, staging..staging + x.len() as u64);
        let group = side.sends.iter().map(|s| {
            let data = memory[s.addr as usize..s.addr as usize + s.bytes].to_vec();
            post(&mut queues, &mut taken, rank, s.peer, data)
        });
        send_groups.push(group.collect());
    }
    // Per receiving rank: its program, the round it is in, and that round's
    // state: its sends posted (their ids), its receives taken.
    struct State {
        side: ReceiveSide,
        round: usize,
        sent: Option<Vec<usize>>,
        received: bool,
    }
    let mut states: Vec<Option<State>> = (0..n)
        .map(|rank| {
            let tile = layout.dst[rank].as_ref()?;
            let bytes = layout.bytes(tile);
            let side = receive_side(layout, plan, rank, buffer(TILE, bytes), buffer(staging, bytes)).unwrap();
            Some(State { side, round: 0, sent: None, received: false })
        })
        .collect();
    let mut taken_now: Vec<usize> = vec![];
    loop {
        let mut progress = false;
        for (rank, state) in states.iter_mut().enumerate() {
            let Some(state) = state else { continue };
            let Some(round) = state.side.rounds.get(state.round) else { continue };
            if state.sent.is_none() {
                let ids = round.sends.iter().map(|s| {
                    let data = memory[rank][s.addr as usize..s.addr as usize + s.bytes].to_vec();
                    post(&mut queues, &mut taken, rank, s.peer, data)
                });
                state.sent = Some(ids.collect());
                progress = true;
            }
            if !state.received {
                let mut heads: HashMap<usize, usize> = HashMap::new();
                let ready = round.recvs.iter().all(|r| {
                    let k = heads.entry(r.peer).or_default();
                    *k += 1;
                    queues.get(&(r.peer, rank)).is_some_and(|q| q.len() >= *k)
                });
                if ready {
                    for r in &round.recvs {
                        let (id, data) = queues.get_mut(&(r.peer, rank)).unwrap().pop_front().unwrap();
                        assert_eq!(
                            data.len(),
                            r.bytes,
                            "rank {rank} receives a message of another size from {}",
                            r.peer
                        );
                        memory[rank][r.addr as usize..r.addr as usize + r.bytes].copy_from_slice(&data);
                        taken_now.push(id);
                    }
                    (state.received, progress) = (true, true);
                }
            }
            for id in taken_now.drain(..) {
                taken[id] = true;
            }
            // The group completes once its sends were received too.
            if state.received && state.sent.as_ref().is_some_and(|ids| ids.iter().all(|&i| taken[i])) {
                (state.round, state.sent, state.received, progress) = (state.round + 1, None, false, true);
            }
        }
        if !progress {
            break;
        }
    }
    for (g, group) in send_groups.iter().enumerate() {
        assert!(group.iter().all(|&i| taken[i]), "send group {g} never completed");
    }
    assert!(queues.values().all(VecDeque::is_empty), "messages nobody received");
    states
        .into_iter()
        .enumerate()
        .map(|(rank, state)| {
            let State { side, round: next, .. } = state?;
            assert_eq!(next, side.rounds.len(), "rank {rank} is stuck in round {next}: a deadlock");
            let bytes = layout.bytes(layout.dst[rank].as_ref()?);
            apply(&mut memory[rank], &side.unpack, TILE..TILE + bytes as u64);
            Some(memory[rank][TILE as usize..TILE as usize + bytes].to_vec())
        })
        .collect()
}

#[test]
fn every_random_layout_arrives_exactly_under_nccl_pairing() {
    let mut rng = StdRng::seed_from_u64(0x6e5);
    for case in 0..300 {
        let layout = disjoint(&random_layout(&mut rng));
        let chunk_bytes = [1, 8, 24, 1000][rng.random_range(0..4)];
        for method in [Method::Direct, Method::Broadcast { chunk_bytes }] {
            let plan = plan(&layout, method);
            for (rank, got) in run(&layout, &plan).into_iter().enumerate() {
                if let (Some(got), Some(tile)) = (got, &layout.dst[rank]) {
                    assert!(got == filled(&layout, tile), "case {case} {method:?}: rank {rank} of {layout:?}");
                }
            }
        }
    }
}

#[test]
fn a_layout_change_packs_each_piece_with_one_copy() {
    // Rows over 2 devices to columns over 4: each piece is 32 rows of 8
    // floats, one 2-D copy out of the source tile, one flat copy into the
    // destination tile (whose rows are the piece's) each.
    let rows = |r: usize| Some(Region { start: vec![32 * r, 0], end: vec![32 * (r + 1), 32] });
    let cols = |c: usize| Some(Region { start: vec![0, 8 * c], end: vec![64, 8 * (c + 1)] });
    let src = vec![rows(0), rows(1), None, None, None, None];
    let dst = vec![None, None, cols(0), cols(1), cols(2), cols(3)];
    let layout = Layout::new(vec![64, 32], 4, src, dst).unwrap();
    let plan = plan(&layout, Method::Direct);
    let b = |bytes| Buffer { addr: 4096, bytes };
    let side = send_side(&layout, &plan, 0, b(32 * 32 * 4), Buffer { addr: 1 << 20, bytes: 32 * 32 * 4 }).unwrap();
    assert_eq!(side.sends.len(), 4);
    assert_eq!(side.pack.len(), 4);
    for c in &side.pack {
        assert_eq!((c.width, c.height, c.src_pitch, c.dst_pitch), (32, 32, 128, 32), "{c:?}");
    }
    let side = receive_side(&layout, &plan, 2, b(64 * 8 * 4), Buffer { addr: 1 << 20, bytes: 64 * 8 * 4 }).unwrap();
    assert_eq!(side.rounds.len(), 1);
    assert_eq!(side.rounds[0].recvs.iter().map(|r| r.peer).collect::<Vec<_>>(), vec![0, 1]);
    assert_eq!(side.unpack.len(), 2, "{:?}", side.unpack);
    for c in &side.unpack {
        assert_eq!((c.width, c.height), (32 * 8 * 4, 1), "{c:?}");
    }
}

#[test]
fn meshes_sharing_a_device_and_short_buffers_are_refused_by_name() {
    let half = |h: usize| Some(Region { start: vec![8 * h], end: vec![8 * (h + 1)] });
    let whole = Some(Region { start: vec![0], end: vec![16] });
    let layout =
        Layout::new(vec![16], 4, vec![half(0), half(1), None], vec![None, whole.clone(), whole.clone()]).unwrap();
    let e = check_disjoint(&layout, &[5, 6, 7]).unwrap_err();
    assert!(matches!(e, Error::Unimplemented(_)) && e.message().contains("[6]"), "{e}");

    let layout = disjoint(&Layout::new(vec![16], 4, vec![half(0), half(1)], vec![whole.clone(), whole]).unwrap());
    let plan = plan(&layout, Method::Direct);
    let b = |bytes| Buffer { addr: 0, bytes };
    let e = send_side(&layout, &plan, 0, b(31), b(32)).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)) && e.message().contains("`x` has 31 bytes, needs 32"), "{e}");
    let e = receive_side(&layout, &plan, 2, b(64), b(63)).unwrap_err();
    assert!(e.message().contains("`staging` has 63 bytes, needs 64"), "{e}");
    let e = receive_side(&layout, &plan, 0, b(64), b(64)).unwrap_err();
    assert!(e.message().contains("needs no tile of the result"), "{e}");
}
