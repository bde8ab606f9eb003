//! The plan generators: one loop per pattern. Ring loops are parametrised by
//! how many blocks travel each way (ring: all forward; bidirectional: split).

use super::*;

/// The plan of `pattern` for `rank` of `n` under `schedule` (`Auto` is resolved here).
pub fn plan(pattern: Pattern, schedule: Schedule, n: usize, rank: usize) -> Plan {
    assert!(n >= 1 && rank < n, "rank {rank} out of range for {n} ranks");
    let schedule = schedule.resolve(n, pattern);
    let mut b = Builder {
        steps: Vec::new(),
        slots: Vec::new(),
        n,
        rank,
        result: None,
        products: 0,
        all_reduce: (pattern == Pattern::AllReduce).then(|| AllGatherRings::new(n, schedule.chunks())),
    };
    let sequential = schedule == Schedule::Sequential;
    if schedule.cuts_blocks() {
        let k = schedule.chunks();
        assert!(k >= 1, "{schedule:?} needs at least one chunk");
        let tiled = matches!(schedule, Schedule::Tiled { .. });
        match pattern {
            Pattern::GatherScatter { gathered } if !tiled => {
                assert!(gathered >= 1 && n % gathered == 0, "{gathered} is no gather axis size of a group of {n}");
                b.gather_scatter(gathered, k, false)
            }
            Pattern::GatherGather { gathered, into_out } if !tiled => {
                assert!(
                    gathered >= 1 && n % gathered == 0,
                    "{gathered} is no axis size of w's gather in a group of {n}"
                );
                b.gather_gather(gathered, into_out, k, false)
            }
            Pattern::Gather { accumulate: false } if tiled => b.gather_tiled(k),
            Pattern::Gather { accumulate: false } => b.gather_sliced(k),
            Pattern::Scatter | Pattern::AllReduce if tiled => b.scatter_tiled(k),
            Pattern::Scatter | Pattern::AllReduce => b.scatter_sliced(k),
            other => panic!("no {schedule:?} plan for {other:?}: only row gathers and scatters are cut into chunks"),
        }
        return Plan { pattern, schedule, n, rank, slots: b.slots, steps: b.steps };
    }
    match pattern {
        Pattern::GatherScatter { gathered } => {
            assert!(gathered >= 1 && n % gathered == 0, "{gathered} is no gather axis size of a group of {n}");
            b.gather_scatter(gathered, 1, sequential);
        }
        Pattern::GatherContractScatter { scattered } => {
            assert!(scattered >= 1 && n % scattered == 0, "{scattered} is no scatter axis size of a group of {n}");
            b.gather_contract_scatter(scattered, sequential);
        }
        Pattern::GatherGather { gathered, into_out } => {
            assert!(gathered >= 1 && n % gathered == 0, "{gathered} is no axis size of w's gather in a group of {n}");
            b.gather_gather(gathered, into_out, 1, sequential);
        }
        Pattern::Gather { accumulate } => {
            b.result = accumulate.then(|| b.slot(SlotKind::Result));
            match () {
                _ if n == 1 => b.local_product(Buf::X),
                _ if sequential => b.gather_then_matmul(),
                _ => b.gather_matmul_overlapped(chain_lengths(schedule, n)),
            }
        }
        Pattern::Scatter | Pattern::AllReduce if n == 1 => b.local_product(Buf::XBlock(0)),
        Pattern::Scatter | Pattern::AllReduce if sequential => b.matmul_then_scatter(),
        Pattern::Scatter | Pattern::AllReduce => b.matmul_scatter_overlapped(chain_lengths(schedule, n)),
        Pattern::ExchangeThenMatmul { accumulate } => {
            b.result = accumulate.then(|| b.slot(SlotKind::Result));
            b.exchange_then_matmul(sequential);
        }
        Pattern::MatmulThenExchange => b.matmul_then_exchange(sequential),
    }
    if let Some(result) = b.result {
        // The sum is complete when the last product is in.
        let last = b.steps.iter().rposition(|s| s.lane == Lane::Compute).expect("a product");
        b.push(Lane::Compute, Action::Sum { terms: vec![Buf::Slot(result)], dst: Buf::Out }, vec![last]);
    }
    Plan { pattern, schedule, n, rank, slots: b.slots, steps: b.steps }
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
    /// The accumulator slot of accumulating patterns.
    result: Option<usize>,
    /// Products pushed so far (the first into the accumulator overwrites it).
    products: usize,
    /// `Pattern::AllReduce`: the all-gather rings that follow each reduced block.
    all_reduce: Option<AllGatherRings>,
}

/// The all-gather half of an all-reduce plan: after a block (or a chunk of
/// one) is reduced, its sum goes round the ring so that every rank copies
/// every block's sum into its output.
struct AllGatherRings {
    /// The chunks a block is cut into (1 unless sliced or tiled).
    chunks: usize,
    /// Rings emitted so far: each takes the next N-1 tags.
    rings: usize,
    /// The first tag step of the rings, past every reduce-scatter tag
    /// (those stay below chunks * N).
    first_tag: usize,
    /// Two slots the passing sums alternate in, made at the first ring.
    slots: Option<[usize; 2]>,
}

impl AllGatherRings {
    fn new(n: usize, chunks: usize) -> AllGatherRings {
        AllGatherRings { chunks, rings: 0, first_tag: chunks * n, slots: None }
    }
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

    /// The product of block `block` held in `src`: into its output block, or
    /// added to the accumulator (the first product overwrites it).
    fn product(&mut self, block: usize, src: Buf, deps: Vec<StepId>) -> StepId {
        let action = match self.result {
            Some(result) => {
                Action::Matmul { block, src, with: Buf::W, dst: Buf::Slot(result), accumulate: self.products > 0 }
            }
            None => Action::Matmul { block, src, with: Buf::W, dst: Buf::OutBlock(block), accumulate: false },
        };
        self.products += 1;
        self.push(Lane::Compute, action, deps)
    }

    /// One rank: the whole op is one local product.
    fn local_product(&mut self, src: Buf) {
        if src == Buf::X {
            self.product(0, src, vec![]);
        } else {
            self.push(
                Lane::Compute,
                Action::Matmul { block: 0, src, with: Buf::W, dst: Buf::Out, accumulate: false },
                vec![],
            );
        }
    }

