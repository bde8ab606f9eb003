use super::*;
use crate::plan::{plan, Action, Schedule};

fn op(dims: &[i64]) -> Operand<'_> {
    Operand { dims, dtype: DType::F32 }
}

/// (kind, x dims, w dims, out dims, dimension) of one valid case.
pub(crate) type Case = (OpKind, Vec<i64>, Vec<i64>, Vec<i64>, i64);

/// One valid case per kind, N = 4 (also used by the CUDA backend's tests).
pub(crate) fn cases() -> Vec<Case> {
    use OpKind::*;
    vec![
        (AllGatherMatmul, vec![2, 3, 5, 8], vec![8, 6], vec![2, 12, 5, 6], 1),
        (AllGatherMatmulContract, vec![5, 3], vec![12, 7], vec![5, 7], 0),
        (MatmulAllGather, vec![8, 3], vec![5, 8], vec![5, 12], 0),
        (MatmulAllGatherContract, vec![3, 7], vec![5, 12], vec![5, 7], 0),
        (MatmulReduceScatter, vec![2, 12, 5, 8], vec![8, 6], vec![2, 3, 5, 6], 1),
        (MatmulReduceScatterCols, vec![5, 8], vec![8, 12], vec![5, 3], 0),
        (AllToAllMatmul, vec![4, 3, 8], vec![8, 6], vec![4, 3, 6], 0),
        (AllToAllMatmulContract, vec![4, 5, 3], vec![12, 6], vec![5, 6], 0),
        (MatmulAllToAll, vec![4, 3, 8], vec![8, 6], vec![4, 3, 6], 0),
        (MatmulAllToAllCols, vec![5, 8], vec![8, 12], vec![4, 5, 3], 0),
        (MatmulAllReduce, vec![12, 8], vec![8, 6], vec![12, 6], 0),
        // F = 2 (w's gather axis) x T = 2 (x's).
        (AllGatherBothMatmul, vec![3, 10], vec![5, 6], vec![6, 6], 2),
        (AllGatherContractMatmulReduceScatter, vec![6, 5], vec![10, 6], vec![3, 6], 2),
    ]
}

#[test]
fn every_gemm_of_every_plan_stays_inside_its_buffers() {
    for (kind, x, w, out, d) in cases() {
        let p = Problem::new(kind, op(&x), op(&w), op(&out), d, 4).unwrap();
        let sizes = p.sizes();
        for rank in 0..4 {
            let pl = plan(p.pattern(), Schedule::Ring, 4, rank);
            for step in &pl.steps {
                let Action::Matmul { block, src, dst, .. } = step.action else { continue };
                for g in p.gemms(block, src, dst) {
                    assert_eq!(g.lhs.1.cols, g.rhs.1.rows, "{kind:?}: inner dims");
                    assert_eq!((g.dst.rows, g.dst.cols), (g.lhs.1.rows, g.rhs.1.cols), "{kind:?}: dst shape");
                    let src_len = match src {
                        Buf::X | Buf::XBlock(_) => sizes.x,
                        _ => sizes.travel,
                    };
                    let side_len = |side| if side == Side::Src { src_len } else { sizes.w };
                    assert!(g.lhs.1.end() <= side_len(g.lhs.0), "{kind:?} lhs {:?}", g.lhs);
                    // A row block of x names the rows a product reads (the
                    // gather-contract-scatter kind's row blocks: strided
                    // kinds read across them).
                    if let (Buf::XBlock(j), OpKind::AllGatherContractMatmulReduceScatter) = (src, kind) {
                        let rows = p.x_block(j).expect("a row block of x");
                        let (start, end) = (g.lhs.1.offset, g.lhs.1.end());
                        assert!(rows.start <= start && end <= rows.end, "{kind:?} {src:?} {rows:?}: {:?}", g.lhs);
                    }
                    assert!(g.rhs.1.end() <= side_len(g.rhs.0), "{kind:?} rhs {:?}", g.rhs);
                    let dst_len = match dst {
                        Buf::Slot(i) => match pl.slots[i] {
                            crate::plan::SlotKind::Partial => sizes.partial,
                            _ => sizes.result,
                        },
                        _ => sizes.result,
                    };
                    assert!(g.dst.end() <= dst_len, "{kind:?} dst {:?} in {dst:?}", g.dst);
                }
            }
        }
    }
}

