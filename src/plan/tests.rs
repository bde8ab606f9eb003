//! Exhaustive property checks of every plan for N in 1..=16 and every rank.

use super::*;
use std::collections::{BTreeMap, BTreeSet, HashMap};

const SCHEDULES: [Schedule; 4] = [Schedule::Auto, Schedule::Ring, Schedule::Bidirectional, Schedule::Sequential];
const PATTERNS: [Pattern; 7] = Pattern::ALL;

fn all_plans() -> impl Iterator<Item = (Pattern, Schedule, usize, Vec<Plan>)> {
    PATTERNS.into_iter().flat_map(|op| {
        SCHEDULES.into_iter().flat_map(move |schedule| {
            (1..=16).map(move |n| (op, schedule, n, (0..n).map(|r| plan(op, schedule, n, r)).collect()))
        })
    })
}

/// `hb[a][b]`: step a finishes before step b starts in every execution
/// (dependencies and same-lane order, transitively).
fn happens_before(plan: &Plan) -> Vec<Vec<bool>> {
    let len = plan.steps.len();
    let mut hb = vec![vec![false; len]; len];
    let mut last_on_lane: HashMap<Lane, StepId> = HashMap::new();
    for step in &plan.steps {
        let mut direct: Vec<StepId> = step.deps.clone();
        if let Some(&p) = last_on_lane.get(&step.lane) {
            direct.push(p);
        }
        for d in direct {
            assert!(d < step.id, "step {} depends on later step {d}", step.id);
            hb[d][step.id] = true;
            for row in hb.iter_mut().take(d) {
                if row[d] {
                    row[step.id] = true;
                }
            }
        }
        last_on_lane.insert(step.lane, step.id);
    }
    hb
}

fn is_workspace_or_output(buf: Buf) -> bool {
    matches!(buf, Buf::Slot(_) | Buf::Out | Buf::OutBlock(_))
}

/// No step reads a buffer before the step that fills it, and no buffer is
/// overwritten while a step that reads its old value may still run.
fn check_hazards(plan: &Plan, label: &str) {
    let hb = happens_before(plan);
    // Per buffer, the accesses in plan order: (step, is_write).
    let mut accesses: HashMap<Buf, Vec<(StepId, bool)>> = HashMap::new();
    for step in &plan.steps {
        for b in step.action.reads().into_iter().filter(|b| is_workspace_or_output(*b)) {
            accesses.entry(b).or_default().push((step.id, false));
        }
        for b in step.action.writes() {
            accesses.entry(b).or_default().push((step.id, true));
        }
        // A sent partial is handed over: to the hazards, the send also ends its value.
        if let Action::Exchange { sends, .. } = &step.action {
            for t in sends.iter().filter(|t| plan.hands_over(t.buf)) {
                accesses.entry(t.buf).or_default().push((step.id, true));
            }
        }
    }
    for (buf, list) in &accesses {
        for (i, &(t, is_write)) in list.iter().enumerate() {
            let earlier = &list[..i];
            let last_write = earlier.iter().rposition(|&(s, w)| w && s != t);
            if !is_write {
                let w =
                    last_write.unwrap_or_else(|| panic!("{label}: step {t} reads {buf:?} before anything fills it"));
                let w = earlier[w].0;
                assert!(hb[w][t], "{label}: step {t} reads {buf:?} but may run before step {w} fills it");
            } else {
                let from = last_write.unwrap_or(0);
                for &(s, _) in &earlier[from..] {
                    if s != t {
                        assert!(hb[s][t], "{label}: step {t} overwrites {buf:?} while step {s} may still use it");
                    }
                }
            }
        }
    }
}

/// What a buffer holds in the symbolic run: the set of (origin rank, block)
/// pieces of data (or products of them) summed into it.
type Value = BTreeSet<(usize, usize)>;

struct RankState {
    cursor: usize,
    sent: bool,
    slots: HashMap<usize, Value>,
    out_writes: HashMap<Buf, (usize, Value)>,
}

/// The piece a product for `block` must multiply on `rank`: a gathered block
/// is rank `block`'s own data; otherwise it is the part for `block` (scatter,
/// matmul-then-exchange) or the part for `rank` sent by `block`.
fn expected_piece(pattern: Pattern, rank: usize, block: usize) -> (usize, usize) {
    sliced_piece(pattern, rank, block, 1)
}

/// `expected_piece` with fine blocks (`Schedule::Sliced`): block `b` is chunk
/// `b % k` of block `b / k`, and a piece is (origin rank, fine block).
fn sliced_piece(pattern: Pattern, rank: usize, block: usize, k: usize) -> (usize, usize) {
    match pattern {
        Pattern::Gather { .. } => (block / k, block),
        Pattern::Scatter | Pattern::AllReduce | Pattern::MatmulThenExchange => (rank, block),
        Pattern::ExchangeThenMatmul { .. } => (block, rank),
        Pattern::GatherScatter { .. } | Pattern::GatherGather { .. } | Pattern::GatherContractScatter { .. } => {
            unreachable!("two-axis plans have their own checks (simulate_two_axis, simulate_two_gathers, ...)")
        }
    }
}

