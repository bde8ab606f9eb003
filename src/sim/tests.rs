use super::*;
use crate::plan::{Action, Direction, Lane, Pattern, Plan, Schedule, Step, Tag, Transfer};
use crate::problem::{OpKind, Operand, Problem};

/// A machine whose GEMMs cost exactly their flops at `flops` per second and
/// whose links cost `latency + bytes / bandwidth`: the ideal formulas hold.
fn synthetic(flops: f64, bytes_per_s: f64, latency_s: f64, topology: Topology) -> Machine {
    Machine {
        name: "synthetic".into(),
        compute: Compute {
            peak_16: flops,
            peak_32: flops,
            peak_64: flops,
            efficiency: 1.0,
            memory_bytes_per_s: f64::INFINITY,
            touch_bytes_per_s: f64::INFINITY,
            half_dim: 0.0,
            waves: None,
            overhead_s: 0.0,
        },
        link: Link { bytes_per_s, latency_s, topology },
        shared_processors: None,
        network: None,
    }
}

fn problem(kind: OpKind, n: usize, x: &[i64], w: &[i64], out: &[i64]) -> Problem {
    let op = |dims| Operand { dims, dtype: DType::F32 };
    Problem::new(kind, op(x), op(w), op(out), 0, n).unwrap()
}

/// all_gather_matmul with x [m, k], w [k, c] on n ranks.
fn ag(n: usize, m: i64, k: i64, c: i64) -> Problem {
    problem(OpKind::AllGatherMatmul, n, &[m, k], &[k, c], &[n as i64 * m, c])
}

fn close(a: f64, b: f64, tol: f64) -> bool {
    (a - b).abs() <= tol * b.abs()
}

/// (t_c, t_m) of one AG step: one block's GEMM and one block's transfer.
fn step_times(m: &Machine, (mm, k, c): (i64, i64, i64)) -> (f64, f64) {
    let t_c = 2.0 * (mm * k * c) as f64 / m.compute.peak_32;
    let t_m = m.link.latency_s + (mm * k * 4) as f64 / m.link.bytes_per_s;
    (t_c, t_m)
}

#[test]
fn per_step_ag_ring_matches_the_ideal_formula() {
    let shape = (64, 128, 96);
    // Compute-bound, balanced and comm-bound links.
    for bandwidth in [1e9, 1e8, 3e7, 1e7] {
        for n in [2, 3, 4, 8] {
            let machine = synthetic(1e9, bandwidth, 5e-6, Topology::Switch);
            let (t_c, t_m) = step_times(&machine, shape);
            let p = ag(n, shape.0, shape.1, shape.2);
            let got = predict(&p, Schedule::Ring, n, &machine, Mode::Full).unwrap().makespan;
            let ideal = t_c + (n - 1) as f64 * t_c.max(t_m);
            assert!(close(got, ideal, 0.01), "n={n} bw={bandwidth}: {got} vs ideal {ideal} (t_c {t_c}, t_m {t_m})");
        }
    }
}

#[test]
fn sequential_ag_is_the_sum_of_compute_and_comm() {
    let shape = (32, 64, 48);
    for bandwidth in [1e9, 1e7] {
        for n in [2, 4, 8] {
            let machine = synthetic(1e9, bandwidth, 2e-6, Topology::Switch);
            let (t_c, t_m) = step_times(&machine, shape);
            let p = ag(n, shape.0, shape.1, shape.2);
            let got = predict(&p, Schedule::Sequential, n, &machine, Mode::Full).unwrap().makespan;
            let ideal = n as f64 * t_c + (n - 1) as f64 * t_m;
            assert!(close(got, ideal, 0.01), "n={n}: {got} vs {ideal}");
        }
    }
}

