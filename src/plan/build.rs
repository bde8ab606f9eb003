//! The plan generators: one loop per op, parametrised by how many blocks travel
//! each way round the ring (ring: all forward; bidirectional: split in two).

use super::*;

/// The plan of `op` for `rank` of `n` under `schedule` (`Auto` is resolved here).
pub fn plan(op: OpKind, schedule: Schedule, n: usize, rank: usize) -> Plan {
    assert!(n >= 1 && rank < n, "rank {rank} out of range for {n} ranks");
    let schedule = schedule.resolve(n);
    let mut b = Builder { steps: Vec::new(), slots: Vec::new(), n, rank };
    match (op, schedule) {
        (_, _) if n == 1 => b.single(op),
        (OpKind::AllGatherMatmul, Schedule::Sequential) => b.gather_then_matmul(),
        (OpKind::AllGatherMatmul, s) => b.gather_matmul_overlapped(chain_lengths(s, n)),
        (OpKind::MatmulReduceScatter, Schedule::Sequential) => b.matmul_then_scatter(),
        (OpKind::MatmulReduceScatter, s) => b.matmul_scatter_overlapped(chain_lengths(s, n)),
    }
    Plan { op, schedule, n, rank, slots: b.slots, steps: b.steps }
}

/// (forward, backward): how many of the other N-1 blocks travel each way.
fn chain_lengths(schedule: Schedule, n: usize) -> (usize, usize) {
    match schedule {
        Schedule::Bidirectional => (n / 2, (n - 1) / 2),
        _ => (n - 1, 0),
    }
}

struct Builder {
    steps: Vec<Step>,
    slots: Vec<SlotKind>,
    n: usize,
    rank: usize,
}

impl Builder {
    fn push(&mut self, lane: Lane, action: Action, deps: Vec<StepId>) -> StepId {
        let id = self.steps.len();
        self.steps.push(Step { id, lane, action, deps });
        id
    }

    fn slot(&mut self, kind: SlotKind) -> usize {
        self.slots.push(kind);
        self.slots.len() - 1
    }

    fn slots(&mut self, kind: SlotKind, count: usize) -> Vec<usize> {
        (0..count).map(|_| self.slot(kind)).collect()
    }

    /// Block index `rank + offset` modulo N.
    fn block(&self, offset: isize) -> usize {
        (self.rank as isize + offset).rem_euclid(self.n as isize) as usize
    }

    fn next(&self) -> usize {
        self.block(1)
    }

    fn prev(&self) -> usize {
        self.block(-1)
    }

    fn single(&mut self, op: OpKind) {
        let (src, dst) = match op {
            OpKind::AllGatherMatmul => (Buf::X, Buf::OutBlock(0)),
            OpKind::MatmulReduceScatter => (Buf::XBlock(0), Buf::Out),
        };
        self.push(Lane::Compute, Action::Matmul { src, dst }, vec![]);
    }

    /// AG, overlapped. Step s sends the block each chain holds on and receives
    /// the next, while the compute lane multiplies the blocks of step s. Step 0
    /// multiplies local rows, so nothing waits at the head; the last blocks are
    /// only multiplied, so no transfer is left at the tail.
    fn gather_matmul_overlapped(&mut self, (fwd, bwd): (usize, usize)) {
        // Double buffers per chain: block s+1 arrives while block s is still
        // being sent on and multiplied.
        let fwd_slots = self.slots(SlotKind::InputRows, 2);
        let bwd_slots = if bwd > 0 { self.slots(SlotKind::InputRows, 2) } else { vec![] };
        let held = held_block;

        let mut exchanges = vec![self.gather_exchange(0, bwd, &fwd_slots, &bwd_slots, vec![])];
        self.push(Lane::Compute, Action::Matmul { src: Buf::X, dst: Buf::OutBlock(self.rank) }, vec![]);
        let mut previous_matmuls = vec![];
        for s in 1..=fwd {
            if s < fwd {
                // Exchange s receives into the slots of step s-1: wait for their matmuls.
                let ex = self.gather_exchange(s, bwd, &fwd_slots, &bwd_slots, previous_matmuls);
                exchanges.push(ex);
            }
            let arrived = exchanges[s - 1];
            let mut matmuls = vec![];
            let dst = Buf::OutBlock(self.block(-(s as isize)));
            matmuls.push(self.push(Lane::Compute, Action::Matmul { src: held(&fwd_slots, s), dst }, vec![arrived]));
            if s <= bwd {
                let dst = Buf::OutBlock(self.block(s as isize));
                matmuls.push(self.push(Lane::Compute, Action::Matmul { src: held(&bwd_slots, s), dst }, vec![arrived]));
            }
            previous_matmuls = matmuls;
        }
    }