/// Runs every rank's plan in plan order, message by message, and checks the
/// results and the pairing of sends and receives.
fn simulate(plans: &[Plan], label: &str) {
    let n = plans.len();
    let pattern = plans[0].pattern;
    let sliced = plans[0].schedule.cuts_blocks();
    let k = plans[0].schedule.chunks();
    let mut ranks: Vec<RankState> = (0..n)
        .map(|_| RankState { cursor: 0, sent: false, slots: HashMap::new(), out_writes: HashMap::new() })
        .collect();
    let mut mailbox: HashMap<(usize, usize, Tag), (Value, SlotKindOf)> = HashMap::new();
    loop {
        let mut progressed = false;
        for r in 0..n {
            while let Some(step) = plans[r].steps.get(ranks[r].cursor) {
                let plan = &plans[r];
                let st = &mut ranks[r];
                let read = |st: &RankState, b: Buf| -> Value {
                    match b {
                        // The whole local x of a gather is this rank's block.
                        Buf::X => [(r, r)].into(),
                        // A sliced gather's XBlock(c) is chunk c of the own block.
                        Buf::XBlock(c) if sliced && !pattern.reduces() => [(r, r * k + c)].into(),
                        // A sliced scatter's XBlock(j) holds every chunk of block j.
                        Buf::XBlock(j) if sliced => (j * k..(j + 1) * k).map(|b| (r, b)).collect(),
                        Buf::XBlock(j) => [(r, j)].into(),
                        Buf::Slot(i) => st
                            .slots
                            .get(&i)
                            .cloned()
                            .unwrap_or_else(|| panic!("{label}: rank {r} reads empty slot {i}")),
                        other => panic!("{label}: rank {r} reads output {other:?}"),
                    }
                };
                match &step.action {
                    Action::Matmul { block, src, with, dst, accumulate } => {
                        assert_eq!(*with, Buf::W, "{label}: a one-axis product multiplies by the local w");
                        let v = read(st, *src);
                        let want: Value = [sliced_piece(pattern, r, *block, k)].into();
                        // A sliced scatter multiplies one chunk of the x block it reads.
                        let v = if sliced && pattern.reduces() && want.is_subset(&v) { want.clone() } else { v };
                        assert_eq!(v, want, "{label}: rank {r} multiplies {v:?} as block {block}");
                        let v = if *accumulate {
                            let mut acc = match dst {
                                Buf::Slot(i) => st
                                    .slots
                                    .get(i)
                                    .cloned()
                                    .unwrap_or_else(|| panic!("{label}: accumulate into empty slot")),
                                other => panic!("{label}: accumulate into {other:?}"),
                            };
                            for item in v {
                                assert!(acc.insert(item), "{label}: rank {r} counts {item:?} twice");
                            }
                            acc
                        } else {
                            v
                        };
                        write(st, plan, *dst, v, label);
                    }
                    Action::Sum { terms, dst } => {
                        let mut acc = BTreeSet::new();
                        for t in terms {
                            for item in read(st, *t) {
                                assert!(acc.insert(item), "{label}: rank {r} counts {item:?} twice");
                            }
                        }
                        if pattern.reduces() {
                            let blocks: BTreeSet<usize> = acc.iter().map(|(_, b)| *b).collect();
                            assert_eq!(
                                blocks.len(),
                                1,
                                "{label}: rank {r} sums partials of different blocks {blocks:?}"
                            );
                        }
                        write(st, plan, *dst, acc, label);
                    }
                    Action::Exchange { sends, recvs } => {
                        if !st.sent {
                            for t in sends {
                                let v = read(st, t.buf);
                                let key = (r, t.peer, t.tag);
                                let previous = mailbox.insert(key, (v, kind_of(plan, t.buf)));
                                assert!(previous.is_none(), "{label}: rank {r} sends {:?} to {} twice", t.tag, t.peer);
                                // Handed over: a later read before a rewrite finds the slot empty.
                                if let (true, Buf::Slot(i)) = (plan.hands_over(t.buf), t.buf) {
                                    st.slots.remove(&i);
                                }
                            }
                            st.sent = true;
                        }
                        if !recvs.iter().all(|t| mailbox.contains_key(&(t.peer, r, t.tag))) {
                            break; // wait for the peers
                        }
                        for t in recvs {
                            let (v, kind) = mailbox.remove(&(t.peer, r, t.tag)).unwrap();
                            assert_eq!(
                                kind,
                                kind_of(plan, t.buf),
                                "{label}: rank {r} receives {:?} into a buffer of another size",
                                t.tag
                            );
                            write(st, plan, t.buf, v, label);
                        }
                        st.sent = false;
                    }
                }
                ranks[r].cursor += 1;
                progressed = true;
            }
        }
        if ranks.iter().zip(plans).all(|(st, p)| st.cursor == p.steps.len()) {
            break;
        }
        assert!(progressed, "{label}: deadlock at cursors {:?}", ranks.iter().map(|s| s.cursor).collect::<Vec<_>>());
    }
    assert!(mailbox.is_empty(), "{label}: sends never received: {:?}", mailbox.keys().collect::<Vec<_>>());

    for (r, st) in ranks.iter().enumerate() {
        if sliced {
            // Every fine output block is written once, with the right pieces:
            // a gather writes all N*k, a scatter the k chunks of its own block.
            // An all-reduce writes all N*k, each the sum over every rank.
            let blocks: Vec<usize> = match pattern {
                Pattern::Scatter => (r * k..(r + 1) * k).collect(),
                _ => (0..n * k).collect(),
            };
            for &b in &blocks {
                let (count, v) = st
                    .out_writes
                    .get(&Buf::OutBlock(b))
                    .unwrap_or_else(|| panic!("{label}: rank {r} never writes fine block {b}"));
                assert_eq!(*count, 1, "{label}: rank {r} writes fine block {b} {count} times");
                let want: Value = match pattern {
                    Pattern::Scatter | Pattern::AllReduce => (0..n).map(|q| (q, b)).collect(),
                    _ => [sliced_piece(pattern, r, b, k)].into(),
                };
                assert_eq!(*v, want, "{label}: rank {r} fine block {b}");
            }
            assert_eq!(st.out_writes.len(), blocks.len(), "{label}: rank {r} writes outside its blocks");
            continue;
        }
        let whole = matches!(
            pattern,
            Pattern::Scatter | Pattern::Gather { accumulate: true } | Pattern::ExchangeThenMatmul { accumulate: true }
        ) || (pattern == Pattern::AllReduce && n == 1);
        if whole {
            let (count, v) =
                st.out_writes.get(&Buf::Out).unwrap_or_else(|| panic!("{label}: rank {r} never writes its output"));
            assert_eq!(*count, 1, "{label}: rank {r} writes its output {count} times");
            let want: Value = (0..n).map(|q| expected_piece(pattern, r, q)).collect();
            let want: Value = match pattern {
                // Rank r's scatter output sums everyone's part for r.
                Pattern::Scatter | Pattern::AllReduce => (0..n).map(|q| (q, r)).collect(),
                _ => want,
            };
            assert_eq!(*v, want, "{label}: rank {r} output");
            assert_eq!(st.out_writes.len(), 1, "{label}: rank {r} writes outside its output");
        } else {
            for j in 0..n {
                let (count, v) = st
                    .out_writes
                    .get(&Buf::OutBlock(j))
                    .unwrap_or_else(|| panic!("{label}: rank {r} never writes block {j}"));
                assert_eq!(*count, 1, "{label}: rank {r} writes block {j} {count} times");
                let want: Value = match pattern {
                    // The block for r that rank j computed.
                    Pattern::MatmulThenExchange => [(j, r)].into(),
                    // Block j summed over every rank.
                    Pattern::AllReduce => (0..n).map(|q| (q, j)).collect(),
                    _ => [expected_piece(pattern, r, j)].into(),
                };
                assert_eq!(*v, want, "{label}: rank {r} block {j}");
            }
            assert_eq!(st.out_writes.len(), n, "{label}: rank {r} writes outside its blocks");
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotKindOf {
    Input,
    Products,
}

fn kind_of(plan: &Plan, buf: Buf) -> SlotKindOf {
    match buf {
        Buf::X | Buf::XBlock(_) | Buf::W => SlotKindOf::Input,
        Buf::Slot(i) => match plan.slots[i] {
            SlotKind::Input | SlotKind::Weight => SlotKindOf::Input,
            SlotKind::Partial | SlotKind::Result => SlotKindOf::Products,
        },
        Buf::Out | Buf::OutBlock(_) => SlotKindOf::Products,
    }
}

fn write(st: &mut RankState, plan: &Plan, dst: Buf, v: Value, label: &str) {
    match dst {
        Buf::Slot(i) => {
            st.slots.insert(i, v);
            let _ = plan;
        }
        Buf::Out | Buf::OutBlock(_) => {
            let entry = st.out_writes.entry(dst).or_insert((0, v.clone()));
            entry.0 += 1;
            entry.1 = v;
        }
        other => panic!("{label}: writes input {other:?}"),
    }
}

#[test]
fn every_plan_is_correct_and_race_free() {
    let mut checked = 0;
    for (op, schedule, n, plans) in all_plans() {
        for p in &plans {
            let label = format!("{op:?} {schedule:?} N={n} rank={}", p.rank);
            check_hazards(p, &label);
            for step in &p.steps {
                for t in step.action.reads().iter().chain(step.action.writes().iter()) {
                    if let Buf::Slot(i) = t {
                        assert!(*i < p.slots.len(), "{label}: slot {i} not declared");
                    }
                }
            }
        }
        simulate(&plans, &format!("{op:?} {schedule:?} N={n}"));
        checked += plans.len();
    }
    assert_eq!(checked, PATTERNS.len() * SCHEDULES.len() * (1..=16).sum::<usize>());
}

const GATHER: Pattern = Pattern::Gather { accumulate: false };

#[test]
fn head_and_tail_are_not_exposed() {
    for n in 2..=16 {
        for schedule in [Schedule::Ring, Schedule::Bidirectional] {
            for pattern in PATTERNS {
                let p = plan(pattern, schedule, n, 0);
                let compute: Vec<_> = p.lane_steps(Lane::Compute).collect();
                match pattern {
                    // The first product multiplies local data: it waits for nothing.
                    Pattern::Gather { .. } | Pattern::ExchangeThenMatmul { .. } => {
                        assert!(compute[0].deps.is_empty(), "{pattern:?}");
                        assert!(matches!(compute[0].action, Action::Matmul { block: 0, .. }), "{pattern:?}");
                    }
                    // The own block is multiplied while the last transfer runs;
                    // only the final sum or copy waits for it (an unchunked
                    // all-reduce's gather ring then runs on the comm lane).
                    Pattern::Scatter | Pattern::AllReduce | Pattern::MatmulThenExchange => {
                        let [.., own, last] = compute[..] else { panic!() };
                        assert!(matches!(own.action, Action::Matmul { block: 0, src: Buf::XBlock(0), .. }));
                        assert!(own.deps.is_empty(), "{pattern:?}");
                        assert!(matches!(last.action, Action::Sum { .. }));
                    }
                    Pattern::GatherScatter { .. }
                    | Pattern::GatherGather { .. }
                    | Pattern::GatherContractScatter { .. } => unreachable!("not in PATTERNS"),
                }
            }
        }
    }
}

#[test]
fn bidirectional_halves_the_transfer_steps() {
    for n in 2..=16 {
        for pattern in [GATHER, Pattern::Gather { accumulate: true }, Pattern::Scatter] {
            // A round is one tag step: the chains' transfers of one step run at once.
            let rounds = |s| {
                let p = plan(pattern, s, n, 0);
                let mut steps: Vec<usize> = p
                    .lane_steps(Lane::Comm)
                    .flat_map(|step| match &step.action {
                        Action::Exchange { sends, .. } => sends.iter().map(|t| t.tag.step).collect(),
                        _ => vec![],
                    })
                    .collect();
                steps.sort();
                steps.dedup();
                steps.len()
            };
            assert_eq!(rounds(Schedule::Ring), n - 1);
            assert_eq!(rounds(Schedule::Bidirectional), n / 2);
        }
    }
}

#[test]
fn bidirectional_scatter_adds_inside_the_gemm() {
    // Every received sum is accumulated onto by a GEMM; the only Sum is the
    // final one into the output (own partial + each chain's last sum).
    for n in 3..=16 {
        for rank in 0..n {
            let p = plan(Pattern::Scatter, Schedule::Bidirectional, n, rank);
            let sums: Vec<_> = p.steps.iter().filter(|s| matches!(s.action, Action::Sum { .. })).collect();
            assert_eq!(sums.len(), 1, "n={n}");
            assert!(matches!(&sums[0].action, Action::Sum { terms, dst: Buf::Out } if terms.len() == 3));
            let accumulating =
                p.steps.iter().filter(|s| matches!(s.action, Action::Matmul { accumulate: true, .. })).count();
            assert_eq!(accumulating, n - 1 - 2, "n={n}: every chain step after its first");
        }
    }
}

#[test]
fn ring_scatter_gemms_run_ahead_of_the_chain() {
    // The compute lane only multiplies: no GEMM waits for a transfer except
    // to reuse the slot handed over three steps before, so a late peer lets
    // a rank compute two more partials before anything on it stalls.
    for n in 2..=16 {
        for rank in 0..n {
            let p = plan(Pattern::Scatter, Schedule::Ring, n, rank);
            let compute: Vec<_> = p.lane_steps(Lane::Compute).collect();
            let exchanges: Vec<StepId> = p
                .lane_steps(Lane::Comm)
                .filter(|s| matches!(s.action, Action::Exchange { .. }))
                .map(|s| s.id)
                .collect();
            let [products @ .., own, last] = &compute[..] else { panic!() };
            assert_eq!(products.len(), n - 1);
            for (s, step) in products.iter().enumerate() {
                assert!(matches!(step.action, Action::Matmul { accumulate: false, .. }));
                let want: Vec<StepId> = if s >= 3 { vec![exchanges[s - 3]] } else { vec![] };
                assert_eq!(step.deps, want, "n={n} rank={rank} product {s}");
            }
            assert!(own.deps.is_empty() && matches!(own.action, Action::Matmul { .. }));
            assert!(matches!(last.action, Action::Sum { dst: Buf::Out, .. }));
            assert_eq!(p.slots.iter().filter(|k| **k == SlotKind::Partial).count(), 3.min(n - 1) + 2 + 1);
        }
    }
}

#[test]
fn sequential_does_not_overlap() {
    for n in 2..=8 {
        for pattern in PATTERNS {
            let p = plan(pattern, Schedule::Sequential, n, 1);
            let first_ex = p.lane_steps(Lane::Comm).next().unwrap().id;
            let last_ex = p.lane_steps(Lane::Comm).last().unwrap().id;
            let hb = happens_before(&p);
            for step in p.steps.iter().filter(|s| matches!(s.action, Action::Matmul { .. })) {
                // Every product runs after every transfer, or before any.
                assert!(hb[last_ex][step.id] || hb[step.id][first_ex], "{pattern:?} N={n} step {}", step.id);
            }
        }
    }
}

#[test]
fn workspace_regions_do_not_overlap() {
    use crate::dtype::DType;
    for (input, output) in
        [(DType::F32, DType::F32), (DType::BF16, DType::BF16), (DType::F16, DType::F32), (DType::F32, DType::F64)]
    {
        let sizes = Sizes { x: 39, w: 91, travel: 39, partial: 21, result: 105, out_view: 21, input, output };
        for pattern in PATTERNS {
            for schedule in SCHEDULES {
                let p = plan(pattern, schedule, 5, 2);
                let mut ws = Workspace::layout(&p, &sizes).unwrap();
                // A backend's own scratch goes after the slots.
                let scratch = ws.append(7, 4, 256).unwrap();
                let mut regions: Vec<_> = ws.slots.clone();
                regions.push(scratch.clone());
                regions.sort_by_key(|r| r.start);
                for pair in regions.windows(2) {
                    assert!(pair[0].end <= pair[1].start);
                }
                assert!(ws.slots.iter().all(|r| r.end <= ws.total && r.start % 64 == 0));
                assert_eq!((scratch.start % 256, scratch.len(), scratch.end), (0, 28, ws.total));
            }
        }
    }
}

const SLICEABLE: [Pattern; 3] = [GATHER, Pattern::Scatter, Pattern::AllReduce];

fn cut_plans(n: usize, schedule: Schedule, pattern: Pattern) -> Vec<Plan> {
    (0..n).map(|r| plan(pattern, schedule, n, r)).collect()
}

#[test]
fn every_sliced_and_tiled_plan_is_correct_and_race_free() {
    for pattern in SLICEABLE {
        for n in 1..=16 {
            for (k, schedule) in [1, 2, 3, 4, 5, 8, 16]
                .into_iter()
                .flat_map(|k| [(k, Schedule::Sliced { slices: k }), (k, Schedule::Tiled { tiles: k })])
            {
                let plans = cut_plans(n, schedule, pattern);
                let label = format!("{pattern:?} {schedule:?} N={n}");
                for p in &plans {
                    check_hazards(p, &format!("{label} rank={}", p.rank));
                    for step in &p.steps {
                        for t in step.action.reads().iter().chain(step.action.writes().iter()) {
                            if let Buf::Slot(i) = t {
                                assert!(*i < p.slots.len(), "{label}: slot {i} not declared");
                            }
                        }
                    }
                    // One whole ring collective per chunk, or per tile (an
                    // all-reduce: a reduce-scatter ring and an all-gather ring).
                    let rings = if pattern == Pattern::AllReduce { 2 } else { 1 };
                    assert_eq!(
                        p.lane_steps(Lane::Comm).filter(|s| matches!(s.action, Action::Exchange { .. })).count(),
                        rings * k * (n - 1)
                    );
                }
                simulate(&plans, &label);
            }
        }
    }
}

/// Per chunk of a sliced plan: (its exchanges, its products), by step id.
fn chunks(p: &Plan, k: usize) -> Vec<(Vec<StepId>, Vec<StepId>)> {
    let mut out = vec![(vec![], vec![]); k];
    for step in &p.steps {
        match &step.action {
            Action::Exchange { sends, .. } => out[sends[0].tag.step / (p.n - 1)].0.push(step.id),
            Action::Matmul { block, .. } => out[block % k].1.push(step.id),
            Action::Sum { .. } => {}
        }
    }
    out
}

#[test]
fn slicing_overlaps_neighbouring_chunks_and_exposes_the_head_or_the_tail() {
    for n in 2..=8 {
        for k in 2..=6 {
            for rank in 0..n {
                // Gather: chunk c+1's collective may run during chunk c's
                // products, but chunk 0's products wait for its whole gather.
                let p = plan(GATHER, Schedule::Sliced { slices: k }, n, rank);
                let hb = happens_before(&p);
                let per = chunks(&p, k);
                for c in 0..k {
                    let (exchanges, products) = &per[c];
                    for &x in exchanges {
                        for &m in products {
                            assert!(hb[x][m], "gather N={n} k={k}: product {m} before its collective");
                        }
                    }
                    if c + 1 < k {
                        let next = per[c + 1].0[0];
                        assert!(products.iter().all(|&m| !hb[m][next]), "gather N={n} k={k}: chunk {c} not overlapped");
                    }
                }
                let first_compute = p.lane_steps(Lane::Compute).next().unwrap();
                assert_eq!(first_compute.deps, vec![*per[0].0.last().unwrap()], "the head is exposed");

                // Scatter: chunk c's collective may run during chunk c+1's
                // products, and only starts when chunk c is multiplied.
                let p = plan(Pattern::Scatter, Schedule::Sliced { slices: k }, n, rank);
                let hb = happens_before(&p);
                let per = chunks(&p, k);
                for c in 0..k {
                    let (exchanges, products) = &per[c];
                    for &x in exchanges {
                        assert!(products.iter().all(|&m| hb[m][x]), "scatter N={n} k={k}: sends before its products");
                    }
                    if c + 1 < k {
                        assert!(per[c + 1].1.iter().all(|&m| !hb[exchanges[0]][m]), "scatter chunk {c} not overlapped");
                    }
                }
                // The tail: after the last product, the whole last collective remains.
                let last_product = *per[k - 1].1.last().unwrap();
                assert!(per[k - 1].0.iter().all(|&x| hb[last_product][x]));
                let last = p.steps.last().unwrap();
                assert!(matches!(last.action, Action::Sum { dst: Buf::OutBlock(_), .. }) && last.lane == Lane::Comm);
            }
        }
    }
}

/// Tile-level triggering: a scatter's first transfer waits for one tile's
/// product only, and after the last transfer a gather multiplies one tile
/// (a scatter adds one tile); per-step granularity waits for, and leaves,
/// a whole block.
#[test]
fn tiles_start_transfers_after_one_tile_and_leave_one_tile_at_the_end() {
    for n in 2..=8 {
        for k in [2, 4, 8] {
            for rank in 0..n {
                let p = plan(Pattern::Scatter, Schedule::Tiled { tiles: k }, n, rank);
                let first = p.lane_steps(Lane::Comm).next().unwrap();
                let compute: Vec<&Step> = p.lane_steps(Lane::Compute).collect();
                assert_eq!(first.deps, vec![compute[0].id], "N={n} k={k}: the first tile alone");
                assert!(matches!(compute[0].action, Action::Matmul { .. }));
                let last_exchange = p.lane_steps(Lane::Comm).last().unwrap().id;
                let after: Vec<&&Step> = compute.iter().filter(|s| s.deps.contains(&last_exchange)).collect();
                assert_eq!(after.len(), 1, "N={n} k={k}");
                assert!(matches!(after[0].action, Action::Sum { .. }));
                assert_eq!(after[0].id, compute.last().unwrap().id, "only the last tile's add is left");
                // The received sums are added to by the GEMMs: the only adds are the k final ones.
                let adds = compute.iter().filter(|s| matches!(s.action, Action::Sum { .. })).count();
                assert_eq!(adds, k, "N={n} k={k}");
                let p = plan(GATHER, Schedule::Tiled { tiles: k }, n, rank);
                let last_exchange = p.lane_steps(Lane::Comm).last().unwrap().id;
                let compute: Vec<&Step> = p.lane_steps(Lane::Compute).collect();
                let waiting = compute.iter().position(|s| s.deps.contains(&last_exchange)).unwrap();
                assert_eq!(waiting, compute.len() - 1, "N={n} k={k}: one tile's product after the last transfer");
                assert_eq!(p.lane_steps(Lane::Comm).next().unwrap().deps, Vec::<StepId>::new());
            }
        }
    }
}

#[test]
fn plans_are_sized_before_they_are_made() {
    use super::{check_size, MAX_CHUNKS, MAX_CUT_BLOCKS, MAX_RANKS};
    assert!(check_size("op", Schedule::Ring, MAX_RANKS).is_ok());
    let e = check_size("op", Schedule::Ring, MAX_RANKS + 1).unwrap_err();
    assert!(e.message().contains("axis size must be in [1, 65536]"), "{e}");
    assert!(check_size("op", Schedule::Tiled { tiles: MAX_CHUNKS }, 4).is_ok());
    let e = check_size("op", Schedule::Tiled { tiles: MAX_CHUNKS + 1 }, 4).unwrap_err();
    assert!(e.message().contains("tiles must be in [1, 1024], got 1025"), "{e}");
    let e = check_size("op", Schedule::Sliced { slices: 1024 }, MAX_CUT_BLOCKS / 512).unwrap_err();
    assert!(e.message().contains("slices=1024 over an axis of 512 makes 524288 blocks"), "{e}");
}

#[test]
fn a_workspace_too_large_to_address_is_an_error() {
    let p = plan(Pattern::Gather { accumulate: false }, Schedule::Sequential, 4, 0);
    let sizes = Sizes {
        x: 1,
        w: 1,
        travel: usize::MAX / 4,
        partial: 0,
        result: 1,
        out_view: 1,
        input: crate::dtype::DType::F32,
        output: crate::dtype::DType::F32,
    };
    let e = Workspace::layout(&p, &sizes).unwrap_err();
    assert!(e.message().contains("the workspace would exceed"), "{e}");
}

#[test]
fn a_sliced_all_reduce_gathers_each_chunk_while_the_next_is_multiplied() {
    for n in 2..=8 {
        for k in 2..=4 {
            for rank in 0..n {
                let p = plan(Pattern::AllReduce, Schedule::Sliced { slices: k }, n, rank);
                let hb = happens_before(&p);
                // Gather exchanges carry the tags past every reduce-scatter's
                // (k * N on), N-1 per chunk in chunk order.
                let gather_chunk = |s: &Step| match &s.action {
                    Action::Exchange { sends, .. } if sends[0].tag.step >= k * n => {
                        Some((sends[0].tag.step - k * n) / (n - 1))
                    }
                    _ => None,
                };
                let scatter_chunk = |s: &Step| match &s.action {
                    Action::Exchange { sends, .. } if sends[0].tag.step < k * n => Some(sends[0].tag.step / (n - 1)),
                    _ => None,
                };
                for c in 0..k - 1 {
                    let gathers: Vec<&Step> = p.steps.iter().filter(|s| gather_chunk(s) == Some(c)).collect();
                    assert_eq!(gathers.len(), n - 1, "N={n} k={k} rank {rank} chunk {c}");
                    // Chunk c+1's products wait for none of chunk c's gather ring.
                    for product in p
                        .steps
                        .iter()
                        .filter(|s| matches!(s.action, Action::Matmul { block, .. } if block % k == c + 1))
                    {
                        for g in &gathers {
                            assert!(
                                !hb[g.id][product.id],
                                "N={n} k={k} rank {rank}: a product of chunk {} waits for chunk {c}'s gather",
                                c + 1
                            );
                        }
                    }
                    // On the comm lane, chunk c's gather ring runs before chunk c+1's reduce-scatter.
                    let next_scatter =
                        p.steps.iter().find(|s| scatter_chunk(s) == Some(c + 1)).expect("a reduce-scatter");
                    assert!(gathers.iter().all(|g| g.id < next_scatter.id), "N={n} k={k} rank {rank} chunk {c}");
                }
            }
        }
    }
}

/// Partial products: (rank that multiplied, fine block d * F + j).
type Pieces = BTreeSet<(usize, usize)>;

/// What a buffer holds in the symbolic run of a two-axis plan.
#[derive(Debug, Clone, PartialEq, Eq)]
enum TwoAxis {
    /// Block j of w.
    W(usize),
    Partials(Pieces),
}

/// One rank of a symbolic run of the two-axis plans: its plan, its index,
/// whether its current exchange has posted its sends, and its slots.
struct Rank<'a, V> {
    plan: &'a Plan,
    r: usize,
    sent: &'a mut bool,
    slots: &'a mut HashMap<usize, V>,
}

/// One rank's `Exchange` in a symbolic run: its sends posted once (what
/// `read` finds; a handed-over slot emptied), then, when every receive has
/// arrived, each taken into its slot, which must be of a kind the value
/// `fits`. Whether the exchange ended (else the rank waits).
fn symbolic_exchange<V: Clone + std::fmt::Debug>(
    rank: Rank<V>,
    sends: &[Transfer],
    recvs: &[Transfer],
    mailbox: &mut HashMap<(usize, usize, Tag), V>,
    read: impl Fn(&HashMap<usize, V>, Buf) -> V,
    fits: impl Fn(&V, SlotKind) -> bool,
    label: &str,
) -> bool {
    let Rank { plan, r, sent, slots } = rank;
    if !*sent {
        for t in sends {
            let v = read(slots, t.buf);
            assert!(mailbox.insert((r, t.peer, t.tag), v).is_none(), "{label}: {:?} sent twice", t.tag);
            if let (true, Buf::Slot(i)) = (plan.hands_over(t.buf), t.buf) {
                slots.remove(&i);
            }
        }
        *sent = true;
    }
    if !recvs.iter().all(|t| mailbox.contains_key(&(t.peer, r, t.tag))) {
        return false;
    }
    for t in recvs {
        let v = mailbox.remove(&(t.peer, r, t.tag)).expect("there");
        let Buf::Slot(i) = t.buf else { panic!("{label}: receives into {:?}", t.buf) };
        assert!(fits(&v, plan.slots[i]), "{label}: rank {r} receives {v:?} into a {:?} slot", plan.slots[i]);
        slots.insert(i, v);
    }
    *sent = false;
    true
}

/// Runs every rank's plan of `Pattern::GatherScatter { gathered: f_size }`
/// message by message: each product multiplies the block of w its fine
/// block names, each sum adds partials of one fine block once each, and
/// rank f*T + t ends with out[j] (fine block t * F + j) summed over the T
/// ranks that share f, for every j, written once.
fn simulate_two_axis(plans: &[Plan], f_size: usize, label: &str) {
    let n = plans.len();
    let t_size = n / f_size;
    // Sliced: each block of w's columns cut into `slices` chunks.
    let slices = plans[0].schedule.chunks();
    let chunks = f_size * slices;
    let mut cursor = vec![0usize; n];
    let mut sent = vec![false; n];
    let mut slots: Vec<HashMap<usize, TwoAxis>> = vec![HashMap::new(); n];
    // Per rank, each output block's (writes, value).
    let mut outs: Vec<HashMap<usize, (usize, Pieces)>> = vec![HashMap::new(); n];
    let mut mailbox: HashMap<(usize, usize, Tag), TwoAxis> = HashMap::new();
    let read = |slots: &HashMap<usize, TwoAxis>, r: usize, b: Buf| -> TwoAxis {
        match b {
            Buf::X => TwoAxis::W(r / t_size),
            Buf::Slot(i) => slots.get(&i).cloned().unwrap_or_else(|| panic!("{label}: rank {r} reads empty slot {i}")),
            other => panic!("{label}: rank {r} reads {other:?}"),
        }
    };
    loop {
        let mut progressed = false;
        for r in 0..n {
            while let Some(step) = plans[r].steps.get(cursor[r]) {
                match &step.action {
                    Action::Matmul { block, src, with: Buf::W, dst: Buf::Slot(i), accumulate: false } => {
                        let j = block % chunks / slices;
                        assert_eq!(read(&slots[r], r, *src), TwoAxis::W(j), "{label}: rank {r} block {block}");
                        slots[r].insert(*i, TwoAxis::Partials([(r, *block)].into()));
                    }
                    Action::Sum { terms, dst } => {
                        let mut acc = BTreeSet::new();
                        for t in terms {
                            let TwoAxis::Partials(v) = read(&slots[r], r, *t) else { panic!("{label}: sums w") };
                            for item in v {
                                assert!(acc.insert(item), "{label}: rank {r} counts {item:?} twice");
                            }
                        }
                        let blocks: BTreeSet<usize> = acc.iter().map(|p| p.1).collect();
                        assert_eq!(blocks.len(), 1, "{label}: rank {r} sums different blocks {blocks:?}");
                        match dst {
                            Buf::Slot(i) => {
                                slots[r].insert(*i, TwoAxis::Partials(acc));
                            }
                            Buf::OutBlock(b) => {
                                let entry = outs[r].entry(*b).or_insert((0, BTreeSet::new()));
                                *entry = (entry.0 + 1, acc);
                            }
                            other => panic!("{label}: rank {r} sums into {other:?}"),
                        }
                    }
                    Action::Exchange { sends, recvs } => {
                        let fits = |v: &TwoAxis, kind| {
                            matches!(
                                (v, kind),
                                (TwoAxis::W(_), SlotKind::Input) | (TwoAxis::Partials(_), SlotKind::Partial)
                            )
                        };
                        let read = |slots: &HashMap<usize, TwoAxis>, b| read(slots, r, b);
                        let rank = Rank { plan: &plans[r], r, sent: &mut sent[r], slots: &mut slots[r] };
                        if !symbolic_exchange(rank, sends, recvs, &mut mailbox, read, fits, label) {
                            break;
                        }
                    }
                    other => panic!("{label}: unexpected {other:?}"),
                }
                cursor[r] += 1;
                progressed = true;
            }
        }
        if (0..n).all(|r| cursor[r] == plans[r].steps.len()) {
            break;
        }
        assert!(progressed, "{label}: deadlock at cursors {cursor:?}");
    }
    assert!(mailbox.is_empty(), "{label}: sends never received");
    for (r, written) in outs.iter().enumerate() {
        let (f, t) = (r / t_size, r % t_size);
        assert_eq!(written.len(), chunks, "{label}: rank {r} writes {:?}", written.keys());
        for j in 0..chunks {
            let b = t * chunks + j;
            let (count, v) = written.get(&b).unwrap_or_else(|| panic!("{label}: rank {r} never writes out[{j}]"));
            assert_eq!(*count, 1, "{label}: rank {r} writes out[{j}] {count} times");
            let want: Pieces = (0..t_size).map(|u| (f * t_size + u, b)).collect();
            assert_eq!(*v, want, "{label}: rank {r} out[{j}]");
        }
    }
}

#[test]
fn every_two_axis_plan_is_correct_and_race_free() {
    let mut checked = 0;
    for f_size in 1..=6 {
        for t_size in 1..=6 {
            let n = f_size * t_size;
            let pattern = Pattern::GatherScatter { gathered: f_size };
            let sliced = [1, 2, 3].map(|slices| Schedule::Sliced { slices });
            for schedule in SCHEDULES.into_iter().chain(sliced) {
                let plans: Vec<Plan> = (0..n).map(|r| plan(pattern, schedule, n, r)).collect();
                let label = format!("F={f_size} T={t_size} {schedule:?}");
                for p in &plans {
                    check_hazards(p, &format!("{label} rank={}", p.rank));
                }
                simulate_two_axis(&plans, f_size, &label);
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 36 * (SCHEDULES.len() + 3));
}

/// The ids of a plan's products, in plan order.
fn matmuls(p: &Plan) -> Vec<StepId> {
    p.steps.iter().filter(|s| matches!(s.action, Action::Matmul { .. })).map(|s| s.id).collect()
}

/// One rank's two-axis plan, as the timing tests below look at it.
struct TwoAxisCase {
    f_size: usize,
    t_size: usize,
    slices: usize,
    rank: usize,
    plan: Plan,
    /// `happens_before(&plan)`.
    hb: Vec<Vec<bool>>,
    /// `matmuls(&plan)`.
    products: Vec<StepId>,
}

/// `check` on every rank's plan of `Pattern::GatherScatter` for each
/// `(F, T, slices)` of `cases`: "ring" for one slice, else "sliced".
fn each_two_axis_plan(cases: &[(usize, usize, usize)], mut check: impl FnMut(&TwoAxisCase)) {
    for &(f_size, t_size, slices) in cases {
        let n = f_size * t_size;
        let schedule = if slices == 1 { Schedule::Ring } else { Schedule::Sliced { slices } };
        for rank in 0..n {
            let plan = plan(Pattern::GatherScatter { gathered: f_size }, schedule, n, rank);
            let (hb, products) = (happens_before(&plan), matmuls(&plan));
            check(&TwoAxisCase { f_size, t_size, slices, rank, plan, hb, products });
        }
    }
}

/// The point of the two-axis plan: the products of chunk c wait for no
/// transfer of chunk c-1's reduce-scatter (it runs while they do), only
/// for the transfer that brought their block of w and for the end of chunk
/// c-2's reduce-scatter, whose partial slots they reuse.
#[test]
fn two_axis_products_do_not_wait_for_the_previous_blocks_reduce_scatter() {
    let cases = [(4, 2, 1), (3, 4, 1), (8, 8, 1), (2, 3, 1), (5, 3, 1), (2, 4, 3), (3, 2, 2)];
    each_two_axis_plan(&cases, |case| {
        let &TwoAxisCase { f_size, t_size, slices, rank, plan: ref p, ref hb, ref products } = case;
        assert_eq!(products.len(), f_size * t_size * slices);
        for (i, &product) in products.iter().enumerate() {
            // Chunk c's products (c = block of w x slices + column chunk).
            let c = i / t_size;
            for s in p.steps.iter().filter(|s| hb[s.id][product]) {
                if let Action::Exchange { recvs, .. } = &s.action {
                    for t in recvs.iter().filter(|t| t.tag.direction == Direction::Forward) {
                        assert!(
                            c >= 2 && t.tag.step < (c - 1) * (t_size - 1),
                            "F={f_size} T={t_size} rank {rank}: block {c}'s product waits for {:?}",
                            t.tag
                        );
                    }
                }
            }
        }
    });
}

#[test]
fn two_axis_ring_steps_wait_for_their_own_product_only() {
    // Step s of a chunk's reduce-scatter ring sends the sum of the row block
    // multiplied s-th: it runs while the compute lane multiplies the chunk's
    // later row blocks, never after them.
    each_two_axis_plan(&[(2, 4, 1), (4, 2, 1), (3, 3, 1), (2, 4, 2), (2, 5, 3)], |case| {
        let &TwoAxisCase { f_size, t_size, slices, rank, plan: ref p, ref hb, ref products } = case;
        for q in 0..f_size * slices {
            for s in 0..t_size - 1 {
                let tag = q * (t_size - 1) + s;
                let exchange = p
                    .steps
                    .iter()
                    .find(|e| match &e.action {
                        Action::Exchange { sends, .. } => {
                            sends.iter().any(|t| t.tag.direction == Direction::Forward && t.tag.step == tag)
                        }
                        _ => false,
                    })
                    .expect("every ring step is an exchange");
                assert!(hb[products[q * t_size + s]][exchange.id], "ring step {s} before its own product");
                for later in s + 1..t_size {
                    assert!(
                        !hb[products[q * t_size + later]][exchange.id],
                        "F={f_size} T={t_size} S={slices} rank {rank}: chunk {q}'s ring step {s} waits for its \
                         product {later}"
                    );
                }
            }
        }
    });
}

/// What a buffer holds in the symbolic run of a two-gather plan.
#[derive(Debug, Clone, PartialEq, Eq)]
enum TwoGathers {
    /// Row chunk u (0 unsliced) of row block p of x, of the ranks with this f.
    X { f: usize, p: usize, u: usize },
    /// Block q of w (its rows), of the ranks with this t.
    W { t: usize, q: usize },
    /// Per row chunk `p * S + u` of the result, the blocks of w multiplied into it.
    Result(BTreeMap<usize, BTreeSet<usize>>),
}

/// Runs every rank's plan of `Pattern::GatherGather { gathered: f_size, .. }`
/// message by message: each product multiplies row chunk u of x's row
/// block p of the rank's own f by w's block q of its own t (block
/// `(p * S + u) * F + q`, S the plan's chunks), into those rows of its
/// result; rank f*T + t ends with every row chunk's products over every
/// block of w, each once, in the output (added up there, or summed into
/// it once from a result slot).
fn simulate_two_gathers(plans: &[Plan], f_size: usize, label: &str) {
    let n = plans.len();
    let t_size = n / f_size;
    let chunks = plans[0].schedule.chunks();
    let mut cursor = vec![0usize; n];
    let mut sent = vec![false; n];
    let mut slots: Vec<HashMap<usize, TwoGathers>> = vec![HashMap::new(); n];
    // Per rank, what its output holds and how many sums wrote it whole.
    let mut outs: Vec<(Option<TwoGathers>, usize)> = vec![(None, 0); n];
    let mut mailbox: HashMap<(usize, usize, Tag), TwoGathers> = HashMap::new();
    let read = |slots: &HashMap<usize, TwoGathers>, r: usize, b: Buf| -> TwoGathers {
        match b {
            Buf::X if chunks == 1 => TwoGathers::X { f: r / t_size, p: r % t_size, u: 0 },
            Buf::XBlock(u) if chunks > 1 => TwoGathers::X { f: r / t_size, p: r % t_size, u },
            Buf::W => TwoGathers::W { t: r % t_size, q: r / t_size },
            Buf::Slot(i) => slots.get(&i).cloned().unwrap_or_else(|| panic!("{label}: rank {r} reads empty slot {i}")),
            other => panic!("{label}: rank {r} reads {other:?}"),
        }
    };
    loop {
        let mut progressed = false;
        for r in 0..n {
            let (f, t) = (r / t_size, r % t_size);
            while let Some(step) = plans[r].steps.get(cursor[r]) {
                match &step.action {
                    Action::Matmul { block, src, with, dst, accumulate } => {
                        let (p, u, q) = (block / (f_size * chunks), block / f_size % chunks, block % f_size);
                        let operands = (read(&slots[r], r, *src), read(&slots[r], r, *with));
                        let want = (TwoGathers::X { f, p, u }, TwoGathers::W { t, q });
                        assert_eq!(operands, want, "{label}: rank {r} block {block}");
                        let held = match dst {
                            Buf::Slot(i) => slots[r].get(i).cloned(),
                            Buf::Out => outs[r].0.clone(),
                            other => panic!("{label}: rank {r} multiplies into {other:?}"),
                        };
                        let mut rows = match (accumulate, held) {
                            (_, Some(TwoGathers::Result(rows))) => rows,
                            (true, other) => panic!("{label}: rank {r} accumulates onto {other:?}"),
                            (false, _) => BTreeMap::new(),
                        };
                        let row = rows.entry(p * chunks + u).or_default();
                        if !accumulate {
                            row.clear();
                        }
                        assert!(row.insert(q), "{label}: rank {r} adds block {block} twice");
                        match dst {
                            Buf::Slot(i) => {
                                slots[r].insert(*i, TwoGathers::Result(rows));
                            }
                            _ => outs[r].0 = Some(TwoGathers::Result(rows)),
                        }
                    }
                    Action::Sum { terms, dst: Buf::Out } => {
                        let [Buf::Slot(i)] = terms[..] else { panic!("{label}: rank {r} sums {terms:?}") };
                        outs[r] = (slots[r].get(&i).cloned(), outs[r].1 + 1);
                    }
                    Action::Exchange { sends, recvs } => {
                        let fits = |v: &TwoGathers, kind| {
                            matches!(
                                (v, kind),
                                (TwoGathers::X { .. }, SlotKind::Input) | (TwoGathers::W { .. }, SlotKind::Weight)
                            )
                        };
                        let read = |slots: &HashMap<usize, TwoGathers>, b| read(slots, r, b);
                        let rank = Rank { plan: &plans[r], r, sent: &mut sent[r], slots: &mut slots[r] };
                        if !symbolic_exchange(rank, sends, recvs, &mut mailbox, read, fits, label) {
                            break;
                        }
                    }
                    other => panic!("{label}: unexpected {other:?}"),
                }
                cursor[r] += 1;
                progressed = true;
            }
        }
        if (0..n).all(|r| cursor[r] == plans[r].steps.len()) {
            break;
        }
        assert!(progressed, "{label}: deadlock at cursors {cursor:?}");
    }
    assert!(mailbox.is_empty(), "{label}: sends never received");
    let into_out = matches!(plans[0].pattern, Pattern::GatherGather { into_out: true, .. });
    let want: BTreeMap<usize, BTreeSet<usize>> = (0..t_size * chunks).map(|p| (p, (0..f_size).collect())).collect();
    for (r, (held, sums)) in outs.iter().enumerate() {
        assert_eq!(held, &Some(TwoGathers::Result(want.clone())), "{label}: rank {r}'s output");
        assert_eq!(*sums, usize::from(!into_out), "{label}: rank {r}'s output summed {sums} times");
    }
}

#[test]
fn every_two_gather_plan_is_correct_and_race_free() {
    let mut checked = 0;
    for f_size in 1..=6 {
        for t_size in 1..=6 {
            let n = f_size * t_size;
            let sliced = [Schedule::Sliced { slices: 2 }, Schedule::Sliced { slices: 3 }];
            for (schedule, into_out) in SCHEDULES.into_iter().chain(sliced).flat_map(|s| [(s, false), (s, true)]) {
                let pattern = Pattern::GatherGather { gathered: f_size, into_out };
                let plans: Vec<Plan> = (0..n).map(|r| plan(pattern, schedule, n, r)).collect();
                let label = format!("F={f_size} T={t_size} {schedule:?} into_out={into_out}");
                for p in &plans {
                    check_hazards(p, &format!("{label} rank={}", p.rank));
                }
                simulate_two_gathers(&plans, f_size, &label);
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 36 * (SCHEDULES.len() + 2) * 2);
}

/// The point of the two-gather plan: nothing waits at the head (the first
/// product multiplies the own blocks), each product waits only for the
/// exchanges that brought its two blocks (and, the compute lane running in
/// order, those an earlier product waited for), and no transfer is left
/// after the last product.
#[test]
fn two_gather_products_wait_only_for_their_own_blocks() {
    let cases = [(2, 2), (2, 4), (4, 2), (3, 3), (1, 4), (4, 1), (8, 8), (3, 5)];
    for ((f_size, t_size), chunks) in cases.into_iter().flat_map(|c| [(c, 1), (c, 2), (c, 3)]) {
        let n = f_size * t_size;
        let schedule = if chunks == 1 { Schedule::Ring } else { Schedule::Sliced { slices: chunks } };
        for rank in 0..n {
            let (f, t) = (rank / t_size, rank % t_size);
            let pattern = Pattern::GatherGather { gathered: f_size, into_out: rank % 2 == 0 };
            let p = plan(pattern, schedule, n, rank);
            let hb = happens_before(&p);
            let products = matmuls(&p);
            assert_eq!(products.len(), n * chunks);
            // The exchange that brings chunk u of x's block (Forward) or w's block (Backward) of step s.
            let brings = |direction: Direction, s: usize, u: usize| -> Option<StepId> {
                let step = s.checked_sub(1)?;
                let tag =
                    Tag { direction, step: if direction == Direction::Forward { step * chunks + u } else { step } };
                let exchange = p.steps.iter().find(|e| match &e.action {
                    Action::Exchange { recvs, .. } => recvs.iter().any(|r| r.tag == tag),
                    _ => false,
                });
                Some(exchange.expect("every block arrives").id)
            };
            let exchanges: Vec<StepId> =
                p.steps.iter().filter(|s| matches!(s.action, Action::Exchange { .. })).map(|s| s.id).collect();
            assert_eq!(exchanges.len(), (f_size - 1) + (t_size - 1) * chunks);
            let mut needed: Option<StepId> = None;
            for &product in &products {
                let Action::Matmul { block, .. } = p.steps[product].action else { unreachable!() };
                // The steps at which x's row chunk and w's block arrive.
                let (row, u, q) = (block / (f_size * chunks), block / f_size % chunks, block % f_size);
                let (s, c) = ((t + t_size - row) % t_size, (f + f_size - q) % f_size);
                needed = needed.max(brings(Direction::Forward, s, u)).max(brings(Direction::Backward, c, 0));
                for &exchange in &exchanges {
                    let label =
                        format!("F={f_size} T={t_size} S={chunks} rank {rank}: block {block} and exchange {exchange}");
                    assert_eq!(hb[exchange][product], needed.is_some_and(|e| exchange <= e), "{label}");
                }
            }
            let last = *products.last().expect("products");
            assert!(exchanges.iter().all(|&e| !hb[last][e]), "a transfer after the last product");
            // What slicing is for: where x's ring is the longer one, what
            // waits for the last transfer is one chunk's F products.
            if t_size >= f_size && t_size > 1 {
                let last_exchange = *exchanges.last().expect("exchanges");
                let after = products.iter().filter(|&&m| hb[last_exchange][m]).count();
                assert_eq!(
                    after, f_size,
                    "F={f_size} T={t_size} S={chunks} rank {rank}: products after the last transfer"
                );
            }
        }
    }
}

/// What a buffer holds in the symbolic run of a gather-contract-scatter plan.
#[derive(Debug, Clone, PartialEq, Eq)]
enum ContractScatter {
    /// Row block q of block p of x's columns, of the ranks with this f.
    X { f: usize, p: usize, q: usize },
    /// Products (origin rank, block q * T + p) summed so far.
    Partials(Pieces),
}

/// Runs every rank's plan of `Pattern::GatherContractScatter { scattered:
/// f_size }` message by message: each product multiplies row block q of
/// block p of x's columns of the rank's own f (block `q * T + p`), x
/// travelling by row blocks; rank f*T + t ends with
/// row block f of the result summed over every p and every rank of its t,
/// each product once, written once.
fn simulate_contract_scatter(plans: &[Plan], f_size: usize, label: &str) {
    let n = plans.len();
    let t_size = n / f_size;
    let mut cursor = vec![0usize; n];
    let mut sent = vec![false; n];
    let mut slots: Vec<HashMap<usize, ContractScatter>> = vec![HashMap::new(); n];
    let mut outs: Vec<(usize, Pieces)> = vec![(0, BTreeSet::new()); n];
    let mut mailbox: HashMap<(usize, usize, Tag), ContractScatter> = HashMap::new();
    let read = |slots: &HashMap<usize, ContractScatter>, r: usize, b: Buf| -> ContractScatter {
        match b {
            Buf::XBlock(q) => ContractScatter::X { f: r / t_size, p: r % t_size, q },
            Buf::Slot(i) => slots.get(&i).cloned().unwrap_or_else(|| panic!("{label}: rank {r} reads empty slot {i}")),
            other => panic!("{label}: rank {r} reads {other:?}"),
        }
    };
    loop {
        let mut progressed = false;
        for r in 0..n {
            let f = r / t_size;
            while let Some(step) = plans[r].steps.get(cursor[r]) {
                match &step.action {
                    Action::Matmul { block, src, with: Buf::W, dst: Buf::Slot(i), accumulate } => {
                        let (q, p) = (block / t_size, block % t_size);
                        let want = ContractScatter::X { f, p, q };
                        assert_eq!(read(&slots[r], r, *src), want, "{label}: rank {r} {block}");
                        let mut acc = match (accumulate, slots[r].get(i)) {
                            (true, Some(ContractScatter::Partials(v))) => v.clone(),
                            (true, other) => panic!("{label}: rank {r} accumulates onto {other:?}"),
                            (false, _) => BTreeSet::new(),
                        };
                        assert!(acc.insert((r, *block)), "{label}: rank {r} adds {block} twice");
                        slots[r].insert(*i, ContractScatter::Partials(acc));
                    }
                    Action::Sum { terms, dst } => {
                        let mut acc = BTreeSet::new();
                        for t in terms {
                            let ContractScatter::Partials(v) = read(&slots[r], r, *t) else {
                                panic!("{label}: sums x")
                            };
                            for item in v {
                                assert!(acc.insert(item), "{label}: rank {r} counts {item:?} twice");
                            }
                        }
                        let rows: BTreeSet<usize> = acc.iter().map(|&(_, b)| b / t_size).collect();
                        assert_eq!(rows.len(), 1, "{label}: rank {r} sums row blocks {rows:?}");
                        match dst {
                            Buf::Slot(i) => {
                                slots[r].insert(*i, ContractScatter::Partials(acc));
                            }
                            Buf::Out => outs[r] = (outs[r].0 + 1, acc),
                            other => panic!("{label}: rank {r} sums into {other:?}"),
                        }
                    }
                    Action::Exchange { sends, recvs } => {
                        let fits = |v: &ContractScatter, kind| {
                            matches!(
                                (v, kind),
                                (ContractScatter::X { .. }, SlotKind::Input)
                                    | (ContractScatter::Partials(_), SlotKind::Partial)
                            )
                        };
                        let read = |slots: &HashMap<usize, ContractScatter>, b| read(slots, r, b);
                        let rank = Rank { plan: &plans[r], r, sent: &mut sent[r], slots: &mut slots[r] };
                        if !symbolic_exchange(rank, sends, recvs, &mut mailbox, read, fits, label) {
                            break;
                        }
                    }
                    other => panic!("{label}: unexpected {other:?}"),
                }
                cursor[r] += 1;
                progressed = true;
            }
        }
        if (0..n).all(|r| cursor[r] == plans[r].steps.len()) {
            break;
        }
        assert!(progressed, "{label}: deadlock at cursors {cursor:?}");
    }
    assert!(mailbox.is_empty(), "{label}: sends never received");
    for (r, (writes, got)) in outs.iter().enumerate() {
        let (f, t) = (r / t_size, r % t_size);
        assert_eq!(*writes, 1, "{label}: rank {r} writes its output {writes} times");
        let want: Pieces =
            (0..f_size).flat_map(|g| (0..t_size).map(move |p| (g * t_size + t, f * t_size + p))).collect();
        assert_eq!(*got, want, "{label}: rank {r}'s output");
    }
}

#[test]
fn every_gather_contract_scatter_plan_is_correct_and_race_free() {
    let mut checked = 0;
    for f_size in 1..=6 {
        for t_size in 1..=6 {
            let n = f_size * t_size;
            for schedule in SCHEDULES {
                let pattern = Pattern::GatherContractScatter { scattered: f_size };
                let plans: Vec<Plan> = (0..n).map(|r| plan(pattern, schedule, n, r)).collect();
                let label = format!("F={f_size} T={t_size} {schedule:?}");
                for p in &plans {
                    check_hazards(p, &format!("{label} rank={}", p.rank));
                }
                simulate_contract_scatter(&plans, f_size, &label);
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 36 * SCHEDULES.len());
}

/// The point of the gather-contract-scatter plan: x travels by row blocks,
/// each partial's products waiting for their own rows (and those before
/// them, the compute lane in order), so the partial the ring sends first is
/// complete before the gather ends; the reduce-scatter's step s waits for
/// partial s's products only (it runs while the next partial is
/// multiplied); and only the own partial's sum is left after the last
/// product.
#[test]
fn gather_contract_scatter_steps_wait_only_for_their_own_products() {
    for (f_size, t_size) in [(2, 2), (2, 4), (4, 2), (3, 3), (1, 4), (4, 1), (5, 3)] {
        let n = f_size * t_size;
        for rank in 0..n {
            let p = plan(Pattern::GatherContractScatter { scattered: f_size }, Schedule::Ring, n, rank);
            let hb = happens_before(&p);
            let products = matmuls(&p);
            assert_eq!(products.len(), n);
            let label = format!("F={f_size} T={t_size} rank {rank}");
            let exchange = |direction: Direction, step: usize| {
                p.steps
                    .iter()
                    .find(|e| match &e.action {
                        Action::Exchange { sends, .. } => sends.iter().any(|t| t.tag == Tag { direction, step }),
                        _ => false,
                    })
                    .expect("every step is an exchange")
                    .id
            };
            // x travels by row blocks in the order the ring takes the partials: exchange e of partial s's rows.
            let x_exchange = |s: usize, e: usize| exchange(Direction::Forward, s * (t_size - 1) + e);
            for (i, &product) in products.iter().enumerate() {
                let (s, step) = (i / t_size, i % t_size);
                for (s2, e) in (0..f_size).flat_map(|s2| (0..t_size - 1).map(move |e| (s2, e))) {
                    // Its own rows up to its step, and what the products before it waited for (a partial from
                    // the third on reuses the slot of one the ring sent, after the whole gather).
                    let want = s2 < s || (s2 == s && e < step) || s >= 2;
                    let waits = hb[x_exchange(s2, e)][product];
                    assert_eq!(waits, want, "{label}: product {i} and exchange {e} of partial {s2}'s rows");
                }
            }
            for s in 0..f_size - 1 {
                let ring = exchange(Direction::Backward, s);
                assert!(hb[products[(s + 1) * t_size - 1]][ring], "{label}: ring step {s} before its partial");
                assert!(!hb[products[(s + 1) * t_size]][ring], "{label}: ring step {s} waits for the next partial");
                // Two partial slots in turn: the partial after next is written where this one was sent from.
                if let Some(&after_next) = products.get((s + 2) * t_size) {
                    assert!(hb[ring][after_next], "{label}: partial {} overwrites ring step {s}'s", s + 2);
                }
                if let (Some(&after_next), true) = (products.get((s + 2) * t_size), s + 1 < f_size - 1) {
                    let next_ring = exchange(Direction::Backward, s + 1);
                    assert!(!hb[next_ring][after_next], "{label}: partial {} waits for ring step {}", s + 2, s + 1);
                }
            }
            let count = |kind: SlotKind| p.slots.iter().filter(|&&k| k == kind).count();
            assert_eq!(count(SlotKind::Partial), f_size.min(2) + (f_size - 1).min(2), "{label}: partial slots");
            assert_eq!(count(SlotKind::Input), (t_size - 1) * f_size, "{label}: row blocks of x received");
        }
    }
}