#[test]
fn output_blocks_of_gathers_tile_the_output_exactly_once() {
    for (kind, x, w, out, d) in cases() {
        if kind.pattern() != (Pattern::Gather { accumulate: false }) {
            continue;
        }
        let p = Problem::new(kind, op(&x), op(&w), op(&out), d, 4).unwrap();
        let mut hits = vec![0u8; p.sizes().result];
        for j in 0..4 {
            for g in p.gemms(j, Buf::X, Buf::OutBlock(j)) {
                for r in 0..g.dst.rows {
                    for c in 0..g.dst.cols {
                        hits[g.dst.offset + r * g.dst.row_stride + c] += 1;
                    }
                }
            }
        }
        assert!(hits.iter().all(|&h| h == 1), "{kind:?}");
    }
}

#[test]
fn folds_leading_dims_into_segments() {
    let p = Problem::new(OpKind::AllGatherMatmul, op(&[2, 3, 5, 8]), op(&[8, 6]), op(&[2, 12, 5, 6]), 1, 4).unwrap();
    assert_eq!((p.outer, p.seg), (2, 15));
    let p =
        Problem::new(OpKind::MatmulReduceScatter, op(&[2, 12, 5, 8]), op(&[8, 6]), op(&[2, 3, 5, 6]), 1, 4).unwrap();
    assert_eq!((p.outer, p.seg), (2, 15));
}

#[test]
fn errors_name_the_argument() {
    type Case<'a> = (OpKind, &'a [i64], &'a [i64], &'a [i64], i64, &'a str);
    let cases: [Case; 11] = [
        (OpKind::AllGatherMatmul, &[8], &[8, 6], &[8, 6], 0, "`x` must have rank >= 2"),
        (OpKind::AllGatherMatmul, &[4, 8], &[8, 6, 1], &[16, 6], 0, "`w` must be 2-D"),
        (OpKind::AllGatherMatmul, &[4, 7], &[8, 6], &[16, 6], 0, "`w` must be 2-D [7, n]"),
        (OpKind::AllGatherMatmul, &[4, 8], &[8, 6], &[16, 6], 1, "`gather_dimension` must be in [0, 1)"),
        (OpKind::MatmulReduceScatter, &[6, 8], &[8, 6], &[1, 6], 0, "divisible by the axis size 4"),
        (OpKind::AllGatherMatmul, &[4, 8], &[8, 6], &[4, 6], 0, "expected [16, 6]"),
        (OpKind::MatmulReduceScatterCols, &[5, 8], &[8, 10], &[5, 2], 0, "columns of `w` (10) must be divisible"),
        (OpKind::AllToAllMatmul, &[3, 3, 8], &[8, 6], &[4, 3, 6], 0, "`x` must be [4, rows, cols]"),
        // The FSDP gathers pass the gathered weights first: errors name them `w`.
        (OpKind::MatmulAllGather, &[-1, 6], &[5, 8], &[5, 24], 0, "`w` has a negative dim"),
        (OpKind::MatmulAllGatherContract, &[2, 6], &[5, 8, 1], &[5, 6], 0, "`x` must be 2-D"),
        // One GEMM per segment in every step: their count is bounded (a frame's dims are not trusted).
        (OpKind::AllGatherMatmul, &[1 << 23, 1, 1, 8], &[8, 6], &[1 << 23, 1, 4, 6], 2, "segments before its dim 2"),
    ];
    for (kind, x, w, out, d, want) in cases {
        let e = Problem::new(kind, op(x), op(w), op(out), d, 4).unwrap_err();
        assert!(e.message().contains(want), "{e} should contain {want}");
    }
}