#[test]
fn bidirectional_beats_ring_on_a_ring_when_comm_bound() {
    let shape = (64, 128, 16);
    for n in [4, 8] {
        let machine = synthetic(1e10, 1e8, 1e-6, Topology::Ring);
        let (t_c, t_m) = step_times(&machine, shape);
        assert!(t_m > 2.0 * t_c);
        let p = ag(n, shape.0, shape.1, shape.2);
        let ring = predict(&p, Schedule::Ring, n, &machine, Mode::Full).unwrap().makespan;
        let bidi = predict(&p, Schedule::Bidirectional, n, &machine, Mode::Full).unwrap().makespan;
        assert!(bidi < 0.75 * ring, "n={n}: bidirectional {bidi} vs ring {ring}");
        // ⌈(N-1)/2⌉ transfer steps instead of N-1.
        let ideal = n.div_ceil(2) as f64 * t_m.max(2.0 * t_c) + 2.0 * t_c;
        assert!(bidi <= ideal * 1.01, "n={n}: {bidi} vs {ideal}");
        // On a switch both directions share the one out port: no gain.
        let switch = synthetic(1e10, 1e8, 1e-6, Topology::Switch);
        let ring_s = predict(&p, Schedule::Ring, n, &switch, Mode::Full).unwrap().makespan;
        let bidi_s = predict(&p, Schedule::Bidirectional, n, &switch, Mode::Full).unwrap().makespan;
        assert!(bidi_s >= 0.9 * ring_s, "n={n}: switch bidirectional {bidi_s} vs ring {ring_s}");
    }
}

/// Plans by hand: rank `from[i]` sends `bytes` to rank `to[i]`, one exchange per rank.
fn exchanges(n: usize, pairs: &[(usize, usize)]) -> Vec<Plan> {
    (0..n)
        .map(|r| {
            let tag = Tag { direction: Direction::Forward, step: 0 };
            let buf = crate::plan::Buf::X;
            let sends = pairs.iter().filter(|p| p.0 == r).map(|p| Transfer { peer: p.1, buf, tag }).collect();
            let recvs = pairs.iter().filter(|p| p.1 == r).map(|p| Transfer { peer: p.0, buf, tag }).collect();
            let step = Step { id: 0, lane: Lane::Comm, action: Action::Exchange { sends, recvs }, deps: vec![] };
            Plan {
                pattern: Pattern::Gather { accumulate: false },
                schedule: Schedule::Ring,
                n,
                rank: r,
                slots: vec![],
                steps: vec![step],
            }
        })
        .collect()
}

#[test]
fn a_switch_port_is_split_between_concurrent_transfers() {
    let (bw, lat, bytes) = (1e9, 1e-5, 1e6);
    let run = |topology, n, pairs: &[(usize, usize)]| {
        let link = Link { bytes_per_s: bw, latency_s: lat, topology };
        simulate(&exchanges(n, pairs), &link, None, &|_, _| 0.0, &|_, _| bytes).unwrap()
    };
    let one = lat + bytes / bw;
    let two = lat + 2.0 * bytes / bw;
    // One transfer alone.
    assert!(close(run(Topology::Switch, 2, &[(1, 0)]).makespan, one, 1e-9));
    // Two senders into one in port, and one sender out to two peers: shared.
    let t = run(Topology::Switch, 3, &[(1, 0), (2, 0)]);
    assert!(close(t.span(0, 0).1, two, 1e-9), "{t:?}");
    assert!(close(run(Topology::Switch, 3, &[(0, 1), (0, 2)]).makespan, two, 1e-9));
    // Disjoint ports run at full speed.
    assert!(close(run(Topology::Switch, 4, &[(0, 1), (2, 3)]).makespan, one, 1e-9));
    // A ring has one link per neighbour and direction: both neighbours at once is free.
    assert!(close(run(Topology::Ring, 4, &[(0, 1), (0, 3)]).makespan, one, 1e-9));
    // A non-neighbour is two hops, store-and-forward.
    assert!(close(run(Topology::Ring, 4, &[(0, 2)]).makespan, 2.0 * one, 1e-9));
    // Everyone sending to the next rank uses disjoint links.
    assert!(close(run(Topology::Ring, 4, &[(0, 1), (1, 2), (2, 3), (3, 0)]).makespan, one, 1e-9));
}

#[test]
fn shared_processors_slow_concurrent_compute() {
    let p = ag(4, 64, 64, 64);
    let mut machine = synthetic(1e9, f64::INFINITY, 0.0, Topology::Switch);
    let alone = predict(&p, Schedule::Ring, 4, &machine, Mode::ComputeOnly).unwrap().makespan;
    machine.shared_processors = Some(2.0);
    let shared = predict(&p, Schedule::Ring, 4, &machine, Mode::ComputeOnly).unwrap().makespan;
    assert!(close(shared, 2.0 * alone, 1e-6), "{shared} vs {alone}");
}