    /// Exchange s of a gather: each chain sends the block it holds and receives the next.
    fn gather_exchange(
        &mut self,
        s: usize,
        bwd: usize,
        fwd_slots: &[usize],
        bwd_slots: &[usize],
        deps: Vec<StepId>,
    ) -> StepId {
        let held = held_block;
        let mut sends = vec![Transfer { peer: self.next(), buf: held(fwd_slots, s), tag: tag(Direction::Forward, s) }];
        let mut recvs =
            vec![Transfer { peer: self.prev(), buf: held(fwd_slots, s + 1), tag: tag(Direction::Forward, s) }];
        if s < bwd {
            sends.push(Transfer { peer: self.prev(), buf: held(bwd_slots, s), tag: tag(Direction::Backward, s) });
            recvs.push(Transfer { peer: self.next(), buf: held(bwd_slots, s + 1), tag: tag(Direction::Backward, s) });
        }
        self.push(Lane::Comm, Action::Exchange { sends, recvs }, deps)
    }

    /// AG baseline: gather every block (N-1 ring steps), then multiply them all.
    fn gather_then_matmul(&mut self) {
        let slots = self.slots(SlotKind::InputRows, self.n - 1);
        let held = |s: usize| if s == 0 { Buf::X } else { Buf::Slot(slots[s - 1]) };
        let mut last = 0;
        for s in 0..self.n - 1 {
            let sends = vec![Transfer { peer: self.next(), buf: held(s), tag: tag(Direction::Forward, s) }];
            let recvs = vec![Transfer { peer: self.prev(), buf: held(s + 1), tag: tag(Direction::Forward, s) }];
            last = self.push(Lane::Comm, Action::Exchange { sends, recvs }, vec![]);
        }
        for s in 0..self.n {
            let dst = Buf::OutBlock(self.block(-(s as isize)));
            self.push(Lane::Compute, Action::Matmul { src: held(s), dst }, vec![last]);
        }
    }

    /// RS, overlapped. Block b is accumulated along the forward chain by ranks
    /// b-fwd..b-1 and along the backward chain by b+bwd..b+1, and ends at b. At
    /// step s each chain multiplies its partial (no network wait), adds the sum
    /// received at step s-1, and sends the result on. The last step multiplies
    /// the own block while the last sums arrive: one add is exposed.
    fn matmul_scatter_overlapped(&mut self, (fwd, bwd): (usize, usize)) {
        let fwd_partial = self.slots(SlotKind::Accum, 2);
        let fwd_in = self.slots(SlotKind::Accum, 2);
        let (bwd_partial, bwd_in) =
            if bwd > 0 { (self.slots(SlotKind::Accum, 2), self.slots(SlotKind::Accum, 2)) } else { (vec![], vec![]) };
        let own = self.slot(SlotKind::Accum);

        let mut exchanges: Vec<StepId> = vec![];
        for s in 0..fwd {
            let mut ready =
                vec![self.partial_sum(s, self.block((fwd - s) as isize), &fwd_partial, &fwd_in, &exchanges)];
            let mut sends = vec![Transfer {
                peer: self.next(),
                buf: Buf::Slot(fwd_partial[s % 2]),
                tag: tag(Direction::Forward, s),
            }];
            let mut recvs =
                vec![Transfer { peer: self.prev(), buf: Buf::Slot(fwd_in[s % 2]), tag: tag(Direction::Forward, s) }];
            if s < bwd {
                let block = self.block(s as isize - bwd as isize);
                ready.push(self.partial_sum(s, block, &bwd_partial, &bwd_in, &exchanges));
                sends.push(Transfer {
                    peer: self.prev(),
                    buf: Buf::Slot(bwd_partial[s % 2]),
                    tag: tag(Direction::Backward, s),
                });
                recvs.push(Transfer {
                    peer: self.next(),
                    buf: Buf::Slot(bwd_in[s % 2]),
                    tag: tag(Direction::Backward, s),
                });
            }
            exchanges.push(self.push(Lane::Comm, Action::Exchange { sends, recvs }, ready));
        }

        self.push(Lane::Compute, Action::Matmul { src: Buf::XBlock(self.rank), dst: Buf::Slot(own) }, vec![]);
        let mut terms = vec![Buf::Slot(own), Buf::Slot(fwd_in[(fwd - 1) % 2])];
        let mut deps = vec![exchanges[fwd - 1]];
        if bwd > 0 {
            terms.push(Buf::Slot(bwd_in[(bwd - 1) % 2]));
            deps.push(exchanges[bwd - 1]);
            deps.dedup();
        }
        self.push(Lane::Compute, Action::Sum { terms, dst: Buf::Out }, deps);
    }