#[test]
fn result_dims_are_the_ones_problem_new_checks() {
    for (kind, x, w, out, d) in cases() {
        let dims = result_dims(kind, &x, &w, d, 4).unwrap();
        assert_eq!(dims.iter().map(|&v| v as i64).collect::<Vec<_>>(), out, "{kind:?}");
    }
}

#[test]
fn sliced_gemms_tile_the_output_and_stay_inside_their_buffers() {
    use crate::plan::Buf;
    // (kind, x, w, out) over N = 4, gathered or scattered along dim 0.
    let cases = [
        (OpKind::AllGatherMatmul, vec![12, 5], vec![5, 3], vec![48, 3]),
        (OpKind::MatmulReduceScatter, vec![48, 5], vec![5, 3], vec![12, 3]),
    ];
    for (kind, x, w, out) in cases {
        for k in [1, 2, 3, 4, 6, 12] {
            let p = Problem::new(kind, op(&x), op(&w), op(&out), 0, 4).unwrap().sliced(k).unwrap();
            let sizes = p.sizes();
            for rank in 0..4 {
                let pl = plan(kind.pattern(), Schedule::Sliced { slices: k }, 4, rank);
                // Each output element written once; for a scatter, each x row read once.
                let mut written = vec![0u32; sizes.result];
                let mut read = vec![0u32; sizes.x];
                for step in &pl.steps {
                    match &step.action {
                        Action::Matmul { block, src, dst, .. } => {
                            for g in p.gemms(*block, *src, *dst) {
                                assert_eq!((g.dst.rows, g.dst.cols), (g.lhs.1.rows, g.rhs.1.cols));
                                let src_len = if matches!(src, Buf::Slot(_)) { sizes.travel } else { sizes.x };
                                assert!(g.lhs.1.end() <= src_len, "{kind:?} k={k}: lhs {:?}", g.lhs);
                                if !matches!(src, Buf::Slot(_)) {
                                    (g.lhs.1.offset..g.lhs.1.end()).for_each(|i| read[i] += 1);
                                }
                                match dst {
                                    Buf::Slot(_) => assert!(g.dst.end() <= sizes.partial, "{kind:?} k={k}"),
                                    _ => (g.dst.offset..g.dst.end()).for_each(|i| written[i] += 1),
                                }
                            }
                        }
                        Action::Sum { dst: dst @ Buf::OutBlock(_), .. } => {
                            p.out_range(*dst).for_each(|i| written[i] += 1);
                        }
                        _ => {}
                    }
                }
                assert!(written.iter().all(|&c| c == 1), "{kind:?} k={k} rank={rank}: {written:?}");
                if kind == OpKind::MatmulReduceScatter {
                    assert!(read.iter().all(|&c| c == 1), "{kind:?} k={k} rank={rank}: {read:?}");
                    assert_eq!(sizes.partial * k, sizes.result);
                } else {
                    // The own x is read once (its chunks), and a chunk is what travels.
                    assert!(read.iter().all(|&c| c == 1), "{kind:?} k={k} rank={rank}: {read:?}");
                    assert_eq!(sizes.travel * k, sizes.x);
                    assert_eq!(p.x_block(0).map(|r| r.len()), Some(sizes.travel), "XBlock(c) is chunk c");
                }
            }
        }
    }
}

#[test]
fn slicing_needs_leading_rows_that_divide() {
    let p = |x: &[i64], out: &[i64], d| Problem::new(OpKind::AllGatherMatmul, op(x), op(&[5, 3]), op(out), d, 4);
    let e = p(&[12, 5], &[48, 3], 0).unwrap().sliced(5).unwrap_err();
    assert!(e.to_string().contains("5 must divide 12"), "{e}");
    let e = p(&[2, 6, 5], &[2, 24, 3], 1).unwrap().sliced(2).unwrap_err();
    assert!(e.to_string().contains("leading"), "{e}");
    let cols = Problem::new(OpKind::MatmulReduceScatterCols, op(&[6, 5]), op(&[5, 8]), op(&[6, 2]), 0, 4).unwrap();
    assert!(cols.sliced(2).unwrap_err().to_string().contains("row gather, scatter or all-reduce"));
}

