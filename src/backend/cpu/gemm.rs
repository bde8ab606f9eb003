//! The CPU matrix product: a safe, checked wrapper over the `gemm` crate,
//! whose API takes raw pointers. This is the backend's only unsafe code.
//!
//! The right-hand side (the stationary `w` of every fused op but the
//! FSDP gathers) is packed by us, once per call where every block multiplies
//! the same `w` ([`pack_rhs`]), into panels of [`PANEL`] columns, each
//! panel's rows contiguous: exactly the layout the crate's micro-kernels
//! read, so the crate, told never to pack that operand itself
//! (`set_lhs_packing_threshold_single_thread`; after its row-major
//! transposition our right-hand side is its left-hand side), multiplies
//! straight from it. The crate has no API for operands it packed before, and
//! left to itself repacks `w` at every step of a ring: 17% of the GEMM time
//! at the demo's shapes (measured, 8 devices on 2 cores).

use super::numeric::Accum;
use crate::error::{Error, Result};
use crate::problem::View;

/// Columns of one panel of a packed right-hand side: a multiple of every
/// vector width the crate's micro-kernels use (8 or 16 f32, 4 or 8 f64).
pub const PANEL: usize = 64;

/// A right-hand side in panels (see the module's doc): panel p holds columns
/// `p * PANEL..` for all `k` rows, row after row, `width(p)` each.
pub struct PackedRhs<'p, A> {
    data: &'p [A],
    k: usize,
    n: usize,
}

impl<'p, A> PackedRhs<'p, A> {
    /// A `k x n` right-hand side that `pack_rhs` packed into `data` before.
    pub fn packed(data: &'p [A], k: usize, n: usize) -> Result<Self> {
        match data.get(..k * n) {
            Some(data) => Ok(PackedRhs { data, k, n }),
            None => Err(Error::Internal(format!("{k}x{n} packed in {} elements", data.len()))),
        }
    }

    fn width(&self, panel: usize) -> usize {
        PANEL.min(self.n - panel * PANEL)
    }
}

/// Packs the `k x n` view `rhs` into `into` (at least `k * n` elements);
/// [`PackedRhs::packed`] reads it back.
pub fn pack_rhs<A: Accum>(rhs: (&[A], View), into: &mut [A]) -> Result<()> {
    let (r, rv) = rhs;
    let (k, n) = (rv.rows, rv.cols);
    check("rhs", rv, r.len())?;
    let size = into.len();
    let into = into.get_mut(..k * n).ok_or_else(|| Error::Internal(format!("{k}x{n} packed into {size} elements")))?;
    for (p, panel) in into.chunks_mut((PANEL * k).max(1)).enumerate() {
        let first = p * PANEL;
        let width = PANEL.min(n - first);
        for (row, packed) in panel.chunks_exact_mut(width).enumerate() {
            let start = rv.offset + row * rv.row_stride + first;
            packed.copy_from_slice(&r[start..start + width]);
        }
    }
    Ok(())
}

fn check(name: &str, view: View, len: usize) -> Result<()> {
    if view.end() > len || (view.rows > 1 && view.row_stride < view.cols) {
        return Err(Error::Internal(format!("matmul {name} view {view:?} does not fit {len} elements")));
    }
    Ok(())
}

/// `dst (+)= lhs @ rhs`, `rhs` packed by [`pack_rhs`]: one product per panel.
pub fn matmul_packed<A: Accum>(
    lhs: (&[A], View),
    rhs: &PackedRhs<'_, A>,
    dst: (&mut [A], View),
    accumulate: bool,
) -> Result<()> {
    let ((l, lv), (d, dv)) = (lhs, dst);
    if dv.cols != rhs.n {
        return Err(Error::Internal(format!("a packed product of {} columns into {}", rhs.n, dv.cols)));
    }
    for p in 0..rhs.n.div_ceil(PANEL) {
        let width = rhs.width(p);
        let panel = View { offset: p * PANEL * rhs.k, rows: rhs.k, cols: width, row_stride: width };
        let into = View { offset: dv.offset + p * PANEL, cols: width, ..dv };
        matmul((l, lv), (rhs.data, panel), (&mut *d, into), accumulate)?;
    }
    Ok(())
}