    /// Gather, overlapped. Step s sends the block each chain holds on and
    /// receives the next, while the compute lane multiplies the blocks of
    /// step s. Step 0 multiplies local data, so nothing waits at the head; the
    /// last blocks are only multiplied, so no transfer is left at the tail.
    fn gather_matmul_overlapped(&mut self, (fwd, bwd): (usize, usize)) {
        // Double buffers per chain: block s+1 arrives while block s is still
        // being sent on and multiplied.
        let fwd_slots = self.slots(SlotKind::Input, 2);
        let bwd_slots = if bwd > 0 { self.slots(SlotKind::Input, 2) } else { vec![] };

        let mut exchanges = vec![self.gather_exchange(0, bwd, &fwd_slots, &bwd_slots, vec![])];
        self.product(self.rank, Buf::X, vec![]);
        let mut previous_products = vec![];
        for s in 1..=fwd {
            if s < fwd {
                // Exchange s receives into the slots of step s-1: wait for their products.
                let ex = self.gather_exchange(s, bwd, &fwd_slots, &bwd_slots, previous_products);
                exchanges.push(ex);
            }
            let arrived = exchanges[s - 1];
            let mut products = vec![self.product(self.block(-(s as isize)), held_block(&fwd_slots, s), vec![arrived])];
            if s <= bwd {
                products.push(self.product(self.block(s as isize), held_block(&bwd_slots, s), vec![arrived]));
            }
            previous_products = products;
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
        let mut sends =
            vec![Transfer { peer: self.next(), buf: held_block(fwd_slots, s), tag: tag(Direction::Forward, s) }];
        let mut recvs =
            vec![Transfer { peer: self.prev(), buf: held_block(fwd_slots, s + 1), tag: tag(Direction::Forward, s) }];
        if s < bwd {
            sends.push(Transfer { peer: self.prev(), buf: held_block(bwd_slots, s), tag: tag(Direction::Backward, s) });
            recvs.push(Transfer {
                peer: self.next(),
                buf: held_block(bwd_slots, s + 1),
                tag: tag(Direction::Backward, s),
            });
        }
        self.push(Lane::Comm, Action::Exchange { sends, recvs }, deps)
    }

    /// Gather baseline: gather every block (N-1 ring steps), then multiply them all.
    fn gather_then_matmul(&mut self) {
        let slots = self.slots(SlotKind::Input, self.n - 1);
        let held = |s: usize| if s == 0 { Buf::X } else { Buf::Slot(slots[s - 1]) };
        let mut last = 0;
        for s in 0..self.n - 1 {
            let sends = vec![Transfer { peer: self.next(), buf: held(s), tag: tag(Direction::Forward, s) }];
            let recvs = vec![Transfer { peer: self.prev(), buf: held(s + 1), tag: tag(Direction::Forward, s) }];
            last = self.push(Lane::Comm, Action::Exchange { sends, recvs }, vec![]);
        }
        for s in 0..self.n {
            self.product(self.block(-(s as isize)), held(s), vec![last]);
        }
    }

    /// Scatter, overlapped. Block b is accumulated along the forward chain by
    /// ranks b-fwd..b-1 and along the backward chain by b+bwd..b+1, and ends at
    /// b. The own block is multiplied while the last sums arrive: one add is
    /// exposed. One chain (ring) adds on the comm lane so that its GEMMs run
    /// ahead; two chains (bidirectional) fuse the adds into the GEMM.
    fn matmul_scatter_overlapped(&mut self, (fwd, bwd): (usize, usize)) {
        let last_sums = if bwd == 0 { vec![self.scatter_run_ahead(fwd)] } else { self.scatter_fused(fwd, bwd) };
        let own = self.slot(SlotKind::Partial);
        let own_product = Action::Matmul {
            block: self.rank,
            src: Buf::XBlock(self.rank),
            with: Buf::W,
            dst: Buf::Slot(own),
            accumulate: false,
        };
        self.push(Lane::Compute, own_product, vec![]);
        let mut terms = vec![Buf::Slot(own)];
        let mut deps = vec![];
        for (slot, arrived) in last_sums {
            terms.push(slot);
            deps.push(arrived);
        }
        self.reduced(Lane::Compute, terms, Buf::Out, deps);
    }

    /// One chain (ring). The compute lane only multiplies; the comm lane
    /// adds each partial onto the sum received at the step before and sends
    /// the result on, as soon as both are there (on a GPU the comm stream runs
    /// the add). So no GEMM waits for a transfer: with three partial slots (one
    /// more than the chain needs) the compute lane runs up to two partials
    /// ahead of the chain, and a late peer stalls nobody's GEMMs. Fusing the
    /// add into the GEMM instead would make every GEMM wait for the previous
    /// transfer, serialising the one chain; `Schedule::Tiled` is the ring with
    /// fused adds, its tiles interleaving as separate chains. Returns the slot
    /// and the exchange of the last sum received.
    fn scatter_run_ahead(&mut self, steps: usize) -> (Buf, StepId) {
        let partial = self.slots(SlotKind::Partial, 3.min(steps));
        let incoming = self.slots(SlotKind::Partial, 2);
        let slot = |s: usize| Buf::Slot(partial[s % partial.len()]);
        let mut exchanges: Vec<StepId> = vec![];
        for s in 0..steps {
            let block = self.block((steps - s) as isize);
            // The slot of partial s was handed over by the exchange of step s-3.
            let reuse = s.checked_sub(partial.len()).map(|e| exchanges[e]).into_iter().collect();
            let action =
                Action::Matmul { block, src: Buf::XBlock(block), with: Buf::W, dst: slot(s), accumulate: false };
            let product = self.push(Lane::Compute, action, reuse);
            if s > 0 {
                // After the exchange of step s-1, earlier on this lane.
                let terms = vec![slot(s), Buf::Slot(incoming[(s - 1) % 2])];
                self.push(Lane::Comm, Action::Sum { terms, dst: slot(s) }, vec![product]);
            }
            let sends = vec![Transfer { peer: self.next(), buf: slot(s), tag: tag(Direction::Forward, s) }];
            let recvs =
                vec![Transfer { peer: self.prev(), buf: Buf::Slot(incoming[s % 2]), tag: tag(Direction::Forward, s) }];
            // Incoming slot s%2 was last read by the add of step s-1, earlier on this lane.
            exchanges.push(self.push(Lane::Comm, Action::Exchange { sends, recvs }, vec![product]));
        }
        (Buf::Slot(incoming[(steps - 1) % 2]), exchanges[steps - 1])
    }

    /// Two chains (bidirectional), the adds fused into the GEMM: at step s
    /// each chain's GEMM accumulates its partial onto the sum it received at
    /// step s-1 and the result goes on at once, in an exchange of its own. The
    /// chains alternate on the compute lane, so each chain's transfer runs
    /// while the other chain multiplies. Two slots per chain: the one being
    /// accumulated and sent, and the one the next sum arrives in. Returns each
    /// chain's last received sum and its exchange.
    fn scatter_fused(&mut self, fwd: usize, bwd: usize) -> Vec<(Buf, StepId)> {
        let chains = [(Direction::Forward, fwd), (Direction::Backward, bwd)];
        let sums: Vec<Vec<usize>> = chains.iter().map(|_| self.slots(SlotKind::Partial, 2)).collect();
        let mut exchanges: Vec<Vec<StepId>> = vec![vec![], vec![]];
        for s in 0..fwd.max(bwd) {
            for (c, &(direction, steps)) in chains.iter().enumerate() {
                if s >= steps {
                    continue;
                }
                let (block, to, from) = match direction {
                    Direction::Forward => (self.block((steps - s) as isize), self.next(), self.prev()),
                    Direction::Backward => (self.block(s as isize - steps as isize), self.prev(), self.next()),
                };
                // Step s accumulates onto and sends `sums[c][(s + 1) % 2]`, and
                // receives into `sums[c][s % 2]`, sent at step s-1 before.
                let slot = Buf::Slot(sums[c][(s + 1) % 2]);
                let deps = if s == 0 { vec![] } else { vec![exchanges[c][s - 1]] };
                let action =
                    Action::Matmul { block, src: Buf::XBlock(block), with: Buf::W, dst: slot, accumulate: s > 0 };
                let product = self.push(Lane::Compute, action, deps);
                let tag = tag(direction, s);
                let sends = vec![Transfer { peer: to, buf: slot, tag }];
                let recvs = vec![Transfer { peer: from, buf: Buf::Slot(sums[c][s % 2]), tag }];
                exchanges[c].push(self.push(Lane::Comm, Action::Exchange { sends, recvs }, vec![product]));
            }
        }
        chains
            .iter()
            .enumerate()
            .map(|(c, &(_, steps))| (Buf::Slot(sums[c][(steps - 1) % 2]), exchanges[c][steps - 1]))
            .collect()
    }

    /// Scatter baseline: the whole matmul, then a ring reduce-scatter of its blocks.
    fn matmul_then_scatter(&mut self) {
        let partial = self.slots(SlotKind::Partial, self.n);
        let incoming = self.slots(SlotKind::Partial, 2);
        let mut last = 0;
        for (j, &slot) in partial.iter().enumerate() {
            let product =
                Action::Matmul { block: j, src: Buf::XBlock(j), with: Buf::W, dst: Buf::Slot(slot), accumulate: false };
            last = self.push(Lane::Compute, product, vec![]);
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
        self.reduced(Lane::Compute, terms, Buf::Out, vec![exchanges[self.n - 2]]);
    }

    /// All-to-all, then matmul. Step s sends block r+s of the local x to rank
    /// r+s and receives block r from rank r-s; the own block is multiplied
    /// first, so nothing waits at the head, and each received block while the
    /// next one travels. Sequential: every exchange, then every product.
    fn exchange_then_matmul(&mut self, sequential: bool) {
        let count = if sequential { self.n.saturating_sub(1) } else { 2.min(self.n - 1) };
        let slots = self.slots(SlotKind::Input, count);
        let slot_of = |s: usize| Buf::Slot(slots[(s - 1) % count.max(1)]);
        let tag_of = |s: usize| tag(Direction::Forward, s);
        let exchange = |b: &mut Self, s: usize, deps: Vec<StepId>| {
            let (to, from) = (b.block(s as isize), b.block(-(s as isize)));
            let sends = vec![Transfer { peer: to, buf: Buf::XBlock(to), tag: tag_of(s) }];
            let recvs = vec![Transfer { peer: from, buf: slot_of(s), tag: tag_of(s) }];
            b.push(Lane::Comm, Action::Exchange { sends, recvs }, deps)
        };
        if sequential {
            let mut last = vec![];
            for s in 1..self.n {
                last = vec![exchange(self, s, vec![])];
            }
            self.product(self.rank, Buf::XBlock(self.rank), last.clone());
            for s in 1..self.n {
                self.product(self.block(-(s as isize)), slot_of(s), last.clone());
            }
            return;
        }
        let mut exchanges = vec![usize::MAX]; // exchanges[s] for s >= 1
        if self.n > 1 {
            exchanges.push(exchange(self, 1, vec![]));
        }
        self.product(self.rank, Buf::XBlock(self.rank), vec![]);
        let mut previous = vec![];
        for s in 1..self.n {
            if s + 1 < self.n {
                // Exchange s+1 reuses the slot of step s-1: wait for its product.
                exchanges.push(exchange(self, s + 1, previous));
            }
            previous = vec![self.product(self.block(-(s as isize)), slot_of(s), vec![exchanges[s]])];
        }
    }

    /// Matmul, then all-to-all. Step s multiplies the block for rank r+s and
    /// sends it there, receiving rank r-s's block for us; the own block is
    /// multiplied last, while the last transfer runs, so only its copy is
    /// exposed. Sequential: every product, then every exchange.
    fn matmul_then_exchange(&mut self, sequential: bool) {
        let n = self.n;
        let depth = if sequential { n.saturating_sub(1).max(1) } else { 2 };
        let outgoing = self.slots(SlotKind::Partial, depth.min(n - 1));
        let incoming = self.slots(SlotKind::Partial, depth.min(n - 1));
        let out_slot = |s: usize| Buf::Slot(outgoing[(s - 1) % depth]);
        let in_slot = |s: usize| Buf::Slot(incoming[(s - 1) % depth]);
        let exchange = |b: &mut Self, s: usize, deps: Vec<StepId>| {
            let (to, from) = (b.block(s as isize), b.block(-(s as isize)));
            let sends = vec![Transfer { peer: to, buf: out_slot(s), tag: tag(Direction::Forward, s) }];
            let recvs = vec![Transfer { peer: from, buf: in_slot(s), tag: tag(Direction::Forward, s) }];
            b.push(Lane::Comm, Action::Exchange { sends, recvs }, deps)
        };
        let own = Action::Matmul {
            block: self.rank,
            src: Buf::XBlock(self.rank),
            with: Buf::W,
            dst: Buf::OutBlock(self.rank),
            accumulate: false,
        };
        let (mut exchanges, mut copies) = (vec![usize::MAX], vec![usize::MAX]);
        for s in 1..n {
            let to = self.block(s as isize);
            // The outgoing slot was last sent by exchange s-depth.
            let deps = if s > depth { vec![exchanges[s - depth]] } else { vec![] };
            let product =
                Action::Matmul { block: to, src: Buf::XBlock(to), with: Buf::W, dst: out_slot(s), accumulate: false };
            let product = self.push(Lane::Compute, product, deps);
            if !sequential {
                // Receiving into in_slot(s) waits until its previous block was copied out.
                let deps = if s > depth { vec![product, copies[s - depth]] } else { vec![product] };
                exchanges.push(exchange(self, s, deps));
                if s >= 2 {
                    copies.push(self.copy_in(s - 1, in_slot(s - 1), exchanges[s - 1]));
                }
            }
        }
        if sequential {
            let own = self.push(Lane::Compute, own, vec![]);
            for s in 1..n {
                exchanges.push(exchange(self, s, vec![own]));
            }
            for (s, &arrived) in exchanges.iter().enumerate().skip(1) {
                self.copy_in(s, in_slot(s), arrived);
            }
        } else {
            self.push(Lane::Compute, own, vec![]);
            if n > 1 {
                self.copy_in(n - 1, in_slot(n - 1), exchanges[n - 1]);
            }
        }
    }

    /// Sliced gather: chunk c of every block is gathered by one ring
    /// all-gather (N-1 exchanges), then its N pieces are multiplied. The comm
    /// lane gathers chunk c+1 while the compute lane multiplies chunk c; chunk
    /// 0's gather waits for nothing and is exposed. Two sets of N-1 slots
    /// alternate between chunks.
    fn gather_sliced(&mut self, k: usize) {
        let n = self.n;
        let sets: Vec<Vec<usize>> = (0..k.min(2)).map(|_| self.slots(SlotKind::Input, n - 1)).collect();
        let held = |c: usize, s: usize| if s == 0 { Buf::XBlock(c) } else { Buf::Slot(sets[c % 2][s - 1]) };
        let mut gathered: Vec<Option<StepId>> = vec![];
        let mut last_product: Vec<StepId> = vec![];
        let gather = |b: &mut Self, c: usize, deps: Vec<StepId>| -> Option<StepId> {
            let mut last = None;
            for s in 0..n - 1 {
                let tag = tag(Direction::Forward, c * (n - 1) + s);
                let sends = vec![Transfer { peer: b.next(), buf: held(c, s), tag }];
                let recvs = vec![Transfer { peer: b.prev(), buf: held(c, s + 1), tag }];
                let deps = if s == 0 { deps.clone() } else { vec![] };
                last = Some(b.push(Lane::Comm, Action::Exchange { sends, recvs }, deps));
            }
            last
        };
        gathered.push(gather(self, 0, vec![]));
        for c in 0..k {
            if c + 1 < k {
                // Chunk c+1 lands in the slots chunk c-1 was multiplied from.
                let deps = if c >= 1 { vec![last_product[c - 1]] } else { vec![] };
                gathered.push(gather(self, c + 1, deps));
            }
            let deps: Vec<StepId> = gathered[c].into_iter().collect();
            let mut last = 0;
            for s in 0..n {
                let q = self.block(-(s as isize));
                let fine = q * k + c;
                let action = Action::Matmul {
                    block: fine,
                    src: held(c, s),
                    with: Buf::W,
                    dst: Buf::OutBlock(fine),
                    accumulate: false,
                };
                last = self.push(Lane::Compute, action, deps.clone());
            }
            last_product.push(last);
        }
    }

    /// Sliced scatter: the partials of chunk c of every block are computed,
    /// then reduce-scattered by one ring (N-1 exchanges, the adds on the comm
    /// lane as a collective does them), ending in chunk c of the own output.
    /// The comm lane reduces chunk c while the compute lane multiplies chunk
    /// c+1; the last chunk's reduce-scatter is exposed. Two sets of N partial
    /// slots alternate between chunks.
    fn scatter_sliced(&mut self, k: usize) {
        let n = self.n;
        let sets: Vec<Vec<usize>> = (0..k.min(2)).map(|_| self.slots(SlotKind::Partial, n)).collect();
        let incoming = self.slots(SlotKind::Partial, (n - 1).min(2));
        let mut reduced: Vec<StepId> = vec![];
        for c in 0..k {
            let set = &sets[c % 2];
            let mut last = 0;
            for s in 0..n {
                // In the order the ring reduces them; the own block last.
                let j = self.block(-1 - s as isize);
                // The set was last used by chunk c-2's reduce-scatter.
                let deps = if s == 0 && c >= 2 { vec![reduced[c - 2]] } else { vec![] };
                let action = Action::Matmul {
                    block: j * k + c,
                    src: Buf::XBlock(j),
                    with: Buf::W,
                    dst: Buf::Slot(set[j]),
                    accumulate: false,
                };
                last = self.push(Lane::Compute, action, deps);
            }
            let mut deps = vec![last];
            for s in 0..n - 1 {
                let slot = Buf::Slot(set[self.block(-1 - s as isize)]);
                if s > 0 {
                    let terms = vec![slot, Buf::Slot(incoming[(s - 1) % incoming.len()])];
                    self.push(Lane::Comm, Action::Sum { terms, dst: slot }, std::mem::take(&mut deps));
                }
                let tag = tag(Direction::Forward, c * (n - 1) + s);
                let sends = vec![Transfer { peer: self.next(), buf: slot, tag }];
                let recvs = vec![Transfer { peer: self.prev(), buf: Buf::Slot(incoming[s % incoming.len()]), tag }];
                self.push(Lane::Comm, Action::Exchange { sends, recvs }, std::mem::take(&mut deps));
            }
            let mut terms = vec![Buf::Slot(set[self.rank])];
            if n > 1 {
                terms.push(Buf::Slot(incoming[(n - 2) % incoming.len()]));
            }
            let dst = Buf::OutBlock(self.rank * k + c);
            reduced.push(self.reduced(Lane::Comm, terms, dst, deps));
        }
    }

    /// Tiled gather (ring): tile t of the block held at step s travels on as
    /// soon as it has arrived, and is multiplied then. Two slots per tile
    /// alternate; a slot is received into again only after the tile it held
    /// two steps before was multiplied.
    fn gather_tiled(&mut self, k: usize) {
        let n = self.n;
        let slots: Vec<Vec<usize>> = (0..k).map(|_| self.slots(SlotKind::Input, 2.min(n - 1))).collect();
        let held = |s: usize, t: usize| if s == 0 { Buf::XBlock(t) } else { Buf::Slot(slots[t][s % slots[t].len()]) };
        let mut products: Vec<Vec<StepId>> = vec![];
        let mut exchanges: Vec<Vec<StepId>> = vec![];
        for s in 0..n {
            let q = self.block(-(s as isize));
            let (mut done, mut sent) = (vec![], vec![]);
            for t in 0..k {
                let deps = if s == 0 { vec![] } else { vec![exchanges[s - 1][t]] };
                let fine = q * k + t;
                let product = Action::Matmul {
                    block: fine,
                    src: held(s, t),
                    with: Buf::W,
                    dst: Buf::OutBlock(fine),
                    accumulate: false,
                };
                done.push(self.push(Lane::Compute, product, deps));
                if s + 1 < n {
                    let tag = tag(Direction::Forward, s * k + t);
                    let sends = vec![Transfer { peer: self.next(), buf: held(s, t), tag }];
                    let recvs = vec![Transfer { peer: self.prev(), buf: held(s + 1, t), tag }];
                    // The slot received into last held this tile at step s-1.
                    let deps = if s >= 2 { vec![products[s - 1][t]] } else { vec![] };
                    sent.push(self.push(Lane::Comm, Action::Exchange { sends, recvs }, deps));
                }
            }
            products.push(done);
            exchanges.push(sent);
        }
    }

    /// Tiled scatter (ring): at step s the product of tile t is accumulated
    /// by the GEMM itself onto the running sum of tile t received at step
    /// s-1 (no separate add pass) and sent on at once. The GEMM of tile t
    /// waits only for tile t's sum, which travelled while the other k-1
    /// tiles were multiplied. Two slots per tile alternate: the one being
    /// added to and sent, and the one the next sum arrives in. The own
    /// block's tiles are multiplied into their own slots first and each
    /// summed into the output as soon as its final sum has arrived.
    fn scatter_tiled(&mut self, k: usize) {
        let n = self.n;
        let sums: Vec<Vec<usize>> = (0..k).map(|_| self.slots(SlotKind::Partial, 2)).collect();
        let own = self.slots(SlotKind::Partial, k);
        // Step s adds to and sends `sums[t][(s + 1) % 2]` and receives into `sums[t][s % 2]`.
        let mut exchanges: Vec<Vec<StepId>> = vec![];
        for s in 0..n - 1 {
            let j = self.block(-1 - s as isize);
            let mut sent = vec![];
            for t in 0..k {
                let slot = Buf::Slot(sums[t][(s + 1) % 2]);
                let deps = if s == 0 { vec![] } else { vec![exchanges[s - 1][t]] };
                let product = Action::Matmul {
                    block: j * k + t,
                    src: Buf::XBlock(j),
                    with: Buf::W,
                    dst: slot,
                    accumulate: s > 0,
                };
                let product = self.push(Lane::Compute, product, deps);
                let tag = tag(Direction::Forward, s * k + t);
                let sends = vec![Transfer { peer: self.next(), buf: slot, tag }];
                let recvs = vec![Transfer { peer: self.prev(), buf: Buf::Slot(sums[t][s % 2]), tag }];
                sent.push(self.push(Lane::Comm, Action::Exchange { sends, recvs }, vec![product]));
            }
            exchanges.push(sent);
        }
        let r = self.rank;
        for (t, &slot) in own.iter().enumerate() {
            let product = Action::Matmul {
                block: r * k + t,
                src: Buf::XBlock(r),
                with: Buf::W,
                dst: Buf::Slot(slot),
                accumulate: false,
            };
            self.push(Lane::Compute, product, vec![]);
        }
        for (t, &slot) in own.iter().enumerate() {
            let mut terms = vec![Buf::Slot(slot)];
            let mut deps = vec![];
            if n > 1 {
                terms.push(Buf::Slot(sums[t][(n - 2) % 2]));
                deps.push(exchanges[n - 2][t]);
            }
            self.reduced(Lane::Compute, terms, Buf::OutBlock(r * k + t), deps);
        }
    }

    /// The end of block `dst`'s reduction: `terms` (the own partial, then
    /// the sums received) summed into `dst` (`Out`: the own block; or a fine
    /// `OutBlock`). An all-reduce sums them in place into the own partial and
    /// sends that round the ring instead (see `all_gather_sum`). Returns the
    /// last step that uses the partial slots of `terms`.
    fn reduced(&mut self, lane: Lane, terms: Vec<Buf>, dst: Buf, deps: Vec<StepId>) -> StepId {
        if self.all_reduce.is_none() {
            return self.push(lane, Action::Sum { terms, dst }, deps);
        }
        let own = terms[0];
        // The step that completes the own sum: the sum of the terms, or
        // (one rank) the product that wrote it.
        let done = if terms.len() > 1 {
            self.push(lane, Action::Sum { terms, dst: own }, deps)
        } else {
            self.steps.iter().rposition(|s| s.action.writes().contains(&own)).expect("the own partial is written")
        };
        let chunk = match dst {
            Buf::OutBlock(b) => b % self.all_reduce.as_ref().map_or(1, |g| g.chunks),
            _ => 0,
        };
        let deps = if self.steps[done].lane == Lane::Comm { vec![] } else { vec![done] };
        self.all_gather_sum(own, chunk, deps)
    }

    /// The all-gather ring of one reduced block (chunk `chunk` of each
    /// block): the own sum, in `own`, is copied into the output and sent on;
    /// at step s the sum of block rank-1-s arrives, is copied into its output
    /// block and sent on at step s+1. The copies run on the comm lane between
    /// the exchanges, so the compute lane goes on with the next chunk. `deps`:
    /// the steps of the compute lane that finished the own sum. Returns the
    /// ring's last step.
    fn all_gather_sum(&mut self, own: Buf, chunk: usize, deps: Vec<StepId>) -> StepId {
        let n = self.n;
        let rings = self.all_reduce.as_ref().expect("an all-reduce plan");
        let (chunks, first) = (rings.chunks, rings.first_tag + rings.rings * n.saturating_sub(1));
        let slots = match rings.slots {
            Some(slots) => slots,
            None => {
                let slots = [self.slot(SlotKind::Partial), self.slot(SlotKind::Partial)];
                self.all_reduce.as_mut().expect("an all-reduce plan").slots = Some(slots);
                slots
            }
        };
        self.all_reduce.as_mut().expect("an all-reduce plan").rings += 1;
        let fine = |j: usize| Buf::OutBlock(j * chunks + chunk);
        let mut last = self.push(Lane::Comm, Action::Sum { terms: vec![own], dst: fine(self.rank) }, deps);
        let mut held = own;
        for s in 0..n - 1 {
            let tag = tag(Direction::Forward, first + s);
            let arrived = Buf::Slot(slots[s % 2]);
            let sends = vec![Transfer { peer: self.next(), buf: held, tag }];
            let recvs = vec![Transfer { peer: self.prev(), buf: arrived, tag }];
            self.push(Lane::Comm, Action::Exchange { sends, recvs }, vec![]);
            let from = self.block(-1 - s as isize);
            last = self.push(Lane::Comm, Action::Sum { terms: vec![arrived], dst: fine(from) }, vec![]);
            held = arrived;
        }
        last
    }

    /// Two rings (`Pattern::GatherScatter`): rank `f * T + t` holds w's
    /// block f. For each block of w, in the order they arrive (block f - c
    /// at step c), the T row-block products of each of its `slices` column
    /// chunks are reduce-scattered round the T ranks that share f, as one
    /// chunk of a sliced scatter (the adds on the comm lane), ending in that
    /// chunk's part of the own output. The blocks of w travel round the F
    /// ranks that share t two blocks ahead: the transfer that brings block
    /// c+2 is posted with the first transfer of block c's first
    /// reduce-scatter, so the two rings' links carry data at once, while the
    /// compute lane multiplies on (three slots for w). Only the last chunk's
    /// reduce-scatter is left at the tail: 1 / (F x slices) of them.
    /// Sequential: every block gathered first, then each chunk's products
    /// and then its reduce-scatter, nothing overlapped.
    fn gather_scatter(&mut self, gathered: usize, slices: usize, sequential: bool) {
        let (n, f_size) = (self.n, gathered);
        let t_size = n / f_size;
        let chunks = f_size * slices;
        let (f, t) = (self.rank / t_size, self.rank % t_size);
        let rank_of = |f: usize, t: usize| (f % f_size) * t_size + t % t_size;
        let (next_f, prev_f) = (rank_of(f + 1, t), rank_of(f + f_size - 1, t));
        let (next_t, prev_t) = (rank_of(f, t + 1), rank_of(f, t + t_size - 1));
        let depth = if sequential { f_size - 1 } else { 3.min(f_size - 1) };
        let w_slots = self.slots(SlotKind::Input, depth);
        // The block of w held at step c (the own at step 0), and which it is.
        let held = |c: usize| if c == 0 { Buf::X } else { Buf::Slot(w_slots[(c - 1) % w_slots.len()]) };
        let block_at = |c: usize| (f + f_size - c % f_size) % f_size;
        // Gather transfer c: on with the block held at step c, in with the next.
        let gather = |c: usize| {
            let tag = tag(Direction::Backward, c);
            (Transfer { peer: next_f, buf: held(c), tag }, Transfer { peer: prev_f, buf: held(c + 1), tag })
        };
        let sets: Vec<Vec<usize>> = (0..chunks.min(2)).map(|_| self.slots(SlotKind::Partial, t_size)).collect();
        let incoming = self.slots(SlotKind::Partial, (t_size - 1).min(2));
        // The row block B's ring reduces at its step s; the own one last.
        let row_at = |s: usize| (t + 2 * t_size - 1 - s) % t_size;

        // arrived[c]: the exchange that brought the block of step c.
        let mut arrived: Vec<Option<StepId>> = vec![None];
        let gathers_first = if sequential { f_size - 1 } else { 1.min(f_size - 1) };
        for c in 0..gathers_first {
            let (send, recv) = gather(c);
            let exchange = Action::Exchange { sends: vec![send], recvs: vec![recv] };
            arrived.push(Some(self.push(Lane::Comm, exchange, vec![])));
        }
        // reduced[q]: the end of chunk q's reduce-scatter (chunk q = c * slices + u).
        let mut reduced: Vec<StepId> = vec![];
        for q in 0..chunks {
            let (c, u) = (q / slices, q % slices);
            let fine = block_at(c) * slices + u;
            let set = &sets[q % 2];
            // products[s]: the product the ring takes at its step s.
            let mut products: Vec<StepId> = vec![];
            for s in 0..t_size {
                let d = row_at(s);
                let mut deps: Vec<StepId> = if s == 0 && u == 0 { arrived[c].into_iter().collect() } else { vec![] };
                if sequential && q == 0 && s == 0 {
                    // Sequential: the first product waits for the whole gather.
                    deps.extend(arrived.last().copied().flatten());
                }
                // The set was last used by chunk q-2's reduce-scatter (sequential: chunk q-1's).
                let before = if sequential { 1 } else { 2 };
                if s == 0 && q >= before {
                    deps.push(reduced[q - before]);
                }
                let action = Action::Matmul {
                    block: d * chunks + fine,
                    src: held(c),
                    with: Buf::W,
                    dst: Buf::Slot(set[d]),
                    accumulate: false,
                };
                products.push(self.push(Lane::Compute, action, deps));
            }
            let last = products[t_size - 1];
            // The transfer that brings block c+2, posted with block c's first
            // partial: its slot held block c-1, multiplied before this block
            // and sent on by an earlier exchange on this lane.
            let mut ahead = (!sequential && u == 0 && c + 2 < f_size).then(|| gather(c + 1));
            // Each step of the ring waits for its own product only, so the
            // ring runs while the compute lane multiplies the chunk's later
            // row blocks (sequential: for the chunk's every product).
            let ready = |s: usize| if sequential { last } else { products[s] };
            let mut deps = vec![ready(0)];
            for s in 0..t_size - 1 {
                let slot = Buf::Slot(set[row_at(s)]);
                if s > 0 {
                    let terms = vec![slot, Buf::Slot(incoming[(s - 1) % incoming.len()])];
                    self.push(Lane::Comm, Action::Sum { terms, dst: slot }, vec![ready(s)]);
                }
                let tag = tag(Direction::Forward, q * (t_size - 1) + s);
                let mut sends = vec![Transfer { peer: next_t, buf: slot, tag }];
                let mut recvs = vec![Transfer { peer: prev_t, buf: Buf::Slot(incoming[s % incoming.len()]), tag }];
                if let Some((send, recv)) = ahead.take() {
                    sends.push(send);
                    recvs.push(recv);
                    arrived.push(Some(self.steps.len()));
                }
                self.push(Lane::Comm, Action::Exchange { sends, recvs }, std::mem::take(&mut deps));
            }
            if let Some((send, recv)) = ahead {
                // No reduce-scatter transfer to go with (T = 1).
                let exchange = Action::Exchange { sends: vec![send], recvs: vec![recv] };
                arrived.push(Some(self.push(Lane::Comm, exchange, vec![last])));
            }
            let mut terms = vec![Buf::Slot(set[t])];
            if t_size > 1 {
                terms.push(Buf::Slot(incoming[(t_size - 2) % incoming.len()]));
            }
            let dst = Buf::OutBlock(t * chunks + fine);
            // The own row block's product is the ring's last (`row_at`).
            reduced.push(self.push(Lane::Comm, Action::Sum { terms, dst }, vec![last]));
        }
    }

    /// Two gathers (`Pattern::GatherGather`): rank `f * T + t` holds row
    /// block t of its x and w's block f (a block of w's rows, the
    /// contraction). x's blocks travel round the T ranks that share f and
    /// w's round the F ranks that share t, the two rings' steps in turn,
    /// and every received block is kept (the gathered operands, as the
    /// unfused form holds them). The product of x's row block p and w's
    /// block q (x_p's columns of block q times w_q) is added into row block
    /// p of the result, in order of the later of the two blocks' arrivals:
    /// the products each exchange makes possible run while the next
    /// exchange travels. Nothing but the own blocks is needed at the head,
    /// and nothing travels after the last product.
    /// The products add up in the output itself where its dtype is the
    /// accumulator's (`into_out`), else in a result slot summed into it at
    /// the end. Sequential: every block gathered first, then the products.
    /// Sliced (`chunks` > 1): each row block of x travels as `chunks` row
    /// chunks, an exchange each (the own one is `XBlock(u)`), and each
    /// chunk is multiplied as it arrives, so what is left after the last
    /// transfer is one chunk's products, not one block's. Product
    /// `((p * chunks + u) * F + q)`: chunk u of x's row block p by w's block q.
    fn gather_gather(&mut self, gathered: usize, into_out: bool, chunks: usize, sequential: bool) {
        let (n, f_size) = (self.n, gathered);
        let t_size = n / f_size;
        let (f, t) = (self.rank / t_size, self.rank % t_size);
        let rank_of = |f: usize, t: usize| (f % f_size) * t_size + t % t_size;
        let (next_f, prev_f) = (rank_of(f + 1, t), rank_of(f + f_size - 1, t));
        let (next_t, prev_t) = (rank_of(f, t + 1), rank_of(f, t + t_size - 1));
        let x_slots = self.slots(SlotKind::Input, (t_size - 1) * chunks);
        let w_slots = self.slots(SlotKind::Weight, f_size - 1);
        let result = if into_out { Buf::Out } else { Buf::Slot(self.slot(SlotKind::Result)) };
        // Chunk u of the block of x held at step s (row block t - s), and w's block at step c (block f - c).
        let x_at = |s: usize, u: usize| match s {
            0 if chunks == 1 => Buf::X,
            0 => Buf::XBlock(u),
            _ => Buf::Slot(x_slots[(s - 1) * chunks + u]),
        };
        let w_at = |c: usize| if c == 0 { Buf::W } else { Buf::Slot(w_slots[c - 1]) };
        // Each ring's step e is an exchange of its own (x's: one per chunk),
        // w's then x's: a device's one port carries them in turn, and the
        // products of w's block e + 1 with the blocks of x already here run
        // while x's block e + 1 travels. The last transfer is then a chunk
        // of x, so what waits for it is that chunk's products, not every
        // product of a block of w. And where devices start apart (a host
        // running several), w's exchanges with an f-peer come before x's
        // with t-peers at every step, so a late device's block of w does
        // not land on a port still busy with a block of x.
        // x_in[s][u] / w_in[c]: the exchange that brought chunk u of step
        // s's block of x / step c's of w.
        let mut x_in: Vec<Vec<Option<StepId>>> = vec![vec![None; chunks]];
        let mut w_in: Vec<Option<StepId>> = vec![None];
        for e in 0..(t_size - 1).max(f_size - 1) {
            if e + 1 < f_size {
                let tag = tag(Direction::Backward, e);
                let sends = vec![Transfer { peer: next_f, buf: w_at(e), tag }];
                let recvs = vec![Transfer { peer: prev_f, buf: w_at(e + 1), tag }];
                w_in.push(Some(self.push(Lane::Comm, Action::Exchange { sends, recvs }, vec![])));
            }
            if e + 1 < t_size {
                let mut arrived = Vec::with_capacity(chunks);
                for u in 0..chunks {
                    let tag = tag(Direction::Forward, e * chunks + u);
                    let sends = vec![Transfer { peer: next_t, buf: x_at(e, u), tag }];
                    let recvs = vec![Transfer { peer: prev_t, buf: x_at(e + 1, u), tag }];
                    arrived.push(Some(self.push(Lane::Comm, Action::Exchange { sends, recvs }, vec![])));
                }
                x_in.push(arrived);
            }
        }
        let last_exchange = self.steps.iter().rposition(|s| s.lane == Lane::Comm);
        // Every product (s, u, c): chunk u of step s's block of x by step
        // c's block of w, in the order the later of its two blocks arrives
        // (stable among products whose blocks arrived together). A row
        // chunk's first product is the one with w's step-0 block (the own),
        // so the rest add onto it.
        let mut products: Vec<(usize, usize, usize)> = vec![];
        for e in 0..t_size.max(f_size) {
            let new_x = (e < t_size).then(|| (0..chunks).flat_map(move |u| (0..f_size.min(e)).map(move |c| (e, u, c))));
            let new_w =
                (e < f_size).then(|| (0..t_size.min(e + 1)).flat_map(move |s| (0..chunks).map(move |u| (s, u, e))));
            products.extend(new_x.into_iter().flatten().chain(new_w.into_iter().flatten()));
        }
        products.sort_by_key(|&(s, u, c)| x_in[s][u].max(w_in[c]));
        let mut waited: Option<StepId> = None;
        for (s, u, c) in products {
            let (p, q) = ((t + t_size - s) % t_size, (f + f_size - c) % f_size);
            // The later of the two exchanges this product needs (sequential: the last of all).
            let needs = if sequential { last_exchange } else { x_in[s][u].max(w_in[c]) };
            let deps: Vec<StepId> = needs.filter(|&exchange| Some(exchange) > waited).into_iter().collect();
            waited = waited.max(needs);
            let action = Action::Matmul {
                block: (p * chunks + u) * f_size + q,
                src: x_at(s, u),
                with: w_at(c),
                dst: result,
                accumulate: c > 0,
            };
            self.push(Lane::Compute, action, deps);
        }
        if !into_out {
            self.push(Lane::Compute, Action::Sum { terms: vec![result], dst: Buf::Out }, vec![]);
        }
    }

    /// A gather along the contraction, then a reduce-scatter
    /// (`Pattern::GatherContractScatter`): rank `f * T + t` holds block t of
    /// x's columns (the contraction). They travel round the T ranks that
    /// share f by row blocks, every received one kept: the rows of the
    /// partial the ring sends first, then the next one's. The product of
    /// row block q of x's block p with the second operand's rows p is added
    /// into the partial of the result's row block q, and the F partials are
    /// reduce-scattered round the F ranks that share t, the adds on the
    /// comm lane. The first partial the ring sends is computed first, each
    /// of its products as its rows arrive, so it is complete while the
    /// other rows travel and the ring starts as the gather ends; every
    /// other partial while the ring's previous step travels; the own
    /// partial, which the ring ends with, last. Two slots hold the partials
    /// in turn, so the workspace holds two of them, not F. Sequential: the
    /// gather, then every product (F slots), then the reduce-scatter.
    fn gather_contract_scatter(&mut self, scattered: usize, sequential: bool) {
        let (n, f_size) = (self.n, scattered);
        let t_size = n / f_size;
        let (f, t) = (self.rank / t_size, self.rank % t_size);
        let rank_of = |f: usize, t: usize| (f % f_size) * t_size + t % t_size;
        let (next_f, prev_f) = (rank_of(f + 1, t), rank_of(f + f_size - 1, t));
        let (next_t, prev_t) = (rank_of(f, t + 1), rank_of(f, t + t_size - 1));
        let x_slots = self.slots(SlotKind::Input, (t_size - 1) * f_size);
        // Two partials in turn (sequential: all F, every product before the
        // ring): the ring's step s sends the partial computed s-th, and the
        // partial of step s + 2 is written into its slot once that send is
        // done, so the products run at most one ring step ahead of it.
        let kept = if sequential { f_size } else { f_size.min(2) };
        let partials = self.slots(SlotKind::Partial, kept);
        let partial_at = |s: usize| Buf::Slot(partials[s % kept]);
        let incoming = self.slots(SlotKind::Partial, (f_size - 1).min(2));
        // The row block the ring reduces at its step s; the own one last.
        let block_at = |s: usize| (f + 2 * f_size - 1 - s) % f_size;
        // Row block q of the block of x held at step e (block t - e of the
        // columns): x travels in its F row blocks, each the rows of one
        // partial, in the order the ring takes the partials. So the partial
        // it sends first is complete once its rows have arrived, and is
        // multiplied while the other rows travel: the ring starts as the
        // gather ends. arrived[q][e]: the exchange that brought it.
        let x_at = |e: usize, q: usize| if e == 0 { Buf::XBlock(q) } else { Buf::Slot(x_slots[(e - 1) * f_size + q]) };
        let mut arrived: Vec<Vec<Option<StepId>>> = vec![vec![None; t_size]; f_size];
        for s in 0..f_size {
            let q = block_at(s);
            for e in 0..t_size - 1 {
                let tag = tag(Direction::Forward, s * (t_size - 1) + e);
                let sends = vec![Transfer { peer: next_t, buf: x_at(e, q), tag }];
                let recvs = vec![Transfer { peer: prev_t, buf: x_at(e + 1, q), tag }];
                arrived[q][e + 1] = Some(self.push(Lane::Comm, Action::Exchange { sends, recvs }, vec![]));
            }
        }
        // The gather's last exchange (what a sequential plan's products wait for).
        let gather_end = arrived.iter().flatten().flatten().max().copied();
        // done[s]: the last product of the partial the ring takes at step s;
        // sent[s]: the ring's exchange of it. Each ring step is pushed once
        // its partial is complete (sequential: all after the last product).
        let mut done: Vec<StepId> = vec![];
        let mut sent: Vec<StepId> = vec![];
        let mut waited: Option<StepId> = None;
        for s in 0..f_size {
            let q = block_at(s);
            for (step, &rows_arrived) in arrived[q].iter().enumerate() {
                let p = (t + t_size - step) % t_size;
                // Its rows of x (sequential: the whole gather).
                let needs = if sequential { gather_end } else { rows_arrived };
                let mut deps: Vec<StepId> = needs.filter(|&e| Some(e) > waited).into_iter().collect();
                waited = waited.max(needs);
                if step == 0 && s >= kept {
                    // The slot's previous partial has left.
                    deps.push(sent[s - kept]);
                }
                let action = Action::Matmul {
                    block: q * t_size + p,
                    src: x_at(step, q),
                    with: Buf::W,
                    dst: partial_at(s),
                    accumulate: step > 0,
                };
                let product = self.push(Lane::Compute, action, deps);
                if step + 1 == t_size {
                    done.push(product);
                }
            }
            let ready = match sequential {
                true if s + 1 == f_size => f_size - 1,
                true => 0,
                false => (s + 1).min(f_size - 1),
            };
            while sent.len() < ready {
                let r = sent.len();
                let (slot, complete) = (partial_at(r), if sequential { done[f_size - 1] } else { done[r] });
                if r > 0 {
                    let terms = vec![slot, Buf::Slot(incoming[(r - 1) % incoming.len()])];
                    self.push(Lane::Comm, Action::Sum { terms, dst: slot }, vec![complete]);
                }
                let tag = tag(Direction::Backward, r);
                let sends = vec![Transfer { peer: next_f, buf: slot, tag }];
                let recvs = vec![Transfer { peer: prev_f, buf: Buf::Slot(incoming[r % incoming.len()]), tag }];
                let deps = if r == 0 { vec![complete] } else { vec![] };
                sent.push(self.push(Lane::Comm, Action::Exchange { sends, recvs }, deps));
            }
        }
        let mut terms = vec![partial_at(f_size - 1)];
        if f_size > 1 {
            terms.push(Buf::Slot(incoming[(f_size - 2) % incoming.len()]));
        }
        self.push(Lane::Comm, Action::Sum { terms, dst: Buf::Out }, vec![done[f_size - 1]]);
    }

    /// Copies the block received at step s into its output block.
    fn copy_in(&mut self, s: usize, slot: Buf, arrived: StepId) -> StepId {
        let from = self.block(-(s as isize));
        self.push(Lane::Compute, Action::Sum { terms: vec![slot], dst: Buf::OutBlock(from) }, vec![arrived])
    }
}

/// The block a double-buffered gather chain holds at step s: local data at
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