#[test]
fn sizes_that_overflow_are_invalid_arguments_naming_what_overflowed() {
    use OpKind::*;
    let huge = 1i64 << 62;
    let expect = |kind, x: &[i64], w: &[i64], out: &[i64], ranks, part: &str| match Problem::new(
        kind,
        op(x),
        op(w),
        op(out),
        0,
        ranks,
    ) {
        Err(crate::error::Error::InvalidArgument(m)) => assert!(m.contains(part), "{part:?} not in {m:?}"),
        other => panic!("{kind:?} {x:?} {w:?} {out:?}: expected INVALID_ARGUMENT, got {other:?}"),
    };
    // kb * N overflows (a release build used to wrap and allocate 8.8 TB).
    expect(AllGatherMatmulContract, &[2, huge], &[8, 3], &[2, 3], 8, "the columns of `x` times the axis size");
    expect(MatmulAllGatherContract, &[huge, 3], &[2, 8], &[2, 3], 8, "the rows of the gathered operand");
    expect(MatmulAllGather, &[4, huge], &[2, 4], &[2, 4], 8, "the columns of the gathered operand");
    // The gathered dim times N, and elements past what one allocation holds.
    expect(AllGatherMatmul, &[1 << 58, 2], &[2, 3], &[1 << 61, 3], 8, "gathered dim 0 of `x` times the axis size");
    expect(AllGatherMatmul, &[1 << 40, 1 << 30], &[1 << 30, 1], &[1 << 40, 1], 1, "`x` of shape");
    // A zero dim does not hide an overflowing product of the others.
    expect(MatmulReduceScatter, &[0, huge, huge, 2], &[2, 3], &[0, huge, huge, 3], 1, "`x` of shape");
    // N x rows past i64: a clear message, not "a negative dim".
    expect(AllGatherMatmul, &[1 << 57, 2], &[2, 3], &[1 << 59, 3], 4, "`out` of shape");
}

#[test]
fn a_tile_count_is_bounded_by_the_rows_before_anything_is_planned() {
    let (x, w, out) = ([0i64, 8], [8i64, 6], [0i64, 6]);
    let p = Problem::new(OpKind::AllGatherMatmul, op(&x), op(&w), op(&out), 0, 4).unwrap();
    // 0 rows: one tile at most (it used to plan 2^40 tiles and abort).
    assert!(p.tiled(1).is_ok());
    let e = p.tiled(1 << 40).unwrap_err();
    assert!(e.message().contains("tiles=1099511627776 is more than the 0 rows of each block"), "{e}");
    let (x, out) = ([6i64, 8], [24i64, 6]);
    let p = Problem::new(OpKind::AllGatherMatmul, op(&x), op(&w), op(&out), 0, 4).unwrap();
    assert!(p.tiled(6).is_ok() && p.tiled(3).is_ok());
    assert!(p.tiled(7).unwrap_err().message().contains("more than the 6 rows"));
}

#[test]
fn problems_with_nothing_to_compute_are_trivial() {
    use OpKind::*;
    let trivial =
        |kind, x: &[i64], w: &[i64], out: &[i64]| Problem::new(kind, op(x), op(w), op(out), 0, 4).unwrap().is_trivial();
    assert!(trivial(AllGatherMatmul, &[0, 8], &[8, 6], &[0, 6]));
    assert!(trivial(AllGatherMatmul, &[3, 0], &[0, 6], &[12, 6]), "k = 0: zeros");
    assert!(trivial(MatmulAllGather, &[0, 2], &[3, 0], &[3, 8]), "k = 0: zeros");
    assert!(trivial(MatmulReduceScatterCols, &[3, 0], &[0, 8], &[3, 2]));
    assert!(!trivial(AllGatherMatmul, &[1, 8], &[8, 6], &[4, 6]));
}