/// `dst (+)= lhs @ rhs` on row-major strided views of the three slices.
pub fn matmul<A: Accum>(lhs: (&[A], View), rhs: (&[A], View), dst: (&mut [A], View), accumulate: bool) -> Result<()> {
    let ((l, lv), (r, rv), (d, dv)) = (lhs, rhs, dst);
    let (m, k, n) = (lv.rows, lv.cols, rv.cols);
    if rv.rows != k || dv.rows != m || dv.cols != n {
        return Err(Error::Internal(format!("matmul of {m}x{k} by {}x{n} into {}x{}", rv.rows, dv.rows, dv.cols)));
    }
    for (name, view, len) in [("lhs", lv, l.len()), ("rhs", rv, r.len()), ("dst", dv, d.len())] {
        check(name, view, len)?;
    }
    // Our right-hand side is packed already (or used once, when packing it
    // costs what the crate's own packing would): the crate must not repack it.
    static NO_REPACKING: std::sync::Once = std::sync::Once::new();
    NO_REPACKING.call_once(|| gemm::set_lhs_packing_threshold_single_thread(usize::MAX));
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                d[dv.offset + i * dv.row_stride..][..n].fill(A::default());
            }
        }
        return Ok(());
    }
    // SAFETY: each view was checked above to lie inside its slice, with rows
    // that do not overlap (row stride >= cols), so every access the kernel
    // makes through these pointers and strides is in bounds; `dst` is a unique
    // borrow, so it aliases neither input. A is f32 or f64, both of which
    // `gemm` supports (it panics on other types, never reached).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            d.as_mut_ptr().add(dv.offset),
            1,
            dv.row_stride as isize,
            accumulate,
            l.as_ptr().add(lv.offset),
            1,
            lv.row_stride as isize,
            r.as_ptr().add(rv.offset),
            1,
            rv.row_stride as isize,
            A::one(),
            A::one(),
            false,
            false,
            false,
            // Each device call runs on its own thread already.
            gemm::Parallelism::None,
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(offset: usize, rows: usize, cols: usize, row_stride: usize) -> View {
        View { offset, rows, cols, row_stride }
    }

    #[test]
    fn strided_views_match_a_naive_product() {
        let (m, k, n) = (5, 13, 7);
        // lhs is the column block 1 of a [m, 3k] matrix, dst the column block 2 of a [m, 3n] one.
        let lhs: Vec<f64> = (0..m * 3 * k).map(|i| ((i * 7 % 11) as f64) - 5.0).collect();
        let rhs: Vec<f64> = (0..k * n).map(|i| ((i * 5 % 13) as f64) * 0.5 - 3.0).collect();
        let mut dst = vec![1.0; m * 3 * n];
        let (lv, rv, dv) = (view(k, m, k, 3 * k), view(0, k, n, n), view(2 * n, m, n, 3 * n));
        matmul((&lhs, lv), (&rhs, rv), (&mut dst, dv), true).unwrap();
        for i in 0..m {
            for j in 0..3 * n {
                let want = if j >= 2 * n {
                    1.0 + (0..k).map(|p| lhs[i * 3 * k + k + p] * rhs[p * n + j - 2 * n]).sum::<f64>()
                } else {
                    1.0
                };
                assert!((dst[i * 3 * n + j] - want).abs() < 1e-9, "({i}, {j})");
            }
        }
    }

    #[test]
    fn views_outside_the_slices_are_an_error_not_a_crash() {
        let mut dst = vec![0f32; 4];
        let e =
            matmul((&[0.0; 5], view(0, 2, 3, 3)), (&[0.0; 6], view(0, 3, 2, 2)), (&mut dst, view(0, 2, 2, 2)), false);
        assert!(e.is_err());
    }

    #[test]
    fn empty_contraction_gives_zeros() {
        let mut dst = vec![1f32; 6];
        matmul((&[], view(0, 2, 0, 0)), (&[], view(0, 0, 3, 3)), (&mut dst, view(0, 2, 3, 3)), false).unwrap();
        assert!(dst.iter().all(|&v| v == 0.0));
    }
}