/// Operands of every kind for `n` ranks (the layouts `OpKind` documents).
fn every_kind(n: usize) -> Vec<Problem> {
    let n64 = n as i64;
    use OpKind::*;
    vec![
        problem(AllGatherMatmul, n, &[16, 32], &[32, 24], &[16 * n64, 24]),
        problem(AllGatherMatmulContract, n, &[16, 8], &[8 * n64, 24], &[16, 24]),
        problem(MatmulAllGather, n, &[32, 8], &[16, 32], &[16, 8 * n64]),
        problem(MatmulAllGatherContract, n, &[8, 24], &[16, 8 * n64], &[16, 24]),
        problem(MatmulReduceScatter, n, &[16 * n64, 32], &[32, 24], &[16, 24]),
        problem(MatmulReduceScatterCols, n, &[16, 32], &[32, 8 * n64], &[16, 8]),
        problem(AllToAllMatmul, n, &[n64, 8, 32], &[32, 24], &[n64, 8, 24]),
        problem(AllToAllMatmulContract, n, &[n64, 16, 8], &[8 * n64, 24], &[16, 24]),
        problem(MatmulAllToAll, n, &[n64, 8, 32], &[32, 24], &[n64, 8, 24]),
        problem(MatmulAllToAllCols, n, &[16, 32], &[32, 8 * n64], &[n64, 16, 8]),
        problem(MatmulAllReduce, n, &[16 * n64, 32], &[32, 24], &[16 * n64, 24]),
    ]
}