    /// Step s of one RS chain: the partial of `block`, plus the sum received at
    /// step s-1. Returns the step after which the slot is ready to send.
    fn partial_sum(
        &mut self,
        s: usize,
        block: usize,
        partial: &[usize],
        incoming: &[usize],
        exchanges: &[StepId],
    ) -> StepId {
        let slot = Buf::Slot(partial[s % 2]);
        // The slot was last sent by exchange s-2; the sum of step s-1, earlier
        // on this lane, already waited for that exchange.
        let matmul = self.push(Lane::Compute, Action::Matmul { src: Buf::XBlock(block), dst: slot }, vec![]);
        if s == 0 {
            return matmul;
        }
        let terms = vec![slot, Buf::Slot(incoming[(s - 1) % 2])];
        self.push(Lane::Compute, Action::Sum { terms, dst: slot }, vec![exchanges[s - 1]])
    }

    /// RS baseline: the whole matmul, then a ring reduce-scatter of its blocks.
    fn matmul_then_scatter(&mut self) {
        let partial = self.slots(SlotKind::Accum, self.n);
        let incoming = self.slots(SlotKind::Accum, 2);
        let mut last = 0;
        for (j, &slot) in partial.iter().enumerate() {
            last = self.push(Lane::Compute, Action::Matmul { src: Buf::XBlock(j), dst: Buf::Slot(slot) }, vec![]);
        }
        let mut exchanges: Vec<StepId> = vec![];
        for s in 0..self.n - 1 {
            let slot = Buf::Slot(partial[self.block(-1 - s as isize)]);
            if s > 0 {
                let terms = vec![slot, Buf::Slot(incoming[(s - 1) % 2])];
                last = self.push(Lane::Compute, Action::Sum { terms, dst: slot }, vec![exchanges[s - 1]]);
            }
            let sends = vec![Transfer { peer: self.next(), buf: slot, tag: tag(Direction::Forward, s) }];
            let recvs =
                vec![Transfer { peer: self.prev(), buf: Buf::Slot(incoming[s % 2]), tag: tag(Direction::Forward, s) }];
            exchanges.push(self.push(Lane::Comm, Action::Exchange { sends, recvs }, vec![last]));
        }
        let terms = vec![Buf::Slot(partial[self.rank]), Buf::Slot(incoming[(self.n - 2) % 2])];
        self.push(Lane::Compute, Action::Sum { terms, dst: Buf::Out }, vec![exchanges[self.n - 2]]);
    }
}

/// The block a double-buffered gather chain holds at step s: local rows at
/// step 0, then its two slots in turn.
fn held_block(slots: &[usize], s: usize) -> Buf {
    if s == 0 {
        Buf::X
    } else {
        Buf::Slot(slots[s % 2])
    }
}

fn tag(direction: Direction, step: usize) -> Tag {
    Tag { direction, step }
}
