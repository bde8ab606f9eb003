//! Exhaustive property checks of every plan for N in 1..=16 and every rank.

use super::*;
use std::collections::{BTreeSet, HashMap};

const SCHEDULES: [Schedule; 4] = [Schedule::Auto, Schedule::Ring, Schedule::Bidirectional, Schedule::Sequential];
const OPS: [OpKind; 2] = [OpKind::AllGatherMatmul, OpKind::MatmulReduceScatter];

fn all_plans() -> impl Iterator<Item = (OpKind, Schedule, usize, Vec<Plan>)> {
    OPS.into_iter().flat_map(|op| {
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

/// What a buffer holds in the symbolic run: the input block it is (AG) or the
/// set of (block, rank) partial products summed into it (RS).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Value {
    Rows(usize),
    Partials(BTreeSet<(usize, usize)>),
}

struct RankState {
    cursor: usize,
    sent: bool,
    slots: HashMap<usize, Value>,
    out_writes: HashMap<Buf, (usize, Value)>,
}

/// Runs every rank's plan in plan order, message by message, and checks the
/// results and the pairing of sends and receives.
fn simulate(plans: &[Plan], label: &str) {
    let n = plans.len();
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
                        Buf::X => Value::Rows(r),
                        Buf::XBlock(j) => Value::Partials([(j, r)].into()),
                        Buf::Slot(i) => st
                            .slots
                            .get(&i)
                            .cloned()
                            .unwrap_or_else(|| panic!("{label}: rank {r} reads empty slot {i}")),
                        other => panic!("{label}: rank {r} reads output {other:?}"),
                    }
                };
                match &step.action {
                    Action::Matmul { src, dst } => {
                        let v = read(st, *src);
                        write(st, plan, *dst, v, label);
                    }
                    Action::Sum { terms, dst } => {
                        let mut acc = BTreeSet::new();
                        for t in terms {
                            let Value::Partials(p) = read(st, *t) else { panic!("{label}: rank {r} sums rows") };
                            for item in p {
                                assert!(acc.insert(item), "{label}: rank {r} counts partial {item:?} twice");
                            }
                        }
                        let blocks: BTreeSet<usize> = acc.iter().map(|(b, _)| *b).collect();
                        assert_eq!(blocks.len(), 1, "{label}: rank {r} sums partials of different blocks {blocks:?}");
                        write(st, plan, *dst, Value::Partials(acc), label);
                    }
                    Action::Exchange { sends, recvs } => {
                        if !st.sent {
                            for t in sends {
                                let v = read(st, t.buf);
                                let key = (r, t.peer, t.tag);
                                let previous = mailbox.insert(key, (v, kind_of(plan, t.buf)));
                                assert!(previous.is_none(), "{label}: rank {r} sends {:?} to {} twice", t.tag, t.peer);
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
        match plans[r].op {
            OpKind::AllGatherMatmul => {
                for j in 0..n {
                    let (count, v) = st
                        .out_writes
                        .get(&Buf::OutBlock(j))
                        .unwrap_or_else(|| panic!("{label}: rank {r} never writes block {j}"));
                    assert_eq!(*count, 1, "{label}: rank {r} writes block {j} {count} times");
                    assert_eq!(*v, Value::Rows(j), "{label}: rank {r} block {j} holds {v:?}");
                }
                assert_eq!(st.out_writes.len(), n, "{label}: rank {r} writes outside its blocks");
            }
            OpKind::MatmulReduceScatter => {
                let (count, v) =
                    st.out_writes.get(&Buf::Out).unwrap_or_else(|| panic!("{label}: rank {r} never writes its output"));
                assert_eq!(*count, 1, "{label}: rank {r} writes its output {count} times");
                let want: BTreeSet<_> = (0..n).map(|q| (r, q)).collect();
                assert_eq!(*v, Value::Partials(want), "{label}: rank {r} output");
            }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotKindOf {
    Rows,
    Accum,
}

fn kind_of(plan: &Plan, buf: Buf) -> SlotKindOf {
    match buf {
        Buf::X | Buf::XBlock(_) => SlotKindOf::Rows,
        Buf::Slot(i) => match plan.slots[i] {
            SlotKind::InputRows => SlotKindOf::Rows,
            SlotKind::Accum => SlotKindOf::Accum,
        },
        Buf::Out | Buf::OutBlock(_) => SlotKindOf::Accum,
    }
}

fn write(st: &mut RankState, plan: &Plan, dst: Buf, v: Value, label: &str) {
    match dst {
        Buf::Slot(i) => {
            let expected = match plan.slots[i] {
                SlotKind::InputRows => matches!(v, Value::Rows(_)),
                SlotKind::Accum => matches!(v, Value::Partials(_)),
            };
            assert!(expected, "{label}: slot {i} of kind {:?} receives {v:?}", plan.slots[i]);
            st.slots.insert(i, v);
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
            let label = format!("{} {:?} N={n} rank={}", op.name(), schedule, p.rank);
            check_hazards(p, &label);
            for step in &p.steps {
                for t in step.action.reads().iter().chain(step.action.writes().iter()) {
                    if let Buf::Slot(i) = t {
                        assert!(*i < p.slots.len(), "{label}: slot {i} not declared");
                    }
                }
            }
        }
        simulate(&plans, &format!("{} {:?} N={n}", op.name(), schedule));
        checked += plans.len();
    }
    assert_eq!(checked, 2 * 4 * (1..=16).sum::<usize>());
}

#[test]
fn head_and_tail_are_not_exposed() {
    for n in 2..=16 {
        for schedule in [Schedule::Ring, Schedule::Bidirectional] {
            let ag = plan(OpKind::AllGatherMatmul, schedule, n, 0);
            // The first matmul multiplies local rows: it waits for nothing.
            let first = ag.lane_steps(Lane::Compute).next().unwrap();
            assert!(first.deps.is_empty() && first.action == Action::Matmul { src: Buf::X, dst: Buf::OutBlock(0) });
            // No transfer after the last exchange's data is multiplied.
            let last_ex = ag.lane_steps(Lane::Comm).last().unwrap().id;
            let after: Vec<_> = ag.steps.iter().filter(|s| s.id > last_ex && s.lane == Lane::Comm).collect();
            assert!(after.is_empty());

            let rs = plan(OpKind::MatmulReduceScatter, schedule, n, 0);
            // Only the final sum waits on the last exchange; the own block's matmul does not.
            let compute: Vec<_> = rs.lane_steps(Lane::Compute).collect();
            let last_two = &compute[compute.len() - 2..];
            assert!(
                matches!(last_two[0].action, Action::Matmul { src: Buf::XBlock(0), .. }) && last_two[0].deps.is_empty()
            );
            assert!(matches!(last_two[1].action, Action::Sum { dst: Buf::Out, .. }));
        }
    }
}

#[test]
fn bidirectional_halves_the_transfer_steps() {
    for n in 2..=16 {
        for op in OPS {
            let exchanges = |s| plan(op, s, n, 0).lane_steps(Lane::Comm).count();
            assert_eq!(exchanges(Schedule::Ring), n - 1);
            assert_eq!(exchanges(Schedule::Bidirectional), n / 2);
        }
    }
}

#[test]
fn sequential_does_not_overlap() {
    for n in 2..=8 {
        let ag = plan(OpKind::AllGatherMatmul, Schedule::Sequential, n, 1);
        let last_ex = ag.lane_steps(Lane::Comm).last().unwrap().id;
        assert!(ag.lane_steps(Lane::Compute).all(|s| s.deps == vec![last_ex]));
        let rs = plan(OpKind::MatmulReduceScatter, Schedule::Sequential, n, 1);
        let last_matmul = rs.steps.iter().rfind(|s| matches!(s.action, Action::Matmul { .. })).unwrap().id;
        let first_ex = rs.lane_steps(Lane::Comm).next().unwrap();
        assert_eq!(first_ex.deps, vec![last_matmul]);
    }
}

#[test]
fn workspace_regions_do_not_overlap() {
    use crate::dtype::DType;
    for (input, output) in
        [(DType::F32, DType::F32), (DType::BF16, DType::BF16), (DType::F16, DType::F32), (DType::F32, DType::F64)]
    {
        let dims = Dims { block_rows: 3, k: 13, n: 7, input, output };
        for op in OPS {
            for schedule in SCHEDULES {
                let p = plan(op, schedule, 5, 2);
                let ws = Workspace::layout(&p, &dims);
                let mut regions: Vec<_> = ws.slots.clone();
                regions.extend(ws.weights.clone());
                regions.extend(ws.rows.clone());
                regions.extend(ws.results.clone());
                regions.sort_by_key(|r| r.start);
                for pair in regions.windows(2) {
                    assert!(pair[0].end <= pair[1].start);
                }
                assert!(regions.iter().all(|r| r.end <= ws.total && r.start % 64 == 0));
                assert_eq!(ws.weights.is_some(), input != dims.accumulator());
            }
        }
    }
}