#[test]
fn every_kind_and_schedule_runs_to_the_end_and_respects_the_floor() {
    let machines = [
        Machine::h100_nvlink(),
        Machine::h100_pcie(),
        Machine::cpu_here(Some(30.0), 2),
        synthetic(1e9, 1e7, 1e-5, Topology::Ring),
    ];
    for n in 1..=8 {
        for p in every_kind(n) {
            for machine in &machines {
                let choice = choose(&p, n, machine).unwrap();
                let best = choice.time(choice.best).unwrap();
                for &(schedule, t) in &choice.predictions {
                    assert!(t.is_finite() && t > 0.0);
                    assert!(best <= t, "{:?} n={n}: best {best} > {schedule:?} {t}", p.kind);
                    assert!(
                        choice.floor() <= t * (1.0 + 1e-9),
                        "{:?} n={n} {}: floor {} > {schedule:?} {t}",
                        p.kind,
                        machine.name,
                        choice.floor()
                    );
                    // Every step of every rank ran, lanes in order.
                    let timeline = predict(&p, schedule, n, machine, Mode::Full).unwrap();
                    for (r, steps) in timeline.steps.iter().enumerate() {
                        let plan = crate::plan::plan(p.kind.pattern(), schedule, n, r);
                        for lane in [Lane::Compute, Lane::Comm] {
                            let mut last = 0.0;
                            for s in plan.lane_steps(lane) {
                                let (start, end) = steps[s.id];
                                assert!(start >= last && end >= start, "{:?} {schedule:?} rank {r}", p.kind);
                                for &d in &s.deps {
                                    assert!(steps[d].1 <= start);
                                }
                                last = end;
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn the_floor_is_one_whole_gemm_so_the_pieces_loss_shows() {
    // Exact flops, free memory traffic and no fixed cost: the joined GEMM
    // does every kind's work, so it takes the pieces' time exactly.
    let exact = synthetic(1e9, 1e8, 1e-6, Topology::Switch);
    for n in 1..=8 {
        for p in every_kind(n) {
            let choice = choose(&p, n, &exact).unwrap();
            let whole = whole_gemm_s(&p, n, &exact).unwrap();
            assert!(close(whole, choice.t_compute, 1e-9), "{:?} n={n}: {whole} vs {}", p.kind, choice.t_compute);
        }
    }
    // Each kind joins its pieces along the dim its blocks cut: the local
    // product of `every_kind`'s shapes, priced as one GEMM where the shape
    // matters (waves), and shared by the ranks on a host's cores.
    for n in 2..=8 {
        let n_ = n;
        let expected = [
            (16 * n_, 32, 24), // all_gather_matmul: the gathered rows
            (16, 8 * n_, 24),  // over the contraction
            (16, 32, 8 * n_),  // matmul_all_gather: the gathered columns
            (16, 8 * n_, 24),  // over the contraction
            (16 * n_, 32, 24), // matmul_reduce_scatter: the whole local product
            (16, 32, 8 * n_),  // its columns
            (8 * n_, 32, 24),  // all_to_all_matmul: every peer's rows
            (16, 8 * n_, 24),  // over the contraction
            (8 * n_, 32, 24),  // matmul_all_to_all: every peer's rows
            (16, 32, 8 * n_),  // its columns
        ];
        for (p, (m, k, c)) in every_kind(n).iter().zip(expected) {
            for (machine, share) in
                [(Machine::h100_nvlink(), 1.0), (Machine::cpu_here(Some(30.0), 2), (n as f64 / 2.0).max(1.0))]
            {
                let want = share * machine.compute.gemm_s(m, k, c, p.input, p.accumulator(), false);
                let got = whole_gemm_s(p, n, &machine).unwrap();
                assert!(close(got, want, 1e-12), "{:?} n={n} on {}: {got} vs {want}", p.kind, machine.name);
            }
        }
    }
    // On an H100, 8 pieces of 128 rows lose their last waves against one
    // GEMM of 1024 rows: the ring no longer reads as the floor.
    let bf16 = |dims| Operand { dims, dtype: DType::BF16 };
    let p = Problem::new(OpKind::AllGatherMatmul, bf16(&[128, 8192]), bf16(&[8192, 3584]), bf16(&[1024, 3584]), 0, 8)
        .unwrap();
    let machine = Machine::h100_nvlink();
    let choice = choose(&p, 8, &machine).unwrap();
    let one = machine.compute.gemm_s(1024, 8192, 3584, DType::BF16, p.accumulator(), false);
    assert!(close(choice.t_gemm, one, 1e-12), "{} vs {one}", choice.t_gemm);
    assert!(choice.t_gemm < 0.9 * choice.t_compute, "{} vs {}", choice.t_gemm, choice.t_compute);
    assert!(choice.time(Schedule::Ring).unwrap() > 1.1 * choice.floor());
}

#[test]
fn sequential_is_about_compute_plus_comm_on_the_presets() {
    for machine in [Machine::h100_nvlink(), Machine::h200_nvlink(), Machine::h100_pcie()] {
        for n in [4, 8] {
            let p = ag(n, 2048, 8192, 4096);
            let choice = choose(&p, n, &machine).unwrap();
            let seq = choice.time(Schedule::Sequential).unwrap();
            let sum = choice.t_compute + choice.t_comm;
            assert!(close(seq, sum, 0.02), "{} n={n}: {seq} vs {sum}", machine.name);
            let (own_compute, own_comm) = choice.parts[0];
            assert_eq!(choice.predictions[0].0, Schedule::Sequential);
            assert!(close(seq, own_compute + own_comm, 1e-6), "{seq} vs {own_compute} + {own_comm}");
            // Auto runs an overlapped schedule within the tiled margin of the fastest.
            let auto = auto_schedule(&p, n, &machine);
            assert!(matches!(auto, Schedule::Ring | Schedule::Bidirectional | Schedule::Tiled { .. }));
            let (t_auto, t_best) = (choice.time(auto).unwrap(), choice.time(choice.best).unwrap());
            assert!(t_auto <= t_best / 0.97 * (1.0 + 1e-9), "{} n={n}: {auto:?} {t_auto} vs {t_best}", machine.name);
            // Overlap wins on a big GEMM.
            assert_ne!(choice.best, Schedule::Sequential);
        }
    }
}

#[test]
fn presets_rank_as_their_figures_say() {
    // The same large AG: PCIe's slower link leaves more exposed than NVLink.
    let p = ag(8, 1024, 8192, 8192);
    let nv = choose(&p, 8, &Machine::h100_nvlink()).unwrap();
    let pcie = choose(&p, 8, &Machine::h100_pcie()).unwrap();
    assert!(pcie.t_comm > 5.0 * nv.t_comm);
    assert!(pcie.time(pcie.best).unwrap() > nv.time(nv.best).unwrap());
    // H200's faster HBM never makes a GEMM slower.
    let h200 = choose(&p, 8, &Machine::h200_nvlink()).unwrap();
    assert!(h200.t_compute <= nv.t_compute);
    // A measured rate calibrates cpu_here.
    let slow = choose(&p, 8, &Machine::cpu_here(Some(10.0), 2)).unwrap();
    let fast = choose(&p, 8, &Machine::cpu_here(Some(40.0), 2)).unwrap();
    assert!(close(slow.t_compute, 4.0 * fast.t_compute, 0.05));
}

#[test]
fn machine_specs_parse_with_overrides_and_name_their_errors() {
    let m = Machine::from_spec("cpu_here:gbytes_per_s=0.5,latency_us=20,topology=ring", Some(25.0), 2).unwrap();
    assert_eq!((m.link.bytes_per_s, m.link.topology), (0.5e9, Topology::Ring));
    assert!(close(m.link.latency_s, 20e-6, 1e-12));
    assert_eq!(m.compute.peak_32, 25e9);
    assert_eq!(Machine::from_spec("h200_nvlink", None, 2).unwrap(), Machine::h200_nvlink());
    let e = Machine::from_spec("tpu", None, 2).unwrap_err().to_string();
    assert!(e.contains("unknown machine") && e.contains("h100_nvlink"), "{e}");
    let e = Machine::from_spec("h100_pcie:topology=mesh", None, 2).unwrap_err().to_string();
    assert!(e.contains("mesh"), "{e}");
}

#[test]
fn explain_renders_every_number() {
    let (x, w, out) = ([256i64, 512], [512i64, 256], [1024i64, 256]);
    let operand = |dims| Operand { dims, dtype: DType::F32 };
    let problem = Problem::new(OpKind::AllGatherMatmul, operand(&x), operand(&w), operand(&out), 0, 4).unwrap();
    let machine = Machine::from_spec("h100_nvlink", None, 2).unwrap();
    let choice = choose(&problem, 4, &machine).unwrap();
    let json = explain::explain(&problem, 4, &machine, &choice).unwrap().to_string();
    for key in
        ["\"schedules\"", "\"sequential\"", "\"ring\"", "\"bidirectional\"", "\"sliced(4)\"", "\"floor\"", "\"plan\""]
    {
        assert!(json.contains(key), "{key} missing in {json}");
    }
}

#[test]
fn per_step_rs_ring_matches_the_ideal_formula() {
    // The adds are free on this machine (infinite memory bandwidth).
    let (m, k, c) = (64i64, 96i64, 128i64);
    for bandwidth in [1e9, 1e8, 1e7] {
        for n in [2usize, 4, 8] {
            let machine = synthetic(1e9, bandwidth, 5e-6, Topology::Switch);
            let t_c = 2.0 * (m * k * c) as f64 / 1e9;
            let t_m = 5e-6 + (m * c * 4) as f64 / bandwidth;
            let p = problem(OpKind::MatmulReduceScatter, n, &[n as i64 * m, k], &[k, c], &[m, c]);
            let got = predict(&p, Schedule::Ring, n, &machine, Mode::Full).unwrap().makespan;
            let ideal = t_c + (n - 1) as f64 * t_c.max(t_m);
            assert!(close(got, ideal, 0.01), "n={n} bw={bandwidth}: {got} vs {ideal}");
            let seq = predict(&p, Schedule::Sequential, n, &machine, Mode::Full).unwrap().makespan;
            assert!(close(seq, n as f64 * t_c + (n - 1) as f64 * t_m, 0.01), "n={n}: sequential {seq}");
        }
    }
}

/// Data slicing with k chunks: c + (k-1)·max(c, p) + p, with c one chunk's
/// matmuls and p one chunk's whole ring collective.
#[test]
fn sliced_schedules_match_the_slicing_formula() {
    let (m, kk, cols) = (64i64, 128i64, 96i64);
    let latency = 4e-6;
    for bandwidth in [1e9, 1e8, 2e7] {
        for n in [2usize, 4, 8] {
            for slices in [1usize, 2, 4, 8] {
                let machine = synthetic(1e9, bandwidth, latency, Topology::Switch);
                let s = slices as f64;
                let steps = (n - 1) as f64;
                // AG: chunk c's gather moves a chunk of x N-1 times, then N chunk GEMMs.
                let c = n as f64 * 2.0 * (m * kk * cols) as f64 / s / 1e9;
                let p = steps * (latency + (m * kk * 4) as f64 / s / bandwidth);
                let ag = ag(n, m, kk, cols);
                let got = predict(&ag, Schedule::Sliced { slices }, n, &machine, Mode::Full).unwrap().makespan;
                let ideal = p + (s - 1.0) * c.max(p) + c;
                assert!(close(got, ideal, 0.01), "AG n={n} k={slices} bw={bandwidth}: {got} vs {ideal}");
                // RS: N chunk GEMMs, then the chunk's reduce-scatter of partials.
                let p = steps * (latency + (m * cols * 4) as f64 / s / bandwidth);
                let rs = problem(OpKind::MatmulReduceScatter, n, &[n as i64 * m, kk], &[kk, cols], &[m, cols]);
                let got = predict(&rs, Schedule::Sliced { slices }, n, &machine, Mode::Full).unwrap().makespan;
                let ideal = c + (s - 1.0) * c.max(p) + p;
                assert!(close(got, ideal, 0.01), "RS n={n} k={slices} bw={bandwidth}: {got} vs {ideal}");
            }
        }
    }
}

/// Tile-level triggering: when communication dominates, only one tile's
/// compute is left outside the transfers (the first, RS; the last, AG), where
/// the per-step ring leaves a whole block's; when compute dominates, both
/// take the N block GEMMs.
#[test]
fn tiles_leave_one_tile_of_compute_exposed() {
    let (m, kk, cols) = (64i64, 128i64, 96i64);
    let latency = 1e-6;
    for n in [2usize, 4, 8] {
        let ag = ag(n, m, kk, cols);
        let rs = problem(OpKind::MatmulReduceScatter, n, &[n as i64 * m, kk], &[kk, cols], &[m, cols]);
        let t_c = 2.0 * (m * kk * cols) as f64 / 1e9;
        for (p, bytes) in [(&ag, m * kk * 4), (&rs, m * cols * 4)] {
            for tiles in [2usize, 4, 8] {
                // Comm-bound: each block's transfer takes 3 t_c.
                let machine = synthetic(1e9, bytes as f64 / (3.0 * t_c), latency, Topology::Switch);
                let t_comm = (n - 1) as f64 * (3.0 * t_c + tiles as f64 * latency);
                let ring = predict(p, Schedule::Ring, n, &machine, Mode::Full).unwrap().makespan;
                let tiled = predict(p, Schedule::Tiled { tiles }, n, &machine, Mode::Full).unwrap().makespan;
                let label = format!("{} n={n} tiles={tiles}", p.kind.name());
                assert!(tiled >= t_comm * (1.0 - 1e-9), "{label}: {tiled} below T_comm {t_comm}");
                assert!(tiled <= t_comm + t_c / tiles as f64 * 1.01, "{label}: {tiled} vs {t_comm} + one tile");
                assert!(tiled < ring, "{label}: tiled {tiled} vs ring {ring}");
                // Compute-bound: each block's transfer takes t_c / 4.
                let machine = synthetic(1e9, bytes as f64 / (0.25 * t_c), latency, Topology::Switch);
                let tiled = predict(p, Schedule::Tiled { tiles }, n, &machine, Mode::Full).unwrap().makespan;
                assert!(close(tiled, n as f64 * t_c, 0.02), "{label}: {tiled} vs N t_c {}", n as f64 * t_c);
            }
        }
    }
}

/// The predicted trace (`explain::predicted_timeline`) is the simulation's
/// timeline: a device per rank, each step a slice at its predicted start
/// and end, each lane's call as long as its last step. A comm-bound ring's
/// matmuls wait for their blocks, and the trace says so.
#[test]
fn the_predicted_trace_is_the_simulated_timeline() {
    use crate::trace::Kind;
    let m = synthetic(1e12, 1e9, 1e-6, Topology::Switch);
    let problem = ag(4, 64, 256, 128);
    let timeline = model::predict(&problem, Schedule::Ring, 4, &m, model::Mode::Full).unwrap();
    let events = explain::predicted_timeline(&problem, Schedule::Ring, 4, &m).unwrap();
    let ns = |s: f64| 1_000 + (s * 1e9) as u64;
    for rank in 0..4 {
        let mine: Vec<_> = events.iter().filter(|e| e.device == rank as i64).collect();
        let plan = crate::plan::plan(Pattern::Gather { accumulate: false }, Schedule::Ring, 4, rank);
        for step in &plan.steps {
            let (start, end) = timeline.span(rank, step.id);
            let slice = mine.iter().find(|e| e.step == Some(step.id) && e.kind != Kind::Wait).unwrap();
            assert_eq!((slice.start_ns, slice.end_ns), (ns(start), ns(end)), "rank {rank} step {}", step.id);
            assert_eq!(slice.lane, step.lane);
        }
        let calls: Vec<_> = mine.iter().filter(|e| e.kind == Kind::Call).collect();
        assert_eq!(calls.len(), 2, "a call slice per lane");
        let last = mine.iter().map(|e| e.end_ns).max().unwrap();
        assert!(calls.iter().any(|c| c.end_ns == last));
        assert!(mine.iter().any(|e| e.kind == Kind::Wait && e.lane == Lane::Compute), "rank {rank}: no wait");
    }
}
