//! The discrete-event simulation of N ranks' plans on one machine.
//!
//! Time advances from event to event. Between events every running piece of
//! work progresses at a constant rate: a GEMM or sum at full speed, or at
//! `p / running` of it when all devices share `p` processors; a transfer's
//! bytes at the bandwidth of the ports or links it uses, split equally among
//! the transfers using them. A transfer posts its bytes first and then pays
//! the latency (per hop on a routed ring); it is eager, as the CPU transport
//! is: it leaves when its exchange starts, whether or not the receiver has
//! posted its receive yet. An exchange ends when all its sends and receives
//! have arrived.

use super::{Link, Topology};
use crate::error::{Error, Result};
use crate::plan::{Action, Buf, Lane, Plan, Step, Tag};
use std::collections::HashMap;

/// When each step of each rank ran.
#[derive(Debug, Clone, PartialEq)]
pub struct Timeline {
    /// When the last step of any rank ended (seconds from the start).
    pub makespan: f64,
    /// `steps[rank][step id] = (start, end)`.
    pub steps: Vec<Vec<(f64, f64)>>,
}

impl Timeline {
    pub fn span(&self, rank: usize, step: usize) -> (f64, f64) {
        self.steps[rank][step]
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Port {
    Out(usize),
    In(usize),
    Link(usize, usize),
}

#[derive(Debug, Clone, Copy)]
enum Phase {
    Data { left: f64 },
    Latency { until: f64 },
}

#[derive(Debug)]
struct Flight {
    key: (usize, usize, Tag),
    sender_step: usize,
    bytes: f64,
    hops: Vec<(usize, usize)>,
    hop: usize,
    phase: Phase,
}

fn route(topology: Topology, n: usize, from: usize, to: usize) -> Vec<(usize, usize)> {
    if from == to {
        return vec![];
    }
    match topology {
        Topology::Switch => vec![(from, to)],
        Topology::Ring => {
            let forward = (to + n - from) % n;
            let (step, count) = if forward <= n - forward { (1, forward) } else { (n - 1, n - forward) };
            let mut at = from;
            (0..count)
                .map(|_| {
                    let next = (at + step) % n;
                    let hop = (at, next);
                    at = next;
                    hop
                })
                .collect()
        }
    }
}

fn ports(topology: Topology, (a, b): (usize, usize)) -> Vec<Port> {
    match topology {
        Topology::Switch => vec![Port::Out(a), Port::In(b)],
        Topology::Ring => vec![Port::Link(a, b)],
    }
}

impl Flight {
    /// The phase of a hop that starts now.
    fn start_hop(&mut self, now: f64, link: &Link) {
        self.phase = if self.bytes > 0.0 && link.bytes_per_s.is_finite() {
            Phase::Data { left: self.bytes }
        } else {
            Phase::Latency { until: now + link.latency_s }
        };
    }
}

/// The step id of work that no step waits for (an exchange's host copies).
const BACKGROUND: usize = usize::MAX;

/// Runs `plans` (`plans[r]` is rank r's) together. `work_s(rank, step)` is the
/// time a GEMM or sum takes alone, and for an exchange the processor time it
/// costs besides its transfers (host copies; 0 where copy engines move the
/// bytes); `bytes(rank, buf)` the size of a sent buffer.
pub fn simulate(
    plans: &[Plan],
    link: &Link,
    shared_processors: Option<f64>,
    work_s: &dyn Fn(usize, &Step) -> f64,
    bytes: &dyn Fn(usize, Buf) -> f64,
) -> Result<Timeline> {
    let n = plans.len();
    for (r, p) in plans.iter().enumerate() {
        if p.rank != r || p.n != n {
            return Err(Error::InvalidArgument(format!(
                "sim: plans[{r}] is rank {} of {}, expected rank {r} of {n}",
                p.rank, p.n
            )));
        }
    }
    let lanes: Vec<[Vec<usize>; 2]> = plans
        .iter()
        .map(|p| {
            [p.lane_steps(Lane::Compute).map(|s| s.id).collect(), p.lane_steps(Lane::Comm).map(|s| s.id).collect()]
        })
        .collect();
    let mut pos = vec![[0usize; 2]; n];
    let mut started: Vec<Vec<bool>> = plans.iter().map(|p| vec![false; p.steps.len()]).collect();
    let mut spans: Vec<Vec<(f64, f64)>> = plans.iter().map(|p| vec![(f64::NAN, f64::NAN); p.steps.len()]).collect();
    let mut done: Vec<Vec<bool>> = plans.iter().map(|p| vec![false; p.steps.len()]).collect();
    let total: usize = plans.iter().map(|p| p.steps.len()).sum();
    let mut finished = 0usize;
    let mut outstanding: Vec<Vec<usize>> = plans.iter().map(|p| vec![0; p.steps.len()]).collect();
    // Posted receives not yet arrived: key -> receiving step; arrived messages not yet posted for.
    let mut posted: HashMap<(usize, usize, Tag), usize> = HashMap::new();
    let mut early: HashMap<(usize, usize, Tag), ()> = HashMap::new();
    let mut work: Vec<(usize, usize, f64)> = vec![];
    let mut flights: Vec<Flight> = vec![];
    let mut now = 0.0f64;

    loop {
        // Start every step that can start now, until nothing changes.
        loop {
            let mut progressed = false;
            for r in 0..n {
                for l in 0..2 {
                    while let Some(&id) = lanes[r][l].get(pos[r][l]) {
                        if started[r][id] {
                            if done[r][id] {
                                pos[r][l] += 1;
                                progressed = true;
                                continue;
                            }
                            break;
                        }
                        let step = &plans[r].steps[id];
                        if !step.deps.iter().all(|&d| done[r].get(d).copied().unwrap_or(false)) {
                            break;
                        }
                        started[r][id] = true;
                        spans[r][id].0 = now;
                        progressed = true;
                        let mut complete = false;
                        match &step.action {
                            Action::Exchange { sends, recvs } => {
                                for t in sends {
                                    let key = (r, t.peer, t.tag);
                                    let mut f = Flight {
                                        key,
                                        sender_step: id,
                                        bytes: bytes(r, t.buf),
                                        hops: route(link.topology, n, r, t.peer),
                                        hop: 0,
                                        phase: Phase::Latency { until: now },
                                    };
                                    if f.hops.is_empty() {
                                        // A message to oneself arrives at once.
                                        if let Some(recv) = posted.remove(&key) {
                                            outstanding[t.peer][recv] -= 1;
                                        } else {
                                            early.insert(key, ());
                                        }
                                        continue;
                                    }
                                    f.start_hop(now, link);
                                    outstanding[r][id] += 1;
                                    flights.push(f);
                                }
                                for t in recvs {
                                    let key = (t.peer, r, t.tag);
                                    if early.remove(&key).is_none() {
                                        posted.insert(key, id);
                                        outstanding[r][id] += 1;
                                    }
                                }
                                complete = outstanding[r][id] == 0;
                                // Processor time the exchange costs (host copies), which
                                // competes with the GEMMs but holds up no step.
                                let copies = work_s(r, step);
                                if copies > 0.0 {
                                    work.push((r, BACKGROUND, copies));
                                }
                            }
                            _ => {
                                let s = work_s(r, step).max(0.0);
                                if s > 0.0 {
                                    work.push((r, id, s));
                                } else {
                                    complete = true;
                                }
                            }
                        }
                        if complete {
                            done[r][id] = true;
                            spans[r][id].1 = now;
                            finished += 1;
                        }
                    }
                }
            }
            if !progressed {
                break;
            }
        }
        if finished == total {
            break;
        }
        if work.is_empty() && flights.is_empty() {
            let stuck: Vec<String> = (0..n)
                .flat_map(|r| {
                    let lanes = &lanes[r];
                    let pos = pos[r];
                    (0..2).filter_map(move |l| lanes[l].get(pos[l]).map(|id| format!("rank {r} step {id}")))
                })
                .collect();
            return Err(Error::InvalidArgument(format!("sim: the plans deadlock at {}", stuck.join(", "))));
        }

        // Rates between now and the next event.
        let work_rate = match shared_processors {
            Some(p) if (work.len() as f64) > p => p / work.len() as f64,
            _ => 1.0,
        };
        let mut users: HashMap<Port, usize> = HashMap::new();
        for f in &flights {
            if matches!(f.phase, Phase::Data { .. }) {
                for p in ports(link.topology, f.hops[f.hop]) {
                    *users.entry(p).or_default() += 1;
                }
            }
        }
        let flight_rate = |f: &Flight| -> f64 {
            if !matches!(f.phase, Phase::Data { .. }) {
                return link.bytes_per_s;
            }
            let most = ports(link.topology, f.hops[f.hop]).iter().map(|p| users[p]).max().unwrap_or(1);
            link.bytes_per_s / most as f64
        };
        let rates: Vec<f64> = flights.iter().map(flight_rate).collect();
        let ttf_flight = |f: &Flight, rate: f64| match f.phase {
            Phase::Data { left } => left / rate,
            Phase::Latency { until } => (until - now).max(0.0),
        };
        let mut dt = f64::INFINITY;
        for &(_, _, left) in &work {
            dt = dt.min(left / work_rate);
        }
        for (f, &rate) in flights.iter().zip(&rates) {
            dt = dt.min(ttf_flight(f, rate));
        }
        let close = |ttf: f64| ttf <= dt * (1.0 + 1e-9) + 1e-18;

        // Advance.
        let then = now + dt;
        let mut ended: Vec<(usize, usize)> = vec![];
        work.retain_mut(|(r, id, left)| {
            if close(*left / work_rate) {
                ended.push((*r, *id));
                false
            } else {
                *left -= dt * work_rate;
                true
            }
        });
        let mut arrived: Vec<Flight> = vec![];
        let mut still = vec![];
        for (mut f, rate) in flights.drain(..).zip(rates) {
            if !close(ttf_flight(&f, rate)) {
                if let Phase::Data { left } = &mut f.phase {
                    *left -= dt * rate;
                }
                still.push(f);
                continue;
            }
            match f.phase {
                Phase::Data { .. } => {
                    f.phase = Phase::Latency { until: then + link.latency_s };
                    still.push(f);
                }
                Phase::Latency { .. } => {
                    f.hop += 1;
                    if f.hop < f.hops.len() {
                        f.start_hop(then, link);
                        still.push(f);
                    } else {
                        arrived.push(f);
                    }
                }
            }
        }
        flights = still;
        now = then;
        for f in arrived {
            let (from, to, _) = f.key;
            outstanding[from][f.sender_step] -= 1;
            if outstanding[from][f.sender_step] == 0 && started[from][f.sender_step] {
                ended.push((from, f.sender_step));
            }
            if let Some(recv) = posted.remove(&f.key) {
                outstanding[to][recv] -= 1;
                if outstanding[to][recv] == 0 {
                    ended.push((to, recv));
                }
            } else {
                early.insert(f.key, ());
            }
        }
        for (r, id) in ended {
            if id != BACKGROUND && !done[r][id] {
                done[r][id] = true;
                spans[r][id].1 = now;
                finished += 1;
            }
        }
    }
    let makespan = spans.iter().flatten().map(|s| s.1).fold(0.0, f64::max);
    Ok(Timeline { makespan, steps: spans })
}
