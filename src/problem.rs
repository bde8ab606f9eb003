//! One rank's problem: the operands' shapes checked against the op, and
//! folded into blocks of rows (leading dims before the gathered or scattered
//! dim become `outer` segments per block, so no transpose is ever needed).
#![forbid(unsafe_code)]

use crate::bail;
use crate::dtype::DType;
use crate::error::Result;
use crate::plan::{Dims, OpKind};

/// Shapes and dtypes of one call's operands, as decoded from the frame.
#[derive(Debug, Clone, Copy)]
pub struct Operand<'a> {
    pub dims: &'a [i64],
    pub dtype: DType,
}

/// A block of rows is `outer` segments of `seg_rows` rows. In an array that
/// holds all N blocks, segment p of block j starts at row `(p*N + j)*seg_rows`;
/// in an array of one block, at `p*seg_rows`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Problem {
    pub op: OpKind,
    pub ranks: usize,
    pub outer: usize,
    pub seg_rows: usize,
    pub dims: Dims,
}

impl Problem {
    /// Checks `x`, `w` and `out` for `op` over `ranks` devices, gathering or
    /// scattering `dimension` of `x` (and of the result).
    pub fn new(op: OpKind, x: Operand, w: Operand, out: Operand, dimension: i64, ranks: usize) -> Result<Problem> {
        let name = op.name();
        let rank = x.dims.len();
        let dim_name = match op {
            OpKind::AllGatherMatmul => "gather_dimension",
            OpKind::MatmulReduceScatter => "scatter_dimension",
        };
        if rank < 2 {
            bail!(InvalidArgument, "{name}: `x` must have rank >= 2, got shape {:?}", x.dims);
        }
        if w.dims.len() != 2 {
            bail!(InvalidArgument, "{name}: `w` must be 2-D, got shape {:?}", w.dims);
        }
        if x.dims.iter().chain(w.dims).any(|&d| d < 0) {
            bail!(InvalidArgument, "{name}: negative dimension in `x` {:?} or `w` {:?}", x.dims, w.dims);
        }
        let (k, n) = (w.dims[0] as usize, w.dims[1] as usize);
        if x.dims[rank - 1] as usize != k {
            bail!(
                InvalidArgument,
                "{name}: `x` contracts its last dim ({}) with `w`'s first ({k}); they must be equal",
                x.dims[rank - 1]
            );
        }
        if x.dtype != w.dtype {
            bail!(
                InvalidArgument,
                "{name}: `x` is {} but `w` is {}; they must have one dtype",
                x.dtype.name(),
                w.dtype.name()
            );
        }
        if dimension < 0 || dimension as usize >= rank - 1 {
            bail!(
                InvalidArgument,
                "{name}: `{dim_name}` must be in [0, {}) for `x` of rank {rank}, got {dimension}",
                rank - 1
            );
        }
        let d = dimension as usize;
        let sizes: Vec<usize> = x.dims.iter().map(|&v| v as usize).collect();
        let outer: usize = sizes[..d].iter().product();
        let inner: usize = sizes[d + 1..rank - 1].iter().product();
        let mut expected = sizes.clone();
        expected[rank - 1] = n;
        let seg_rows = match op {
            OpKind::AllGatherMatmul => {
                expected[d] *= ranks;
                sizes[d] * inner
            }
            OpKind::MatmulReduceScatter => {
                if sizes[d] % ranks != 0 {
                    bail!(
                        InvalidArgument,
                        "{name}: `x` dim {d} ({}) must be divisible by the axis size {ranks}",
                        sizes[d]
                    );
                }
                expected[d] /= ranks;
                sizes[d] / ranks * inner
            }
        };
        let expected: Vec<i64> = expected.into_iter().map(|v| v as i64).collect();
        if out.dims != expected.as_slice() {
            bail!(
                InvalidArgument,
                "{name}: result shape {:?} does not match the operands: expected {expected:?}",
                out.dims
            );
        }
        let dims = Dims { block_rows: outer * seg_rows, k, n, input: x.dtype, output: out.dtype };
        Ok(Problem { op, ranks, outer, seg_rows, dims })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(dims: &[i64]) -> Operand<'_> {
        Operand { dims, dtype: DType::F32 }
    }

    #[test]
    fn folds_leading_dims_into_segments() {
        // x [2, 3, 5, 8] gathered on dim 1 over 4 ranks -> out [2, 12, 5, 6].
        let p =
            Problem::new(OpKind::AllGatherMatmul, op(&[2, 3, 5, 8]), op(&[8, 6]), op(&[2, 12, 5, 6]), 1, 4).unwrap();
        assert_eq!((p.outer, p.seg_rows, p.dims.block_rows), (2, 15, 30));
        // x [2, 12, 5, 8] scattered on dim 1 over 4 ranks -> out [2, 3, 5, 6].
        let p = Problem::new(OpKind::MatmulReduceScatter, op(&[2, 12, 5, 8]), op(&[8, 6]), op(&[2, 3, 5, 6]), 1, 4)
            .unwrap();
        assert_eq!((p.outer, p.seg_rows, p.dims.block_rows), (2, 15, 30));
    }

    #[test]
    fn errors_name_the_argument() {
        type Case<'a> = (OpKind, &'a [i64], &'a [i64], &'a [i64], i64, &'a str);
        let cases: [Case; 6] = [
            (OpKind::AllGatherMatmul, &[8], &[8, 6], &[8, 6], 0, "`x` must have rank >= 2"),
            (OpKind::AllGatherMatmul, &[4, 8], &[8, 6, 1], &[16, 6], 0, "`w` must be 2-D"),
            (OpKind::AllGatherMatmul, &[4, 7], &[8, 6], &[16, 6], 0, "contracts its last dim (7)"),
            (OpKind::AllGatherMatmul, &[4, 8], &[8, 6], &[16, 6], 1, "`gather_dimension` must be in [0, 1)"),
            (OpKind::MatmulReduceScatter, &[6, 8], &[8, 6], &[1, 6], 0, "divisible by the axis size 4"),
            (OpKind::AllGatherMatmul, &[4, 8], &[8, 6], &[4, 6], 0, "expected [16, 6]"),
        ];
        for (kind, x, w, out, d, want) in cases {
            let e = Problem::new(kind, op(x), op(w), op(out), d, 4).unwrap_err();
            assert!(e.message().contains(want), "{e} should contain {want}");
        }
    }
}
